/* The foreach family: one launch per call over a tensor list (the FOREACH and FOREACH_NORM kernels
 * of k_math_foreach.c). Prototypes: CANN's aclnn API reference (aclnn_foreach_add_list_v2.h,
 * aclnn_foreach_mul_scalar_v2.h, aclnn_foreach_lerp_scalar.h, aclnn_foreach_norm.h, ...) as
 * op-plugin calls them (op_plugin/ops/opapi/Foreach*KernelNpuOpApi.cpp): lists are aclTensorList,
 * a "Scalar" of the first versions (ForeachAddList, ForeachMulScalar, ...) is a one-element device
 * tensor (op-plugin's copy_scalar_to_device), a "V2" scalar an aclScalar, a scalar list an
 * aclScalarList, and ForeachAddcdivScalarList/ForeachAddcmulScalarList take their per-tensor values
 * as one 1-D device tensor (ForeachAddcdivTensorKernelNpuOpApi.cpp). Scalars are taken as the CPU's
 * foreach fallbacks take them: float for float, half and bfloat16 tensors (the opmath type) in the
 * multiplicative maps, the tensor's own dtype in add, sub and pow. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "opapi_int.h"

#define ARGS workspaceSize, executor

static bool is_float(int dt) { return dt == OPS_DT_FLOAT || dt == OPS_DT_FLOAT16 || dt == OPS_DT_BF16; }
static double sc_op(double v, int dt) { return is_float(dt) ? (double)(float)v : v; }

static double bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return f;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    memcpy(&f, &bits, 4);
    return f;
}

/* v in dtype dt itself: the CPU's add, sub and pow take their scalar so (BinaryOpsKernel.cpp,
 * PowKernel.cpp: measured, every element equal) */
static double sc_dt(double v, int dt) {
    switch (dt) {
    case OPS_DT_FLOAT: return (float)v;
    case OPS_DT_FLOAT16: return (double)(_Float16)(float)v;
    case OPS_DT_BF16: return bf16_round((float)v);
    default: return v;
    }
}

/* One input of a foreach map: a list (one tensor per group), a one-element device tensor shared by
 * every group, or a 1-D device tensor whose element g belongs to group g. */
enum { FE_LIST, FE_SCALAR_T, FE_ELEM_T };
struct fe_in {
    int kind;
    const aclTensorList *l;
    const aclTensor *t;
};

#define FE_MAX_IN 4

/* per: G*m per-group scalars (group g's at per[g*m]); common: nc scalars for every group */
static aclnnStatus foreach_op(const char *name, enum ops_ew_fn fn, const struct fe_in *ins, int nin,
                              const aclTensorList *out, const double *per, int m, const double *common, int nc,
                              uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!out || nin > FE_MAX_IN) return ACLNN_ERR_PARAM_NULLPTR;
    uint64_t G = out->size;
    aclnnStatus st;
    for (int j = 0; j < nin; j++) {
        if (ins[j].kind == FE_LIST) {
            if (!ins[j].l) return ACLNN_ERR_PARAM_NULLPTR;
            if (ins[j].l->size != G) return ACLNN_ERR_PARAM_INVALID;
        } else {
            if ((st = t_check(ins[j].t, DTM_NUM | DTM(OPS_DT_BOOL)))) return st;
            if (ins[j].kind == FE_SCALAR_T && t_numel(ins[j].t) != 1) return ACLNN_ERR_PARAM_INVALID;
            if (ins[j].kind == FE_ELEM_T && (ins[j].t->ndim != 1 || ins[j].t->dims[0] < (int64_t)G))
                return ACLNN_ERR_PARAM_INVALID;
        }
    }
    for (uint64_t g = 0; g < G; g++) {
        const aclTensor *o = out->tensors[g];
        if ((st = t_check(o, DTM_NUM | DTM(OPS_DT_BOOL)))) return st;
        for (int j = 0; j < nin; j++) {
            if (ins[j].kind != FE_LIST) continue;
            const aclTensor *t = ins[j].l->tensors[g];
            if ((st = t_check(t, DTM_NUM | DTM(OPS_DT_BOOL)))) return st;
            if (!t_same_shape(t, o->dims, o->ndim)) return ACLNN_ERR_PARAM_INVALID;
        }
    }
    aclOpExecutor *e = ex_open(name, OPS_OP_FOREACH, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, fn);
    ex_int(e, nin + 1);
    ex_int(e, m);
    for (uint64_t i = 0; i < G * (uint64_t)m; i++) ex_scalar(e, per[i]);
    for (int j = 0; j < nc; j++) ex_scalar(e, common[j]);
    for (uint64_t g = 0; g < G; g++) {
        const aclTensor *o = out->tensors[g];
        for (int j = 0; j < nin; j++) {
            const aclTensor *t = ins[j].kind == FE_LIST ? ins[j].l->tensors[g] : ins[j].t;
            struct ops_tensor v = t_aligned(t, o->dims, o->ndim);
            if (ins[j].kind != FE_LIST)
                for (int d = 0; d < v.ndim; d++) v.stride[d] = 0;
            if (ins[j].kind == FE_ELEM_T) v.offset += (int64_t)g * t->strides[0];
            ex_tensor(e, v);
        }
        ex_tensor(e, t_view(o));
    }
    return ex_done(e);
}

#define L(x) {FE_LIST, x, NULL}
#define ST(x) {FE_SCALAR_T, NULL, x}
#define ET(x) {FE_ELEM_T, NULL, x}
#define INS(...) (const struct fe_in[]){__VA_ARGS__}, (int)(sizeof((const struct fe_in[]){__VA_ARGS__}) / sizeof(struct fe_in))

static int list_dtype(const aclTensorList *l) {
    return l && l->size && l->tensors[0] ? l->tensors[0]->dtype : OPS_DT_FLOAT;
}

/* group scalars of a scalar list, each as its group's opmath value */
static double *scalar_list(const aclScalarList *s, const aclTensorList *out, int in_dtype, aclnnStatus *st) {
    *st = ACLNN_SUCCESS;
    if (!s || !out) {
        *st = ACLNN_ERR_PARAM_NULLPTR;
        return NULL;
    }
    if (s->size != out->size) {
        *st = ACLNN_ERR_PARAM_INVALID;
        return NULL;
    }
    double *v = malloc(sizeof(double) * (s->size ? s->size : 1));
    if (!v) {
        *st = ACLNN_ERR_INNER;
        return NULL;
    }
    for (uint64_t i = 0; i < s->size; i++)
    {
        int dt = out->tensors[i] ? out->tensors[i]->dtype : OPS_DT_FLOAT;
        v[i] = in_dtype ? sc_dt(s_value(s->scalars[i]), dt) : sc_op(s_value(s->scalars[i]), dt);
    }
    return v;
}

/* ---------------------------------------------------------------- list (op) list */

/* out = x1 + alpha * x2 (alpha an aclScalar: V2; a device tensor: the first version) */
API aclnnStatus aclnnForeachAddListV2GetWorkspaceSize(const aclTensorList *x1, const aclTensorList *x2,
                                                      const aclScalar *alpha, const aclTensorList *out,
                                                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!x1 || !x2 || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sc_op(s_value(alpha), list_dtype(out))};
    return foreach_op("aclnnForeachAddListV2", OPS_EWF_ADD, INS(L(x1), L(x2)), out, NULL, 0, s, 1, ARGS);
}
OPS_LAUNCHER(aclnnForeachAddListV2)

API aclnnStatus aclnnForeachSubListV2GetWorkspaceSize(const aclTensorList *x1, const aclTensorList *x2,
                                                      const aclScalar *alpha, const aclTensorList *out,
                                                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!x1 || !x2 || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sc_op(s_value(alpha), list_dtype(out))};
    return foreach_op("aclnnForeachSubListV2", OPS_EWF_SUB, INS(L(x1), L(x2)), out, NULL, 0, s, 1, ARGS);
}
OPS_LAUNCHER(aclnnForeachSubListV2)

/* x1 + alpha * x2 with alpha in a one-element device tensor: the ADDCMUL map x0 + s0 * x1 * x2
 * with x2 = alpha and s0 = +-1, rounded once as the V2 form is. */
static aclnnStatus list_alpha_t(const char *name, const aclTensorList *x1, const aclTensorList *x2,
                                const aclTensor *alpha, const aclTensorList *out, double sign,
                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!x1 || !x2 || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sign};
    return foreach_op(name, OPS_EWF_ADDCMUL, INS(L(x1), L(x2), ST(alpha)), out, NULL, 0, s, 1, ARGS);
}

API aclnnStatus aclnnForeachAddListGetWorkspaceSize(const aclTensorList *x1, const aclTensorList *x2,
                                                    const aclTensor *alpha, const aclTensorList *out,
                                                    uint64_t *workspaceSize, aclOpExecutor **executor) {
    return list_alpha_t("aclnnForeachAddList", x1, x2, alpha, out, 1.0, ARGS);
}
OPS_LAUNCHER(aclnnForeachAddList)

API aclnnStatus aclnnForeachSubListGetWorkspaceSize(const aclTensorList *x1, const aclTensorList *x2,
                                                    const aclTensor *alpha, const aclTensorList *out,
                                                    uint64_t *workspaceSize, aclOpExecutor **executor) {
    return list_alpha_t("aclnnForeachSubList", x1, x2, alpha, out, -1.0, ARGS);
}
OPS_LAUNCHER(aclnnForeachSubList)

#define FE_LIST2(Name, fn)                                                                                    \
    API aclnnStatus aclnnForeach##Name##GetWorkspaceSize(const aclTensorList *x1, const aclTensorList *x2,    \
                                                         const aclTensorList *out, uint64_t *workspaceSize,   \
                                                         aclOpExecutor **executor) {                          \
        if (!x1 || !x2 || !out) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        return foreach_op("aclnnForeach" #Name, fn, INS(L(x1), L(x2)), out, NULL, 0, NULL, 0, ARGS);          \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name)

FE_LIST2(MulList, OPS_EWF_MUL)
FE_LIST2(DivList, OPS_EWF_DIV)
FE_LIST2(MaximumList, OPS_EWF_MAXIMUM)
FE_LIST2(MinimumList, OPS_EWF_MINIMUM)
FE_LIST2(PowList, OPS_EWF_POW_TT)

/* ---------------------------------------------------------------- list (op) scalar */

/* op(x, scalar): V2 (aclScalar), the first version (a one-element device tensor), a scalar list.
 * fn_s: the map with the scalar as s0 (and s1 = 1 for the add/sub maps), fn_t: with it as x1. */
#define FE_SCALAR(Name, fn_s, fn_t, extra, in_dt)                                                                  \
    API aclnnStatus aclnnForeach##Name##ScalarV2GetWorkspaceSize(const aclTensorList *x, const aclScalar *scalar, \
                                                                 const aclTensorList *out, uint64_t *workspaceSize, \
                                                                 aclOpExecutor **executor) {                  \
        if (!x || !scalar || !out) return ACLNN_ERR_PARAM_NULLPTR;                                            \
        double s[2] = {in_dt ? sc_dt(s_value(scalar), list_dtype(out)) : sc_op(s_value(scalar), list_dtype(out)), extra};                                       \
        return foreach_op("aclnnForeach" #Name "ScalarV2", fn_s, INS(L(x)), out, NULL, 0, s, 2, ARGS);        \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name##ScalarV2)                                                                \
    API aclnnStatus aclnnForeach##Name##ScalarGetWorkspaceSize(const aclTensorList *x, const aclTensor *scalar, \
                                                               const aclTensorList *out, uint64_t *workspaceSize, \
                                                               aclOpExecutor **executor) {                    \
        if (!x || !scalar || !out) return ACLNN_ERR_PARAM_NULLPTR;                                            \
        double s[1] = {extra};                                                                                \
        return foreach_op("aclnnForeach" #Name "Scalar", fn_t, INS(L(x), ST(scalar)), out, NULL, 0, s, 1, ARGS); \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name##Scalar)                                                                  \
    API aclnnStatus aclnnForeach##Name##ScalarListGetWorkspaceSize(const aclTensorList *x,                    \
                                                                   const aclScalarList *scalars,              \
                                                                   const aclTensorList *out,                  \
                                                                   uint64_t *workspaceSize,                   \
                                                                   aclOpExecutor **executor) {                \
        if (!x || !scalars || !out) return ACLNN_ERR_PARAM_NULLPTR;                                           \
        aclnnStatus st;                                                                                       \
        double *per = scalar_list(scalars, out, in_dt, &st);                                                         \
        if (!per) return st;                                                                                  \
        double s[1] = {extra};                                                                                \
        st = foreach_op("aclnnForeach" #Name "ScalarList", fn_s, INS(L(x)), out, per, 1, s, 1, ARGS);         \
        free(per);                                                                                            \
        return st;                                                                                            \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name##ScalarList)

/* ADDS: x0 + s1 * s0; SUBS: x0 - s1 * s0; with the tensor scalar: ADD x0 + s0 * x1, SUB x0 - s0 * x1 */
FE_SCALAR(Add, OPS_EWF_ADDS, OPS_EWF_ADD, 1.0, 1)
FE_SCALAR(Sub, OPS_EWF_SUBS, OPS_EWF_SUB, 1.0, 1)
FE_SCALAR(Mul, OPS_EWF_MULS, OPS_EWF_MUL, 0.0, 0)
FE_SCALAR(Div, OPS_EWF_DIVS, OPS_EWF_DIV, 0.0, 0)
FE_SCALAR(Maximum, OPS_EWF_MAXS, OPS_EWF_MAXIMUM, 0.0, 0)
FE_SCALAR(Minimum, OPS_EWF_MINS, OPS_EWF_MINIMUM, 0.0, 0)
FE_SCALAR(Pow, OPS_EWF_POW_TS, OPS_EWF_POW_TT, 0.0, 1)

/* scalar ** x */
API aclnnStatus aclnnForeachPowScalarAndTensorGetWorkspaceSize(const aclScalar *scalar, const aclTensorList *x,
                                                               const aclTensorList *out, uint64_t *workspaceSize,
                                                               aclOpExecutor **executor) {
    if (!x || !scalar || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sc_dt(s_value(scalar), list_dtype(out))};
    return foreach_op("aclnnForeachPowScalarAndTensor", OPS_EWF_POW_ST, INS(L(x)), out, NULL, 0, s, 1, ARGS);
}
OPS_LAUNCHER(aclnnForeachPowScalarAndTensor)

/* ---------------------------------------------------------------- lerp */

API aclnnStatus aclnnForeachLerpScalarGetWorkspaceSize(const aclTensorList *x1, const aclTensorList *x2,
                                                       const aclScalar *weight, const aclTensorList *out,
                                                       uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!x1 || !x2 || !weight || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sc_op(s_value(weight), list_dtype(out))};
    return foreach_op("aclnnForeachLerpScalar", OPS_EWF_LERPS, INS(L(x1), L(x2)), out, NULL, 0, s, 1, ARGS);
}
OPS_LAUNCHER(aclnnForeachLerpScalar)

API aclnnStatus aclnnForeachLerpListGetWorkspaceSize(const aclTensorList *x1, const aclTensorList *x2,
                                                     const aclTensorList *weight, const aclTensorList *out,
                                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!x1 || !x2 || !weight || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return foreach_op("aclnnForeachLerpList", OPS_EWF_LERP, INS(L(x1), L(x2), L(weight)), out, NULL, 0, NULL, 0,
                      ARGS);
}
OPS_LAUNCHER(aclnnForeachLerpList)

/* ---------------------------------------------------------------- addcmul, addcdiv */

#define FE_ADDC(Name, fn, fn_t)                                                                               \
    API aclnnStatus aclnnForeach##Name##ScalarV2GetWorkspaceSize(                                             \
        const aclTensorList *x, const aclTensorList *x1, const aclTensorList *x2, const aclScalar *scalar,    \
        const aclTensorList *out, uint64_t *workspaceSize, aclOpExecutor **executor) {                        \
        if (!x || !x1 || !x2 || !scalar || !out) return ACLNN_ERR_PARAM_NULLPTR;                              \
        double s[1] = {sc_op(s_value(scalar), list_dtype(out))};                                              \
        return foreach_op("aclnnForeach" #Name "ScalarV2", fn, INS(L(x), L(x1), L(x2)), out, NULL, 0, s, 1, ARGS); \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name##ScalarV2)                                                                \
    API aclnnStatus aclnnForeach##Name##ScalarGetWorkspaceSize(                                               \
        const aclTensorList *x, const aclTensorList *x1, const aclTensorList *x2, const aclTensor *scalar,    \
        const aclTensorList *out, uint64_t *workspaceSize, aclOpExecutor **executor) {                        \
        if (!x || !x1 || !x2 || !scalar || !out) return ACLNN_ERR_PARAM_NULLPTR;                              \
        return foreach_op("aclnnForeach" #Name "Scalar", fn_t, INS(L(x), L(x1), L(x2), ST(scalar)), out, NULL, 0, \
                          NULL, 0, ARGS);                                                                     \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name##Scalar)                                                                  \
    API aclnnStatus aclnnForeach##Name##ScalarListGetWorkspaceSize(                                           \
        const aclTensorList *x, const aclTensorList *x1, const aclTensorList *x2, const aclTensor *scalars,    \
        const aclTensorList *out, uint64_t *workspaceSize, aclOpExecutor **executor) {                        \
        if (!x || !x1 || !x2 || !scalars || !out) return ACLNN_ERR_PARAM_NULLPTR;                             \
        return foreach_op("aclnnForeach" #Name "ScalarList", fn_t, INS(L(x), L(x1), L(x2), ET(scalars)), out, \
                          NULL, 0, NULL, 0, ARGS);                                                            \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name##ScalarList)

FE_ADDC(Addcmul, OPS_EWF_ADDCMUL, OPS_EWF_ADDCMUL_T)
FE_ADDC(Addcdiv, OPS_EWF_ADDCDIV, OPS_EWF_ADDCDIV_T)

/* ---------------------------------------------------------------- unary */

#define FE_UNARY(Name, fn)                                                                                    \
    API aclnnStatus aclnnForeach##Name##GetWorkspaceSize(const aclTensorList *x, const aclTensorList *out,    \
                                                         uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!x || !out) return ACLNN_ERR_PARAM_NULLPTR;                                                       \
        return foreach_op("aclnnForeach" #Name, fn, INS(L(x)), out, NULL, 0, NULL, 0, ARGS);                  \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnForeach##Name)

FE_UNARY(Sqrt, OPS_EWF_SQRT)
FE_UNARY(Exp, OPS_EWF_EXP)
FE_UNARY(Log, OPS_EWF_LOG)
FE_UNARY(Neg, OPS_EWF_NEG)
FE_UNARY(Abs, OPS_EWF_ABS)
FE_UNARY(Reciprocal, OPS_EWF_RECIPROCAL)
FE_UNARY(Sign, OPS_EWF_SIGN)
FE_UNARY(Sigmoid, OPS_EWF_SIGMOID)
FE_UNARY(Tanh, OPS_EWF_TANH)
FE_UNARY(Erf, OPS_EWF_ERF)

/* copy every src into its dst (dtypes may differ: a cast) */
API aclnnStatus aclnnForeachCopyGetWorkspaceSize(const aclTensorList *src, const aclTensorList *dst,
                                                 uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!src || !dst) return ACLNN_ERR_PARAM_NULLPTR;
    return foreach_op("aclnnForeachCopy", OPS_EWF_COPY, INS(L(src)), dst, NULL, 0, NULL, 0, ARGS);
}
OPS_LAUNCHER(aclnnForeachCopy)

API aclnnStatus aclnnForeachZeroInplaceGetWorkspaceSize(const aclTensorList *x, uint64_t *workspaceSize,
                                                        aclOpExecutor **executor) {
    if (!x) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {0.0};
    return foreach_op("aclnnForeachZeroInplace", OPS_EWF_FILL, NULL, 0, x, NULL, 0, s, 1, ARGS);
}
OPS_LAUNCHER(aclnnForeachZeroInplace)

/* ---------------------------------------------------------------- norm */

/* out[g] (0-d, or one element) = ||x[g]||_ord over all its elements; ord as LinalgVectorNorm takes
 * it (0, 1, 2, p > 0, +inf). */
API aclnnStatus aclnnForeachNormGetWorkspaceSize(const aclTensorList *x, const aclScalar *scalar,
                                                 const aclTensorList *out, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!x || !scalar || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (x->size != out->size) return ACLNN_ERR_PARAM_INVALID;
    double p = s_value(scalar);
    if (p != p || p < 0) return ACLNN_ERR_PARAM_INVALID;
    aclnnStatus st;
    for (uint64_t g = 0; g < x->size; g++) {
        if ((st = t_check(x->tensors[g], DTM_FLOATS)) || (st = t_check(out->tensors[g], DTM_FLOATS))) return st;
        if (t_numel(out->tensors[g]) != 1) return ACLNN_ERR_PARAM_INVALID;
    }
    aclOpExecutor *e = ex_open("aclnnForeachNorm", OPS_OP_FOREACH_NORM, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_scalar(e, p);
    for (uint64_t g = 0; g < x->size; g++) {
        const aclTensor *in = x->tensors[g], *o = out->tensors[g];
        struct ops_tensor v = t_view(in), ov = t_view(in);
        ov.addr = o->data, ov.offset = o->offset, ov.dtype = o->dtype;
        for (int d = 0; d < ov.ndim; d++) ov.shape[d] = 1, ov.stride[d] = 0;
        ex_tensor(e, v);
        ex_tensor(e, ov);
    }
    return ex_done(e);
}
OPS_LAUNCHER(aclnnForeachNorm)

/* ---------------------------------------------------------------- GradScaler */

/* scaledGrads *= invScale in place; foundInf = 1 if any element was inf or NaN (aclnn
 * ForeachNonFiniteCheckAndUnscale, called by AmpForeachNonFiniteCheckAndUnscaleKernelNpuOpApi.cpp
 * with a float foundInf and a float invScale of one element each) */
API aclnnStatus aclnnForeachNonFiniteCheckAndUnscaleGetWorkspaceSize(const aclTensorList *scaledGrads,
                                                                     const aclTensor *foundInf,
                                                                     const aclTensor *invScale,
                                                                     uint64_t *workspaceSize,
                                                                     aclOpExecutor **executor) {
    if (!scaledGrads || !foundInf || !invScale) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(foundInf, DTM(OPS_DT_FLOAT))) || (st = t_check(invScale, DTM(OPS_DT_FLOAT)))) return st;
    if (t_numel(foundInf) != 1 || t_numel(invScale) != 1) return ACLNN_ERR_PARAM_INVALID;
    for (uint64_t g = 0; g < scaledGrads->size; g++)
        if ((st = t_check(scaledGrads->tensors[g], DTM_FLOATS))) return st;
    aclOpExecutor *e = ex_open("aclnnForeachNonFiniteCheckAndUnscale", OPS_OP_AMP, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, 0);
    ex_tensor(e, t_view(foundInf));
    ex_tensor(e, t_view(invScale));
    for (uint64_t g = 0; g < scaledGrads->size; g++) ex_tensor(e, t_view(scaledGrads->tensors[g]));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnForeachNonFiniteCheckAndUnscale)

/* GradScaler's scale update (AmpUpdateScaleKernelNpuOpApi.cpp passes current_scale, growth_tracker,
 * found_inf, growth_factor, backoff_factor, growth_interval, then current_scale and growth_tracker
 * again as the outputs) */
API aclnnStatus aclnnAmpUpdateScaleGetWorkspaceSize(const aclTensor *currentScale, const aclTensor *growthTracker,
                                                    const aclTensor *foundInf, double growthFactor,
                                                    double backoffFactor, int64_t growthInterval,
                                                    aclTensor *scaleOut, aclTensor *trackerOut,
                                                    uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!currentScale || !growthTracker || !foundInf || !scaleOut || !trackerOut) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(currentScale, DTM(OPS_DT_FLOAT))) || (st = t_check(scaleOut, DTM(OPS_DT_FLOAT))) ||
        (st = t_check(growthTracker, DTM(OPS_DT_INT32))) || (st = t_check(trackerOut, DTM(OPS_DT_INT32))) ||
        (st = t_check(foundInf, DTM(OPS_DT_FLOAT))))
        return st;
    if (t_numel(currentScale) != 1 || t_numel(growthTracker) != 1 || t_numel(foundInf) != 1 ||
        t_numel(scaleOut) != 1 || t_numel(trackerOut) != 1)
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = ex_open("aclnnAmpUpdateScale", OPS_OP_AMP, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, 1);
    ex_int(e, growthInterval);
    ex_scalar(e, growthFactor);
    ex_scalar(e, backoffFactor);
    ex_tensor(e, t_view(currentScale));
    ex_tensor(e, t_view(growthTracker));
    ex_tensor(e, t_view(foundInf));
    ex_tensor(e, t_view(scaleOut));
    ex_tensor(e, t_view(trackerOut));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnAmpUpdateScale)

/* ---------------------------------------------------------------- rounding */

/* _foreach_floor/ceil/round/trunc/frac: CANN's RoundMode (1 rint, 2 floor, 3 ceil, 4 round half
 * away, 5 trunc; 7 frac as ForeachRoundOffNumberKernelNpuOpApi.cpp passes it); V2 takes the mode
 * as an aclScalar, the first version as a one-element int8 device tensor */
static bool round_mode_ok(double m) { return m == 1 || m == 2 || m == 3 || m == 4 || m == 5 || m == 7; }

API aclnnStatus aclnnForeachRoundOffNumberV2GetWorkspaceSize(const aclTensorList *x, const aclScalar *roundMode,
                                                             const aclTensorList *out, uint64_t *workspaceSize,
                                                             aclOpExecutor **executor) {
    if (!x || !roundMode || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {s_value(roundMode)};
    if (!round_mode_ok(s[0])) return ACLNN_ERR_PARAM_INVALID;
    return foreach_op("aclnnForeachRoundOffNumberV2", OPS_EWF_ROUND_MODE, INS(L(x)), out, NULL, 0, s, 1, ARGS);
}
OPS_LAUNCHER(aclnnForeachRoundOffNumberV2)

/* the mode's value is on the device: it is read there, and an unknown mode gives NaN */
API aclnnStatus aclnnForeachRoundOffNumberGetWorkspaceSize(const aclTensorList *x, const aclTensor *roundMode,
                                                           const aclTensorList *out, uint64_t *workspaceSize,
                                                           aclOpExecutor **executor) {
    if (!x || !roundMode || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return foreach_op("aclnnForeachRoundOffNumber", OPS_EWF_ROUND_MODE_T, INS(L(x), ST(roundMode)), out, NULL, 0,
                      NULL, 0, ARGS);
}
OPS_LAUNCHER(aclnnForeachRoundOffNumber)
