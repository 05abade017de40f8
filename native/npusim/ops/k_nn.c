/* Kernels with structure: batched matrix products and reductions over a dimension set. */
#include <stdlib.h>

#include "kern.h"

/* out[b, M, N] = a[b, M, K] @ b[b, K, N] for every batch index b of out's leading dimensions; a and b
 * come aligned to out's batch dimensions (stride 0 where broadcast). Each output element sums its K
 * products in k order in float, as a single-threaded fp32 GEMM does (fp16/bf16 accumulate in float
 * too, as the cube unit does), so results are the same run after run. */
KHIDDEN int k_matmul(const struct kctx *k) {
    if (k->a->nt != 3) return KERR_ARGS;
    const struct ops_tensor *A = &k->t[0], *B = &k->t[1], *O = &k->t[2];
    int nd = O->ndim;
    if (nd < 2 || A->ndim != nd || B->ndim != nd) return KERR_ARGS;
    int64_t M = O->shape[nd - 2], N = O->shape[nd - 1], K = A->shape[nd - 1];
    if (A->shape[nd - 2] != M || B->shape[nd - 2] != K || B->shape[nd - 1] != N) return KERR_ARGS;
    int err;
    char *pa = khost(k, A, &err);
    if (err) return err;
    char *pb = khost(k, B, &err);
    if (err) return err;
    char *po = khost(k, O, &err);
    if (err) return err;
    int64_t nout = knumel(O);
    if (nout == 0) return 0;
    int64_t batch = nout / (M * N);
    int64_t os0 = O->stride[nd - 2], os1 = O->stride[nd - 1];
    struct kmm m;
    if (kmm_open(&m, A, pa, B, pb, K, N) != 0) return KERR_ARGS;
    /* batch dimensions: iterate them with an iterator over out's leading shape */
    struct ops_tensor ta = *A, tb = *B, to = *O;
    ta.ndim = tb.ndim = to.ndim = nd - 2;
    const struct ops_tensor *ts[3] = {&ta, &tb, &to};
    struct kit it;
    kit_init(&it, O->shape, nd - 2, ts, 3);
    /* Output rows (over every batch) in kblocks() bands, each band written then charged, in order. */
    int64_t rows = batch * M;
    uint32_t nb = kblocks(k, rows), blk = 0;
    int64_t band_end = rows / nb;
    for (int64_t b = 0; b < batch; b++) {
        int64_t oa = it.off[0], oo = it.off[2];
        kmm_batch(&m, it.off[1]);
        for (int64_t i0 = 0; i0 < M; i0 += KMM_R) {
            int R = kmm_group(&m, oa, M, i0);
            for (int r = 0; r < R; r++) {
                int64_t i = i0 + r;
                while (b * M + i >= band_end && blk < nb) { /* the band before this row is done */
                    kblock_cost();
                    blk++;
                    band_end = rows * (blk + 1) / nb;
                }
                for (int64_t j = 0; j < N; j++) kst(O->dtype, po, oo + i * os0 + j * os1, m.acc[r * N + j]);
            }
        }
        kit_next(&it);
    }
    kmm_close(&m);
    for (; blk < nb; blk++) kblock_cost();
    return 0;
}

/* out = reduce(in) over the flagged dimensions; out is given in in's rank, size 1 (any stride) on
 * the reduced ones. Each output element accumulates its inputs in row-major order, in double. */
KHIDDEN int k_reduce(const struct kctx *k) {
    if (k->a->nt != 2 || k->a->ni < 1) return KERR_ARGS;
    const struct ops_tensor *in = &k->t[0], *out = &k->t[1];
    int nd = in->ndim;
    if (out->ndim != nd || (int)k->a->ni < 1 + nd) return KERR_ARGS;
    int kind = (int)k->i[0];
    double p = k->a->ns ? k->s[0] : 2.0;
    int err;
    char *pi = khost(k, in, &err);
    if (err) return err;
    char *po = khost(k, out, &err);
    if (err) return err;
    int64_t nout = knumel(out), n = knumel(in);
    if (nout == 0) return 0;
    /* split dims: kept (outer) and reduced (inner) */
    struct ops_tensor ko = *in, ro = *in, oo = *out;
    int nk = 0, nr = 0;
    for (int d = 0; d < nd; d++) {
        if (k->i[1 + d]) {
            ro.shape[nr] = in->shape[d];
            ro.stride[nr++] = in->stride[d];
        } else {
            ko.shape[nk] = in->shape[d];
            ko.stride[nk] = in->stride[d];
            oo.shape[nk] = out->shape[d];
            oo.stride[nk++] = out->stride[d];
        }
    }
    ko.ndim = oo.ndim = nk;
    ro.ndim = nr;
    int64_t m = knumel(&ro); /* elements per output */
    const struct ops_tensor *ts[2] = {&ko, &oo};
    const struct ops_tensor *rs[1] = {&ro};
    struct kit it, rt;
    kit_init(&it, ko.shape, nk, ts, 2);
    for (int64_t o = 0; o < nout; o++) {
        double acc;
        switch (kind) {
        case OPS_RED_MAX: acc = -INFINITY; break;
        case OPS_RED_MIN: acc = INFINITY; break;
        case OPS_RED_PROD: acc = 1.0; break;
        default: acc = 0.0;
        }
        kit_init(&rt, ro.shape, nr, rs, 1);
        for (int64_t r = 0; r < m; r++) {
            double v = kld(in->dtype, pi, it.off[0] + rt.off[0]);
            switch (kind) {
            case OPS_RED_MAX: acc = (v > acc || v != v) ? v : acc; break;
            case OPS_RED_MIN: acc = (v < acc || v != v) ? v : acc; break;
            case OPS_RED_PROD: acc *= v; break;
            case OPS_RED_NORM:
                if (p == INFINITY) acc = fabs(v) > acc ? fabs(v) : acc;
                else if (p == 0.0) acc += v != 0.0;
                else if (p == 1.0) acc += fabs(v);
                else if (p == 2.0) acc += v * v;
                else acc += pow(fabs(v), p);
                break;
            default: acc += v;
            }
            kit_next(&rt);
        }
        if (kind == OPS_RED_MEAN) acc = m ? acc / (double)m : NAN;
        if (kind == OPS_RED_NORM && p != INFINITY && p != 0.0 && p != 1.0) acc = p == 2.0 ? sqrt(acc) : pow(acc, 1.0 / p);
        kst(out->dtype, po, it.off[1], acc);
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}
