/* The simulated device's operator kernels: the kernel binary that libopapi.so loads with
 * aclrtBinaryLoadFromFile from <tree>/opp/built-in/op_impl/ai_core/tbe/kernel/npusim/, as real
 * aclnn operators find their AI-core binaries under the opp directory. Each kernel has the
 * signature of npusim_kernel.h and runs on the runtime's engine thread when its stream reaches it.
 *
 * Every operator runs through npusim_op, which dispatches to its row's kernel (ops_list.h). A
 * kernel computes its output, then kcost() charges NPUSIM_KERNEL_BLOCK_US (default 0, memory speed)
 * microseconds per block (blockDim blocks, as many AI cores would take a share of the output
 * each), so that a kernel takes visible time on tensors this small; 0 runs at memory speed. */
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
    return 0;
}

static void block_cost(long us) {
    if (us <= 0) return;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static uint32_t nblocks(const npusim_kernel_ctx *ctx, int64_t work) {
    uint32_t b = ctx->block_dim ? ctx->block_dim : 1;
    if (work < (int64_t)b) b = work > 0 ? (uint32_t)work : 1;
    return b;
}

/* ---------------------------------------------------------------- the generic family (kern.h) */

KHIDDEN uint32_t kblocks(const struct kctx *k, int64_t work) { return nblocks(k->ctx, work); }

KHIDDEN void kblock_cost(void) { block_cost(block_us()); }

KHIDDEN void kcost(const struct kctx *k, int64_t work) {
    long us = block_us();
    if (us > 0) block_cost(us * (long)nblocks(k->ctx, work));
}

/* Sixteen outputs at a time stay in registers across kk; the order of each one's sum is unchanged.
 * The AVX2 clone multiplies and adds as separate instructions as the default one does (no FMA is
 * enabled, so nothing is contracted): the same bits on either. */
__attribute__((target_clones("avx2", "default"))) KHIDDEN void kmm_row(const float *a, const float *bt, int64_t K,
                                                                       int64_t N, float *acc) {
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) {
        float c[16] = {0};
        for (int64_t kk = 0; kk < K; kk++) {
            float av = a[kk];
            const float *b = bt + kk * N + j;
            for (int q = 0; q < 16; q++) c[q] += av * b[q];
        }
        memcpy(acc + j, c, sizeof c);
    }
    for (; j < N; j++) {
        float c = 0.0f;
        for (int64_t kk = 0; kk < K; kk++) c += a[kk] * bt[kk * N + j];
        acc[j] = c;
    }
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
