/* Kernels of the nn family with structure (ops_list_nn.h says each one's args): softmax and
 * log-softmax, layer and RMS norms, negative log-likelihood, gathers by index (IndexSelect, Gather,
 * Index, Embedding) and the embedding gradient, triangles, ranges, copies into slices (Cat, Stack),
 * argmax, top-k, matrix products with a bias (Addmm, Baddbmm) and the reduced MseLoss.
 *
 * Every kernel walks its output in a fixed order and accumulates in double (or, where torch's CPU
 * kernel accumulates in the tensor's own type in a fixed order, as the embedding gradient does, in
 * that type in the same order), so a result is the same bits run after run. An index out of range
 * is an address fault (KERR_ADDR), never a silent clamp. */
#include <stdlib.h>

#include "kern.h"

#define HOST(var, t)                       \
    char *var;                             \
    do {                                   \
        int err_;                          \
        var = khost(k, (t), &err_);        \
        if (err_) return err_;             \
    } while (0)

/* Offsets, from a view's element 0, of each element of its trailing `kd` dims in row-major order. */
static int64_t *inner_offsets(const struct ops_tensor *t, int kd, int64_t m) {
    int64_t *o = malloc(sizeof(int64_t) * (size_t)(m ? m : 1));
    if (!o) return NULL;
    struct ops_tensor in = *t;
    in.ndim = kd;
    for (int d = 0; d < kd; d++) {
        in.shape[d] = t->shape[t->ndim - kd + d];
        in.stride[d] = t->stride[t->ndim - kd + d];
    }
    const struct ops_tensor *ts[1] = {&in};
    struct kit it;
    kit_init(&it, in.shape, kd, ts, 1);
    for (int64_t e = 0; e < m; e++) {
        o[e] = it.off[0];
        kit_next(&it);
    }
    return o;
}

static int64_t rows_of(const struct ops_tensor *t, int kd) {
    int64_t r = 1;
    for (int d = 0; d < t->ndim - kd; d++) r *= t->shape[d];
    return r;
}

/* ---------------------------------------------------------------- softmax */

KHIDDEN int k_softmax(const struct kctx *k) {
    if (k->a->nt != 2 || k->a->ni < 1) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *y = &k->t[1];
    int nd = x->ndim, logm = k->i[0] != 0;
    if (nd < 1 || y->ndim != nd) return KERR_ARGS;
    HOST(px, x);
    HOST(py, y);
    int64_t n = x->shape[nd - 1], rows = rows_of(x, 1);
    if (n == 0 || rows == 0) return 0;
    double *buf = malloc(sizeof(double) * (size_t)n);
    if (!buf) return KERR_ARGS;
    const struct ops_tensor *ts[2] = {x, y};
    struct kit it;
    kit_init(&it, x->shape, nd - 1, ts, 2);
    int64_t sx = x->stride[nd - 1], sy = y->stride[nd - 1];
    for (int64_t r = 0; r < rows; r++) {
        double mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            buf[j] = kld(x->dtype, px, it.off[0] + j * sx);
            if (buf[j] > mx || buf[j] != buf[j]) mx = buf[j];
            if (mx != mx) break;
        }
        double sum = 0.0;
        if (mx == mx)
            for (int64_t j = 0; j < n; j++) sum += exp(buf[j] - mx);
        double lse = log(sum);
        for (int64_t j = 0; j < n; j++) {
            double v = kld(x->dtype, px, it.off[0] + j * sx);
            double o = mx != mx ? NAN : logm ? v - mx - lse : exp(v - mx) / sum;
            kst(y->dtype, py, it.off[1] + j * sy, o);
        }
        kit_next(&it);
    }
    free(buf);
    kcost(k, rows * n);
    return 0;
}

KHIDDEN int k_softmax_bwd(const struct kctx *k) {
    if (k->a->nt != 3 || k->a->ni < 1) return KERR_ARGS;
    const struct ops_tensor *g = &k->t[0], *y = &k->t[1], *gi = &k->t[2];
    int nd = g->ndim, logm = k->i[0] != 0;
    if (nd < 1 || y->ndim != nd || gi->ndim != nd) return KERR_ARGS;
    HOST(pg, g);
    HOST(py, y);
    HOST(pgi, gi);
    int64_t n = g->shape[nd - 1], rows = rows_of(g, 1);
    if (n == 0 || rows == 0) return 0;
    const struct ops_tensor *ts[3] = {g, y, gi};
    struct kit it;
    kit_init(&it, g->shape, nd - 1, ts, 3);
    int64_t sg = g->stride[nd - 1], sy = y->stride[nd - 1], si = gi->stride[nd - 1];
    for (int64_t r = 0; r < rows; r++) {
        double dot = 0.0;
        for (int64_t j = 0; j < n; j++) {
            double gv = kld(g->dtype, pg, it.off[0] + j * sg);
            dot += logm ? gv : gv * kld(y->dtype, py, it.off[1] + j * sy);
        }
        for (int64_t j = 0; j < n; j++) {
            double gv = kld(g->dtype, pg, it.off[0] + j * sg), yv = kld(y->dtype, py, it.off[1] + j * sy);
            kst(gi->dtype, pgi, it.off[2] + j * si, logm ? gv - exp(yv) * dot : yv * (gv - dot));
        }
        kit_next(&it);
    }
    kcost(k, rows * n);
    return 0;
}

/* ---------------------------------------------------------------- layer and RMS norms */

KHIDDEN int k_norm(const struct kctx *k) {
    if (k->a->ni < 2 || k->a->ns < 1) return KERR_ARGS;
    int kd = (int)k->i[0], fl = (int)k->i[1];
    double eps = k->s[0];
    const struct ops_tensor *T[6] = {0}; /* x, w, b, y, mean, rstd */
    uint32_t ti = 0;
    int want[6] = {1, fl & NORM_W, fl & NORM_B, 1, fl & NORM_MEAN, fl & NORM_RSTD};
    for (int j = 0; j < 6; j++)
        if (want[j]) {
            if (ti >= k->a->nt) return KERR_ARGS;
            T[j] = &k->t[ti++];
        }
    if (ti != k->a->nt) return KERR_ARGS;
    const struct ops_tensor *x = T[0];
    int nd = x->ndim;
    if (kd < 1 || kd > nd) return KERR_ARGS;
    char *p[6] = {0};
    const struct ops_tensor *ts[6];
    int64_t *io[6] = {0};
    int nt = 0, map[6];
    int64_t m = 1;
    for (int d = nd - kd; d < nd; d++) m *= x->shape[d];
    int64_t rows = rows_of(x, kd);
    if (m == 0 || rows == 0) return 0;
    int rc = 0;
    for (int j = 0; j < 6; j++) {
        if (!T[j]) continue;
        if (T[j]->ndim != nd) return KERR_ARGS;
        int err;
        p[j] = khost(k, T[j], &err);
        if (err) rc = err;
        map[j] = nt;
        ts[nt++] = T[j];
        if (!(io[j] = inner_offsets(T[j], kd, m))) rc = KERR_ARGS;
    }
    double *xv = malloc(sizeof(double) * (size_t)m);
    if (!xv) rc = KERR_ARGS;
    if (rc == 0) {
        struct kit it;
        kit_init(&it, x->shape, nd - kd, ts, nt);
        for (int64_t r = 0; r < rows; r++) {
            double mean = 0.0, var = 0.0;
            int64_t bx = it.off[map[0]];
            for (int64_t e = 0; e < m; e++) {
                xv[e] = kld(x->dtype, p[0], bx + io[0][e]);
                mean += xv[e];
            }
            mean /= (double)m;
            if (fl & NORM_RMS) {
                for (int64_t e = 0; e < m; e++) var += xv[e] * xv[e];
                mean = 0.0;
            } else {
                for (int64_t e = 0; e < m; e++) var += (xv[e] - mean) * (xv[e] - mean);
            }
            var /= (double)m;
            double rstd = 1.0 / sqrt(var + eps);
            for (int64_t e = 0; e < m; e++) {
                double v = (xv[e] - mean) * rstd;
                if (T[1]) v *= kld(T[1]->dtype, p[1], it.off[map[1]] + io[1][e]);
                if (T[2]) v += kld(T[2]->dtype, p[2], it.off[map[2]] + io[2][e]);
                kst(T[3]->dtype, p[3], it.off[map[3]] + io[3][e], v);
            }
            if (T[4]) kst(T[4]->dtype, p[4], it.off[map[4]], mean);
            if (T[5]) kst(T[5]->dtype, p[5], it.off[map[5]], rstd);
            kit_next(&it);
        }
        kcost(k, rows * m);
    }
    free(xv);
    for (int j = 0; j < 6; j++) free(io[j]);
    return rc;
}

KHIDDEN int k_norm_bwd(const struct kctx *k) {
    if (k->a->ni < 2) return KERR_ARGS;
    int kd = (int)k->i[0], fl = (int)k->i[1];
    const struct ops_tensor *T[8] = {0}; /* g, x, mean, rstd, w, gx, gw, gb */
    int want[8] = {1, 1, !(fl & NORM_RMS), 1, 1, fl & NORM_GX, fl & NORM_GW, fl & NORM_GB};
    uint32_t ti = 0;
    for (int j = 0; j < 8; j++)
        if (want[j]) {
            if (ti >= k->a->nt) return KERR_ARGS;
            T[j] = &k->t[ti++];
        }
    if (ti != k->a->nt) return KERR_ARGS;
    const struct ops_tensor *x = T[1];
    int nd = x->ndim;
    if (kd < 1 || kd > nd) return KERR_ARGS;
    int64_t m = 1;
    for (int d = nd - kd; d < nd; d++) m *= x->shape[d];
    int64_t rows = rows_of(x, kd);
    char *p[8] = {0};
    const struct ops_tensor *ts[8];
    int64_t *io[8] = {0};
    int nt = 0, map[8];
    int rc = 0;
    for (int j = 0; j < 8; j++) {
        if (!T[j]) continue;
        if (T[j]->ndim != nd) return KERR_ARGS;
        int err;
        p[j] = khost(k, T[j], &err);
        if (err) rc = err;
        map[j] = nt;
        ts[nt++] = T[j];
        if (!(io[j] = inner_offsets(T[j], kd, m))) rc = KERR_ARGS;
    }
    double *gw = calloc((size_t)(m ? m : 1), sizeof(double)), *gb = calloc((size_t)(m ? m : 1), sizeof(double));
    double *dyw = malloc(sizeof(double) * (size_t)(m ? m : 1)), *xh = malloc(sizeof(double) * (size_t)(m ? m : 1));
    if (!gw || !gb || !dyw || !xh) rc = KERR_ARGS;
    if (rc == 0 && m > 0) {
        struct kit it;
        kit_init(&it, x->shape, nd - kd, ts, nt);
        for (int64_t r = 0; r < rows; r++) {
            double mean = T[2] ? kld(T[2]->dtype, p[2], it.off[map[2]]) : 0.0;
            double rstd = kld(T[3]->dtype, p[3], it.off[map[3]]);
            double a = 0.0, b = 0.0;
            for (int64_t e = 0; e < m; e++) {
                double gv = kld(T[0]->dtype, p[0], it.off[map[0]] + io[0][e]);
                double xv = kld(x->dtype, p[1], it.off[map[1]] + io[1][e]);
                double wv = kld(T[4]->dtype, p[4], it.off[map[4]] + io[4][e]);
                xh[e] = (xv - mean) * rstd;
                dyw[e] = gv * wv;
                a += dyw[e];
                b += dyw[e] * xh[e];
                gw[e] += gv * xh[e];
                gb[e] += gv;
            }
            a /= (double)m;
            b /= (double)m;
            if (T[5])
                for (int64_t e = 0; e < m; e++) {
                    double v = (fl & NORM_RMS) ? rstd * (dyw[e] - xh[e] * b) : rstd * (dyw[e] - a - xh[e] * b);
                    kst(T[5]->dtype, p[5], it.off[map[5]] + io[5][e], v);
                }
            kit_next(&it);
        }
        /* gw and gb: one value per normalized element, summed over the rows in order; their views
         * have stride 0 on the outer dimensions, so element e is at io[e]. */
        for (int64_t e = 0; e < m; e++) {
            if (T[6]) kst(T[6]->dtype, p[6], io[6][e], gw[e]);
            if (T[7]) kst(T[7]->dtype, p[7], io[7][e], gb[e]);
        }
        kcost(k, rows * m);
    }
    free(gw), free(gb), free(dyw), free(xh);
    for (int j = 0; j < 8; j++) free(io[j]);
    return rc;
}

/* ---------------------------------------------------------------- negative log-likelihood */

/* x has the target's dims and the class dim last; out (reduction none) the target's dims, else
 * none. The loss of position p is -weight[t] * x[p, t] (t = target[p]), as torch's CPU
 * nll_loss and nll_loss2d; positions are walked in row-major order of the target. */
KHIDDEN int k_nll(const struct kctx *k) {
    if (k->a->nt != 5 || k->a->ni < 2) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *tg = &k->t[1], *w = &k->t[2], *out = &k->t[3], *tw = &k->t[4];
    int64_t red = k->i[0], ignore = k->i[1];
    int r = tg->ndim;
    if (x->ndim != r + 1 || w->ndim != 1 || (red == 0 && out->ndim != r)) return KERR_ARGS;
    HOST(px, x);
    HOST(pt, tg);
    HOST(pw, w);
    HOST(po, out);
    HOST(ptw, tw);
    int64_t N = knumel(tg), C = x->shape[r];
    struct ops_tensor none = *tg;
    memset(none.stride, 0, sizeof none.stride);
    const struct ops_tensor *ts[3] = {x, tg, red == 0 ? out : &none};
    struct kit it;
    kit_init(&it, tg->shape, r, ts, 3);
    double sum = 0.0, wsum = 0.0;
    for (int64_t n = 0; n < N; n++) {
        int64_t t = ktoint(kld(tg->dtype, pt, it.off[1]));
        double l = 0.0;
        if (t != ignore) {
            if (t < 0 || t >= C) return KERR_ADDR;
            double wt = kld(w->dtype, pw, t * w->stride[0]);
            l = -wt * kld(x->dtype, px, it.off[0] + t * x->stride[r]);
            wsum += wt;
        }
        if (red == 0) kst(out->dtype, po, it.off[2], l);
        else sum += l;
        kit_next(&it);
    }
    if (red == 1) kst(out->dtype, po, 0, sum / wsum);
    else if (red == 2) kst(out->dtype, po, 0, sum);
    if (ptw) kst(tw->dtype, ptw, 0, red == 0 ? 0.0 : wsum);
    kcost(k, N);
    return 0;
}

KHIDDEN int k_nll_bwd(const struct kctx *k) {
    if (k->a->nt != 6 || k->a->ni < 2) return KERR_ARGS;
    const struct ops_tensor *go = &k->t[0], *x = &k->t[1], *tg = &k->t[2], *w = &k->t[3], *tw = &k->t[4],
                            *gi = &k->t[5];
    int64_t red = k->i[0], ignore = k->i[1];
    int r = tg->ndim;
    if (x->ndim != r + 1 || gi->ndim != r + 1 || w->ndim != 1 || (red == 0 && go->ndim != r)) return KERR_ARGS;
    HOST(pgo, go);
    HOST(pt, tg);
    HOST(pw, w);
    HOST(ptw, tw);
    HOST(pgi, gi);
    int64_t N = knumel(tg), C = gi->shape[r], ng = knumel(gi);
    if (ng) {
        const struct ops_tensor *zs[1] = {gi};
        struct kit z;
        kit_init(&z, gi->shape, gi->ndim, zs, 1);
        for (int64_t e = 0; e < ng; e++) {
            kst(gi->dtype, pgi, z.off[0], 0.0);
            kit_next(&z);
        }
    }
    struct ops_tensor none = *tg;
    memset(none.stride, 0, sizeof none.stride);
    const struct ops_tensor *ts[3] = {gi, tg, red == 0 ? go : &none};
    struct kit it;
    kit_init(&it, tg->shape, r, ts, 3);
    double twv = red == 1 ? kld(tw->dtype, ptw, 0) : 1.0;
    for (int64_t n = 0; n < N; n++, kit_next(&it)) {
        int64_t t = ktoint(kld(tg->dtype, pt, it.off[1]));
        if (t == ignore) continue;
        if (t < 0 || t >= C) return KERR_ADDR;
        double g = kld(go->dtype, pgo, it.off[2]);
        /* torch: grad = -(mean ? grad_output / total_weight : grad_output), in the tensor's type */
        g = -kround(gi->dtype, red == 1 ? g / twv : g);
        kst(gi->dtype, pgi, it.off[0] + t * gi->stride[r], kld(w->dtype, pw, t * w->stride[0]) * g);
    }
    kcost(k, ng);
    return 0;
}

/* ---------------------------------------------------------------- gathers by index */

/* The walk of INDEX and INDEX_PUT over the shape of t[0] (out, or the values): ints (after `skip`
 * leading ones): t[0]->ndim base strides (self's stride for each walked dim, 0 where an index
 * decides), then for each index (t[2..]) the stride and size of the self dimension it indexes. put:
 * self[...] = (accumulate: +=) t[0][...], else t[0][...] = self[...]. */
static int index_walk(const struct kctx *k, int skip, int put, int accumulate) {
    if (k->a->nt < 2 || k->a->nt > KIT_MAX) return KERR_ARGS;
    const struct ops_tensor *out = &k->t[0], *self = &k->t[1];
    int nidx = (int)k->a->nt - 2, nd = out->ndim;
    const int64_t *in = k->i + skip;
    if ((int)k->a->ni != skip + nd + 2 * nidx) return KERR_ARGS;
    HOST(po, out);
    HOST(ps, self);
    struct ops_tensor base = *out;
    for (int d = 0; d < nd; d++) base.stride[d] = in[d];
    const struct ops_tensor *ts[KIT_MAX] = {out, &base};
    char *pi[KIT_MAX] = {0};
    for (int j = 0; j < nidx; j++) {
        ts[2 + j] = &k->t[2 + j];
        if (ts[2 + j]->ndim != nd) return KERR_ARGS;
        HOST(pj, ts[2 + j]);
        pi[j] = pj;
    }
    int64_t n = knumel(out);
    if (n == 0) return 0;
    /* the self range an index may reach: self's own view, checked by khost above */
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < self->ndim; d++) {
        int64_t span = (self->shape[d] - 1) * self->stride[d];
        if (span < 0) lo += span;
        else hi += span;
    }
    struct kit it;
    kit_init(&it, out->shape, nd, ts, 2 + nidx);
    for (int64_t e = 0; e < n; e++) {
        int64_t off = it.off[1];
        for (int j = 0; j < nidx; j++) {
            int64_t v = ktoint(kld(ts[2 + j]->dtype, pi[j], it.off[2 + j]));
            int64_t size = in[nd + 2 * j + 1];
            if (v < 0) v += size;
            if (v < 0 || v >= size) return KERR_ADDR;
            off += v * in[nd + 2 * j];
        }
        if (off < lo || off > hi) return KERR_ADDR;
        if (!put) {
            kst(out->dtype, po, it.off[0], kld(self->dtype, ps, off));
        } else {
            double v = kld(out->dtype, po, it.off[0]);
            kst(self->dtype, ps, off, accumulate ? kld(self->dtype, ps, off) + v : v);
        }
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}

KHIDDEN int k_index(const struct kctx *k) { return index_walk(k, 0, 0, 0); }

/* Accumulating puts add in the walk's order in self's type, as torch's CPU index_put_ with
 * accumulate=True does (index_put_with_sort is the CUDA path; the CPU adds serially). */
KHIDDEN int k_index_put(const struct kctx *k) {
    if (k->a->ni < 1) return KERR_ARGS;
    return index_walk(k, 1, 1, k->i[0] != 0);
}

/* out = self; then along the walk (index's shape for Scatter and ScatterAdd, source's for
 * IndexAdd) out[base + wrap(index) * stride] op= s0 * src (or = s0 for a value), one element after
 * another, in out's type: the CPU's scatter/scatter_add/index_add_ run serially in this order. */
KHIDDEN int k_scatter(const struct kctx *k) {
    if (k->a->ni < 4 || k->a->ns < 1 || k->a->nt < 3) return KERR_ARGS;
    int mode = (int)k->i[0], hassrc = k->i[1] != 0;
    int64_t dstride = k->i[2], dsize = k->i[3];
    const struct ops_tensor *self = &k->t[0], *out = &k->t[1], *idx = &k->t[2], *src = hassrc ? &k->t[3] : NULL;
    int nd = idx->ndim;
    if ((int)k->a->nt != 3 + hassrc || (int)k->a->ni != 4 + nd || self->ndim != out->ndim ||
        (src && src->ndim != nd))
        return KERR_ARGS;
    HOST(pself, self);
    HOST(po, out);
    HOST(pi, idx);
    char *psrc = NULL;
    if (src) {
        HOST(p, src);
        psrc = p;
    }
    int64_t no = knumel(out);
    if (no) {
        const struct ops_tensor *cs[2] = {self, out};
        struct kit c;
        kit_init(&c, out->shape, out->ndim, cs, 2);
        if (self->addr != out->addr || self->offset != out->offset || memcmp(self->stride, out->stride, sizeof self->stride))
            for (int64_t e = 0; e < no; e++) {
                kst(out->dtype, po, c.off[1], kld(self->dtype, pself, c.off[0]));
                kit_next(&c);
            }
    }
    int64_t n = knumel(idx);
    if (n == 0) return 0;
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < out->ndim; d++) {
        int64_t span = (out->shape[d] - 1) * out->stride[d];
        if (span < 0) lo += span;
        else hi += span;
    }
    struct ops_tensor base = *idx;
    for (int d = 0; d < nd; d++) base.stride[d] = k->i[4 + d];
    const struct ops_tensor *ts[3] = {&base, idx, src ? src : idx};
    struct kit it;
    kit_init(&it, idx->shape, nd, ts, 3);
    for (int64_t e = 0; e < n; e++) {
        int64_t v = ktoint(kld(idx->dtype, pi, it.off[1]));
        if (v < 0) v += dsize;
        if (v < 0 || v >= dsize) return KERR_ADDR;
        int64_t off = it.off[0] + v * dstride;
        if (off < lo || off > hi) return KERR_ADDR;
        double x = src ? kld(src->dtype, psrc, it.off[2]) : k->s[0];
        if (src && k->s[0] != 1.0) x *= k->s[0];
        double cur = kld(out->dtype, po, off);
        kst(out->dtype, po, off, mode == 1 ? cur + x : mode == 2 ? cur * x : x);
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}

/* grad_weight[idx[i]] += grad[i] (scaled by 1 / count(idx[i]) with scale_grad_by_freq), in the
 * order of the indices and in the output's type, as torch's embedding_dense_backward_cpu adds rows
 * (Embedding.cpp): the same additions in the same order give the same bits. grad comes in the
 * indices' rank plus one (the row). */
KHIDDEN int k_embedding_bwd(const struct kctx *k) {
    if (k->a->nt != 3 || k->a->ni < 2) return KERR_ARGS;
    const struct ops_tensor *g = &k->t[0], *idx = &k->t[1], *out = &k->t[2];
    int64_t pad = k->i[0], byfreq = k->i[1];
    int r = idx->ndim;
    if (g->ndim != r + 1 || out->ndim != 2) return KERR_ARGS;
    HOST(pg, g);
    HOST(pi, idx);
    HOST(po, out);
    int64_t V = out->shape[0], D = out->shape[1], n = knumel(idx);
    if (g->shape[r] != D) return KERR_ARGS;
    for (int64_t v = 0; v < V; v++)
        for (int64_t d = 0; d < D; d++) kst(out->dtype, po, v * out->stride[0] + d * out->stride[1], 0.0);
    if (n == 0) return 0;
    int64_t *cnt = NULL;
    const struct ops_tensor *ts[2] = {idx, g};
    struct kit it;
    if (byfreq) {
        if (!(cnt = calloc((size_t)(V ? V : 1), sizeof(int64_t)))) return KERR_ARGS;
        kit_init(&it, idx->shape, r, ts, 1);
        for (int64_t e = 0; e < n; e++) {
            int64_t v = ktoint(kld(idx->dtype, pi, it.off[0]));
            if (v >= 0 && v < V) cnt[v]++;
            kit_next(&it);
        }
    }
    kit_init(&it, idx->shape, r, ts, 2);
    int rc = 0;
    for (int64_t e = 0; e < n; e++) {
        int64_t v = ktoint(kld(idx->dtype, pi, it.off[0]));
        if (v != pad) {
            if (v < 0 || v >= V) {
                rc = KERR_ADDR;
                break;
            }
            double scale = byfreq ? kround(out->dtype, 1.0 / (double)cnt[v]) : 1.0;
            for (int64_t d = 0; d < D; d++) {
                int64_t oo = v * out->stride[0] + d * out->stride[1];
                double gv = kld(g->dtype, pg, it.off[1] + d * g->stride[r]);
                kst(out->dtype, po, oo, kld(out->dtype, po, oo) + (byfreq ? gv * scale : gv));
            }
        }
        kit_next(&it);
    }
    free(cnt);
    kcost(k, n * D);
    return rc;
}

/* ---------------------------------------------------------------- shapes */

KHIDDEN int k_tri(const struct kctx *k) {
    if (k->a->nt != 2 || k->a->ni < 2) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *out = &k->t[1];
    int nd = out->ndim;
    int64_t diag = k->i[0], upper = k->i[1];
    if (nd < 2 || x->ndim != nd) return KERR_ARGS;
    HOST(px, x);
    HOST(po, out);
    int64_t n = knumel(out);
    if (n == 0) return 0;
    const struct ops_tensor *ts[2] = {x, out};
    struct kit it;
    kit_init(&it, out->shape, nd, ts, 2);
    for (int64_t e = 0; e < n; e++) {
        int64_t dj = it.idx[nd - 1] - it.idx[nd - 2];
        int keep = upper ? dj >= diag : dj <= diag;
        kst(out->dtype, po, it.off[1], keep ? kld(x->dtype, px, it.off[0]) : 0.0);
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}

/* out[i] = start + i * step, computed in double as torch's CPU arange computes in its accumulate
 * type (RangeFactories.cpp), rounded once to out's type. */
KHIDDEN int k_arange(const struct kctx *k) {
    if (k->a->nt != 1 || k->a->ns < 2) return KERR_ARGS;
    const struct ops_tensor *out = &k->t[0];
    if (out->ndim != 1) return KERR_ARGS;
    HOST(po, out);
    for (int64_t i = 0; i < out->shape[0]; i++) kst(out->dtype, po, i * out->stride[0], k->s[0] + (double)i * k->s[1]);
    kcost(k, out->shape[0]);
    return 0;
}

KHIDDEN int k_copies(const struct kctx *k) {
    if (k->a->nt % 2) return KERR_ARGS;
    int64_t total = 0;
    for (uint32_t j = 0; j < k->a->nt; j += 2) {
        const struct ops_tensor *s = &k->t[j], *d = &k->t[j + 1];
        if (s->ndim != d->ndim) return KERR_ARGS;
        HOST(ps, s);
        HOST(pd, d);
        int64_t n = knumel(d);
        if (n == 0) continue;
        const struct ops_tensor *ts[2] = {s, d};
        struct kit it;
        kit_init(&it, d->shape, d->ndim, ts, 2);
        for (int64_t e = 0; e < n; e++) {
            kst(d->dtype, pd, it.off[1], kld(s->dtype, ps, it.off[0]));
            kit_next(&it);
        }
        total += n;
    }
    kcost(k, total);
    return 0;
}

/* The coordinates of self's nonzero elements in row-major order, written as a contiguous
 * [count, ndim] (or [ndim, count]) array from out's first element, the shape torch_npu gives out
 * after the op (resize_); the count goes to the workspace for aclGetViewShape to read. */
KHIDDEN int k_nonzero(const struct kctx *k) {
    if (k->a->nt != 2 || k->a->ni != 2) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *out = &k->t[1];
    int nd = x->ndim, tr = k->i[0] != 0;
    HOST(px, x);
    HOST(po, out);
    int64_t n = knumel(x), cnt = 0, cap = knumel(out);
    int64_t *ws = (int64_t *)k->ctx->dev_ptr(k->ctx, (uint64_t)k->i[1], sizeof(int64_t));
    if (!ws) return KERR_ADDR;
    const struct ops_tensor *ts[1] = {x};
    struct kit it;
    kit_init(&it, x->shape, nd, ts, 1);
    for (int64_t e = 0; e < n; e++, kit_next(&it)) cnt += kld(x->dtype, px, it.off[0]) != 0.0;
    if (cnt * (nd ? nd : 1) > cap && cnt) return KERR_ADDR;
    int64_t i = 0;
    kit_init(&it, x->shape, nd, ts, 1);
    for (int64_t e = 0; e < n; e++, kit_next(&it)) {
        if (kld(x->dtype, px, it.off[0]) == 0.0) continue;
        for (int d = 0; d < nd; d++) kst(out->dtype, po, tr ? d * cnt + i : i * nd + d, (double)it.idx[d]);
        i++;
    }
    *ws = cnt;
    kcost(k, n);
    return 0;
}

/* self's elements where mask is set, in row-major order of their broadcast shape, from out's first
 * element on; the count goes to the workspace, as NONZERO's. */
KHIDDEN int k_masked_select(const struct kctx *k) {
    if (k->a->nt != 3 || k->a->ni != 1) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *m = &k->t[1], *out = &k->t[2];
    if (m->ndim != x->ndim || out->ndim != 1) return KERR_ARGS;
    HOST(px, x);
    HOST(pm, m);
    HOST(po, out);
    int64_t *ws = (int64_t *)k->ctx->dev_ptr(k->ctx, (uint64_t)k->i[0], sizeof(int64_t));
    if (!ws) return KERR_ADDR;
    int64_t n = knumel(x), cnt = 0;
    const struct ops_tensor *ts[2] = {x, m};
    struct kit it;
    kit_init(&it, x->shape, x->ndim, ts, 2);
    for (int64_t e = 0; e < n; e++, kit_next(&it)) {
        if (kld(m->dtype, pm, it.off[1]) == 0.0) continue;
        if (cnt >= out->shape[0]) return KERR_ADDR;
        kst(out->dtype, po, cnt * out->stride[0], kld(x->dtype, px, it.off[0]));
        cnt++;
    }
    *ws = cnt;
    kcost(k, n);
    return 0;
}

KHIDDEN int k_masked_scatter(const struct kctx *k) {
    if (k->a->nt != 3) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *m = &k->t[1], *src = &k->t[2];
    if (m->ndim != x->ndim) return KERR_ARGS;
    HOST(px, x);
    HOST(pm, m);
    HOST(ps, src);
    int64_t n = knumel(x), ns = knumel(src), used = 0;
    const struct ops_tensor *ts[2] = {x, m}, *ss[1] = {src};
    struct kit it, st;
    kit_init(&it, x->shape, x->ndim, ts, 2);
    kit_init(&st, src->shape, src->ndim, ss, 1);
    for (int64_t e = 0; e < n; e++, kit_next(&it)) {
        if (kld(m->dtype, pm, it.off[1]) == 0.0) continue;
        if (used >= ns) return KERR_ADDR; /* fewer source elements than set mask elements */
        kst(x->dtype, px, it.off[0], kld(src->dtype, ps, st.off[0]));
        kit_next(&st);
        used++;
    }
    kcost(k, n);
    return 0;
}

/* ---------------------------------------------------------------- argmax, top-k */

/* The first maximum of each row; a NaN is the maximum (the first NaN), as torch's CPU argmax. */
KHIDDEN int k_argmax(const struct kctx *k) {
    if (k->a->nt != 2) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *out = &k->t[1];
    int nd = x->ndim;
    if (nd < 1 || out->ndim != nd) return KERR_ARGS;
    HOST(px, x);
    HOST(po, out);
    int64_t n = x->shape[nd - 1], rows = rows_of(x, 1);
    if (rows == 0) return 0;
    if (n == 0) return KERR_ARGS;
    const struct ops_tensor *ts[2] = {x, out};
    struct kit it;
    kit_init(&it, x->shape, nd - 1, ts, 2);
    for (int64_t r = 0; r < rows; r++) {
        int64_t best = 0;
        double bv = kld(x->dtype, px, it.off[0]);
        for (int64_t j = 1; j < n && bv == bv; j++) {
            double v = kld(x->dtype, px, it.off[0] + j * x->stride[nd - 1]);
            if (v > bv || v != v) bv = v, best = j;
        }
        kst(out->dtype, po, it.off[1], (double)best);
        kit_next(&it);
    }
    kcost(k, rows * n);
    return 0;
}

struct kv {
    double v;
    int64_t i;
};

/* NaN above every number; ties by index, so the order is total and the result the same every run. */
static int kv_desc(const void *a, const void *b) {
    const struct kv *x = a, *y = b;
    int xn = x->v != x->v, yn = y->v != y->v;
    if (xn != yn) return xn ? -1 : 1;
    if (!xn && x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

static int kv_asc(const void *a, const void *b) {
    const struct kv *x = a, *y = b;
    int xn = x->v != x->v, yn = y->v != y->v;
    if (xn != yn) return xn ? 1 : -1;
    if (!xn && x->v != y->v) return x->v < y->v ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

KHIDDEN int k_topk(const struct kctx *k) {
    if (k->a->nt != 3 || k->a->ni < 3) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *vo = &k->t[1], *io = &k->t[2];
    int nd = x->ndim;
    int64_t kk = k->i[0], largest = k->i[1];
    if (nd < 1 || vo->ndim != nd || io->ndim != nd) return KERR_ARGS;
    HOST(px, x);
    HOST(pv, vo);
    HOST(pi, io);
    int64_t n = x->shape[nd - 1], rows = rows_of(x, 1);
    if (kk < 0 || kk > n) return KERR_ARGS;
    if (rows == 0 || kk == 0) return 0;
    struct kv *buf = malloc(sizeof *buf * (size_t)n);
    if (!buf) return KERR_ARGS;
    const struct ops_tensor *ts[3] = {x, vo, io};
    struct kit it;
    kit_init(&it, x->shape, nd - 1, ts, 3);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < n; j++) buf[j] = (struct kv){kld(x->dtype, px, it.off[0] + j * x->stride[nd - 1]), j};
        qsort(buf, (size_t)n, sizeof *buf, largest ? kv_desc : kv_asc);
        for (int64_t j = 0; j < kk; j++) {
            kst(vo->dtype, pv, it.off[1] + j * vo->stride[nd - 1], buf[j].v);
            kst(io->dtype, pi, it.off[2] + j * io->stride[nd - 1], (double)buf[j].i);
        }
        kit_next(&it);
    }
    free(buf);
    kcost(k, rows * n);
    return 0;
}

/* ---------------------------------------------------------------- matrix products with a bias */

/* out = beta * c + alpha * (a @ b) per batch; the products summed in k order in float as k_matmul
 * sums them, then scaled and added in double and rounded once; beta == 0 ignores c (NaN and all),
 * as torch's addmm does. */
KHIDDEN int k_addmm(const struct kctx *k) {
    if (k->a->nt != 4 || k->a->ns < 2) return KERR_ARGS;
    const struct ops_tensor *A = &k->t[0], *B = &k->t[1], *Cc = &k->t[2], *O = &k->t[3];
    double beta = k->s[0], alpha = k->s[1];
    int nd = O->ndim;
    if (nd < 2 || A->ndim != nd || B->ndim != nd || Cc->ndim != nd) return KERR_ARGS;
    int64_t M = O->shape[nd - 2], N = O->shape[nd - 1], K = A->shape[nd - 1];
    if (A->shape[nd - 2] != M || B->shape[nd - 2] != K || B->shape[nd - 1] != N) return KERR_ARGS;
    HOST(pa, A);
    HOST(pb, B);
    HOST(pc, Cc);
    HOST(po, O);
    int64_t nout = knumel(O);
    if (nout == 0) return 0;
    int64_t batch = nout / (M * N);
    int64_t cs0 = Cc->stride[nd - 2], cs1 = Cc->stride[nd - 1], os0 = O->stride[nd - 2], os1 = O->stride[nd - 1];
    struct kmm m;
    if (kmm_open(&m, A, pa, B, pb, K, N) != 0) return KERR_ARGS;
    struct ops_tensor ta = *A, tb = *B, tc = *Cc, to = *O;
    ta.ndim = tb.ndim = tc.ndim = to.ndim = nd - 2;
    const struct ops_tensor *ts[4] = {&ta, &tb, &tc, &to};
    struct kit it;
    kit_init(&it, O->shape, nd - 2, ts, 4);
    for (int64_t bi = 0; bi < batch; bi++) {
        int64_t oa = it.off[0], oc = it.off[2], oo = it.off[3];
        kmm_batch(&m, it.off[1]);
        for (int64_t i0 = 0; i0 < M; i0 += KMM_R) {
            int R = kmm_group(&m, oa, M, i0);
            for (int r = 0; r < R; r++) {
                int64_t i = i0 + r;
                for (int64_t j = 0; j < N; j++) {
                    double v = alpha * (double)m.acc[r * N + j];
                    if (beta != 0.0) v += beta * kld(Cc->dtype, pc, oc + i * cs0 + j * cs1);
                    kst(O->dtype, po, oo + i * os0 + j * os1, v);
                }
            }
        }
        kit_next(&it);
    }
    kmm_close(&m);
    kcost(k, nout);
    return 0;
}

/* ---------------------------------------------------------------- MseLoss, reduced */

KHIDDEN int k_mse(const struct kctx *k) {
    if (k->a->nt != 3 || k->a->ni < 1) return KERR_ARGS;
    const struct ops_tensor *a = &k->t[0], *b = &k->t[1], *out = &k->t[2];
    if (b->ndim != a->ndim) return KERR_ARGS;
    HOST(pa, a);
    HOST(pb, b);
    HOST(po, out);
    int64_t n = knumel(a);
    double sum = 0.0;
    if (n) {
        const struct ops_tensor *ts[2] = {a, b};
        struct kit it;
        kit_init(&it, a->shape, a->ndim, ts, 2);
        for (int64_t e = 0; e < n; e++) {
            double d = kld(a->dtype, pa, it.off[0]) - kld(b->dtype, pb, it.off[1]);
            sum += d * d;
            kit_next(&it);
        }
    }
    kst(out->dtype, po, 0, k->i[0] == 1 ? sum / (double)n : sum);
    kcost(k, n);
    return 0;
}
