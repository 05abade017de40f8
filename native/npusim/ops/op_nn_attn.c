/* aclnnFlashAttentionScore and aclnnFlashAttentionScoreGrad: what op-plugin calls for
 * torch.nn.functional.scaled_dot_product_attention on a 910B-class SoC when query, key and value
 * are 4-D float16/bfloat16/float32 with a bool mask or none (and, for float32, head dims that are
 * multiples of 4; otherwise it decomposes into matmul and softmax): scaled_dot_product_attention
 * in ScaledDotProductAttentionKernelNpuOpApi.cpp calls npu_fusion_attention_v3 with layout "BNSD",
 * sparse mode 2 (a causal mask from the top left) for is_causal or 0 with the mask negated (1 =
 * hidden), keep_prob 1 - dropout_p; npu_fusion_attention_v3_symint and its backward
 * (FlashAttentionKernelNpuOpApi.cpp) give the argument order of both prototypes. Dropout (a drop
 * mask, keepProb < 1), a positional shift (pse), prefix and band sparse modes (4 to 8) are refused
 * with 161002. */
#include <string.h>

#include "op_nn_int.h"

/* t as a [B, N, S, D] view for its layout, with n heads (BSH/SBH split H into n heads of H / n). */
static int bnsd(const aclTensor *t, const char *layout, int64_t n, struct ops_tensor *v) {
    *v = t_view(t);
    const int64_t *s = t->dims, *st = t->strides;
    if (!strcmp(layout, "BNSD")) return t->ndim == 4 ? 0 : -1;
    if (!strcmp(layout, "BSND")) {
        if (t->ndim != 4) return -1;
        int64_t shape[4] = {s[0], s[2], s[1], s[3]}, stride[4] = {st[0], st[2], st[1], st[3]};
        memcpy(v->shape, shape, sizeof shape);
        memcpy(v->stride, stride, sizeof stride);
        return 0;
    }
    int sbh = !strcmp(layout, "SBH");
    if ((!sbh && strcmp(layout, "BSH")) || t->ndim != 3 || n <= 0 || s[2] % n) return -1;
    int64_t d = s[2] / n;
    int bi = sbh ? 1 : 0, si = sbh ? 0 : 1;
    int64_t shape[4] = {s[bi], n, s[si], d}, stride[4] = {st[bi], d * st[2], st[si], st[2]};
    v->ndim = 4;
    memcpy(v->shape, shape, sizeof shape);
    memcpy(v->stride, stride, sizeof stride);
    return 0;
}

/* The views of q, k, v (and out or the gradients) and the checks both phases share. */
struct fa_args {
    struct ops_tensor q, k, v, mask;
    int hasmask;
};

static aclnnStatus fa_views(const aclTensor *query, const aclTensor *key, const aclTensor *value,
                            const aclTensor *pse, const aclTensor *dropMask, const aclTensor *attenMask,
                            double keepProb, int64_t headNum, const char *layout, int64_t sparseMode,
                            struct fa_args *a) {
    NN_CHECK(t_check(query, DTM_FLOATS));
    NN_CHECK(t_check(key, DTM_FLOATS));
    NN_CHECK(t_check(value, DTM_FLOATS));
    NN_REQUIRE(key->dtype == query->dtype && value->dtype == query->dtype);
    NN_REQUIRE(!(pse && t_numel(pse)) && !(dropMask && t_numel(dropMask)) && keepProb == 1.0);
    NN_REQUIRE(sparseMode >= 0 && sparseMode <= 3 && headNum > 0);
    NN_REQUIRE(bnsd(query, layout, headNum, &a->q) == 0 && a->q.shape[1] == headNum);
    int64_t D = a->q.shape[3];
    int64_t n2 = 0;
    if (key->ndim == 3) {
        NN_REQUIRE(D > 0 && key->dims[2] % D == 0);
        n2 = key->dims[2] / D;
    }
    NN_REQUIRE(bnsd(key, layout, n2, &a->k) == 0);
    n2 = a->k.shape[1];
    NN_REQUIRE(bnsd(value, layout, n2, &a->v) == 0);
    NN_REQUIRE(n2 > 0 && headNum % n2 == 0 && a->k.shape[3] == D && a->k.shape[0] == a->q.shape[0] &&
               a->v.shape[0] == a->q.shape[0] && a->v.shape[1] == n2 && a->v.shape[2] == a->k.shape[2]);
    a->hasmask = attenMask && t_numel(attenMask) && sparseMode <= 1;
    if (a->hasmask) {
        NN_CHECK(t_check(attenMask, DTM(OPS_DT_BOOL) | DTM(OPS_DT_UINT8)));
        int64_t want[4] = {a->q.shape[0], headNum, a->q.shape[2], a->k.shape[2]}, tmp[OPS_MAX_DIMS];
        NN_REQUIRE(attenMask->ndim <= 4 && t_broadcast(attenMask->dims, attenMask->ndim, want, 4, tmp) == 4);
        for (int d = 0; d < 4; d++) NN_REQUIRE(tmp[d] == want[d]);
        a->mask = t_aligned(attenMask, want, 4);
    }
    return ACLNN_SUCCESS;
}

static void fa_ints(aclOpExecutor *e, int64_t sparseMode, int64_t preTokens, int64_t nextTokens, int hasmask,
                    double scale) {
    ex_int(e, sparseMode);
    ex_int(e, preTokens);
    ex_int(e, nextTokens);
    ex_int(e, hasmask);
    ex_scalar(e, scale);
}

API aclnnStatus aclnnFlashAttentionScoreGetWorkspaceSize(
    const aclTensor *query, const aclTensor *key, const aclTensor *value, const aclTensor *realShiftOptional,
    const aclTensor *dropMaskOptional, const aclTensor *paddingMaskOptional, const aclTensor *attenMaskOptional,
    const aclIntArray *prefixOptional, double scaleValue, double keepProb, int64_t preTokens, int64_t nextTokens,
    int64_t headNum, char *inputLayout, int64_t innerPrecise, int64_t sparseMode, const aclTensor *softmaxMaxOut,
    const aclTensor *softmaxSumOut, const aclTensor *softmaxOutOut, const aclTensor *attentionOutOut,
    uint64_t *workspaceSize, aclOpExecutor **executor) {
    (void)paddingMaskOptional, (void)prefixOptional, (void)innerPrecise, (void)softmaxOutOut;
    if (!query || !key || !value || !inputLayout || !softmaxMaxOut || !softmaxSumOut || !attentionOutOut)
        return ACLNN_ERR_PARAM_NULLPTR;
    struct fa_args a;
    NN_CHECK(fa_views(query, key, value, realShiftOptional, dropMaskOptional, attenMaskOptional, keepProb, headNum,
                      inputLayout, sparseMode, &a));
    NN_CHECK(t_check(softmaxMaxOut, DTM(OPS_DT_FLOAT)));
    NN_CHECK(t_check(softmaxSumOut, DTM(OPS_DT_FLOAT)));
    NN_CHECK(t_check(attentionOutOut, DTM_FLOATS));
    struct ops_tensor out;
    NN_REQUIRE(bnsd(attentionOutOut, inputLayout, headNum, &out) == 0);
    int64_t want[4] = {a.q.shape[0], headNum, a.q.shape[2], a.v.shape[3]};
    for (int d = 0; d < 4; d++) NN_REQUIRE(out.shape[d] == want[d]);
    int64_t sm[4] = {a.q.shape[0], headNum, a.q.shape[2], 8};
    NN_REQUIRE(t_same_shape(softmaxMaxOut, sm, 4) && t_same_shape(softmaxSumOut, sm, 4));
    NN_OPEN(e, "aclnnFlashAttentionScore", OPS_OP_FA);
    fa_ints(e, sparseMode, preTokens, nextTokens, a.hasmask, scaleValue);
    ex_tensor(e, a.q);
    ex_tensor(e, a.k);
    ex_tensor(e, a.v);
    if (a.hasmask) ex_tensor(e, a.mask);
    ex_tensor(e, t_view(softmaxMaxOut));
    ex_tensor(e, t_view(softmaxSumOut));
    ex_tensor(e, out);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnFlashAttentionScore)

/* The gradient recomputes the probabilities from query and key: softmaxMax, softmaxSum, softmaxIn
 * and attentionIn are accepted and not read. */
API aclnnStatus aclnnFlashAttentionScoreGradGetWorkspaceSize(
    const aclTensor *query, const aclTensor *key, const aclTensor *value, const aclTensor *dy,
    const aclTensor *pseShiftOptional, const aclTensor *dropMaskOptional, const aclTensor *paddingMaskOptional,
    const aclTensor *attenMaskOptional, const aclTensor *softmaxMaxOptional, const aclTensor *softmaxSumOptional,
    const aclTensor *softmaxInOptional, const aclTensor *attentionInOptional, const aclIntArray *prefixOptional,
    double scaleValue, double keepProb, int64_t preTokens, int64_t nextTokens, int64_t headNum, char *inputLayout,
    int64_t innerPrecise, int64_t sparseMode, const aclTensor *dqOut, const aclTensor *dkOut,
    const aclTensor *dvOut, const aclTensor *dpseOut, uint64_t *workspaceSize, aclOpExecutor **executor) {
    (void)paddingMaskOptional, (void)softmaxMaxOptional, (void)softmaxSumOptional, (void)softmaxInOptional;
    (void)attentionInOptional, (void)prefixOptional, (void)innerPrecise, (void)dpseOut;
    if (!query || !key || !value || !dy || !inputLayout || !dqOut || !dkOut || !dvOut) return ACLNN_ERR_PARAM_NULLPTR;
    struct fa_args a;
    NN_CHECK(fa_views(query, key, value, pseShiftOptional, dropMaskOptional, attenMaskOptional, keepProb, headNum,
                      inputLayout, sparseMode, &a));
    NN_CHECK(t_check(dy, DTM_FLOATS));
    NN_CHECK(t_check(dqOut, DTM_FLOATS));
    NN_CHECK(t_check(dkOut, DTM_FLOATS));
    NN_CHECK(t_check(dvOut, DTM_FLOATS));
    NN_REQUIRE(nn_same_shape(dqOut, query) && nn_same_shape(dkOut, key) && nn_same_shape(dvOut, value));
    struct ops_tensor g, dq, dk, dv;
    NN_REQUIRE(bnsd(dy, inputLayout, headNum, &g) == 0 && g.shape[3] == a.v.shape[3] && g.shape[2] == a.q.shape[2]);
    NN_REQUIRE(bnsd(dqOut, inputLayout, headNum, &dq) == 0);
    NN_REQUIRE(bnsd(dkOut, inputLayout, a.k.shape[1], &dk) == 0);
    NN_REQUIRE(bnsd(dvOut, inputLayout, a.v.shape[1], &dv) == 0);
    NN_OPEN(e, "aclnnFlashAttentionScoreGrad", OPS_OP_FA_BWD);
    fa_ints(e, sparseMode, preTokens, nextTokens, a.hasmask, scaleValue);
    ex_tensor(e, a.q);
    ex_tensor(e, a.k);
    ex_tensor(e, a.v);
    ex_tensor(e, g);
    if (a.hasmask) ex_tensor(e, a.mask);
    ex_tensor(e, dq);
    ex_tensor(e, dk);
    ex_tensor(e, dv);
    return ex_done(e);
}
OPS_LAUNCHER(aclnnFlashAttentionScoreGrad)
