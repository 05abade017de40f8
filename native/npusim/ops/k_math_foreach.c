/* The foreach family's kernels: one launch runs an element-wise map, or a norm, over every group of
 * a tensor list, as one aclnnForeach* launch does on an AI core per group (op_math_foreach.c builds
 * the args). Each group is the EW or REDUCE kernel's work on its own views, so results are the
 * same as those kernels give tensor by tensor, in list order. */
#include "kern.h"

/* FOREACH args: ints[0] = enum ops_ew_fn, ints[1] = k tensors per group (inputs aligned to the
 * group's output, output last), ints[2] = m scalars per group; scalars: G*m per-group values, then
 * the common ones; tensors: G groups of k. Group g's map sees s = [its m values, common...]. */
KHIDDEN int k_foreach(const struct kctx *k) {
    if (k->a->ni < 3 || k->i[1] < 1 || k->i[1] > KIT_MAX || k->i[2] < 0) return KERR_ARGS;
    int64_t kk = k->i[1], m = k->i[2];
    if (k->a->nt % kk) return KERR_ARGS;
    int64_t groups = k->a->nt / kk;
    if ((int64_t)k->a->ns < groups * m || (int64_t)k->a->ns - groups * m + m > 16) return KERR_ARGS;
    int64_t nc = (int64_t)k->a->ns - groups * m;
    double s[16];
    for (int64_t j = 0; j < nc; j++) s[m + j] = k->s[groups * m + j];
    struct ops_args hdr = {OPS_OP_EW, (uint32_t)kk, (uint32_t)(m + nc), 1};
    int64_t fn = k->i[0];
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t j = 0; j < m; j++) s[j] = k->s[g * m + j];
        struct kctx sub = {k->ctx, &hdr, &fn, s, &k->t[g * kk]};
        int rc = k_ew(&sub);
        if (rc) return rc;
    }
    return 0;
}

/* FOREACH_NORM args: s[0] = p; tensors: pairs (in, out), out given in in's rank with every
 * dimension of size 1 (stride 0). Each out = ||in||_p over all its elements. */
KHIDDEN int k_foreach_norm(const struct kctx *k) {
    if (k->a->ns < 1 || k->a->nt % 2) return KERR_ARGS;
    int64_t ints[1 + OPS_MAX_DIMS];
    ints[0] = OPS_RED_NORM;
    for (int d = 0; d < OPS_MAX_DIMS; d++) ints[1 + d] = 1;
    for (uint32_t g = 0; g < k->a->nt / 2; g++) {
        const struct ops_tensor *in = &k->t[2 * g];
        struct ops_args hdr = {OPS_OP_REDUCE, 2, 1, (uint32_t)(1 + in->ndim)};
        struct kctx sub = {k->ctx, &hdr, ints, k->s, in};
        int rc = k_reduce(&sub);
        if (rc) return rc;
    }
    return 0;
}
