/* Reductions of the math family: amax/amin over a dim list, max/min over everything or along one
 * dim with indices, prod, and the norms. Prototypes: CANN's aclnn API reference (aclnn_amax.h,
 * aclnn_amin.h, aclnn_max.h, aclnn_max_dim.h, aclnn_prod.h, aclnn_linalg_vector_norm.h,
 * aclnn_norm.h) as op-plugin calls them (MaxKernelNpuOpApi.cpp, ProdKernelNpuOpApi.cpp,
 * LinalgVectorNormKernelNpuOpApi.cpp, NormKernelNpuOpApi.cpp). They run on the REDUCE kernel
 * (k_nn.c, through op_linalg.c's reduce_op) and the ARGRED kernel (k_math_misc.c). */
#include <math.h>
#include <string.h>

#include "opapi_int.h"

/* op_linalg.c: a reduction of self over dims (all when NULL or empty) into out. */
HIDDEN aclnnStatus reduce_op(const char *name, int kind, double p, const aclTensor *self, const aclIntArray *dims,
                             bool keepDim, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor);

#define ARGS workspaceSize, executor

API aclnnStatus aclnnAmaxGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !dim || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (t_numel(self) == 0) return ACLNN_ERR_PARAM_INVALID; /* torch refuses an empty amax too */
    return reduce_op("aclnnAmax", OPS_RED_MAX, 0, self, dim, keepDim, out, ARGS);
}
OPS_LAUNCHER(aclnnAmax)

API aclnnStatus aclnnAminGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !dim || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (t_numel(self) == 0) return ACLNN_ERR_PARAM_INVALID;
    return reduce_op("aclnnAmin", OPS_RED_MIN, 0, self, dim, keepDim, out, ARGS);
}
OPS_LAUNCHER(aclnnAmin)

/* max()/min() of every element into a 0-d out */
API aclnnStatus aclnnMaxGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                         aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (t_numel(self) == 0) return ACLNN_ERR_PARAM_INVALID;
    return reduce_op("aclnnMax", OPS_RED_MAX, 0, self, NULL, false, out, ARGS);
}
OPS_LAUNCHER(aclnnMax)

API aclnnStatus aclnnMinGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                         aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (t_numel(self) == 0) return ACLNN_ERR_PARAM_INVALID;
    return reduce_op("aclnnMin", OPS_RED_MIN, 0, self, NULL, false, out, ARGS);
}
OPS_LAUNCHER(aclnnMin)

/* values and int64 (or int32) indices along dim */
static aclnnStatus argred(const char *name, const aclTensor *self, int64_t dim, bool keepdim, const aclTensor *out,
                          const aclTensor *indices, int is_min, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out || !indices) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_ALL)) || (st = t_check(out, DTM_ALL)) ||
        (st = t_check(indices, DTM(OPS_DT_INT64) | DTM(OPS_DT_INT32))))
        return st;
    int nd = self->ndim, d = t_dim(dim, nd);
    if (d < 0) return ACLNN_ERR_PARAM_INVALID;
    if (nd && self->dims[d] == 0) return ACLNN_ERR_PARAM_INVALID;
    int64_t want[OPS_MAX_DIMS];
    int nw = 0;
    for (int i = 0; i < nd; i++)
        if (i != d) want[nw++] = self->dims[i];
        else if (keepdim) want[nw++] = 1;
    if (!t_same_shape(out, want, nw) || !t_same_shape(indices, want, nw)) return ACLNN_ERR_PARAM_INVALID;
    /* the outputs in self's rank, size 1 and stride 0 on dim */
    struct ops_tensor v = t_view(self), x;
    v.addr = out->data, v.offset = out->offset, v.dtype = out->dtype;
    for (int i = 0, k = 0; i < nd; i++) {
        if (i == d) {
            v.shape[i] = 1, v.stride[i] = 0;
            if (keepdim) k++;
        } else {
            v.shape[i] = out->dims[k], v.stride[i] = out->strides[k];
            k++;
        }
    }
    x = v;
    x.addr = indices->data, x.offset = indices->offset, x.dtype = indices->dtype;
    for (int i = 0, k = 0; i < nd; i++) {
        if (i == d) {
            if (keepdim) k++;
        } else {
            x.stride[i] = indices->strides[k++];
        }
    }
    aclOpExecutor *e = ex_open(name, OPS_OP_ARGRED, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, nd ? d : 0);
    ex_int(e, is_min);
    ex_tensor(e, t_view(self));
    ex_tensor(e, v);
    ex_tensor(e, x);
    return ex_done(e);
}

API aclnnStatus aclnnMaxDimGetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepdim, aclTensor *out,
                                            aclTensor *indices, uint64_t *workspaceSize, aclOpExecutor **executor) {
    return argred("aclnnMaxDim", self, dim, keepdim, out, indices, 0, ARGS);
}
OPS_LAUNCHER(aclnnMaxDim)

API aclnnStatus aclnnMinDimGetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepdim, aclTensor *out,
                                            aclTensor *indices, uint64_t *workspaceSize, aclOpExecutor **executor) {
    return argred("aclnnMinDim", self, dim, keepdim, out, indices, 1, ARGS);
}
OPS_LAUNCHER(aclnnMinDim)

/* prod of every element, in dtype (out's) */
API aclnnStatus aclnnProdGetWorkspaceSize(const aclTensor *self, int32_t dtype, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (out->dtype != dtype) return ACLNN_ERR_PARAM_INVALID;
    return reduce_op("aclnnProd", OPS_RED_PROD, 0, self, NULL, false, out, ARGS);
}
OPS_LAUNCHER(aclnnProd)

API aclnnStatus aclnnProdDimGetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepDim, int32_t dtype,
                                             aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (out->dtype != dtype) return ACLNN_ERR_PARAM_INVALID;
    int64_t d[1] = {dim};
    aclIntArray dims = {1, d};
    return reduce_op("aclnnProdDim", OPS_RED_PROD, 0, self, &dims, keepDim, out, ARGS);
}
OPS_LAUNCHER(aclnnProdDim)

/* ||self||_ord over dims: ord 0 (count of non-zeros), 1, 2, any p > 0, +inf; -inf and negative
 * orders are refused (the REDUCE kernel has no min-abs). */
static aclnnStatus vnorm(const char *name, const aclTensor *self, const aclScalar *ord, const aclIntArray *dims,
                         bool keepDim, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    double p = ord ? s_value(ord) : 2.0;
    if (p != p || p < 0) return ACLNN_ERR_PARAM_INVALID;
    aclnnStatus st;
    if ((st = t_check(self, DTM_FLOATS | DTM(OPS_DT_DOUBLE))) || (st = t_check(out, DTM_FLOATS | DTM(OPS_DT_DOUBLE))))
        return st;
    return reduce_op(name, OPS_RED_NORM, p, self, dims, keepDim, out, ARGS);
}

API aclnnStatus aclnnLinalgVectorNormGetWorkspaceSize(const aclTensor *self, const aclScalar *ord,
                                                      const aclIntArray *dims, bool keepDim, int32_t dtype,
                                                      aclTensor *out, uint64_t *workspaceSize,
                                                      aclOpExecutor **executor) {
    if (!self || !ord || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (out->dtype != dtype) return ACLNN_ERR_PARAM_INVALID;
    return vnorm("aclnnLinalgVectorNorm", self, ord, dims, keepDim, out, ARGS);
}
OPS_LAUNCHER(aclnnLinalgVectorNorm)

API aclnnStatus aclnnNormGetWorkspaceSize(const aclTensor *self, const aclScalar *pScalar, const aclIntArray *dim,
                                          bool keepdim, aclTensor *out, uint64_t *workspaceSize,
                                          aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return vnorm("aclnnNorm", self, pScalar, dim, keepdim, out, ARGS);
}
OPS_LAUNCHER(aclnnNorm)

/* any/all of self != 0 over dims (all dimensions when empty), into a bool (or uint8) out */
static aclnnStatus anyall(const char *name, int all, const aclTensor *self, const aclIntArray *dims, bool keepdim,
                          const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_ALL)) || (st = t_check(out, DTM(OPS_DT_BOOL) | DTM(OPS_DT_UINT8)))) return st;
    int nd = self->ndim;
    uint8_t red[OPS_MAX_DIMS] = {0};
    if (!dims || dims->size == 0) {
        for (int d = 0; d < nd; d++) red[d] = 1;
    } else {
        for (uint64_t i = 0; i < dims->size; i++) {
            int d = t_dim(dims->value[i], nd);
            if (d < 0 || (nd && red[d])) return ACLNN_ERR_PARAM_INVALID;
            if (nd) red[d] = 1;
        }
    }
    int64_t want[OPS_MAX_DIMS];
    int nw = 0;
    for (int d = 0; d < nd; d++)
        if (!red[d]) want[nw++] = self->dims[d];
        else if (keepdim) want[nw++] = 1;
    if (!t_same_shape(out, want, nw)) return ACLNN_ERR_PARAM_INVALID;
    struct ops_tensor o = t_view(self);
    o.addr = out->data, o.offset = out->offset, o.dtype = out->dtype;
    for (int d = 0, k = 0; d < nd; d++) {
        if (red[d]) {
            o.shape[d] = 1, o.stride[d] = 0;
            if (keepdim) k++;
        } else {
            o.shape[d] = out->dims[k], o.stride[d] = out->strides[k];
            k++;
        }
    }
    aclOpExecutor *e = ex_open(name, OPS_OP_BOOLRED, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, all);
    for (int d = 0; d < nd; d++) ex_int(e, red[d]);
    if (!nd) ex_int(e, 0);
    ex_tensor(e, t_view(self));
    ex_tensor(e, o);
    return ex_done(e);
}

API aclnnStatus aclnnAnyGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepdim, aclTensor *out,
                                         uint64_t *workspaceSize, aclOpExecutor **executor) {
    return anyall("aclnnAny", 0, self, dim, keepdim, out, ARGS);
}
OPS_LAUNCHER(aclnnAny)

API aclnnStatus aclnnAllGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepdim, aclTensor *out,
                                         uint64_t *workspaceSize, aclOpExecutor **executor) {
    return anyall("aclnnAll", 1, self, dim, keepdim, out, ARGS);
}
OPS_LAUNCHER(aclnnAll)

/* torch.equal: one bool, true when the shapes and every element agree (op-plugin does not check
 * the shapes first: EqualKernelNpuOpApi.cpp) */
API aclnnStatus aclnnEqualGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_ALL)) || (st = t_check(other, DTM_ALL)) ||
        (st = t_check(out, DTM(OPS_DT_BOOL))))
        return st;
    if (t_numel(out) != 1) return ACLNN_ERR_PARAM_INVALID;
    bool same = t_same_shape(other, self->dims, self->ndim);
    aclOpExecutor *e = ex_open("aclnnEqual", OPS_OP_BOOLRED, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, 2);
    ex_int(e, same);
    ex_tensor(e, t_view(self));
    ex_tensor(e, same ? t_view(other) : t_view(self));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnEqual)

/* ---------------------------------------------------------------- statistics */

/* flags of the reduced dimensions (all when dims is NULL or empty) and the reduced shape check of
 * each output; outputs viewed in self's rank */
static aclnnStatus stat_op(const char *name, int kind, int64_t correction, const aclTensor *self,
                           const aclIntArray *dims, bool keepdim, const aclTensor *out0, const aclTensor *out1,
                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    uint64_t m = kind == 5 ? DTM_NUM : DTM_FLOATS | DTM(OPS_DT_DOUBLE);
    if ((st = t_check(self, kind == 0 ? DTM_ALL : m)) || (st = t_check(out0, m)) || (out1 && (st = t_check(out1, m))))
        return st;
    int nd = self->ndim;
    uint8_t red[OPS_MAX_DIMS] = {0};
    if (!dims || dims->size == 0) {
        for (int d = 0; d < nd; d++) red[d] = 1;
    } else {
        for (uint64_t i = 0; i < dims->size; i++) {
            int d = t_dim(dims->value[i], nd);
            if (d < 0 || (nd && red[d])) return ACLNN_ERR_PARAM_INVALID;
            if (nd) red[d] = 1;
        }
    }
    int64_t want[OPS_MAX_DIMS];
    int nw = 0;
    for (int d = 0; d < nd; d++)
        if (!red[d]) want[nw++] = self->dims[d];
        else if (keepdim) want[nw++] = 1;
    const aclTensor *outs[2] = {out0, out1};
    struct ops_tensor views[2];
    for (int j = 0; j < 2; j++) {
        if (!outs[j]) continue;
        if (!t_same_shape(outs[j], want, nw)) return ACLNN_ERR_PARAM_INVALID;
        struct ops_tensor o = t_view(self);
        o.addr = outs[j]->data, o.offset = outs[j]->offset, o.dtype = outs[j]->dtype;
        for (int d = 0, k = 0; d < nd; d++) {
            if (red[d]) {
                o.shape[d] = 1, o.stride[d] = 0;
                if (keepdim) k++;
            } else {
                o.shape[d] = outs[j]->dims[k], o.stride[d] = outs[j]->strides[k];
                k++;
            }
        }
        views[j] = o;
    }
    aclOpExecutor *e = ex_open(name, OPS_OP_STAT, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, kind);
    ex_int(e, correction);
    for (int d = 0; d < nd; d++) ex_int(e, red[d]);
    ex_tensor(e, t_view(self));
    ex_tensor(e, views[0]);
    if (out1) ex_tensor(e, views[1]);
    return ex_done(e);
}

API aclnnStatus aclnnLogSumExpGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim,
                                               aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return stat_op("aclnnLogSumExp", 0, 0, self, dim, keepDim, out, NULL, ARGS);
}
OPS_LAUNCHER(aclnnLogSumExp)

/* correction by value as int64 (VarKernelNpuOpApi.cpp, StdKernelNpuOpApi.cpp) */
API aclnnStatus aclnnVarCorrectionGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, int64_t correction,
                                                   bool keepdim, aclTensor *out, uint64_t *workspaceSize,
                                                   aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return stat_op("aclnnVarCorrection", 1, correction, self, dim, keepdim, out, NULL, ARGS);
}
OPS_LAUNCHER(aclnnVarCorrection)

API aclnnStatus aclnnStdGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, int64_t correction,
                                         bool keepdim, aclTensor *out, uint64_t *workspaceSize,
                                         aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return stat_op("aclnnStd", 2, correction, self, dim, keepdim, out, NULL, ARGS);
}
OPS_LAUNCHER(aclnnStd)

API aclnnStatus aclnnVarMeanGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, int64_t correction,
                                             bool keepdim, aclTensor *varOut, aclTensor *meanOut,
                                             uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !varOut || !meanOut) return ACLNN_ERR_PARAM_NULLPTR;
    return stat_op("aclnnVarMean", 3, correction, self, dim, keepdim, varOut, meanOut, ARGS);
}
OPS_LAUNCHER(aclnnVarMean)

API aclnnStatus aclnnStdMeanCorrectionGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim,
                                                       int64_t correction, bool keepdim, aclTensor *stdOut,
                                                       aclTensor *meanOut, uint64_t *workspaceSize,
                                                       aclOpExecutor **executor) {
    if (!self || !stdOut || !meanOut) return ACLNN_ERR_PARAM_NULLPTR;
    return stat_op("aclnnStdMeanCorrection", 4, correction, self, dim, keepdim, stdOut, meanOut, ARGS);
}
OPS_LAUNCHER(aclnnStdMeanCorrection)

/* min and max over dims (AminmaxKernelNpuOpApi.cpp passes every dimension when dim is absent) */
API aclnnStatus aclnnAminmaxGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepdim,
                                             aclTensor *minOut, aclTensor *maxOut, uint64_t *workspaceSize,
                                             aclOpExecutor **executor) {
    if (!self || !minOut || !maxOut) return ACLNN_ERR_PARAM_NULLPTR;
    if (t_numel(self) == 0) return ACLNN_ERR_PARAM_INVALID;
    return stat_op("aclnnAminmax", 5, 0, self, dim, keepdim, minOut, maxOut, ARGS);
}
OPS_LAUNCHER(aclnnAminmax)

API aclnnStatus aclnnAminmaxAllGetWorkspaceSize(const aclTensor *self, aclTensor *minOut, aclTensor *maxOut,
                                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !minOut || !maxOut) return ACLNN_ERR_PARAM_NULLPTR;
    if (t_numel(self) == 0) return ACLNN_ERR_PARAM_INVALID;
    return stat_op("aclnnAminmaxAll", 5, 0, self, NULL, false, minOut, maxOut, ARGS);
}
OPS_LAUNCHER(aclnnAminmaxAll)

API aclnnStatus aclnnAminmaxDimGetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepdim, aclTensor *minOut,
                                                aclTensor *maxOut, uint64_t *workspaceSize,
                                                aclOpExecutor **executor) {
    if (!self || !minOut || !maxOut) return ACLNN_ERR_PARAM_NULLPTR;
    if (t_numel(self) == 0) return ACLNN_ERR_PARAM_INVALID;
    int64_t d[1] = {dim};
    aclIntArray dims = {1, d};
    return stat_op("aclnnAminmaxDim", 5, 0, self, &dims, keepdim, minOut, maxOut, ARGS);
}
OPS_LAUNCHER(aclnnAminmaxDim)

/* ---------------------------------------------------------------- scans */

static aclnnStatus scan_op(const char *name, int prod, const aclTensor *self, int64_t dim, int32_t dtype,
                           const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(self, DTM_NUM | DTM(OPS_DT_BOOL))) || (st = t_check(out, DTM_NUM))) return st;
    if (out->dtype != dtype || !t_same_shape(out, self->dims, self->ndim)) return ACLNN_ERR_PARAM_INVALID;
    int d = t_dim(dim, self->ndim);
    if (d < 0) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = ex_open(name, OPS_OP_SCAN, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, self->ndim ? d : 0);
    ex_int(e, prod);
    ex_tensor(e, t_view(self));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}

/* dim by value, dtype the output's (CumsumKernelNpuOpApi.cpp) */
API aclnnStatus aclnnCumsumGetWorkspaceSize(const aclTensor *self, int64_t dim, int32_t dtype, aclTensor *out,
                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return scan_op("aclnnCumsum", 0, self, dim, dtype, out, ARGS);
}
OPS_LAUNCHER(aclnnCumsum)

/* dim as an aclScalar (op_plugin_functions.yaml: aclnnCumprod, self, dim_scalar, dst_type, out) */
API aclnnStatus aclnnCumprodGetWorkspaceSize(const aclTensor *self, const aclScalar *dim, int32_t dtype,
                                             aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !dim || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return scan_op("aclnnCumprod", 1, self, (int64_t)s_value(dim), dtype, out, ARGS);
}
OPS_LAUNCHER(aclnnCumprod)
