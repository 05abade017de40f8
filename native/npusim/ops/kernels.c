/* The simulated device's operator kernels: the kernel binary that libopapi.so loads with
 * aclrtBinaryLoadFromFile from <tree>/opp/built-in/op_impl/ai_core/tbe/kernel/npusim/, as real
 * aclnn operators find their AI-core binaries under the opp directory. Each kernel has the
 * signature of npusim_kernel.h and runs on the runtime's engine thread when its stream reaches it.
 *
 * Kernels compute honestly in fp32, block by block (blockDim blocks, as many AI cores would take
 * a share of the output each), writing their output as they go: a copy of device memory taken
 * while a kernel runs sees part of the new values and part of the old. NPUSIM_KERNEL_BLOCK_US
 * (default 100) adds that many microseconds per block, so that a kernel takes visible time on
 * tensors this small; 0 runs at memory speed. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../npusim_kernel.h"
#include "kern.h"





static long block_us(void) {
    const char *v = getenv("NPUSIM_KERNEL_BLOCK_US");
    if (v && *v) return atol(v) > 0 ? atol(v) : 0;
    return 100;
}

static void block_cost(long us) {
    if (us <= 0) return;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static int64_t numel(const struct ops_view *v) {
    int64_t n = 1;
    for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
    return n;
}

/* Host view of the first element of v's storage range (element `offset` onward). */
static float *host_of(const npusim_kernel_ctx *ctx, const struct ops_view *v) {
    int64_t last = 0;
    for (int d = 0; d < v->ndim; d++)
        if (v->shape[d] > 0) last += (v->shape[d] - 1) * v->stride[d];
    if (numel(v) == 0) return NULL;
    size_t bytes = (size_t)(last + 1) * sizeof(float);
    char *p = ctx->dev_ptr(ctx, v->addr + (uint64_t)v->offset * sizeof(float), bytes);
    return (float *)p;
}

/* Element offset (from the view's first element) of linear index i of `shape`, in view v. */
static int64_t at(const struct ops_view *v, const int64_t *shape, int ndim, int64_t i) {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        int64_t s = shape[d];
        off += (i % s) * v->stride[d];
        i /= s;
    }
    return off;
}

static uint32_t nblocks(const npusim_kernel_ctx *ctx, int64_t work) {
    uint32_t b = ctx->block_dim ? ctx->block_dim : 1;
    if (work < (int64_t)b) b = work > 0 ? (uint32_t)work : 1;
    return b;
}

KAPI int npusim_elementwise(const npusim_kernel_ctx *ctx, const void *args, size_t args_size) {
    if (args_size != sizeof(struct ops_ew_args)) return KERR_ARGS;
    const struct ops_ew_args *a = args;
    int64_t n = numel(&a->out);
    if (n == 0) return 0;
    float *o = host_of(ctx, &a->out);
    float *in[3] = {NULL, NULL, NULL};
    if (!o) return KERR_ADDR;
    for (int k = 0; k < a->nin && k < 3; k++)
        if (!(in[k] = host_of(ctx, &a->in[k]))) return KERR_ADDR;
    const int64_t *shape = a->out.shape;
    int nd = a->out.ndim;
    uint32_t nb = nblocks(ctx, n);
    long us = block_us();
    for (uint32_t blk = 0; blk < nb; blk++) {
        int64_t lo = n * blk / nb, hi = n * (blk + 1) / nb;
        for (int64_t i = lo; i < hi; i++) {
            float x = in[0][at(&a->in[0], shape, nd, i)];
            float y = a->nin > 1 ? in[1][at(&a->in[1], shape, nd, i)] : 0.0f;
            float z = a->nin > 2 ? in[2][at(&a->in[2], shape, nd, i)] : 0.0f;
            float r;
            switch (a->op) {
            case OPS_EW_ADD: r = x + a->alpha * y; break;
            case OPS_EW_MUL: r = x * y; break;
            case OPS_EW_MULS: r = x * a->alpha; break;
            case OPS_EW_RELU: r = x > 0.0f ? x : 0.0f; break;
            case OPS_EW_THRESHOLD_BWD: r = y > a->alpha ? x : 0.0f; break;
            case OPS_EW_MSE_BWD: r = a->alpha * (x - y) * z; break;
            case OPS_EW_SQDIFF: r = (x - y) * (x - y); break;
            default: return KERR_ARGS;
            }
            o[at(&a->out, shape, nd, i)] = r;
        }
        block_cost(us);
    }
    return 0;
}

KAPI int npusim_matmul(const npusim_kernel_ctx *ctx, const void *args, size_t args_size) {
    if (args_size != sizeof(struct ops_mm_args)) return KERR_ARGS;
    const struct ops_mm_args *m = args;
    int64_t M = m->a.shape[0], K = m->a.shape[1], N = m->b.shape[1];
    if (M * N == 0) return 0;
    float *o = host_of(ctx, &m->out);
    if (!o) return KERR_ADDR;
    float *A = K ? host_of(ctx, &m->a) : NULL, *B = K ? host_of(ctx, &m->b) : NULL;
    if (K && (!A || !B)) return KERR_ADDR;
    int64_t as0 = m->a.stride[0], as1 = m->a.stride[1], bs0 = m->b.stride[0], bs1 = m->b.stride[1];
    int64_t os0 = m->out.stride[0], os1 = m->out.stride[1];
    uint32_t nb = nblocks(ctx, M); /* a block is a band of output rows */
    long us = block_us();
    /* Row by row, k outside j: B is read along its rows (contiguous in the usual layout), and each
     * output element still sums its products in k order, so results equal the textbook loop's. */
    float *acc = malloc(sizeof(float) * (size_t)N);
    if (!acc) return KERR_ARGS;
    for (uint32_t blk = 0; blk < nb; blk++) {
        int64_t lo = M * blk / nb, hi = M * (blk + 1) / nb;
        for (int64_t i = lo; i < hi; i++) {
            for (int64_t j = 0; j < N; j++) acc[j] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                float a = A[i * as0 + k * as1];
                const float *b = B + k * bs0;
                if (bs1 == 1)
                    for (int64_t j = 0; j < N; j++) acc[j] += a * b[j];
                else
                    for (int64_t j = 0; j < N; j++) acc[j] += a * b[j * bs1];
            }
            for (int64_t j = 0; j < N; j++) o[i * os0 + j * os1] = acc[j];
        }
        block_cost(us);
    }
    free(acc);
    return 0;
}

KAPI int npusim_reduce_sum(const npusim_kernel_ctx *ctx, const void *args, size_t args_size) {
    if (args_size != sizeof(struct ops_reduce_args)) return KERR_ARGS;
    const struct ops_reduce_args *r = args;
    int nd = r->in.ndim;
    int64_t n = numel(&r->in), nout = numel(&r->out);
    float *o = nout ? host_of(ctx, &r->out) : NULL;
    if (nout && !o) return KERR_ADDR;
    float *x = n ? host_of(ctx, &r->in) : NULL;
    if (n && !x) return KERR_ADDR;
    for (int64_t i = 0; i < nout; i++) o[at(&r->out, r->out.shape, nd, i)] = 0.0f;
    /* The output index of an input element: its multi-index with the reduced dimensions at 0. */
    struct ops_view ov = r->out;
    for (int d = 0; d < nd; d++)
        if (r->reduce[d]) ov.stride[d] = 0;
    uint32_t nb = nblocks(ctx, n);
    long us = block_us();
    for (uint32_t blk = 0; blk < nb; blk++) {
        int64_t lo = n * blk / nb, hi = n * (blk + 1) / nb;
        for (int64_t i = lo; i < hi; i++) o[at(&ov, r->in.shape, nd, i)] += x[at(&r->in, r->in.shape, nd, i)];
        block_cost(us);
    }
    return 0;
}

KAPI int npusim_mse_loss(const npusim_kernel_ctx *ctx, const void *args, size_t args_size) {
    if (args_size != sizeof(struct ops_mse_args)) return KERR_ARGS;
    const struct ops_mse_args *m = args;
    int64_t n = numel(&m->a);
    float *o = host_of(ctx, &m->out);
    if (!o) return KERR_ADDR;
    float *A = n ? host_of(ctx, &m->a) : NULL, *B = n ? host_of(ctx, &m->b) : NULL;
    if (n && (!A || !B)) return KERR_ADDR;
    uint32_t nb = nblocks(ctx, n);
    long us = block_us();
    float acc = 0.0f;
    for (uint32_t blk = 0; blk < nb; blk++) {
        int64_t lo = n * blk / nb, hi = n * (blk + 1) / nb;
        for (int64_t i = lo; i < hi; i++) {
            float d = A[at(&m->a, m->a.shape, m->a.ndim, i)] - B[at(&m->b, m->a.shape, m->a.ndim, i)];
            acc += d * d;
        }
        block_cost(us);
    }
    o[0] = m->reduction == 1 && n ? acc / (float)n : acc;
    return 0;
}

/* ---------------------------------------------------------------- the generic family (kern.h) */

KHIDDEN void kcost(const struct kctx *k, int64_t work) {
    long us = block_us();
    if (us > 0) block_cost(us * (long)nblocks(k->ctx, work));
}

typedef int (*kfn)(const struct kctx *k);
static const kfn KERNELS[OPS_OP_COUNT] = {
#define KROW(id, fn) [OPS_OP_##id] = fn,
    OPS_KERNELS(KROW)
#undef KROW
};

/* The one entry of the generic family: checks the args block is whole, then runs its op's row. */
KAPI int npusim_op(const npusim_kernel_ctx *ctx, const void *args, size_t args_size) {
    if (args_size < sizeof(struct ops_args)) return KERR_ARGS;
    const struct ops_args *a = args;
    if (a->op >= OPS_OP_COUNT || a->ni > 4096 || a->ns > 65536 || a->nt > 65536) return KERR_ARGS;
    size_t need = sizeof *a + a->ni * sizeof(int64_t) + a->ns * sizeof(double) + a->nt * sizeof(struct ops_tensor);
    if (args_size != need) return KERR_ARGS;
    struct kctx k = {ctx, a, OPS_ARGS_INTS(a), OPS_ARGS_SCALARS(a), OPS_ARGS_TENSORS(a)};
    for (uint32_t j = 0; j < a->nt; j++)
        if (k.t[j].ndim < 0 || k.t[j].ndim > OPS_MAX_DIMS || !kesize(k.t[j].dtype)) return KERR_ARGS;
    return KERNELS[a->op](&k);
}
