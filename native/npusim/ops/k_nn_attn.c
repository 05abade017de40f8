/* Attention (FlashAttentionScore and its gradient) on [B, N, S, D] views: scores
 * s_ij = scale * q_i . k_j, masked where the mask says 1 or the sparse mode's band excludes j,
 * p = softmax(s) per row, out_i = sum_j p_ij v_j. Grouped heads: query head n reads key/value head
 * n / (N1 / N2). Everything in double in a fixed order; the gradient recomputes p from q and k
 * rather than from the stored row max and sum, which are float. A row with every key masked gives
 * 0 (there is nothing to attend to) and no gradient. */
#include <stdlib.h>

#include "kern.h"

#define HOST(var, t)                       \
    char *var;                             \
    do {                                   \
        int err_;                          \
        var = khost(k, (t), &err_);        \
        if (err_) return err_;             \
    } while (0)

static inline int64_t at4(const struct ops_tensor *t, int64_t a, int64_t b, int64_t c, int64_t d) {
    return a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + d * t->stride[3];
}

/* Whether key j is hidden from query i. Sparse modes of aclnnFlashAttentionScore: 0 default and
 * 1 all (the mask, and the band i - pre <= j <= i + next), 2 causal from the top left (j > i),
 * 3 causal from the bottom right (j > i + S1 - S0); modes 2 and 3 pass a compressed mask that is
 * not read here (the rule is the mask). */
static int hidden(int mode, int64_t pre, int64_t next, int64_t i, int64_t j, int64_t S0, int64_t S1, double m) {
    switch (mode) {
    case 2: return j > i;
    case 3: return j > i + S1 - S0;
    default: return m != 0.0 || j < i - pre || j > i + next;
    }
}

struct fa {
    const struct ops_tensor *q, *kk, *v, *mask;
    char *pq, *pk, *pv, *pm;
    int64_t B, N1, N2, S0, S1, D, D2, grp, pre, next;
    int mode;
    double scale;
};

/* The common args; returns whether a mask is given, or -1 for args this kernel does not take. */
static int fa_setup(const struct kctx *k, struct fa *f, int nfixed) {
    if (k->a->ni < 4 || k->a->ns < 1) return -1;
    f->mode = (int)k->i[0];
    f->pre = k->i[1];
    f->next = k->i[2];
    int hasmask = k->i[3] != 0;
    if ((int)k->a->nt != nfixed + hasmask) return -1;
    f->scale = k->s[0];
    f->q = &k->t[0], f->kk = &k->t[1], f->v = &k->t[2];
    for (uint32_t j = 0; j < k->a->nt; j++)
        if (k->t[j].ndim != 4) return -1;
    f->B = f->q->shape[0], f->N1 = f->q->shape[1], f->S0 = f->q->shape[2], f->D = f->q->shape[3];
    f->N2 = f->kk->shape[1], f->S1 = f->kk->shape[2], f->D2 = f->v->shape[3];
    if (f->N2 <= 0 || f->N1 % f->N2) return -1;
    f->grp = f->N1 / f->N2;
    return hasmask;
}

/* The scores of row (b, n, i) into s[S1] (NAN where hidden); returns the row max, -inf if all hidden. */
static double fa_scores(const struct fa *f, int64_t b, int64_t n, int64_t i, double *s) {
    int64_t kn = n / f->grp;
    double mx = -INFINITY;
    for (int64_t j = 0; j < f->S1; j++) {
        double m = f->pm ? kld(f->mask->dtype, f->pm, at4(f->mask, b, n, i, j)) : 0.0;
        if (hidden(f->mode, f->pre, f->next, i, j, f->S0, f->S1, m)) {
            s[j] = NAN;
            continue;
        }
        double acc = 0.0;
        for (int64_t d = 0; d < f->D; d++)
            acc += kld(f->q->dtype, f->pq, at4(f->q, b, n, i, d)) * kld(f->kk->dtype, f->pk, at4(f->kk, b, kn, j, d));
        s[j] = acc * f->scale;
        if (s[j] > mx) mx = s[j];
    }
    return mx;
}

/* s -> p in place (0 where hidden); returns the sum of exp(s - max). */
static double fa_probs(const struct fa *f, double *s, double mx) {
    double sum = 0.0;
    for (int64_t j = 0; j < f->S1; j++) {
        s[j] = s[j] != s[j] ? 0.0 : exp(s[j] - mx);
        sum += s[j];
    }
    for (int64_t j = 0; j < f->S1; j++) s[j] = sum > 0.0 ? s[j] / sum : 0.0;
    return sum;
}

KHIDDEN int k_fa(const struct kctx *k) {
    struct fa f = {0};
    int hasmask = fa_setup(k, &f, 6);
    if (hasmask < 0) return KERR_ARGS;
    const struct ops_tensor *smax = &k->t[3 + hasmask], *ssum = &k->t[4 + hasmask], *out = &k->t[5 + hasmask];
    f.mask = hasmask ? &k->t[3] : NULL;
    HOST(pq, f.q);
    HOST(pk, f.kk);
    HOST(pv, f.v);
    f.pq = pq, f.pk = pk, f.pv = pv;
    if (hasmask) {
        HOST(pm, f.mask);
        f.pm = pm;
    }
    HOST(pmax, smax);
    HOST(psum, ssum);
    HOST(po, out);
    double *s = malloc(sizeof(double) * (size_t)(f.S1 ? f.S1 : 1));
    if (!s) return KERR_ARGS;
    for (int64_t b = 0; b < f.B; b++)
        for (int64_t n = 0; n < f.N1; n++)
            for (int64_t i = 0; i < f.S0; i++) {
                double mx = fa_scores(&f, b, n, i, s);
                double sum = fa_probs(&f, s, mx);
                for (int64_t d = 0; d < f.D2; d++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < f.S1; j++)
                        if (s[j] != 0.0) acc += s[j] * kld(f.v->dtype, pv, at4(f.v, b, n / f.grp, j, d));
                    kst(out->dtype, po, at4(out, b, n, i, d), acc);
                }
                for (int64_t l = 0; l < smax->shape[3]; l++) {
                    kst(smax->dtype, pmax, at4(smax, b, n, i, l), mx);
                    kst(ssum->dtype, psum, at4(ssum, b, n, i, l), sum);
                }
            }
    free(s);
    kcost(k, f.B * f.N1 * f.S0 * f.S1);
    return 0;
}

KHIDDEN int k_fa_bwd(const struct kctx *k) {
    struct fa f = {0};
    int hasmask = fa_setup(k, &f, 7);
    if (hasmask < 0) return KERR_ARGS;
    const struct ops_tensor *dy = &k->t[3], *dq = &k->t[4 + hasmask], *dk = &k->t[5 + hasmask],
                            *dv = &k->t[6 + hasmask];
    f.mask = hasmask ? &k->t[4] : NULL;
    HOST(pq, f.q);
    HOST(pk, f.kk);
    HOST(pv, f.v);
    f.pq = pq, f.pk = pk, f.pv = pv;
    if (hasmask) {
        HOST(pm, f.mask);
        f.pm = pm;
    }
    HOST(pdy, dy);
    HOST(pdq, dq);
    HOST(pdk, dk);
    HOST(pdv, dv);
    size_t s1 = (size_t)(f.S1 ? f.S1 : 1);
    double *p = malloc(sizeof(double) * s1), *dp = malloc(sizeof(double) * s1);
    double *gk = malloc(sizeof(double) * s1 * (size_t)(f.D ? f.D : 1));
    double *gv = malloc(sizeof(double) * s1 * (size_t)(f.D2 ? f.D2 : 1));
    double *gq = malloc(sizeof(double) * (size_t)(f.D ? f.D : 1));
    int rc = (!p || !dp || !gk || !gv || !gq) ? KERR_ARGS : 0;
    for (int64_t b = 0; b < f.B && !rc; b++)
        for (int64_t kn = 0; kn < f.N2; kn++) {
            /* dk and dv of key/value head kn: summed over its query heads and their rows, in order */
            for (int64_t e = 0; e < f.S1 * f.D; e++) gk[e] = 0.0;
            for (int64_t e = 0; e < f.S1 * f.D2; e++) gv[e] = 0.0;
            for (int64_t n = kn * f.grp; n < (kn + 1) * f.grp; n++)
                for (int64_t i = 0; i < f.S0; i++) {
                    double mx = fa_scores(&f, b, n, i, p);
                    fa_probs(&f, p, mx);
                    double dsum = 0.0;
                    for (int64_t j = 0; j < f.S1; j++) {
                        double acc = 0.0;
                        for (int64_t d = 0; d < f.D2; d++) {
                            double g = kld(dy->dtype, pdy, at4(dy, b, n, i, d));
                            acc += g * kld(f.v->dtype, pv, at4(f.v, b, kn, j, d));
                            gv[j * f.D2 + d] += p[j] * g;
                        }
                        dp[j] = acc;
                        dsum += p[j] * acc;
                    }
                    for (int64_t d = 0; d < f.D; d++) gq[d] = 0.0;
                    for (int64_t j = 0; j < f.S1; j++) {
                        double ds = p[j] * (dp[j] - dsum) * f.scale;
                        if (ds == 0.0) continue;
                        for (int64_t d = 0; d < f.D; d++) {
                            gq[d] += ds * kld(f.kk->dtype, pk, at4(f.kk, b, kn, j, d));
                            gk[j * f.D + d] += ds * kld(f.q->dtype, pq, at4(f.q, b, n, i, d));
                        }
                    }
                    for (int64_t d = 0; d < f.D; d++) kst(dq->dtype, pdq, at4(dq, b, n, i, d), gq[d]);
                }
            for (int64_t j = 0; j < f.S1; j++) {
                for (int64_t d = 0; d < f.D; d++) kst(dk->dtype, pdk, at4(dk, b, kn, j, d), gk[j * f.D + d]);
                for (int64_t d = 0; d < f.D2; d++) kst(dv->dtype, pdv, at4(dv, b, kn, j, d), gv[j * f.D2 + d]);
            }
        }
    free(p), free(dp), free(gk), free(gv), free(gq);
    if (!rc) kcost(k, 3 * f.B * f.N1 * f.S0 * f.S1);
    return rc;
}
