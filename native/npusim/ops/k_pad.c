/* The constant-pad kernel (op_pad.c): each output element is the input element it lands on, or
 * the fill value where it lands outside the input. */
#include "kern.h"

KHIDDEN int k_pad(const struct kctx *k) {
    if (k->a->nt != 2 || k->a->ns != 1) return KERR_ARGS;
    const struct ops_tensor *in = &k->t[0], *out = &k->t[1];
    int nd = out->ndim;
    if (in->ndim != nd || (int)k->a->ni != nd) return KERR_ARGS;
    int err;
    char *pi = khost(k, in, &err);
    if (err) return err;
    char *po = khost(k, out, &err);
    if (err) return err;
    int64_t n = knumel(out);
    const struct ops_tensor *ts[1] = {out};
    struct kit it;
    kit_init(&it, out->shape, nd, ts, 1);
    for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        int inside = 1;
        for (int d = 0; d < nd; d++) {
            int64_t j = it.idx[d] - k->i[d];
            if (j < 0 || j >= in->shape[d]) {
                inside = 0;
                break;
            }
            off += j * in->stride[d];
        }
        kst(out->dtype, po, it.off[0], inside ? kld(in->dtype, pi, off) : k->s[0]);
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}
