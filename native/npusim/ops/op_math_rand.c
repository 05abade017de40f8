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
 * passes float scalars, int64 seed and offset). */
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
