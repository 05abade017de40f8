/* What every kernel of the generic family (k_*.c) uses: its args, host views of device memory,
 * element loads and stores in every dtype, and an iterator over strided views.
 *
 * Values move through double: every fp32/fp16/bf16 add, subtract, multiply, divide and square root
 * computed in double and rounded once to the output's type equals the IEEE result in that type, so
 * element-wise results match the CPU's bit for bit; reductions accumulate in double in a fixed order
 * (deterministic run after run). Integers pass exactly up to 2^53. */
#ifndef NPUSIM_KERN_H
#define NPUSIM_KERN_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../npusim_kernel.h"
#include "ops_abi.h"

#define KAPI __attribute__((visibility("default")))
#define KHIDDEN __attribute__((visibility("hidden")))
#define KERR_ADDR 1 /* a view outside device memory: an AI-core address fault */
#define KERR_ARGS 2 /* args this binary does not understand */

struct kctx {
    const npusim_kernel_ctx *ctx;
    const struct ops_args *a;
    const int64_t *i;           /* a->ni ints */
    const double *s;            /* a->ns scalars */
    const struct ops_tensor *t; /* a->nt tensors */
};

/* A kernel's time on the simulated AI cores: kcost() charges every block at once (after the output
 * was written); a kernel that writes block by block instead calls kblock_cost() after each of its
 * kblocks() blocks, so that a copy taken while it runs sees part of its output new. */
KHIDDEN void kcost(const struct kctx *k, int64_t work);
KHIDDEN uint32_t kblocks(const struct kctx *k, int64_t work);
KHIDDEN void kblock_cost(void);

static inline size_t kesize(int dtype) {
    switch (dtype) {
    case OPS_DT_FLOAT: case OPS_DT_INT32: return 4;
    case OPS_DT_FLOAT16: case OPS_DT_INT16: case OPS_DT_BF16: return 2;
    case OPS_DT_INT8: case OPS_DT_UINT8: case OPS_DT_BOOL: return 1;
    case OPS_DT_INT64: case OPS_DT_DOUBLE: return 8;
    default: return 0;
    }
}

static inline int64_t knumel(const struct ops_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* Host address of element offset 0 of the view (addr + offset), checked to cover every element
 * the view reaches; NULL for an empty view. *err = KERR_ADDR if the range is not device memory. */
static inline char *khost(const struct kctx *k, const struct ops_tensor *t, int *err) {
    *err = 0;
    if (knumel(t) == 0) return NULL;
    int64_t lo = 0, hi = 0;
    for (int d = 0; d < t->ndim; d++) {
        int64_t span = (t->shape[d] - 1) * t->stride[d];
        if (span < 0) lo += span;
        else hi += span;
    }
    size_t es = kesize(t->dtype);
    if (!es || t->offset + lo < 0) {
        *err = KERR_ADDR;
        return NULL;
    }
    uint64_t first = t->addr + (uint64_t)(t->offset + lo) * es;
    char *p = k->ctx->dev_ptr(k->ctx, first, (size_t)(hi - lo + 1) * es);
    if (!p) {
        *err = KERR_ADDR;
        return NULL;
    }
    return p - lo * (int64_t)es;
}

/* fp16 and bf16 as the CPU computes them: in float, rounded to nearest even once per store. */
static inline float kbf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t kto_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Element `off` (in elements) of a view whose element 0 is at p. */
static inline double kld(int dtype, const char *p, int64_t off) {
    switch (dtype) {
    case OPS_DT_FLOAT: return ((const float *)p)[off];
    case OPS_DT_FLOAT16: return (double)((const _Float16 *)p)[off];
    case OPS_DT_BF16: return kbf16(((const uint16_t *)p)[off]);
    case OPS_DT_DOUBLE: return ((const double *)p)[off];
    case OPS_DT_INT64: return (double)((const int64_t *)p)[off];
    case OPS_DT_INT32: return ((const int32_t *)p)[off];
    case OPS_DT_INT16: return ((const int16_t *)p)[off];
    case OPS_DT_INT8: return ((const int8_t *)p)[off];
    case OPS_DT_UINT8: return ((const uint8_t *)p)[off];
    case OPS_DT_BOOL: return ((const uint8_t *)p)[off] != 0;
    default: return NAN;
    }
}

static inline int64_t ktoint(double v) {
    if (v != v) return 0;
    if (v >= 9.2233720368547758e18) return INT64_MAX;
    if (v <= -9.2233720368547758e18) return INT64_MIN;
    return (int64_t)v; /* toward zero, as a C cast in torch's CPU kernels */
}

static inline void kst(int dtype, char *p, int64_t off, double v) {
    switch (dtype) {
    case OPS_DT_FLOAT: ((float *)p)[off] = (float)v; break;
    case OPS_DT_FLOAT16: ((_Float16 *)p)[off] = (_Float16)(float)v; break;
    case OPS_DT_BF16: ((uint16_t *)p)[off] = kto_bf16((float)v); break;
    case OPS_DT_DOUBLE: ((double *)p)[off] = v; break;
    case OPS_DT_INT64: ((int64_t *)p)[off] = ktoint(v); break;
    case OPS_DT_INT32: ((int32_t *)p)[off] = (int32_t)ktoint(v); break;
    case OPS_DT_INT16: ((int16_t *)p)[off] = (int16_t)ktoint(v); break;
    case OPS_DT_INT8: ((int8_t *)p)[off] = (int8_t)ktoint(v); break;
    case OPS_DT_UINT8: ((uint8_t *)p)[off] = (uint8_t)ktoint(v); break;
    case OPS_DT_BOOL: ((uint8_t *)p)[off] = v != 0; break;
    default: break;
    }
}

/* Round v to the precision of dtype (what a store then a load would give). */
static inline double kround(int dtype, double v) {
    switch (dtype) {
    case OPS_DT_FLOAT: return (float)v;
    case OPS_DT_FLOAT16: return (double)(_Float16)(float)v;
    case OPS_DT_BF16: return kbf16(kto_bf16((float)v));
    default: return v;
    }
}

/* acc[r * N + j] = sum over kk of a[r][kk] * b[kk * bs0 + j * bs1] for r < KMM_R, summed from 0.0f in kk
 * order in float: what a single-threaded fp32 GEMM gives, run after run (kernels.c). a comes
 * interleaved, at[kk * KMM_R + r]; rows past the caller's last are zeros and their outputs unused.
 * b's elements are of dtype dt: float32, or float16 / bfloat16 (widened to float, exactly). */
#define KMM_R 8
KHIDDEN void kmm_rows(const float *at, const void *b, int dt, int64_t bs0, int64_t bs1, int64_t K, int64_t N,
                      float *acc);

/* One matrix product's working set, shared by the kernels that multiply (k_matmul, k_addmm): a's and
 * b's views (the last two dimensions: rows, columns), b read where it lies when it can be (a
 * float32, float16 or bfloat16 view with a unit stride), else each batch's b copied row-major into
 * floats; KMM_R rows of a packed at a time, and their sums (acc[r * N + j]). */
struct kmm {
    const struct ops_tensor *A, *B;
    const char *pa, *pb;
    int64_t K, N, as0, as1, bs0, bs1;
    const void *direct;
    float *bt, *at, *acc;
    const void *bp; /* the current batch's b, as kmm_rows reads it */
    int bdt;
    int64_t s0, s1;
};

/* 0, or KERR_ARGS when its buffers cannot be had (nothing to free then). */
KHIDDEN int kmm_open(struct kmm *m, const struct ops_tensor *A, const char *pa, const struct ops_tensor *B,
                     const char *pb, int64_t K, int64_t N);
/* The batch whose b starts at element ob of B's view. */
KHIDDEN void kmm_batch(struct kmm *m, int64_t ob);
/* Rows i0.. of a (of M, the batch's a at element oa) times the batch's b into acc; how many rows. */
KHIDDEN int kmm_group(struct kmm *m, int64_t oa, int64_t M, int64_t i0);
KHIDDEN void kmm_close(struct kmm *m);

/* An iterator over every element of `shape` in row-major order, keeping each of nt views' element
 * offsets (views given in the same rank as shape; a broadcast dimension has stride 0). */
#define KIT_MAX 8
struct kit {
    int nd, nt;
    int64_t shape[OPS_MAX_DIMS], idx[OPS_MAX_DIMS];
    int64_t st[KIT_MAX][OPS_MAX_DIMS];
    int64_t off[KIT_MAX];
};

static inline void kit_init(struct kit *it, const int64_t *shape, int nd, const struct ops_tensor *const *ts, int nt) {
    memset(it, 0, sizeof *it);
    it->nd = nd;
    it->nt = nt;
    for (int d = 0; d < nd; d++) it->shape[d] = shape[d];
    for (int j = 0; j < nt; j++)
        for (int d = 0; d < nd; d++) it->st[j][d] = ts[j]->stride[d];
}

/* Position the iterator at linear index i. */
static inline void kit_seek(struct kit *it, int64_t i) {
    for (int j = 0; j < it->nt; j++) it->off[j] = 0;
    for (int d = it->nd - 1; d >= 0; d--) {
        int64_t s = it->shape[d] ? it->shape[d] : 1;
        it->idx[d] = i % s;
        i /= s;
        for (int j = 0; j < it->nt; j++) it->off[j] += it->idx[d] * it->st[j][d];
    }
}

static inline void kit_next(struct kit *it) {
    for (int d = it->nd - 1; d >= 0; d--) {
        it->idx[d]++;
        for (int j = 0; j < it->nt; j++) it->off[j] += it->st[j][d];
        if (it->idx[d] < it->shape[d]) return;
        for (int j = 0; j < it->nt; j++) it->off[j] -= it->st[j][d] * it->shape[d];
        it->idx[d] = 0;
    }
}

#define KDECL(id, fn) KHIDDEN int fn(const struct kctx *k);
OPS_KERNELS(KDECL)
#undef KDECL

#endif
