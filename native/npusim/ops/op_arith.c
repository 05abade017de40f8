/* Arithmetic operators of the generic family: tensor-tensor and tensor-scalar add, subtract,
 * multiply, divide, their in-place forms, fills and copies. Prototypes: CANN's aclnn API reference
 * (aclnn_add.h, aclnn_sub.h, aclnn_mul.h, aclnn_div.h, aclnn_fill_scalar.h, aclnn_copy.h); the
 * partner names op-plugin checks before it takes the aclnn path (DO_COMPATIBILITY in
 * op_plugin/ops/opapi/, the KernelNpuOpApi files) are all here, so no op falls back to aclop. */
#include <string.h>

#include "opapi_int.h"

/* Scalars as torch's CPU kernels take them (measured against torch 2.13 element by element):
 * a multiplier, divisor or alpha as float for a float tensor (at::opmath_type), an addend in the
 * tensor's own dtype. Passing the double on would round differently in one element of ~20. */
static double as_float(const aclTensor *t, double v) {
    if (!t) return v;
    switch (t->dtype) {
    case OPS_DT_FLOAT: case OPS_DT_FLOAT16: case OPS_DT_BF16: return (float)v;
    default: return v;
    }
}

static double in_dtype(const aclTensor *t, double v) {
    if (!t) return v;
    switch (t->dtype) {
    case OPS_DT_FLOAT: return (float)v;
    case OPS_DT_FLOAT16: return (double)(_Float16)(float)v;
    case OPS_DT_BF16: {
        float f = (float)v;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        if ((bits & 0x7fffffffu) <= 0x7f800000u) bits += 0x7fffu + ((bits >> 16) & 1u); /* nearest even */
        bits &= 0xffff0000u;
        memcpy(&f, &bits, 4);
        return f;
    }
    default: return v;
    }
}

#define EW2(name, fn, a, b, s, ns, out) \
    ew_op(#name, fn, (const aclTensor *const[]){a, b}, 2, s, ns, out, workspaceSize, executor)
#define EW1(name, fn, a, s, ns, out) ew_op(#name, fn, (const aclTensor *const[]){a}, 1, s, ns, out, workspaceSize, executor)

/* out = self + alpha * other */
API aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                         aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(self, s_value(alpha))};
    return EW2(aclnnAdd, OPS_EWF_ADD, self, other, s, 1, out);
}
OPS_LAUNCHER(aclnnAdd)

API aclnnStatus aclnnInplaceAddGetWorkspaceSize(const aclTensor *selfRef, const aclTensor *other,
                                                const aclScalar *alpha, uint64_t *workspaceSize,
                                                aclOpExecutor **executor) {
    if (!selfRef || !other || !alpha) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(selfRef, s_value(alpha))};
    return EW2(aclnnInplaceAdd, OPS_EWF_ADD, selfRef, other, s, 1, selfRef);
}
OPS_LAUNCHER(aclnnInplaceAdd)

/* out = self + alpha * other (other a scalar) */
API aclnnStatus aclnnAddsGetWorkspaceSize(const aclTensor *self, const aclScalar *other, const aclScalar *alpha,
                                          aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[2] = {in_dtype(self, s_value(other)), as_float(self, s_value(alpha))};
    return EW1(aclnnAdds, OPS_EWF_ADDS, self, s, 2, out);
}
OPS_LAUNCHER(aclnnAdds)

API aclnnStatus aclnnInplaceAddsGetWorkspaceSize(const aclTensor *selfRef, const aclScalar *other,
                                                 const aclScalar *alpha, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!selfRef || !other || !alpha) return ACLNN_ERR_PARAM_NULLPTR;
    double s[2] = {in_dtype(selfRef, s_value(other)), as_float(selfRef, s_value(alpha))};
    return EW1(aclnnInplaceAdds, OPS_EWF_ADDS, selfRef, s, 2, selfRef);
}
OPS_LAUNCHER(aclnnInplaceAdds)

/* out = self(scalar) + alpha * other: aclnnAddV3 (aclnn_add_v3.h) */
API aclnnStatus aclnnAddV3GetWorkspaceSize(const aclScalar *self, const aclTensor *other, const aclScalar *alpha,
                                           aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    /* self + alpha*other = (alpha*other) + 1*self: a MULS then ADDS would round twice; ADDS with
     * the roles swapped keeps one rounding only when alpha is 1, so use the general form:
     * x*alpha + self computed in double, rounded once. */
    double s[2] = {in_dtype(other, s_value(self)), as_float(other, s_value(alpha))};
    return EW1(aclnnAddV3, OPS_EWF_RADDS, other, s, 2, out);
}
OPS_LAUNCHER(aclnnAddV3)

API aclnnStatus aclnnSubGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                         aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(self, s_value(alpha))};
    return EW2(aclnnSub, OPS_EWF_SUB, self, other, s, 1, out);
}
OPS_LAUNCHER(aclnnSub)

API aclnnStatus aclnnInplaceSubGetWorkspaceSize(const aclTensor *selfRef, const aclTensor *other,
                                                const aclScalar *alpha, uint64_t *workspaceSize,
                                                aclOpExecutor **executor) {
    if (!selfRef || !other || !alpha) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(selfRef, s_value(alpha))};
    return EW2(aclnnInplaceSub, OPS_EWF_SUB, selfRef, other, s, 1, selfRef);
}
OPS_LAUNCHER(aclnnInplaceSub)

API aclnnStatus aclnnSubsGetWorkspaceSize(const aclTensor *self, const aclScalar *other, const aclScalar *alpha,
                                          aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[2] = {in_dtype(self, s_value(other)), as_float(self, s_value(alpha))};
    return EW1(aclnnSubs, OPS_EWF_SUBS, self, s, 2, out);
}
OPS_LAUNCHER(aclnnSubs)

API aclnnStatus aclnnInplaceSubsGetWorkspaceSize(const aclTensor *selfRef, const aclScalar *other,
                                                 const aclScalar *alpha, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!selfRef || !other || !alpha) return ACLNN_ERR_PARAM_NULLPTR;
    double s[2] = {in_dtype(selfRef, s_value(other)), as_float(selfRef, s_value(alpha))};
    return EW1(aclnnInplaceSubs, OPS_EWF_SUBS, selfRef, s, 2, selfRef);
}
OPS_LAUNCHER(aclnnInplaceSubs)

API aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                         uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return EW2(aclnnMul, OPS_EWF_MUL, self, other, NULL, 0, out);
}
OPS_LAUNCHER(aclnnMul)

API aclnnStatus aclnnInplaceMulGetWorkspaceSize(const aclTensor *selfRef, const aclTensor *other,
                                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;
    return EW2(aclnnInplaceMul, OPS_EWF_MUL, selfRef, other, NULL, 0, selfRef);
}
OPS_LAUNCHER(aclnnInplaceMul)

API aclnnStatus aclnnMulsGetWorkspaceSize(const aclTensor *self, const aclScalar *other, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(self, s_value(other))};
    return EW1(aclnnMuls, OPS_EWF_MULS, self, s, 1, out);
}
OPS_LAUNCHER(aclnnMuls)

API aclnnStatus aclnnInplaceMulsGetWorkspaceSize(const aclTensor *selfRef, const aclScalar *other,
                                                 uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(selfRef, s_value(other))};
    return EW1(aclnnInplaceMuls, OPS_EWF_MULS, selfRef, s, 1, selfRef);
}
OPS_LAUNCHER(aclnnInplaceMuls)

API aclnnStatus aclnnDivGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                         uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return EW2(aclnnDiv, OPS_EWF_DIV, self, other, NULL, 0, out);
}
OPS_LAUNCHER(aclnnDiv)

API aclnnStatus aclnnInplaceDivGetWorkspaceSize(const aclTensor *selfRef, const aclTensor *other,
                                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;
    return EW2(aclnnInplaceDiv, OPS_EWF_DIV, selfRef, other, NULL, 0, selfRef);
}
OPS_LAUNCHER(aclnnInplaceDiv)

API aclnnStatus aclnnDivsGetWorkspaceSize(const aclTensor *self, const aclScalar *other, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(self, s_value(other))};
    return EW1(aclnnDivs, OPS_EWF_DIVS, self, s, 1, out);
}
OPS_LAUNCHER(aclnnDivs)

API aclnnStatus aclnnInplaceDivsGetWorkspaceSize(const aclTensor *selfRef, const aclScalar *other,
                                                 uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {as_float(selfRef, s_value(other))};
    return EW1(aclnnInplaceDivs, OPS_EWF_DIVS, selfRef, s, 1, selfRef);
}
OPS_LAUNCHER(aclnnInplaceDivs)

/* selfRef = value (aclnn_fill_scalar.h) */
API aclnnStatus aclnnInplaceFillScalarGetWorkspaceSize(aclTensor *selfRef, const aclScalar *value,
                                                       uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !value) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {s_value(value)};
    return ew_op("aclnnInplaceFillScalar", OPS_EWF_FILL, NULL, 0, s, 1, selfRef, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceFillScalar)

API aclnnStatus aclnnInplaceZeroGetWorkspaceSize(aclTensor *selfRef, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {0.0};
    return ew_op("aclnnInplaceZero", OPS_EWF_FILL, NULL, 0, s, 1, selfRef, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceZero)

API aclnnStatus aclnnInplaceOneGetWorkspaceSize(aclTensor *selfRef, uint64_t *workspaceSize,
                                                aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {1.0};
    return ew_op("aclnnInplaceOne", OPS_EWF_FILL, NULL, 0, s, 1, selfRef, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceOne)

/* selfRef = src, broadcast and cast to selfRef's dtype: every non-contiguous copy, every dtype
 * conversion op-plugin does through copy_ (aclnn_copy.h). */
API aclnnStatus aclnnInplaceCopyGetWorkspaceSize(aclTensor *selfRef, const aclTensor *src, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor) {
    if (!selfRef || !src) return ACLNN_ERR_PARAM_NULLPTR;
    return ew_op("aclnnInplaceCopy", OPS_EWF_COPY, (const aclTensor *const[]){src}, 1, NULL, 0, selfRef,
                 workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceCopy)

/* out = self cast to dtype (aclnn_cast.h): the dtype must be out's. */
API aclnnStatus aclnnCastGetWorkspaceSize(const aclTensor *self, int32_t dtype, aclTensor *out,
                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (out->dtype != dtype) return ACLNN_ERR_PARAM_INVALID;
    return ew_op("aclnnCast", OPS_EWF_COPY, (const aclTensor *const[]){self}, 1, NULL, 0, out, workspaceSize,
                 executor);
}
OPS_LAUNCHER(aclnnCast)
