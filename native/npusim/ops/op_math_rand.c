/* Random fills of the math family: normal_, uniform_ and bernoulli_ (torch.randn, torch.rand,
 * dropout masks built from them). Prototypes: CANN's aclnn API reference (aclnn_normal.h:
 * aclnnInplaceNormal(selfRef, float mean, float std, int64_t seed, int64_t offset); aclnn_uniform.h:
 * aclnnInplaceUniform(selfRef, double from, double to, uint64_t seed, uint64_t offset);
 * aclnn_bernoulli.h: aclnnInplaceBernoulli(selfRef, const aclScalar *prob, int64_t seed,
 * int64_t offset)), as op-plugin calls them with the seed and philox offset of torch_npu's
 * generator (NormalKernelNpuOpApi.cpp, UniformKernelNpuOpApi.cpp, BernoulliKernelNpuOpApi.cpp).
 * The RAND kernel (k_math_misc.c) draws from Philox4x32-10 keyed by (seed, offset): the same
 * seed and offset give the same numbers run after run; they are not the CPU generator's numbers.
 * Also aclnnInplaceRandom (random_, randint), aclnnInplaceBernoulliTensor (bernoulli_ with a
 * tensor of probabilities) and the out-of-place normals with tensor means or stds
 * (aclnnNormalTensorTensor, ...FloatTensor, ...TensorFloat, ...FloatFloat: NormalKernelNpuOpApi.cpp
 * passes float scalars, int64 seed and offset), and dropout's aclnnDropoutGenMaskV2 and
 * aclnnDropoutDoMask (NativeDropoutKernelNpuOpApi.cpp: a bit mask of align(numel, 128) / 8 bytes,
 * then out = self * bit / (1 - p); the backward applies the same mask to the gradient). */
#include "opapi_int.h"

#define RAND_DTM (DTM_FLOATS | DTM(OPS_DT_DOUBLE))

/* out filled by `kind` with parameters a, b; pa/pb (optional) replace them element by element */
static aclnnStatus rand_op2(const char *name, int kind, const aclTensor *out, double a, double b, const aclTensor *pa,
                            const aclTensor *pb, int64_t seed, int64_t offset, uint64_t dtypes,
                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(out, dtypes))) return st;
    const aclTensor *ps[2] = {pa, pb};
    for (int j = 0; j < 2; j++) {
        if (!ps[j]) continue;
        if ((st = t_check(ps[j], DTM_ALL))) return st;
        int64_t shape[OPS_MAX_DIMS];
        int nd = t_broadcast(out->dims, out->ndim, ps[j]->dims, ps[j]->ndim, shape);
        if (nd < 0 || !t_same_shape(out, shape, nd)) return ACLNN_ERR_PARAM_INVALID;
    }
    aclOpExecutor *e = ex_open(name, OPS_OP_RAND, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, kind);
    ex_int(e, seed);
    ex_int(e, offset);
    ex_int(e, (pa ? 1 : 0) | (pb ? 2 : 0));
    ex_int(e, t_numel(out));
    ex_scalar(e, a);
    ex_scalar(e, b);
    ex_tensor(e, t_view(out));
    for (int j = 0; j < 2; j++)
        if (ps[j]) ex_tensor(e, t_aligned(ps[j], out->dims, out->ndim));
    return ex_done(e);
}

static aclnnStatus rand_op(const char *name, int kind, const aclTensor *self, double a, double b, int64_t seed,
                           int64_t offset, uint64_t dtypes, uint64_t *workspaceSize, aclOpExecutor **executor) {
    return rand_op2(name, kind, self, a, b, NULL, NULL, seed, offset, dtypes, workspaceSize, executor);
}

API aclnnStatus aclnnInplaceNormalGetWorkspaceSize(const aclTensor *selfRef, float mean, float std, int64_t seed,
                                                   int64_t offset, uint64_t *workspaceSize,
                                                   aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    if (!(std >= 0.0f)) return ACLNN_ERR_PARAM_INVALID;
    return rand_op("aclnnInplaceNormal", 0, selfRef, mean, std, seed, offset, RAND_DTM, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceNormal)

API aclnnStatus aclnnInplaceUniformGetWorkspaceSize(const aclTensor *selfRef, double from, double to, uint64_t seed,
                                                    uint64_t offset, uint64_t *workspaceSize,
                                                    aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    if (!(from <= to)) return ACLNN_ERR_PARAM_INVALID;
    return rand_op("aclnnInplaceUniform", 1, selfRef, from, to, (int64_t)seed, (int64_t)offset, RAND_DTM,
                   workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceUniform)

API aclnnStatus aclnnInplaceBernoulliGetWorkspaceSize(const aclTensor *selfRef, const aclScalar *prob, int64_t seed,
                                                      int64_t offset, uint64_t *workspaceSize,
                                                      aclOpExecutor **executor) {
    if (!selfRef || !prob) return ACLNN_ERR_PARAM_NULLPTR;
    double p = s_value(prob);
    if (!(p >= 0.0 && p <= 1.0)) return ACLNN_ERR_PARAM_INVALID;
    return rand_op("aclnnInplaceBernoulli", 2, selfRef, p, 0.0, seed, offset, DTM_ALL, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceBernoulli)

/* selfRef = integers uniform in [from, to) (RandomKernelNpuOpApi.cpp: from, to, then the
 * generator's seed and offset) */
API aclnnStatus aclnnInplaceRandomGetWorkspaceSize(const aclTensor *selfRef, int64_t from, int64_t to, uint64_t seed,
                                                   uint64_t offset, uint64_t *workspaceSize,
                                                   aclOpExecutor **executor) {
    if (!selfRef) return ACLNN_ERR_PARAM_NULLPTR;
    if (!(from < to)) return ACLNN_ERR_PARAM_INVALID;
    return rand_op("aclnnInplaceRandom", 3, selfRef, (double)from, (double)to, (int64_t)seed, (int64_t)offset,
                   DTM_NUM, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceRandom)

API aclnnStatus aclnnInplaceBernoulliTensorGetWorkspaceSize(const aclTensor *selfRef, const aclTensor *prob,
                                                            int64_t seed, int64_t offset, uint64_t *workspaceSize,
                                                            aclOpExecutor **executor) {
    if (!selfRef || !prob) return ACLNN_ERR_PARAM_NULLPTR;
    return rand_op2("aclnnInplaceBernoulliTensor", 2, selfRef, 0.0, 0.0, prob, NULL, seed, offset, DTM_ALL,
                    workspaceSize, executor);
}
OPS_LAUNCHER(aclnnInplaceBernoulliTensor)

API aclnnStatus aclnnNormalTensorTensorGetWorkspaceSize(const aclTensor *mean, const aclTensor *std, int64_t seed,
                                                        int64_t offset, aclTensor *out, uint64_t *workspaceSize,
                                                        aclOpExecutor **executor) {
    if (!mean || !std || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return rand_op2("aclnnNormalTensorTensor", 0, out, 0.0, 0.0, mean, std, seed, offset, RAND_DTM, workspaceSize,
                    executor);
}
OPS_LAUNCHER(aclnnNormalTensorTensor)

API aclnnStatus aclnnNormalTensorFloatGetWorkspaceSize(const aclTensor *mean, float std, int64_t seed, int64_t offset,
                                                       aclTensor *out, uint64_t *workspaceSize,
                                                       aclOpExecutor **executor) {
    if (!mean || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (!(std >= 0.0f)) return ACLNN_ERR_PARAM_INVALID;
    return rand_op2("aclnnNormalTensorFloat", 0, out, 0.0, std, mean, NULL, seed, offset, RAND_DTM, workspaceSize,
                    executor);
}
OPS_LAUNCHER(aclnnNormalTensorFloat)

API aclnnStatus aclnnNormalFloatTensorGetWorkspaceSize(float mean, const aclTensor *std, int64_t seed, int64_t offset,
                                                       aclTensor *out, uint64_t *workspaceSize,
                                                       aclOpExecutor **executor) {
    if (!std || !out) return ACLNN_ERR_PARAM_NULLPTR;
    return rand_op2("aclnnNormalFloatTensor", 0, out, mean, 0.0, NULL, std, seed, offset, RAND_DTM, workspaceSize,
                    executor);
}
OPS_LAUNCHER(aclnnNormalFloatTensor)

API aclnnStatus aclnnNormalFloatFloatGetWorkspaceSize(float mean, float std, int64_t seed, int64_t offset,
                                                      aclTensor *out, uint64_t *workspaceSize,
                                                      aclOpExecutor **executor) {
    if (!out) return ACLNN_ERR_PARAM_NULLPTR;
    if (!(std >= 0.0f)) return ACLNN_ERR_PARAM_INVALID;
    return rand_op("aclnnNormalFloatFloat", 0, out, mean, std, seed, offset, RAND_DTM, workspaceSize, executor);
}
OPS_LAUNCHER(aclnnNormalFloatFloat)

/* shape: the dropped tensor's; out: uint8 of align(numel, 128) / 8 bytes */
API aclnnStatus aclnnDropoutGenMaskV2GetWorkspaceSize(const aclIntArray *shape, double prob, int64_t seed,
                                                      int64_t offset, int32_t probDataType, aclTensor *out,
                                                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!shape || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (!(prob >= 0.0 && prob <= 1.0)) return ACLNN_ERR_PARAM_INVALID;
    if (probDataType != OPS_DT_FLOAT && probDataType != OPS_DT_FLOAT16 && probDataType != OPS_DT_BF16)
        return ACLNN_ERR_PARAM_INVALID;
    aclnnStatus st;
    if ((st = t_check(out, DTM(OPS_DT_UINT8)))) return st;
    int64_t n = 1;
    for (uint64_t i = 0; i < shape->size; i++) n *= shape->value[i];
    if (out->ndim != 1 || out->dims[0] != (n + 127) / 128 * 16) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = ex_open("aclnnDropoutGenMaskV2", OPS_OP_RAND, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, 4);
    ex_int(e, seed);
    ex_int(e, offset);
    ex_int(e, 0);
    ex_int(e, n);
    ex_scalar(e, prob);
    ex_scalar(e, 0.0);
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnDropoutGenMaskV2)

API aclnnStatus aclnnDropoutDoMaskGetWorkspaceSize(const aclTensor *self, const aclTensor *mask, double prob,
                                                   aclTensor *out, uint64_t *workspaceSize,
                                                   aclOpExecutor **executor) {
    if (!self || !mask || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (!(prob >= 0.0 && prob <= 1.0)) return ACLNN_ERR_PARAM_INVALID;
    aclnnStatus st;
    if ((st = t_check(self, RAND_DTM)) || (st = t_check(out, RAND_DTM)) || (st = t_check(mask, DTM(OPS_DT_UINT8))))
        return st;
    if (!t_same_shape(out, self->dims, self->ndim) || mask->ndim != 1 || mask->dims[0] * 8 < t_numel(self))
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = ex_open("aclnnDropoutDoMask", OPS_OP_DOMASK, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_scalar(e, prob < 1.0 ? 1.0 / (1.0 - prob) : 0.0);
    ex_tensor(e, t_view(self));
    ex_tensor(e, t_view(mask));
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnDropoutDoMask)

/* num_samples indices per row of self (1-D: one row) by its non-negative weights, into int64 out
 * (MultinomialKernelNpuOpApi.cpp: self, num_samples, replacement, seed, offset, out) */
API aclnnStatus aclnnMultinomialGetWorkspaceSize(const aclTensor *self, int64_t numsamples, bool replacement,
                                                 int64_t seed, int64_t offset, aclTensor *out,
                                                 uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!self || !out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(self, RAND_DTM)) || (st = t_check(out, DTM(OPS_DT_INT64) | DTM(OPS_DT_INT32)))) return st;
    if (self->ndim < 1 || self->ndim > 2 || out->ndim != self->ndim || numsamples < 1) return ACLNN_ERR_PARAM_INVALID;
    int64_t cats = self->dims[self->ndim - 1];
    if (!replacement && numsamples > cats) return ACLNN_ERR_PARAM_INVALID;
    if (out->dims[out->ndim - 1] != numsamples || (self->ndim == 2 && out->dims[0] != self->dims[0]))
        return ACLNN_ERR_PARAM_INVALID;
    struct ops_tensor w = t_view(self), o = t_view(out);
    if (self->ndim == 1) {
        w.shape[1] = w.shape[0], w.stride[1] = w.stride[0], w.shape[0] = 1, w.stride[0] = 0, w.ndim = 2;
        o.shape[1] = o.shape[0], o.stride[1] = o.stride[0], o.shape[0] = 1, o.stride[0] = 0, o.ndim = 2;
    }
    aclOpExecutor *e = ex_open("aclnnMultinomial", OPS_OP_SAMPLE, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, 0);
    ex_int(e, seed);
    ex_int(e, offset);
    ex_int(e, numsamples);
    ex_int(e, replacement);
    ex_tensor(e, w);
    ex_tensor(e, o);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnMultinomial)

/* a permutation of 0..n-1 (RandpermKernelNpuOpApi.cpp: n, seed, offset, out) */
API aclnnStatus aclnnRandpermGetWorkspaceSize(int64_t n, int64_t seed, int64_t offset, aclTensor *out,
                                              uint64_t *workspaceSize, aclOpExecutor **executor) {
    if (!out) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus st;
    if ((st = t_check(out, DTM_NUM))) return st;
    if (n < 0 || out->ndim != 1 || out->dims[0] != n) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = ex_open("aclnnRandperm", OPS_OP_SAMPLE, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, 1);
    ex_int(e, seed);
    ex_int(e, offset);
    ex_tensor(e, t_view(out));
    return ex_done(e);
}
OPS_LAUNCHER(aclnnRandperm)
