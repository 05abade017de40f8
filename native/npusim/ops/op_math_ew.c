/* Element-wise math of the generic family: unary math, their backward maps, logic, clamps, powers,
 * comparisons, masked fill, where, lerp, addcmul/addcdiv, maximum/minimum, rsub. Prototypes: CANN's
 * aclnn API reference (aclnn_exp.h, aclnn_clamp.h, aclnn_pow.h, aclnn_gt_scalar.h, aclnn_s_where.h,
 * aclnn_lerp.h, aclnn_addcmul.h, ...), as op-plugin calls them (the KernelNpuOpApi files of op_plugin/ops/opapi
 * and the gen_opapi entries of op_plugin/config/op_plugin_functions.yaml: the arguments in the
 * schema's order, then the output). Only names op-plugin looks up are exported.
 *
 * Scalars follow the CPU kernels' types, so that results agree with torch bit for bit where the
 * math is exact: multiplicative arithmetic (lerp, addcmul, addcdiv, mul, div) on float, half and
 * bfloat16 takes its scalar as float (the opmath type, aten/src/ATen/OpMathType.h); additive
 * arithmetic (add, sub, rsub), powers, comparisons and clamps take it in the tensor's own type (the
 * iterator's common dtype), as measured against torch 2.13's CPU kernels. */
#include <math.h>
#include <string.h>

#include "opapi_int.h"

static bool is_float(int dt) { return dt == OPS_DT_FLOAT || dt == OPS_DT_FLOAT16 || dt == OPS_DT_BF16; }

/* v as the opmath scalar of a kernel computing in dtype dt */
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

/* v in dtype dt itself */
static double sc_dt(double v, int dt) {
    switch (dt) {
    case OPS_DT_FLOAT: return (float)v;
    case OPS_DT_FLOAT16: return (double)(_Float16)(float)v;
    case OPS_DT_BF16: return bf16_round((float)v);
    default: return v;
    }
}

#define ARGS workspaceSize, executor
#define T1(a) (const aclTensor *const[]){a}, 1
#define T2(a, b) (const aclTensor *const[]){a, b}, 2
#define T3(a, b, c) (const aclTensor *const[]){a, b, c}, 3

/* ---------------------------------------------------------------- unary */

/* ins/outs of a unary map: the input in `in_mask`, the output in `out_mask` */
static aclnnStatus unary(const char *name, enum ops_ew_fn fn, const aclTensor *self, const aclTensor *out,
                         uint64_t in_mask, uint64_t out_mask, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(self, in_mask)) || (st = t_check(out, out_mask))) return st;
    return ew_op(name, fn, T1(self), NULL, 0, out, ARGS);
}

/* math whose result is floating (an integer input gives a float output, as op-plugin allocates) */
#define FMATH_IN (DTM_ALL)
#define FMATH_OUT (DTM_FLOATS | DTM(OPS_DT_DOUBLE))
#define NUM_NOBOOL (DTM_NUM)

#define UNARY_OUT(Name, fn, inm, outm)                                                                         \
    API aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize, \
                                                  aclOpExecutor **executor) {                                  \
        if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;                                                     \
        return unary("aclnn" #Name, fn, self, out, inm, outm, ARGS);                                           \
    }                                                                                                          \
    OPS_LAUNCHER(aclnn##Name)

#define UNARY_INPLACE(Name, fn, m)                                                                            \
    API aclnnStatus aclnnInplace##Name##GetWorkspaceSize(aclTensor *selfRef, uint64_t *workspaceSize,         \
                                                         aclOpExecutor **executor) {                          \
        if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;                                                         \
        return unary("aclnnInplace" #Name, fn, selfRef, selfRef, m, m, ARGS);                                 \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Name)

UNARY_OUT(Exp, OPS_EWF_EXP, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Exp, OPS_EWF_EXP, FMATH_OUT)
UNARY_OUT(Log, OPS_EWF_LOG, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Log, OPS_EWF_LOG, FMATH_OUT)
UNARY_OUT(Sqrt, OPS_EWF_SQRT, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Sqrt, OPS_EWF_SQRT, FMATH_OUT)
UNARY_OUT(Rsqrt, OPS_EWF_RSQRT, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Rsqrt, OPS_EWF_RSQRT, FMATH_OUT)
UNARY_OUT(Reciprocal, OPS_EWF_RECIPROCAL, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Reciprocal, OPS_EWF_RECIPROCAL, FMATH_OUT)
UNARY_OUT(Tanh, OPS_EWF_TANH, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Tanh, OPS_EWF_TANH, FMATH_OUT)
UNARY_OUT(Sigmoid, OPS_EWF_SIGMOID, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Sigmoid, OPS_EWF_SIGMOID, FMATH_OUT)
UNARY_OUT(Erf, OPS_EWF_ERF, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Erf, OPS_EWF_ERF, FMATH_OUT)
UNARY_OUT(Silu, OPS_EWF_SILU, FMATH_OUT, FMATH_OUT)
UNARY_OUT(Neg, OPS_EWF_NEG, NUM_NOBOOL, NUM_NOBOOL)
UNARY_OUT(Abs, OPS_EWF_ABS, NUM_NOBOOL, NUM_NOBOOL)
UNARY_OUT(Sign, OPS_EWF_SIGN, NUM_NOBOOL | DTM(OPS_DT_BOOL), DTM_ALL)
UNARY_OUT(Floor, OPS_EWF_FLOOR, NUM_NOBOOL, NUM_NOBOOL)
UNARY_INPLACE(Floor, OPS_EWF_FLOOR, NUM_NOBOOL)
UNARY_OUT(Ceil, OPS_EWF_CEIL, NUM_NOBOOL, NUM_NOBOOL)
UNARY_INPLACE(Ceil, OPS_EWF_CEIL, NUM_NOBOOL)
UNARY_OUT(Round, OPS_EWF_ROUND, NUM_NOBOOL, NUM_NOBOOL)
UNARY_OUT(Trunc, OPS_EWF_TRUNC, NUM_NOBOOL, NUM_NOBOOL)
UNARY_OUT(Sin, OPS_EWF_SIN, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Sin, OPS_EWF_SIN, FMATH_OUT)
UNARY_OUT(Cos, OPS_EWF_COS, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Cos, OPS_EWF_COS, FMATH_OUT)
UNARY_OUT(Tan, OPS_EWF_TAN, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Tan, OPS_EWF_TAN, FMATH_OUT)
UNARY_OUT(Asin, OPS_EWF_ASIN, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Asin, OPS_EWF_ASIN, FMATH_OUT)
UNARY_OUT(Acos, OPS_EWF_ACOS, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Acos, OPS_EWF_ACOS, FMATH_OUT)
UNARY_OUT(Atan, OPS_EWF_ATAN, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Atan, OPS_EWF_ATAN, FMATH_OUT)
UNARY_OUT(Sinh, OPS_EWF_SINH, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Sinh, OPS_EWF_SINH, FMATH_OUT)
UNARY_OUT(Cosh, OPS_EWF_COSH, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Cosh, OPS_EWF_COSH, FMATH_OUT)
UNARY_OUT(Asinh, OPS_EWF_ASINH, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Asinh, OPS_EWF_ASINH, FMATH_OUT)
UNARY_OUT(Acosh, OPS_EWF_ACOSH, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Acosh, OPS_EWF_ACOSH, FMATH_OUT)
UNARY_OUT(Atanh, OPS_EWF_ATANH, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Atanh, OPS_EWF_ATANH, FMATH_OUT)
UNARY_OUT(Expm1, OPS_EWF_EXPM1, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Expm1, OPS_EWF_EXPM1, FMATH_OUT)
UNARY_OUT(Log1p, OPS_EWF_LOG1P, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Log1p, OPS_EWF_LOG1P, FMATH_OUT)
UNARY_OUT(Log2, OPS_EWF_LOG2, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Log2, OPS_EWF_LOG2, FMATH_OUT)
UNARY_OUT(Log10, OPS_EWF_LOG10, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Log10, OPS_EWF_LOG10, FMATH_OUT)
UNARY_OUT(Exp2, OPS_EWF_EXP2, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Exp2, OPS_EWF_EXP2, FMATH_OUT)
UNARY_OUT(Erfc, OPS_EWF_ERFC, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Erfc, OPS_EWF_ERFC, FMATH_OUT)
UNARY_OUT(Frac, OPS_EWF_FRAC, NUM_NOBOOL, NUM_NOBOOL)
UNARY_INPLACE(Frac, OPS_EWF_FRAC, NUM_NOBOOL)
UNARY_OUT(IsFinite, OPS_EWF_ISFINITE, DTM_ALL, DTM_ALL)
UNARY_OUT(IsNegInf, OPS_EWF_ISNEGINF, DTM_ALL, DTM_ALL)
UNARY_OUT(IsPosInf, OPS_EWF_ISPOSINF, DTM_ALL, DTM_ALL)
UNARY_OUT(Signbit, OPS_EWF_SIGNBIT, DTM_ALL, DTM_ALL)
UNARY_OUT(Erfinv, OPS_EWF_ERFINV, FMATH_IN, FMATH_OUT)
UNARY_INPLACE(Erfinv, OPS_EWF_ERFINV, FMATH_OUT)
UNARY_OUT(LogicalNot, OPS_EWF_LNOT, DTM_ALL, DTM_ALL)
UNARY_INPLACE(LogicalNot, OPS_EWF_LNOT, DTM_ALL)

/* bitwise_not: ~x on integers, logical not on bool (aclnn_bitwise_not.h: no floating types) */
API aclnnStatus aclnnBitwiseNotGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,
                                                aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    uint64_t m = DTM_INTS | DTM(OPS_DT_BOOL);
    aclnnStatus st;
    if ((st = t_check(self, m)) || (st = t_check(out, m))) return st;
    if (self->dtype != out->dtype) return ACLNN_ERR_PARAM_INVALID;
    return unary("aclnnBitwiseNot", self->dtype == OPS_DT_BOOL ? OPS_EWF_LNOT : OPS_EWF_BNOT, self, out, m, m, ARGS);
}
OPS_LAUNCHER(aclnnBitwiseNot)

/* ---------------------------------------------------------------- backward maps */

static aclnnStatus binary(const char *name, enum ops_ew_fn fn, const aclTensor *a, const aclTensor *b,
                          const double *s, int ns, const aclTensor *out, uint64_t in_mask, uint64_t out_mask,
                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(a, in_mask)) || (st = t_check(b, in_mask)) || (st = t_check(out, out_mask))) return st;
    return ew_op(name, fn, T2(a, b), s, ns, out, ARGS);
}

#define BACKWARD(Name, fn)                                                                                    \
    API aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *gradOutput, const aclTensor *x,            \
                                                  aclTensor *gradInput, uint64_t *workspaceSize,              \
                                                  aclOpExecutor **executor) {                                 \
        if (!gradOutput || !x || !gradInput) return ACLNN_ERR_PARAM_NULLPTR;                                  \
        return binary("aclnn" #Name, fn, gradOutput, x, NULL, 0, gradInput, FMATH_OUT, FMATH_OUT, ARGS);      \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Name)

BACKWARD(SiluBackward, OPS_EWF_SILU_BWD)       /* (gradOutput, self, gradInput) */
BACKWARD(SigmoidBackward, OPS_EWF_SIGMOID_BWD) /* (gradOutput, output, gradInput) */
BACKWARD(TanhBackward, OPS_EWF_TANH_BWD)       /* (gradOutput, output, gradInput) */

/* ---------------------------------------------------------------- logic */

#define LOGIC2(Name, fn)                                                                                      \
    API aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out, \
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {        \
        if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;                                          \
        return binary("aclnn" #Name, fn, self, other, NULL, 0, out, DTM_ALL, DTM_ALL, ARGS);                  \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Name)                                                                                 \
    API aclnnStatus aclnnInplace##Name##GetWorkspaceSize(aclTensor *selfRef, const aclTensor *other,          \
                                                         uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        return binary("aclnnInplace" #Name, fn, selfRef, other, NULL, 0, selfRef, DTM_ALL, DTM_ALL, ARGS);    \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Name)

LOGIC2(LogicalAnd, OPS_EWF_LAND)
LOGIC2(LogicalOr, OPS_EWF_LOR)

API aclnnStatus aclnnLogicalXorGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return binary("aclnnLogicalXor", OPS_EWF_LXOR, self, other, NULL, 0, out, DTM_ALL, DTM_ALL, ARGS);
}
OPS_LAUNCHER(aclnnLogicalXor)

/* bitwise and/or/xor on integers and bool (a bool's 1 and 0 combine the same way) */
#define BITWISE(Name, FT, FS)                                                                                 \
    API aclnnStatus aclnn##Name##TensorGetWorkspaceSize(const aclTensor *self, const aclTensor *other,        \
                                                        aclTensor *out, uint64_t *workspaceSize,              \
                                                        aclOpExecutor **executor) {                           \
        if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;                                          \
        return binary("aclnn" #Name "Tensor", FT, self, other, NULL, 0, out, BITS, BITS, ARGS);               \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Name##Tensor)                                                                         \
    API aclnnStatus aclnnInplace##Name##TensorGetWorkspaceSize(aclTensor *selfRef, const aclTensor *other,    \
                                                               uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        return binary("aclnnInplace" #Name "Tensor", FT, selfRef, other, NULL, 0, selfRef, BITS, BITS, ARGS); \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Name##Tensor)                                                                  \
    API aclnnStatus aclnn##Name##ScalarGetWorkspaceSize(const aclTensor *self, const aclScalar *other,        \
                                                        aclTensor *out, uint64_t *workspaceSize,              \
                                                        aclOpExecutor **executor) {                           \
        if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;                                          \
        aclnnStatus st;                                                                                       \
        if ((st = t_check(self, BITS)) || (st = t_check(out, BITS))) return st;                               \
        double s[1] = {s_value(other)};                                                                       \
        return ew_op("aclnn" #Name "Scalar", FS, T1(self), s, 1, out, ARGS);                                  \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Name##Scalar)                                                                         \
    API aclnnStatus aclnnInplace##Name##ScalarGetWorkspaceSize(aclTensor *selfRef, const aclScalar *other,    \
                                                               uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        aclnnStatus st;                                                                                       \
        if ((st = t_check(selfRef, BITS))) return st;                                                         \
        double s[1] = {s_value(other)};                                                                       \
        return ew_op("aclnnInplace" #Name "Scalar", FS, T1(selfRef), s, 1, selfRef, ARGS);                    \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Name##Scalar)

#define BITS (DTM_INTS | DTM(OPS_DT_BOOL))
BITWISE(BitwiseAnd, OPS_EWF_BAND, OPS_EWF_BANDS)
BITWISE(BitwiseOr, OPS_EWF_BOR, OPS_EWF_BORS)
BITWISE(BitwiseXor, OPS_EWF_BXOR, OPS_EWF_BXORS)

/* ---------------------------------------------------------------- comparisons */

/* self OP other (a tensor) or self OP scalar, into a bool (or any) out; selfRef OP= ... keeps
 * selfRef's dtype (1 or 0). */
#define COMPARE(Op, FT, FS)                                                                                   \
    API aclnnStatus aclnn##Op##TensorGetWorkspaceSize(const aclTensor *self, const aclTensor *other,          \
                                                      aclTensor *out, uint64_t *workspaceSize,                \
                                                      aclOpExecutor **executor) {                             \
        if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;                                          \
        return binary("aclnn" #Op "Tensor", FT, self, other, NULL, 0, out, DTM_ALL, DTM_ALL, ARGS);           \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Op##Tensor)                                                                           \
    API aclnnStatus aclnnInplace##Op##TensorGetWorkspaceSize(aclTensor *selfRef, const aclTensor *other,      \
                                                             uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        return binary("aclnnInplace" #Op "Tensor", FT, selfRef, other, NULL, 0, selfRef, DTM_ALL, DTM_ALL, ARGS); \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Op##Tensor)                                                                    \
    API aclnnStatus aclnn##Op##ScalarGetWorkspaceSize(const aclTensor *self, const aclScalar *other,          \
                                                      aclTensor *out, uint64_t *workspaceSize,                \
                                                      aclOpExecutor **executor) {                             \
        if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;                                          \
        aclnnStatus st;                                                                                       \
        if ((st = t_check(self, DTM_ALL)) || (st = t_check(out, DTM_ALL))) return st;                         \
        double s[1] = {sc_dt(s_value(other), self->dtype)};                                                   \
        return ew_op("aclnn" #Op "Scalar", FS, T1(self), s, 1, out, ARGS);                                    \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Op##Scalar)                                                                           \
    API aclnnStatus aclnnInplace##Op##ScalarGetWorkspaceSize(aclTensor *selfRef, const aclScalar *other,      \
                                                             uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        aclnnStatus st;                                                                                       \
        if ((st = t_check(selfRef, DTM_ALL))) return st;                                                      \
        double s[1] = {sc_dt(s_value(other), selfRef->dtype)};                                               \
        return ew_op("aclnnInplace" #Op "Scalar", FS, T1(selfRef), s, 1, selfRef, ARGS);                      \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Op##Scalar)

COMPARE(Gt, OPS_EWF_GT, OPS_EWF_GTS)
COMPARE(Ge, OPS_EWF_GE, OPS_EWF_GES)
COMPARE(Lt, OPS_EWF_LT, OPS_EWF_LTS)
COMPARE(Le, OPS_EWF_LE, OPS_EWF_LES)
COMPARE(Eq, OPS_EWF_EQ, OPS_EWF_EQS)
COMPARE(Ne, OPS_EWF_NE, OPS_EWF_NES)

/* ---------------------------------------------------------------- clamps, maximum, minimum */

/* clamp(self, min?, max?): an absent bound is NULL (op-plugin passes an absent optional Scalar as
 * nullptr); both absent is refused, as torch refuses it before. */
API aclnnStatus aclnnClampGetWorkspaceSize(const aclTensor *self, const aclScalar *clipValueMin,
                                           const aclScalar *clipValueMax, aclTensor *out, uint64_t *workspaceSize,
                                           aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (!clipValueMin && !clipValueMax) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;
    double s[2] = {clipValueMin ? sc_dt(s_value(clipValueMin), out->dtype) : -INFINITY,
                   clipValueMax ? sc_dt(s_value(clipValueMax), out->dtype) : INFINITY};
    return ew_op("aclnnClamp", OPS_EWF_CLAMP, T1(self), s, 2, out, ARGS);
}
OPS_LAUNCHER(aclnnClamp)

static aclnnStatus clamp1(const char *name, const aclTensor *self, const aclScalar *v, int is_max,
                          const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !v || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;
    double b = sc_dt(s_value(v), out->dtype);
    double s[2] = {is_max ? -INFINITY : b, is_max ? b : INFINITY};
    return ew_op(name, OPS_EWF_CLAMP, T1(self), s, 2, out, ARGS);
}

API aclnnStatus aclnnClampMinGetWorkspaceSize(const aclTensor *self, const aclScalar *clipValueMin, aclTensor *out,
                                              uint64_t *workspaceSize, aclOpExecutor **executor) {
    return clamp1("aclnnClampMin", self, clipValueMin, 0, out, ARGS);
}
OPS_LAUNCHER(aclnnClampMin)

API aclnnStatus aclnnClampMaxGetWorkspaceSize(const aclTensor *self, const aclScalar *clipValueMax, aclTensor *out,
                                              uint64_t *workspaceSize, aclOpExecutor **executor) {
    return clamp1("aclnnClampMax", self, clipValueMax, 1, out, ARGS);
}
OPS_LAUNCHER(aclnnClampMax)

API aclnnStatus aclnnInplaceClampMaxGetWorkspaceSize(aclTensor *selfRef, const aclScalar *clipValueMax,
                                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    return clamp1("aclnnInplaceClampMax", selfRef, clipValueMax, 1, selfRef, ARGS);
}
OPS_LAUNCHER(aclnnInplaceClampMax)

/* clamp with tensor bounds: an absent one is NULL */
API aclnnStatus aclnnClampTensorGetWorkspaceSize(const aclTensor *self, const aclTensor *clipValueMin,
                                                 const aclTensor *clipValueMax, aclTensor *out,
                                                 uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;
    if (clipValueMin && clipValueMax) {
        if ((st = t_check(clipValueMin, DTM_NUM)) || (st = t_check(clipValueMax, DTM_NUM))) return st;
        return ew_op("aclnnClampTensor", OPS_EWF_CLAMP_T, T3(self, clipValueMin, clipValueMax), NULL, 0, out, ARGS);
    }
    if (clipValueMin)
        return binary("aclnnClampTensor", OPS_EWF_MAXIMUM, self, clipValueMin, NULL, 0, out, DTM_NUM, DTM_NUM, ARGS);
    if (clipValueMax)
        return binary("aclnnClampTensor", OPS_EWF_MINIMUM, self, clipValueMax, NULL, 0, out, DTM_NUM, DTM_NUM, ARGS);
    return ACLNN_ERR_PARAM_NULLPTR;
}
OPS_LAUNCHER(aclnnClampTensor)

/* clamp_min/clamp_max with a tensor bound, and maximum/minimum: NaN from either side wins */
#define BIN_NUM(Name, fn)                                                                                     \
    API aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out, \
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {        \
        if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;                                          \
        return binary("aclnn" #Name, fn, self, other, NULL, 0, out, DTM_ALL, DTM_ALL, ARGS);                  \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Name)
#define BIN_NUM_INPLACE(Name, fn)                                                                             \
    API aclnnStatus aclnnInplace##Name##GetWorkspaceSize(aclTensor *selfRef, const aclTensor *other,          \
                                                         uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        return binary("aclnnInplace" #Name, fn, selfRef, other, NULL, 0, selfRef, DTM_ALL, DTM_ALL, ARGS);    \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Name)

BIN_NUM(ClampMinTensor, OPS_EWF_MAXIMUM)
BIN_NUM_INPLACE(ClampMinTensor, OPS_EWF_MAXIMUM)
BIN_NUM(ClampMaxTensor, OPS_EWF_MINIMUM)
BIN_NUM_INPLACE(ClampMaxTensor, OPS_EWF_MINIMUM)
BIN_NUM(Maximum, OPS_EWF_MAXIMUM)
BIN_NUM(Minimum, OPS_EWF_MINIMUM)

/* ---------------------------------------------------------------- powers */

API aclnnStatus aclnnPowTensorScalarGetWorkspaceSize(const aclTensor *self, const aclScalar *exponent, aclTensor *out,
                                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !exponent || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;
    double s[1] = {sc_dt(s_value(exponent), out->dtype)};
    return ew_op("aclnnPowTensorScalar", OPS_EWF_POW_TS, T1(self), s, 1, out, ARGS);
}
OPS_LAUNCHER(aclnnPowTensorScalar)

API aclnnStatus aclnnInplacePowTensorScalarGetWorkspaceSize(aclTensor *selfRef, const aclScalar *exponent,
                                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !exponent) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(selfRef, DTM_NUM))) return st;
    double s[1] = {sc_dt(s_value(exponent), selfRef->dtype)};
    return ew_op("aclnnInplacePowTensorScalar", OPS_EWF_POW_TS, T1(selfRef), s, 1, selfRef, ARGS);
}
OPS_LAUNCHER(aclnnInplacePowTensorScalar)

API aclnnStatus aclnnPowScalarTensorGetWorkspaceSize(const aclScalar *self, const aclTensor *exponent, aclTensor *out,
                                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !exponent || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(exponent, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;
    double s[1] = {sc_dt(s_value(self), out->dtype)};
    return ew_op("aclnnPowScalarTensor", OPS_EWF_POW_ST, T1(exponent), s, 1, out, ARGS);
}
OPS_LAUNCHER(aclnnPowScalarTensor)

BIN_NUM(PowTensorTensor, OPS_EWF_POW_TT)
BIN_NUM_INPLACE(PowTensorTensor, OPS_EWF_POW_TT)

/* ---------------------------------------------------------------- masked fill, where */

/* selfRef[mask] = value; mask is bool (or uint8) and broadcasts to selfRef */
API aclnnStatus aclnnInplaceMaskedFillScalarGetWorkspaceSize(aclTensor *selfRef, const aclTensor *mask,
                                                             const aclScalar *value, uint64_t *workspaceSize,
                                                             aclOpExecutor **executor) {
    if (!selfRef || !mask || !value) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(selfRef, DTM_ALL)) || (st = t_check(mask, DTM(OPS_DT_BOOL) | DTM(OPS_DT_UINT8)))) return st;
    double s[1] = {sc_dt(s_value(value), selfRef->dtype)};
    return ew_op("aclnnInplaceMaskedFillScalar", OPS_EWF_MASKED_FILL, T2(selfRef, mask), s, 1, selfRef, ARGS);
}
OPS_LAUNCHER(aclnnInplaceMaskedFillScalar)

/* value is a 0-d tensor: where(mask, value, self) */
API aclnnStatus aclnnInplaceMaskedFillTensorGetWorkspaceSize(aclTensor *selfRef, const aclTensor *mask,
                                                             const aclTensor *value, uint64_t *workspaceSize,
                                                             aclOpExecutor **executor) {
    if (!selfRef || !mask || !value) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(selfRef, DTM_ALL)) || (st = t_check(mask, DTM(OPS_DT_BOOL) | DTM(OPS_DT_UINT8))) ||
        (st = t_check(value, DTM_ALL)))
        return st;
    if (t_numel(value) != 1) return ACLNN_ERR_PARAM_INVALID;
    return ew_op("aclnnInplaceMaskedFillTensor", OPS_EWF_WHERE, T3(mask, value, selfRef), NULL, 0, selfRef, ARGS);
}
OPS_LAUNCHER(aclnnInplaceMaskedFillTensor)

API aclnnStatus aclnnSWhereGetWorkspaceSize(const aclTensor *condition, const aclTensor *self, const aclTensor *other,
                                            aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!condition || !self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(condition, DTM(OPS_DT_BOOL) | DTM(OPS_DT_UINT8))) || (st = t_check(self, DTM_ALL)) ||
        (st = t_check(other, DTM_ALL)) || (st = t_check(out, DTM_ALL)))
        return st;
    return ew_op("aclnnSWhere", OPS_EWF_WHERE, T3(condition, self, other), NULL, 0, out, ARGS);
}
OPS_LAUNCHER(aclnnSWhere)

/* ---------------------------------------------------------------- lerp, addcmul, addcdiv, rsub */

API aclnnStatus aclnnLerpsGetWorkspaceSize(const aclTensor *self, const aclTensor *end, const aclScalar *weight,
                                           aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !end || !weight || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sc_op(s_value(weight), out->dtype)};
    return binary("aclnnLerps", OPS_EWF_LERPS, self, end, s, 1, out, FMATH_OUT, FMATH_OUT, ARGS);
}
OPS_LAUNCHER(aclnnLerps)

API aclnnStatus aclnnInplaceLerpsGetWorkspaceSize(aclTensor *selfRef, const aclTensor *end, const aclScalar *weight,
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !end || !weight) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sc_op(s_value(weight), selfRef->dtype)};
    return binary("aclnnInplaceLerps", OPS_EWF_LERPS, selfRef, end, s, 1, selfRef, FMATH_OUT, FMATH_OUT, ARGS);
}
OPS_LAUNCHER(aclnnInplaceLerps)

static aclnnStatus ternary(const char *name, enum ops_ew_fn fn, const aclTensor *a, const aclTensor *b,
                           const aclTensor *c, const double *s, int ns, const aclTensor *out, uint64_t mask,
                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(a, mask)) || (st = t_check(b, mask)) || (st = t_check(c, mask)) || (st = t_check(out, mask)))
        return st;
    return ew_op(name, fn, T3(a, b, c), s, ns, out, ARGS);
}

API aclnnStatus aclnnLerpGetWorkspaceSize(const aclTensor *self, const aclTensor *end, const aclTensor *weight,
                                          aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !end || !weight || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return ternary("aclnnLerp", OPS_EWF_LERP, self, end, weight, NULL, 0, out, FMATH_OUT, ARGS);
}
OPS_LAUNCHER(aclnnLerp)

API aclnnStatus aclnnInplaceLerpGetWorkspaceSize(aclTensor *selfRef, const aclTensor *end, const aclTensor *weight,
                                                 uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !end || !weight) return ACLNN_ERR_PARAM_NULLPTR;
    return ternary("aclnnInplaceLerp", OPS_EWF_LERP, selfRef, end, weight, NULL, 0, selfRef, FMATH_OUT, ARGS);
}
OPS_LAUNCHER(aclnnInplaceLerp)

#define ADDC(Name, fn, mask)                                                                                  \
    API aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclTensor *tensor1,            \
                                                  const aclTensor *tensor2, const aclScalar *value,           \
                                                  aclTensor *out, uint64_t *workspaceSize,                    \
                                                  aclOpExecutor **executor) {                                 \
        if (!self || !tensor1 || !tensor2 || !value || !out) return ACLNN_ERR_PARAM_NULLPTR;                  \
        double s[1] = {sc_op(s_value(value), out->dtype)};                                                    \
        return ternary("aclnn" #Name, fn, self, tensor1, tensor2, s, 1, out, mask, ARGS);                     \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Name)                                                                                 \
    API aclnnStatus aclnnInplace##Name##GetWorkspaceSize(aclTensor *selfRef, const aclTensor *tensor1,        \
                                                         const aclTensor *tensor2, const aclScalar *value,    \
                                                         uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !tensor1 || !tensor2 || !value) return ACLNN_ERR_PARAM_NULLPTR;                       \
        double s[1] = {sc_op(s_value(value), selfRef->dtype)};                                                \
        return ternary("aclnnInplace" #Name, fn, selfRef, tensor1, tensor2, s, 1, selfRef, mask, ARGS);       \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Name)

/* addcdiv has no integer form (torch refuses it: true division) */
ADDC(Addcmul, OPS_EWF_ADDCMUL, DTM_NUM)
ADDC(Addcdiv, OPS_EWF_ADDCDIV, FMATH_OUT)

/* out = other - alpha * self (aclnn_rsub.h) */
API aclnnStatus aclnnRsubGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                          aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[1] = {sc_op(s_value(alpha), out->dtype)};
    return binary("aclnnRsub", OPS_EWF_SUB, other, self, s, 1, out, DTM_NUM, DTM_NUM, ARGS);
}
OPS_LAUNCHER(aclnnRsub)

API aclnnStatus aclnnRsubsGetWorkspaceSize(const aclTensor *self, const aclScalar *other, const aclScalar *alpha,
                                           aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !alpha || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;
    double s[2] = {sc_dt(s_value(other), out->dtype), sc_op(s_value(alpha), out->dtype)};
    return ew_op("aclnnRsubs", OPS_EWF_RSUBS, T1(self), s, 2, out, ARGS);
}
OPS_LAUNCHER(aclnnRsubs)

/* ---------------------------------------------------------------- atan2, remainder, fmod, floor divide, nan_to_num */

BIN_NUM(Atan2, OPS_EWF_ATAN2)
BIN_NUM_INPLACE(Atan2, OPS_EWF_ATAN2)
BIN_NUM(RemainderTensorTensor, OPS_EWF_REMAINDER)
BIN_NUM_INPLACE(RemainderTensorTensor, OPS_EWF_REMAINDER)
BIN_NUM(FmodTensor, OPS_EWF_FMOD)
BIN_NUM_INPLACE(FmodTensor, OPS_EWF_FMOD)
BIN_NUM(FloorDivide, OPS_EWF_FLOOR_DIV)
BIN_NUM_INPLACE(FloorDivide, OPS_EWF_FLOOR_DIV)

/* tensor (op) scalar, the scalar taken by sc (sc_dt or sc_op) */
#define TS_OP(Name, fn, sc)                                                                                   \
    API aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclScalar *other, aclTensor *out, \
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {        \
        if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;                                          \
        aclnnStatus st;                                                                                       \
        if ((st = t_check(self, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;                         \
        double s[1] = {sc(s_value(other), out->dtype)};                                                       \
        return ew_op("aclnn" #Name, fn, T1(self), s, 1, out, ARGS);                                           \
    }                                                                                                         \
    OPS_LAUNCHER(aclnn##Name)                                                                                 \
    API aclnnStatus aclnnInplace##Name##GetWorkspaceSize(aclTensor *selfRef, const aclScalar *other,          \
                                                         uint64_t *workspaceSize, aclOpExecutor **executor) { \
        if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;                                               \
        aclnnStatus st;                                                                                       \
        if ((st = t_check(selfRef, DTM_NUM))) return st;                                                      \
        double s[1] = {sc(s_value(other), selfRef->dtype)};                                                   \
        return ew_op("aclnnInplace" #Name, fn, T1(selfRef), s, 1, selfRef, ARGS);                             \
    }                                                                                                         \
    OPS_LAUNCHER(aclnnInplace##Name)

/* the CPU takes remainder's and fmod's scalar in the tensor's dtype, floor_divide's as float
 * (measured against torch 2.13: every element equal) */
TS_OP(RemainderTensorScalar, OPS_EWF_REMAINDER_TS, sc_dt)
TS_OP(FmodScalar, OPS_EWF_FMOD_TS, sc_dt)
TS_OP(FloorDivides, OPS_EWF_FLOOR_DIVS, sc_op)

API aclnnStatus aclnnRemainderScalarTensorGetWorkspaceSize(const aclScalar *self, const aclTensor *other,
                                                           aclTensor *out, uint64_t *workspaceSize,
                                                           aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(other, DTM_NUM)) || (st = t_check(out, DTM_NUM))) return st;
    double s[1] = {sc_dt(s_value(self), out->dtype)};
    return ew_op("aclnnRemainderScalarTensor", OPS_EWF_REMAINDER_ST, T1(other), s, 1, out, ARGS);
}
OPS_LAUNCHER(aclnnRemainderScalarTensor)

/* nan_to_num: op-plugin passes the replacements as float (NanToNumKernelNpuOpApi.cpp) */
API aclnnStatus aclnnNanToNumGetWorkspaceSize(const aclTensor *self, float nan, float posInf, float negInf,
                                              aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_ALL)) || (st = t_check(out, DTM_ALL))) return st;
    double s[3] = {nan, posInf, negInf};
    return ew_op("aclnnNanToNum", OPS_EWF_NAN_TO_NUM, T1(self), s, 3, out, ARGS);
}
OPS_LAUNCHER(aclnnNanToNum)

API aclnnStatus aclnnInplaceNanToNumGetWorkspaceSize(aclTensor *selfRef, float nan, float posInf, float negInf,
                                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(selfRef, DTM_ALL))) return st;
    double s[3] = {nan, posInf, negInf};
    return ew_op("aclnnInplaceNanToNum", OPS_EWF_NAN_TO_NUM, T1(selfRef), s, 3, selfRef, ARGS);
}
OPS_LAUNCHER(aclnnInplaceNanToNum)

/* torch.isclose (aclnn_is_close.h): rtol, atol and equal_nan by value */
API aclnnStatus aclnnIsCloseGetWorkspaceSize(const aclTensor *self, const aclTensor *other, double rtol, double atol,
                                             bool equalNan, aclTensor *out, uint64_t *workspaceSize,
                                             aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    double s[3] = {rtol, atol, equalNan ? 1.0 : 0.0};
    return binary("aclnnIsClose", OPS_EWF_ISCLOSE, self, other, s, 3, out, DTM_ALL, DTM_ALL, ARGS);
}
OPS_LAUNCHER(aclnnIsClose)

/* ---------------------------------------------------------------- round(decimals), logit, xlogy */

/* decimals by value (RoundKernelNpuOpApi.cpp); the intermediate x * 10^d is rounded to float, as
 * the CPU's kernel computes it in float for float, half and bfloat16 (measured) */
API aclnnStatus aclnnRoundDecimalsGetWorkspaceSize(const aclTensor *self, int64_t decimals, aclTensor *out,
                                                   uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_FLOATS)) || (st = t_check(out, DTM_FLOATS))) return st;
    double s[2] = {(double)decimals, (double)OPS_DT_FLOAT};
    return ew_op("aclnnRoundDecimals", OPS_EWF_ROUND_DEC, T1(self), s, 2, out, ARGS);
}
OPS_LAUNCHER(aclnnRoundDecimals)

API aclnnStatus aclnnInplaceRoundDecimalsGetWorkspaceSize(aclTensor *selfRef, int64_t decimals,
                                                          uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(selfRef, DTM_FLOATS))) return st;
    double s[2] = {(double)decimals, (double)OPS_DT_FLOAT};
    return ew_op("aclnnInplaceRoundDecimals", OPS_EWF_ROUND_DEC, T1(selfRef), s, 2, selfRef, ARGS);
}
OPS_LAUNCHER(aclnnInplaceRoundDecimals)

/* eps as a double, -1 when absent (LogitKernelNpuOpApi.cpp) */
API aclnnStatus aclnnLogitGetWorkspaceSize(const aclTensor *self, double eps, aclTensor *out, uint64_t *workspaceSize,
                                           aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, FMATH_IN)) || (st = t_check(out, FMATH_OUT))) return st;
    double s[1] = {eps};
    return ew_op("aclnnLogit", OPS_EWF_LOGIT, T1(self), s, 1, out, ARGS);
}
OPS_LAUNCHER(aclnnLogit)

BIN_NUM(XLogYTensor, OPS_EWF_XLOGY)
BIN_NUM_INPLACE(XLogYTensor, OPS_EWF_XLOGY)

API aclnnStatus aclnnXLogYScalarOtherGetWorkspaceSize(const aclTensor *self, const aclScalar *other, aclTensor *out,
                                                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, DTM_ALL)) || (st = t_check(out, FMATH_OUT))) return st;
    double s[1] = {sc_dt(s_value(other), out->dtype)};
    return ew_op("aclnnXLogYScalarOther", OPS_EWF_XLOGY_TS, T1(self), s, 1, out, ARGS);
}
OPS_LAUNCHER(aclnnXLogYScalarOther)

API aclnnStatus aclnnInplaceXLogYScalarOtherGetWorkspaceSize(aclTensor *selfRef, const aclScalar *other,
                                                             uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!selfRef || !other) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(selfRef, FMATH_OUT))) return st;
    double s[1] = {sc_dt(s_value(other), selfRef->dtype)};
    return ew_op("aclnnInplaceXLogYScalarOther", OPS_EWF_XLOGY_TS, T1(selfRef), s, 1, selfRef, ARGS);
}
OPS_LAUNCHER(aclnnInplaceXLogYScalarOther)

API aclnnStatus aclnnXLogYScalarSelfGetWorkspaceSize(const aclScalar *self, const aclTensor *other, aclTensor *out,
                                                     uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !other || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(other, DTM_ALL)) || (st = t_check(out, FMATH_OUT))) return st;
    double s[1] = {sc_dt(s_value(self), out->dtype)};
    return ew_op("aclnnXLogYScalarSelf", OPS_EWF_XLOGY_ST, T1(other), s, 1, out, ARGS);
}
OPS_LAUNCHER(aclnnXLogYScalarSelf)
