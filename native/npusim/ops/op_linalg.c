/* Matrix products and reductions of the generic family. Prototypes: CANN's aclnn API reference
 * (aclnn_matmul.h, aclnn_mm.h, aclnn_batch_matmul.h, aclnn_reduce_sum.h, aclnn_mean.h,
 * aclnn_linalg_vector_norm.h, aclnn_amax.h). cubeMathType (0 KEEP_DTYPE, 1 ALLOW_FP32_DOWN_PRECISION,
 * 2 USE_FP16, 3 USE_HF32) is accepted and ignored: the simulated cube unit always keeps fp32. */
#include <string.h>

#include "opapi_int.h"

/* A [.., M, K] @ B [.., K, N] -> out, with torch.matmul's rules: a 1-D a is [1, K] (its M dimension
 * absent from out), a 1-D b is [K, 1] (its N absent), batch dimensions broadcast. */
static aclnnStatus matmul(const char *name, const aclTensor *a, const aclTensor *b, const aclTensor *out,
                          int8_t cubeMathType, int batched_only, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(a, DTM_FLOATS)) || (st = t_check(b, DTM_FLOATS)) || (st = t_check(out, DTM_FLOATS))) return st;
    if (cubeMathType < 0 || cubeMathType > 3) return ACLNN_ERR_PARAM_INVALID;
    if (a->ndim < 1 || b->ndim < 1 || (batched_only && (a->ndim != 3 || b->ndim != 3))) return ACLNN_ERR_PARAM_INVALID;
    struct ops_tensor A = t_view(a), B = t_view(b);
    if (a->ndim == 1) { /* [K] -> [1, K] */
        A.shape[1] = A.shape[0], A.stride[1] = A.stride[0];
        A.shape[0] = 1, A.stride[0] = 0, A.ndim = 2;
    }
    if (b->ndim == 1) { /* [K] -> [K, 1] */
        B.shape[1] = 1, B.stride[1] = 0, B.ndim = 2;
    }
    int64_t M = A.shape[A.ndim - 2], K = A.shape[A.ndim - 1], N = B.shape[B.ndim - 1];
    if (B.shape[B.ndim - 2] != K) return ACLNN_ERR_PARAM_INVALID;
    int64_t batch[OPS_MAX_DIMS];
    int nb = t_broadcast(A.shape, A.ndim - 2, B.shape, B.ndim - 2, batch);
    if (nb < 0 || nb + 2 > OPS_MAX_DIMS) return ACLNN_ERR_PARAM_INVALID;
    /* out as [batch.., M, N] */
    int64_t want[OPS_MAX_DIMS];
    int nw = 0;
    for (int d = 0; d < nb; d++) want[nw++] = batch[d];
    if (a->ndim > 1) want[nw++] = M;
    if (b->ndim > 1) want[nw++] = N;
    if (!t_same_shape(out, want, nw)) return ACLNN_ERR_PARAM_INVALID;
    struct ops_tensor O = t_view(out);
    O.ndim = nb + 2;
    for (int d = 0; d < nb; d++) O.shape[d] = batch[d], O.stride[d] = out->strides[d];
    O.shape[nb] = M, O.stride[nb] = a->ndim > 1 ? out->strides[nb] : 0;
    O.shape[nb + 1] = N, O.stride[nb + 1] = b->ndim > 1 ? out->strides[out->ndim - 1] : 0;
    /* a and b aligned to out's batch dimensions */
    struct ops_tensor AA = A, BB = B;
    AA.ndim = BB.ndim = nb + 2;
    for (int d = 0; d < nb; d++) {
        int ia = A.ndim - 2 - nb + d, ib = B.ndim - 2 - nb + d;
        AA.shape[d] = BB.shape[d] = batch[d];
        AA.stride[d] = ia >= 0 && A.shape[ia] == batch[d] && batch[d] != 1 ? A.stride[ia] : 0;
        BB.stride[d] = ib >= 0 && B.shape[ib] == batch[d] && batch[d] != 1 ? B.stride[ib] : 0;
    }
    AA.shape[nb] = M, AA.stride[nb] = A.stride[A.ndim - 2];
    AA.shape[nb + 1] = K, AA.stride[nb + 1] = A.stride[A.ndim - 1];
    BB.shape[nb] = K, BB.stride[nb] = B.stride[B.ndim - 2];
    BB.shape[nb + 1] = N, BB.stride[nb + 1] = B.stride[B.ndim - 1];
    aclOpExecutor *e = ex_open(name, OPS_OP_MATMUL, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_tensor(e, AA);
    ex_tensor(e, BB);
    ex_tensor(e, O);
    return ex_done(e);
}

API aclnnStatus aclnnMatmulGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                            int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !mat2 || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return matmul("aclnnMatmul", self, mat2, out, cubeMathType, 0, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnMatmul)

API aclnnStatus aclnnMmGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                        int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !mat2 || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (self->ndim != 2 || mat2->ndim != 2) return ACLNN_ERR_PARAM_INVALID;
    return matmul("aclnnMm", self, mat2, out, cubeMathType, 0, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnMm)

API aclnnStatus aclnnBatchMatMulGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                                 int8_t cubeMathType, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!self || !mat2 || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return matmul("aclnnBatchMatMul", self, mat2, out, cubeMathType, 1, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnBatchMatMul)

/* A reduction of self over dims (all dimensions when dims is empty or NULL) into out, whose shape
 * is self's with the reduced dimensions removed (or kept as 1 with keepDim). */
HIDDEN aclnnStatus reduce_op(const char *name, int kind, double p, const aclTensor *self, const aclIntArray *dims,
                             bool keepDim, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(self, DTM_ALL)) || (st = t_check(out, DTM_ALL))) return st;
    int nd = self->ndim;
    uint8_t red[OPS_MAX_DIMS] = {0};
    if (!dims || dims->size == 0) {
        for (int d = 0; d < nd; d++) red[d] = 1;
    } else {
        for (uint64_t i = 0; i < dims->size; i++) {
            int d = t_dim(dims->value[i], nd);
            if (d < 0 || (nd && red[d])) return ACLNN_ERR_PARAM_INVALID; /* out of range or repeated */
            if (nd) red[d] = 1;
        }
    }
    int64_t want[OPS_MAX_DIMS];
    int nw = 0;
    for (int d = 0; d < nd; d++)
        if (!red[d]) want[nw++] = self->dims[d];
        else if (keepDim) want[nw++] = 1;
    if (!t_same_shape(out, want, nw)) return ACLNN_ERR_PARAM_INVALID;
    struct ops_tensor o = t_view(self); /* out in self's rank */
    o.addr = out->data;
    o.offset = out->offset;
    o.dtype = out->dtype;
    for (int d = 0, k = 0; d < nd; d++) {
        if (red[d]) {
            o.shape[d] = 1;
            o.stride[d] = 0;
            if (keepDim) k++;
        } else {
            o.shape[d] = out->dims[k];
            o.stride[d] = out->strides[k];
            k++;
        }
    }
    aclOpExecutor *e = ex_open(name, OPS_OP_REDUCE, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, kind);
    for (int d = 0; d < nd; d++) ex_int(e, red[d]);
    ex_scalar(e, p);
    ex_tensor(e, t_view(self));
    ex_tensor(e, o);
    return ex_done(e);
}

API aclnnStatus aclnnReduceSumGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim,
                                               int32_t dtype, aclTensor *out, uint64_t *workspaceSize,
                                               aclOpExecutor **executor) {
    if (!self || !dim || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (out->dtype != dtype) return ACLNN_ERR_PARAM_INVALID;
    return reduce_op("aclnnReduceSum", OPS_RED_SUM, 0, self, dim, keepDim, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnReduceSum)

API aclnnStatus aclnnMeanGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim, int32_t dtype,
                                          aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (out->dtype != dtype) return ACLNN_ERR_PARAM_INVALID;
    return reduce_op("aclnnMean", OPS_RED_MEAN, 0, self, dim, keepDim, out, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnMean)
