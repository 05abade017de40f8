/* The math family's structured kernels: the max or min along one dimension with its index, and
 * random fills. */
#include <stdlib.h>

#include "kern.h"

/* ARGRED args: ints[0] = dim, ints[1] = 0 max / 1 min; tensors: in, values, indices, the outputs
 * given in in's rank with size 1 on dim. As torch's CPU kernel (ReduceOpsKernel.cpp,
 * SharedReduceOps.h): NaN wins and keeps its first index; ties keep the first index. */
KHIDDEN int k_argred(const struct kctx *k) {
    if (k->a->ni < 2 || k->a->nt != 3) return KERR_ARGS;
    const struct ops_tensor *in = &k->t[0], *vo = &k->t[1], *io = &k->t[2];
    int nd = in->ndim, dim = (int)k->i[0], is_min = k->i[1] != 0;
    if (vo->ndim != nd || io->ndim != nd || dim < 0 || (nd && dim >= nd)) return KERR_ARGS;
    int err;
    char *pi = khost(k, in, &err);
    if (err) return err;
    char *pv = khost(k, vo, &err);
    if (err) return err;
    char *px = khost(k, io, &err);
    if (err) return err;
    int64_t nout = knumel(vo);
    if (nout == 0 || knumel(in) == 0) return 0;
    int64_t len = nd ? in->shape[dim] : 1, st = nd ? in->stride[dim] : 0;
    struct ops_tensor ko = *in;
    if (nd) ko.shape[dim] = 1;
    const struct ops_tensor *ts[3] = {&ko, vo, io};
    struct kit it;
    kit_init(&it, ko.shape, nd, ts, 3);
    for (int64_t o = 0; o < nout; o++) {
        double best = kld(in->dtype, pi, it.off[0]);
        int64_t bi = 0;
        for (int64_t r = 1; r < len && best == best; r++) {
            double v = kld(in->dtype, pi, it.off[0] + r * st);
            if (v != v || (is_min ? v < best : v > best)) best = v, bi = r;
        }
        kst(vo->dtype, pv, it.off[1], best);
        kst(io->dtype, px, it.off[2], (double)bi);
        kit_next(&it);
    }
    kcost(k, knumel(in));
    return 0;
}

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the
 * counter-based generator behind torch's and CANN's device random ops: a pure function of
 * (seed, counter), so a fill is the same run after run and any element can be drawn alone. */
static void philox(uint32_t ctr[4], uint64_t seed) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * ctr[0], p1 = (uint64_t)0xCD9E8D57u * ctr[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ ctr[1] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ ctr[3] ^ k1;
        ctr[1] = (uint32_t)p1, ctr[3] = (uint32_t)p0, ctr[0] = n0, ctr[2] = n2;
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
}

/* A double in (0, 1) from 53 random bits (never 0, so log() below is finite). */
static double unit(uint32_t hi, uint32_t lo) {
    uint64_t b = (((uint64_t)hi << 32) | lo) >> 11;
    return ((double)b + 0.5) / 9007199254740992.0;
}

/* RAND args: ints[0] = 0 normal (mean s0, std s1), 1 uniform [s0, s1), 2 bernoulli (p = s0),
 * 3 integers uniform in [s0, s1), 4 dropout's bit mask (out uint8, one bit per element,
 * little-endian in each byte: bit set = kept, with probability 1 - s0; ints[4] = the element count,
 * bits past it 0); ints[1] = seed, ints[2] = offset (torch's philox offset);
 * ints[3] = which parameters come from tensors instead (bit 0: the first, bit 1: the second);
 * tensors: out, then those parameter tensors aligned to out's shape. Element i (row-major in out's
 * shape) draws from counter (i, offset). */
KHIDDEN int k_rand(const struct kctx *k) {
    if (k->a->ni < 4 || k->a->ns < 2 || k->a->nt < 1 || k->a->nt > 3) return KERR_ARGS;
    const struct ops_tensor *o = &k->t[0];
    int kind = (int)k->i[0], from_t = (int)k->i[3];
    uint64_t seed = (uint64_t)k->i[1], off = (uint64_t)k->i[2];
    int np = (from_t & 1) + ((from_t >> 1) & 1);
    if ((int)k->a->nt != 1 + np) return KERR_ARGS;
    int err;
    char *p[3];
    const struct ops_tensor *ts[3];
    for (uint32_t j = 0; j < k->a->nt; j++) {
        ts[j] = &k->t[j];
        if (ts[j]->ndim != o->ndim) return KERR_ARGS;
        p[j] = khost(k, ts[j], &err);
        if (err) return err;
    }
    int64_t n = knumel(o);
    if (n == 0) return 0;
    struct kit it;
    kit_init(&it, o->shape, o->ndim, ts, (int)k->a->nt);
    if (kind == 4) {
        if (k->a->ni < 5 || np) return KERR_ARGS;
        int64_t nbits = k->i[4];
        for (int64_t byte = 0; byte < n; byte++) {
            unsigned v = 0;
            for (int b = 0; b < 8; b++) {
                int64_t i = byte * 8 + b;
                if (i >= nbits) break;
                uint32_t c[4] = {(uint32_t)i, (uint32_t)((uint64_t)i >> 32), (uint32_t)off, (uint32_t)(off >> 32)};
                philox(c, seed);
                if (unit(c[0], c[1]) >= k->s[0]) v |= 1u << b;
            }
            kst(o->dtype, p[0], it.off[0], v);
            kit_next(&it);
        }
        kcost(k, n);
        return 0;
    }
    for (int64_t i = 0; i < n; i++) {
        int j = 1;
        double a = (from_t & 1) ? kld(ts[j]->dtype, p[j], it.off[j]) : k->s[0];
        if (from_t & 1) j++;
        double b = (from_t & 2) ? kld(ts[j]->dtype, p[j], it.off[j]) : k->s[1];
        uint32_t c[4] = {(uint32_t)i, (uint32_t)((uint64_t)i >> 32), (uint32_t)off, (uint32_t)(off >> 32)};
        philox(c, seed);
        double u = unit(c[0], c[1]), v;
        if (kind == 0) {
            /* Box-Muller */
            v = a + b * sqrt(-2.0 * log(u)) * cos(6.283185307179586 * unit(c[2], c[3]));
        } else if (kind == 1) {
            v = a + (b - a) * (u - 0x1p-54); /* [a, b) */
            /* rounding to a narrow dtype must not reach b: step back one unit of its precision */
            double eps = o->dtype == OPS_DT_BF16 ? 0x1p-8 : o->dtype == OPS_DT_FLOAT16 ? 0x1p-11 : 0x1p-24;
            if (b > a && kround(o->dtype, v) >= b) v = b - (b - a) * eps;
        } else if (kind == 2) {
            v = u < a;
        } else {
            v = a + floor((u - 0x1p-54) * (b - a)); /* an integer in [a, b) */
        }
        kst(o->dtype, p[0], it.off[0], v);
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}

/* AMP args: ints[0] = 0: unscale (tensors found_inf, inv_scale, then the gradients, scaled in
 * place; found_inf = 1 when any gradient element is not finite), as torch's
 * _amp_foreach_non_finite_check_and_unscale_cpu_ (aten/src/ATen/native/AmpKernels.cpp);
 * ints[0] = 1: update the scale (tensors current_scale, growth_tracker, found_inf, then the outputs
 * scale and tracker; s = growth_factor, backoff_factor; ints[1] = growth_interval), as
 * _amp_update_scale_cpu_. */
KHIDDEN int k_amp(const struct kctx *k) {
    if (k->a->ni < 1) return KERR_ARGS;
    int err;
    if (k->i[0] == 0) {
        if (k->a->nt < 2) return KERR_ARGS;
        const struct ops_tensor *fi = &k->t[0], *is = &k->t[1];
        char *pf = khost(k, fi, &err);
        if (err || !pf) return err ? err : KERR_ARGS;
        char *ps = khost(k, is, &err);
        if (err || !ps) return err ? err : KERR_ARGS;
        double inv = kld(is->dtype, ps, 0);
        int found = 0;
        int64_t work = 0;
        for (uint32_t g = 2; g < k->a->nt; g++) {
            const struct ops_tensor *t = &k->t[g];
            char *p = khost(k, t, &err);
            if (err) return err;
            int64_t n = knumel(t);
            if (!n) continue;
            const struct ops_tensor *ts[1] = {t};
            struct kit it;
            kit_init(&it, t->shape, t->ndim, ts, 1);
            for (int64_t i = 0; i < n; i++) {
                double v = kld(t->dtype, p, it.off[0]);
                if (!isfinite(v)) found = 1;
                kst(t->dtype, p, it.off[0], inv == 1.0 ? v : v * inv);
                kit_next(&it);
            }
            work += n;
        }
        if (found) kst(fi->dtype, pf, 0, 1.0);
        kcost(k, work);
        return 0;
    }
    if (k->a->nt != 5 || k->a->ns < 2 || k->a->ni < 2) return KERR_ARGS;
    char *p[5];
    for (int j = 0; j < 5; j++) {
        p[j] = khost(k, &k->t[j], &err);
        if (err || !p[j]) return err ? err : KERR_ARGS;
    }
    double scale = kld(k->t[0].dtype, p[0], 0), tracker = kld(k->t[1].dtype, p[1], 0);
    double found = kld(k->t[2].dtype, p[2], 0);
    if (found != 0.0) {
        scale = (double)(float)scale * k->s[1];
        tracker = 0;
    } else {
        double successful = tracker + 1;
        if (successful == (double)k->i[1]) {
            float ns = (float)(scale * k->s[0]);
            if (isfinite(ns)) scale = ns;
            tracker = 0;
        } else {
            tracker = successful;
        }
    }
    kst(k->t[3].dtype, p[3], 0, scale);
    kst(k->t[4].dtype, p[4], 0, tracker);
    kcost(k, 1);
    return 0;
}

/* BOOLRED args: ints[0] = 0 any / 1 all, ints[1..nd] = reduced flags; tensors in, out (out in in's
 * rank, size 1 on the reduced dimensions): out = any/all of in != 0 (NaN counts as true).
 * ints[0] = 2: torch.equal; ints[1] = 1 if the shapes agree; tensors a, b (same shape then), out
 * (one element): every element equal (NaN never equals). */
KHIDDEN int k_boolred(const struct kctx *k) {
    if (k->a->ni < 2) return KERR_ARGS;
    int err;
    if (k->i[0] == 2) {
        if (k->a->nt != 3) return KERR_ARGS;
        const struct ops_tensor *A = &k->t[0], *B = &k->t[1], *O = &k->t[2];
        char *po = khost(k, O, &err);
        if (err || !po) return err ? err : KERR_ARGS;
        int eq = k->i[1] != 0;
        if (eq) {
            if (A->ndim != B->ndim) return KERR_ARGS;
            char *pa = khost(k, A, &err);
            if (err) return err;
            char *pb = khost(k, B, &err);
            if (err) return err;
            int64_t n = knumel(A);
            const struct ops_tensor *ts[2] = {A, B};
            struct kit it;
            kit_init(&it, A->shape, A->ndim, ts, 2);
            for (int64_t i = 0; i < n && eq; i++) {
                eq = kld(A->dtype, pa, it.off[0]) == kld(B->dtype, pb, it.off[1]);
                kit_next(&it);
            }
            kcost(k, n);
        }
        kst(O->dtype, po, 0, eq);
        return 0;
    }
    if (k->a->nt != 2) return KERR_ARGS;
    const struct ops_tensor *in = &k->t[0], *out = &k->t[1];
    int nd = in->ndim, all = k->i[0] == 1;
    if (out->ndim != nd || (int)k->a->ni < 1 + nd) return KERR_ARGS;
    char *pi = khost(k, in, &err);
    if (err) return err;
    char *po = khost(k, out, &err);
    if (err) return err;
    int64_t nout = knumel(out);
    if (nout == 0) return 0;
    struct ops_tensor ko = *in, ro = *in, oo = *out;
    int nk = 0, nr = 0;
    for (int d = 0; d < nd; d++) {
        if (k->i[1 + d]) {
            ro.shape[nr] = in->shape[d], ro.stride[nr++] = in->stride[d];
        } else {
            ko.shape[nk] = in->shape[d], ko.stride[nk] = in->stride[d];
            oo.shape[nk] = out->shape[d], oo.stride[nk++] = out->stride[d];
        }
    }
    ko.ndim = oo.ndim = nk;
    ro.ndim = nr;
    int64_t m = knumel(&ro);
    const struct ops_tensor *ts[2] = {&ko, &oo}, *rs[1] = {&ro};
    struct kit it, rt;
    kit_init(&it, ko.shape, nk, ts, 2);
    for (int64_t o = 0; o < nout; o++) {
        int acc = all;
        kit_init(&rt, ro.shape, nr, rs, 1);
        for (int64_t r = 0; r < m && acc == all; r++) {
            acc = kld(in->dtype, pi, it.off[0] + rt.off[0]) != 0.0;
            kit_next(&rt);
        }
        kst(out->dtype, po, it.off[1], acc);
        kit_next(&it);
    }
    kcost(k, knumel(in));
    return 0;
}

/* STAT args: ints[0] = kind: 0 logsumexp, 1 var, 2 std, 3 var and mean, 4 std and mean, 5 min and
 * max; ints[1] = correction (var, std); ints[2..2+nd] = reduced flags; tensors: in, out0[, out1]
 * (outputs in in's rank, size 1 on the reduced dimensions). Each output element reads its inputs in
 * row-major order in double: logsumexp as torch computes it (the max taken out unless infinite),
 * var in two passes (mean, then squared deviations) divided by max(0, N - correction). */
KHIDDEN int k_stat(const struct kctx *k) {
    if (k->a->ni < 2 || k->a->nt < 2 || k->a->nt > 3) return KERR_ARGS;
    const struct ops_tensor *in = &k->t[0], *o0 = &k->t[1], *o1 = k->a->nt > 2 ? &k->t[2] : NULL;
    int nd = in->ndim, kind = (int)k->i[0];
    double corr = (double)k->i[1];
    if ((int)k->a->ni < 2 + nd || o0->ndim != nd || (o1 && o1->ndim != nd)) return KERR_ARGS;
    if ((kind >= 3) != (o1 != NULL)) return KERR_ARGS;
    int err;
    char *pi = khost(k, in, &err);
    if (err) return err;
    char *p0 = khost(k, o0, &err);
    if (err) return err;
    char *p1 = o1 ? khost(k, o1, &err) : NULL;
    if (err) return err;
    int64_t nout = knumel(o0);
    if (nout == 0) return 0;
    struct ops_tensor ko = *in, ro = *in, a0 = *o0, a1 = o1 ? *o1 : *o0;
    int nk = 0, nr = 0;
    for (int d = 0; d < nd; d++) {
        if (k->i[2 + d]) {
            ro.shape[nr] = in->shape[d], ro.stride[nr++] = in->stride[d];
        } else {
            ko.shape[nk] = in->shape[d], ko.stride[nk] = in->stride[d];
            a0.shape[nk] = o0->shape[d], a0.stride[nk] = o0->stride[d];
            a1.shape[nk] = a1.shape[d], a1.stride[nk] = o1 ? o1->stride[d] : 0;
            nk++;
        }
    }
    ko.ndim = a0.ndim = a1.ndim = nk;
    ro.ndim = nr;
    int64_t m = knumel(&ro);
    const struct ops_tensor *ts[3] = {&ko, &a0, &a1}, *rs[1] = {&ro};
    struct kit it, rt;
    kit_init(&it, ko.shape, nk, ts, 3);
    for (int64_t o = 0; o < nout; o++) {
        double r0 = 0, r1 = 0;
        if (kind == 0 || kind == 5) {
            double mx = -INFINITY, mn = INFINITY;
            kit_init(&rt, ro.shape, nr, rs, 1);
            for (int64_t r = 0; r < m; r++) {
                double v = kld(in->dtype, pi, it.off[0] + rt.off[0]);
                mx = (v > mx || v != v || mx != mx) ? (mx != mx ? mx : v) : mx;
                mn = (v < mn || v != v || mn != mn) ? (mn != mn ? mn : v) : mn;
                kit_next(&rt);
            }
            if (kind == 5) {
                r0 = mn, r1 = mx;
            } else {
                double shift = isinf(mx) ? 0.0 : mx, sum = 0;
                kit_init(&rt, ro.shape, nr, rs, 1);
                for (int64_t r = 0; r < m; r++) {
                    sum += exp(kld(in->dtype, pi, it.off[0] + rt.off[0]) - shift);
                    kit_next(&rt);
                }
                r0 = log(sum) + shift;
            }
        } else {
            double mean = 0, ss = 0;
            kit_init(&rt, ro.shape, nr, rs, 1);
            for (int64_t r = 0; r < m; r++) {
                mean += kld(in->dtype, pi, it.off[0] + rt.off[0]);
                kit_next(&rt);
            }
            mean = m ? mean / (double)m : NAN;
            kit_init(&rt, ro.shape, nr, rs, 1);
            for (int64_t r = 0; r < m; r++) {
                double dv = kld(in->dtype, pi, it.off[0] + rt.off[0]) - mean;
                ss += dv * dv;
                kit_next(&rt);
            }
            double dof = (double)m - corr;
            double var = ss / (dof > 0 ? dof : 0.0);
            r0 = (kind == 2 || kind == 4) ? sqrt(var) : var;
            r1 = mean;
        }
        kst(o0->dtype, p0, it.off[1], r0);
        if (o1) kst(o1->dtype, p1, it.off[2], r1);
        kit_next(&it);
    }
    kcost(k, knumel(in));
    return 0;
}

/* SCAN args: ints[0] = dim, ints[1] = 0 sum / 1 product; tensors in, out (same shape). Each line
 * along dim accumulates in double in index order, every partial result stored (rounded once). */
KHIDDEN int k_scan(const struct kctx *k) {
    if (k->a->ni < 2 || k->a->nt != 2) return KERR_ARGS;
    const struct ops_tensor *in = &k->t[0], *out = &k->t[1];
    int nd = in->ndim, dim = (int)k->i[0], prod = k->i[1] != 0;
    if (out->ndim != nd || dim < 0 || (nd && dim >= nd)) return KERR_ARGS;
    int err;
    char *pi = khost(k, in, &err);
    if (err) return err;
    char *po = khost(k, out, &err);
    if (err) return err;
    int64_t n = knumel(in);
    if (n == 0) return 0;
    int64_t len = nd ? in->shape[dim] : 1, si = nd ? in->stride[dim] : 0, so = nd ? out->stride[dim] : 0;
    struct ops_tensor ki = *in, ko = *out;
    if (nd) ki.shape[dim] = ko.shape[dim] = 1;
    const struct ops_tensor *ts[2] = {&ki, &ko};
    struct kit it;
    kit_init(&it, ki.shape, nd, ts, 2);
    for (int64_t l = 0; l < n / len; l++) {
        double acc = prod ? 1.0 : 0.0;
        for (int64_t j = 0; j < len; j++) {
            double v = kld(in->dtype, pi, it.off[0] + j * si);
            acc = prod ? acc * v : acc + v;
            kst(out->dtype, po, it.off[1] + j * so, acc);
        }
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}

/* DOMASK args: s0 = 1 / (1 - p) (0 when p = 1); tensors self, mask (uint8 bits, kind 4 of RAND),
 * out: out = self * s0 where element i's (row-major) bit is set, else 0. */
KHIDDEN int k_domask(const struct kctx *k) {
    if (k->a->nt != 3 || k->a->ns < 1) return KERR_ARGS;
    const struct ops_tensor *x = &k->t[0], *m = &k->t[1], *o = &k->t[2];
    if (x->ndim != o->ndim || m->ndim != 1) return KERR_ARGS;
    int err;
    char *px = khost(k, x, &err);
    if (err) return err;
    char *pm = khost(k, m, &err);
    if (err) return err;
    char *po = khost(k, o, &err);
    if (err) return err;
    int64_t n = knumel(o);
    if (n == 0) return 0;
    if (m->shape[0] * 8 < n) return KERR_ARGS;
    const struct ops_tensor *ts[2] = {x, o};
    struct kit it;
    kit_init(&it, o->shape, o->ndim, ts, 2);
    double scale = k->s[0];
    for (int64_t i = 0; i < n; i++) {
        unsigned byte = (unsigned)kld(m->dtype, pm, (i / 8) * m->stride[0]);
        double v = (byte >> (i % 8)) & 1u ? kld(x->dtype, px, it.off[0]) * scale : 0.0;
        kst(o->dtype, po, it.off[1], v);
        kit_next(&it);
    }
    kcost(k, n);
    return 0;
}

/* one uniform double in (0, 1) for counter (idx, off) */
static double draw(uint64_t seed, uint64_t off, uint64_t idx) {
    uint32_t c[4] = {(uint32_t)idx, (uint32_t)(idx >> 32), (uint32_t)off, (uint32_t)(off >> 32)};
    philox(c, seed);
    return unit(c[0], c[1]);
}

/* SAMPLE args: ints[0] = 0 multinomial (ints[3] samples per row, ints[4] = 1 with replacement;
 * tensors: weights [rows, k] (a 1-D input as one row), out int64 [rows, samples]), 1 randperm
 * (tensors: out [n]); ints[1] = seed, ints[2] = offset. Draw j of row r uses counter
 * (r * 2^20 + j, offset). Multinomial draws by the inverse of the row's cumulative weights (in
 * double); without replacement a drawn category's weight is removed. Randperm is Fisher-Yates. */
KHIDDEN int k_sample(const struct kctx *k) {
    if (k->a->ni < 3) return KERR_ARGS;
    uint64_t seed = (uint64_t)k->i[1], off = (uint64_t)k->i[2];
    int err;
    if (k->i[0] == 1) {
        if (k->a->nt != 1 || k->t[0].ndim != 1) return KERR_ARGS;
        const struct ops_tensor *o = &k->t[0];
        char *po = khost(k, o, &err);
        if (err) return err;
        int64_t n = o->shape[0];
        for (int64_t i = 0; i < n; i++) kst(o->dtype, po, i * o->stride[0], (double)i);
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(draw(seed, off, (uint64_t)i) * (double)(i + 1));
            if (j > i) j = i;
            double a = kld(o->dtype, po, i * o->stride[0]), b = kld(o->dtype, po, j * o->stride[0]);
            kst(o->dtype, po, i * o->stride[0], b);
            kst(o->dtype, po, j * o->stride[0], a);
        }
        kcost(k, n);
        return 0;
    }
    if (k->a->ni < 5 || k->a->nt != 2) return KERR_ARGS;
    const struct ops_tensor *w = &k->t[0], *o = &k->t[1];
    if (w->ndim != 2 || o->ndim != 2 || w->shape[0] != o->shape[0]) return KERR_ARGS;
    int64_t rows = w->shape[0], cats = w->shape[1], ns = k->i[3];
    int repl = k->i[4] != 0;
    if (o->shape[1] != ns || (!repl && ns > cats)) return KERR_ARGS;
    char *pw = khost(k, w, &err);
    if (err) return err;
    char *po = khost(k, o, &err);
    if (err) return err;
    double *cw = malloc(sizeof(double) * (size_t)(cats ? cats : 1));
    if (!cw) return KERR_ARGS;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cats; c++) cw[c] = kld(w->dtype, pw, r * w->stride[0] + c * w->stride[1]);
        for (int64_t j = 0; j < ns; j++) {
            double total = 0;
            for (int64_t c = 0; c < cats; c++) total += cw[c];
            double t = draw(seed, off, (uint64_t)r * 1048576u + (uint64_t)j) * total, acc = 0;
            int64_t pick = -1, last = -1;
            for (int64_t c = 0; c < cats; c++) {
                if (cw[c] <= 0) continue;
                last = c;
                acc += cw[c];
                if (t < acc) {
                    pick = c;
                    break;
                }
            }
            if (pick < 0) pick = last < 0 ? 0 : last;
            kst(o->dtype, po, r * o->stride[0] + j * o->stride[1], (double)pick);
            if (!repl) cw[pick] = 0;
        }
    }
    free(cw);
    kcost(k, rows * cats);
    return 0;
}
