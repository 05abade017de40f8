/* Random fills of the math family: normal_, uniform_ and bernoulli_ (torch.randn, torch.rand,
 * dropout masks built from them). Prototypes: CANN's aclnn API reference (aclnn_normal.h:
 * aclnnInplaceNormal(selfRef, float mean, float std, int64_t seed, int64_t offset); aclnn_uniform.h:
 * aclnnInplaceUniform(selfRef, double from, double to, uint64_t seed, uint64_t offset);
 * aclnn_bernoulli.h: aclnnInplaceBernoulli(selfRef, const aclScalar *prob, int64_t seed,
 * int64_t offset)), as op-plugin calls them with the seed and philox offset of torch_npu's
 * generator (NormalKernelNpuOpApi.cpp, UniformKernelNpuOpApi.cpp, BernoulliKernelNpuOpApi.cpp).
 * The RAND kernel (k_math_misc.c) draws from Philox4x32-10 keyed by (seed, offset): the same
 * seed and offset give the same numbers run after run; they are not the CPU generator's numbers. */
#include "opapi_int.h"

#define RAND_DTM (DTM_FLOATS | DTM(OPS_DT_DOUBLE))

static aclnnStatus rand_op(const char *name, int kind, const aclTensor *self, double a, double b, int64_t seed,
                           int64_t offset, uint64_t dtypes, uint64_t *workspaceSize, aclOpExecutor **executor) {
    aclnnStatus st;
    if ((st = t_check(self, dtypes))) return st;
    aclOpExecutor *e = ex_open(name, OPS_OP_RAND, workspaceSize, executor);
    if (!e) return workspaceSize && executor ? ACLNN_ERR_INNER : ACLNN_ERR_PARAM_NULLPTR;
    ex_int(e, kind);
    ex_int(e, seed);
    ex_int(e, offset);
    ex_scalar(e, a);
    ex_scalar(e, b);
    ex_tensor(e, t_view(self));
    return ex_done(e);
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
