/* The element-wise kernel: out[i] = f(in0[i], in1[i], ..., scalars) for one row of OPS_EW
 * (ops_list.h, ops_list_*.h). Inputs come aligned to the output's shape (broadcast dimensions of stride 0);
 * each is loaded in its own dtype and the result stored in the output's, so mixed-dtype operands
 * and boolean results need nothing more. */
#include "kern.h"

/* x: the inputs' elements as double, s: the scalars. */
static double ew_copy(const double *x, const double *s) { (void)s; return x[0]; }
static double ew_add(const double *x, const double *s) { return x[0] + s[0] * x[1]; }
static double ew_sub(const double *x, const double *s) { return x[0] - s[0] * x[1]; }
static double ew_mul(const double *x, const double *s) { (void)s; return x[0] * x[1]; }
static double ew_div(const double *x, const double *s) { (void)s; return x[0] / x[1]; }
static double ew_adds(const double *x, const double *s) { return x[0] + s[1] * s[0]; }
static double ew_radds(const double *x, const double *s) { return s[0] + s[1] * x[0]; }
static double ew_subs(const double *x, const double *s) { return x[0] - s[1] * s[0]; }
static double ew_muls(const double *x, const double *s) { return x[0] * s[0]; }
static double ew_divs(const double *x, const double *s) { return x[0] / s[0]; }
static double ew_fill(const double *x, const double *s) { (void)x; return s[0]; }

typedef double (*ewfn)(const double *x, const double *s);
static const ewfn EW[OPS_EWF_COUNT] = {
#define EWROW(id, fn) [OPS_EWF_##id] = fn,
    OPS_EW(EWROW)
#undef EWROW
};

/* ints[0]: the function; ints[1]: 1 if intermediate results round to the output's precision
 * before the store (a scalar operand of a lower-precision op is rounded the same way). */
KHIDDEN int k_ew(const struct kctx *k) {
    if (k->a->ni < 1 || k->i[0] < 0 || k->i[0] >= OPS_EWF_COUNT || k->a->nt < 1 || k->a->nt > KIT_MAX) return KERR_ARGS;
    ewfn f = EW[k->i[0]];
    int nt = (int)k->a->nt, nin = nt - 1;
    const struct ops_tensor *out = &k->t[nt - 1];
    const struct ops_tensor *ts[KIT_MAX];
    char *p[KIT_MAX];
    int err;
    for (int j = 0; j < nt; j++) {
        ts[j] = &k->t[j];
        if (ts[j]->ndim != out->ndim) return KERR_ARGS;
        p[j] = khost(k, ts[j], &err);
        if (err) return err;
    }
    int64_t n = knumel(out);
    if (n == 0) return 0;
    struct kit it;
    kit_init(&it, out->shape, out->ndim, ts, nt);
    double x[KIT_MAX];
    double s[16] = {0};
    for (uint32_t j = 0; j < k->a->ns && j < 16; j++) s[j] = k->s[j];
    int all_float = 1;
    for (int j = 0; j < nt; j++) all_float &= ts[j]->dtype == OPS_DT_FLOAT;
    if (all_float && out->ndim > 0) {
        /* the same values in the same order, a row of the last dimension at a time: the iterator
         * steps and the dtype switches once a row, not once an element */
        int last = out->ndim - 1;
        int64_t len = out->shape[last], st[KIT_MAX];
        for (int j = 0; j < nt; j++) st[j] = ts[j]->stride[last];
        struct kit rows;
        kit_init(&rows, out->shape, last, ts, nt);
        float *o = (float *)p[nt - 1];
        for (int64_t r = 0; r < n / len; r++) {
            float *orow = o + rows.off[nt - 1];
            int64_t ost = st[nt - 1];
            /* one loop per function, so that (with the binary's link-time optimisation) each
             * function is inlined into its own loop instead of called once an element */
#define EWLOOP(id, fn)                                                                          \
    case OPS_EWF_##id:                                                                          \
        for (int64_t e = 0; e < len; e++) {                                                     \
            for (int j = 0; j < nin; j++) x[j] = ((const float *)p[j])[rows.off[j] + e * st[j]]; \
            orow[e * ost] = (float)fn(x, s);                                                    \
        }                                                                                       \
        break;
            switch (k->i[0]) {
                OPS_EW(EWLOOP)
            default: return KERR_ARGS;
            }
#undef EWLOOP
            kit_next(&rows);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            for (int j = 0; j < nin; j++) x[j] = kld(ts[j]->dtype, p[j], it.off[j]);
            kst(out->dtype, p[nt - 1], it.off[nt - 1], f(x, s));
            kit_next(&it);
        }
    }
    kcost(k, n);
    return 0;
}
