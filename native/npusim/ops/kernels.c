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
#include <pthread.h>
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

/* Eight floats at any float's alignment (GCC's vector extension: AVX registers in the AVX2 clone,
 * SSE pairs in the default one). */
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));
#define ld8(p) (*(const v8f *)(p))

/* Columns [j0, j1) of KMM_R rows of a against one pass over b (b points at column j0): each b
 * element is loaded once per KMM_R rows, not once per row, and b is read where it lies (row-major,
 * or transposed as a Linear layer's weight) instead of copied. Every output still sums its K
 * products from 0.0f in kk order, one multiply then one add each: the AVX2 clone uses separate
 * instructions as the default one does (no FMA is enabled, so nothing is contracted), and vector
 * lanes only run different outputs side by side: the same bits as a scalar loop over kk. j0 is a
 * multiple of 8. */
__attribute__((target_clones("avx2", "default"))) static void kmm_cols(const float *at, const float *b, int64_t bs0,
                                                                       int64_t bs1, int64_t K, int64_t N,
                                                                       float *acc, int64_t j0, int64_t j1) {
    int64_t j = j0;
    if (bs1 == 1) {
        /* b's rows contiguous: walk them in order (a strided walk down b's columns misses the TLB
         * on every row), four at a time into the KMM_R output rows kept in acc. */
        int64_t jv = j0 + (j1 - j0) / 8 * 8;
        for (int r = 0; r < KMM_R; r++) memset(acc + r * N + j0, 0, sizeof(float) * (size_t)(j1 - j0));
        for (int64_t kk = 0; kk < K; kk += 4) {
            int n = K - kk < 4 ? (int)(K - kk) : 4;
            const float *av = at + kk * KMM_R, *br = b + kk * bs0 - j0;
            for (int r = 0; r < KMM_R; r++) {
                float *cr = acc + r * N;
                if (n == 4) {
                    float x0 = av[r], x1 = av[KMM_R + r], x2 = av[2 * KMM_R + r], x3 = av[3 * KMM_R + r];
                    for (int64_t q = j0; q < jv; q += 8) {
                        v8f c = ld8(cr + q);
                        c += ld8(br + q) * x0;
                        c += ld8(br + bs0 + q) * x1;
                        c += ld8(br + 2 * bs0 + q) * x2;
                        c += ld8(br + 3 * bs0 + q) * x3;
                        memcpy(cr + q, &c, sizeof c);
                    }
                } else {
                    for (int m = 0; m < n; m++) {
                        float x = av[m * KMM_R + r];
                        for (int64_t q = j0; q < jv; q += 8) {
                            v8f c = ld8(cr + q) + ld8(br + m * bs0 + q) * x;
                            memcpy(cr + q, &c, sizeof c);
                        }
                    }
                }
            }
        }
        j = jv;
    } else if (bs0 == 1) {
        /* b[kk][j] = w[j][kk], w's rows contiguous: eight columns, the KMM_R rows of a in lanes */
        for (; j + 8 <= j1; j += 8) {
            v8f c[8] = {{0}};
            const float *w = b + (j - j0) * bs1;
            for (int64_t kk = 0; kk < K; kk++) {
                v8f av = ld8(at + kk * KMM_R);
                for (int q = 0; q < 8; q++) c[q] += av * w[q * bs1 + kk];
            }
            for (int r = 0; r < KMM_R; r++)
                for (int q = 0; q < 8; q++) acc[r * N + j + q] = c[q][r];
        }
    }
    for (; j < j1; j++) {
        float c[KMM_R] = {0};
        for (int64_t kk = 0; kk < K; kk++) {
            float x = b[kk * bs0 + (j - j0) * bs1];
            for (int r = 0; r < KMM_R; r++) c[r] += at[kk * KMM_R + r] * x;
        }
        for (int r = 0; r < KMM_R; r++) acc[r * N + j] = c[r];
    }
}

/* A float16 or bfloat16 value as the float it is exactly (what kld gives, rounded to float: no
 * rounding happens). float16: the exponent rebased, subnormals normalised through a float
 * subtraction that is exact, infinities and NaNs kept. */
static inline float kmm_widen(int dt, uint16_t h) {
    uint32_t u;
    float f;
    if (dt == OPS_DT_BF16) {
        u = (uint32_t)h << 16;
    } else {
        const uint32_t shifted_exp = 0x7c00u << 13;
        u = ((uint32_t)h & 0x7fffu) << 13;
        uint32_t e = u & shifted_exp;
        u += (127u - 15u) << 23;
        if (e == shifted_exp) {
            u += (128u - 16u) << 23; /* Inf, NaN */
        } else if (e == 0) {         /* zero, subnormal */
            const uint32_t magic_u = 113u << 23;
            float magic;
            memcpy(&magic, &magic_u, 4);
            u += 1u << 23;
            memcpy(&f, &u, 4);
            f -= magic;
            memcpy(&u, &f, 4);
        }
        u |= ((uint32_t)h & 0x8000u) << 16;
    }
    memcpy(&f, &u, 4);
    return f;
}

/* Columns of a float16 or bfloat16 b, PANEL at a time: each panel widened into float once (for
 * these KMM_R rows of a), then multiplied as a float b is. Same values, same order: same bits. */
#define KMM_PANEL 64

static void kmm_cols_any(const float *at, const void *b, int dt, int64_t bs0, int64_t bs1, int64_t K, int64_t N,
                         float *acc, int64_t j0, int64_t j1) {
    if (dt == OPS_DT_FLOAT) {
        kmm_cols(at, (const float *)b + j0 * bs1, bs0, bs1, K, N, acc, j0, j1);
        return;
    }
    const uint16_t *h = b;
    float *panel = malloc(sizeof(float) * (size_t)(K ? K : 1) * KMM_PANEL);
    for (int64_t p0 = j0; p0 < j1; p0 += KMM_PANEL) {
        int64_t p1 = p0 + KMM_PANEL < j1 ? p0 + KMM_PANEL : j1, w = p1 - p0;
        if (!panel) { /* no room for a panel: column by column, widened as read */
            for (int64_t j = p0; j < p1; j++) {
                float c[KMM_R] = {0};
                for (int64_t kk = 0; kk < K; kk++) {
                    float x = kmm_widen(dt, h[kk * bs0 + j * bs1]);
                    for (int r = 0; r < KMM_R; r++) c[r] += at[kk * KMM_R + r] * x;
                }
                for (int r = 0; r < KMM_R; r++) acc[r * N + j] = c[r];
            }
            continue;
        }
        if (bs1 == 1) { /* row-major: the panel's rows, w wide */
            for (int64_t kk = 0; kk < K; kk++)
                for (int64_t q = 0; q < w; q++) panel[kk * w + q] = kmm_widen(dt, h[kk * bs0 + p0 + q]);
            kmm_cols(at, panel, w, 1, K, N, acc, p0, p1);
        } else { /* transposed: the panel's columns are w's rows, K long */
            for (int64_t q = 0; q < w; q++)
                for (int64_t kk = 0; kk < K; kk++) panel[q * K + kk] = kmm_widen(dt, h[(p0 + q) * bs1 + kk]);
            kmm_cols(at, panel, 1, K, K, N, acc, p0, p1);
        }
    }
    free(panel);
}

struct kmm_half {
    const float *at;
    const void *b;
    int dt;
    int64_t bs0, bs1, K, N, j0, j1;
    float *acc;
};

static void *kmm_half_main(void *arg) {
    const struct kmm_half *h = arg;
    kmm_cols_any(h->at, h->b, h->dt, h->bs0, h->bs1, h->K, h->N, h->acc, h->j0, h->j1);
    return NULL;
}

/* A device's AI cores each take a share of a product's output (blockDim blocks): a large product
 * here takes its columns in two halves, the second on a thread of its own. Each output is computed
 * by one thread as before: the bits do not depend on the split. */
#define KMM_SPLIT_MACS ((int64_t)1 << 22)

KHIDDEN void kmm_rows(const float *at, const void *b, int dt, int64_t bs0, int64_t bs1, int64_t K, int64_t N,
                      float *acc) {
    int64_t mid = N / 2 / 8 * 8;
    if (K * N * KMM_R >= KMM_SPLIT_MACS && mid >= 8) {
        struct kmm_half h = {at, b, dt, bs0, bs1, K, N, mid, N, acc};
        pthread_t th;
        if (pthread_create(&th, NULL, kmm_half_main, &h) == 0) {
            kmm_cols_any(at, b, dt, bs0, bs1, K, N, acc, 0, mid);
            pthread_join(th, NULL);
            return;
        }
    }
    kmm_cols_any(at, b, dt, bs0, bs1, K, N, acc, 0, N);
}

KHIDDEN int kmm_open(struct kmm *m, const struct ops_tensor *A, const char *pa, const struct ops_tensor *B,
                     const char *pb, int64_t K, int64_t N) {
    int nd = A->ndim;
    memset(m, 0, sizeof *m);
    m->A = A, m->B = B, m->pa = pa, m->pb = pb, m->K = K, m->N = N;
    m->as0 = A->stride[nd - 2], m->as1 = A->stride[nd - 1], m->bs0 = B->stride[nd - 2], m->bs1 = B->stride[nd - 1];
    int dt = B->dtype;
    int widened = dt == OPS_DT_FLOAT || dt == OPS_DT_FLOAT16 || dt == OPS_DT_BF16;
    m->direct = widened && (m->bs0 == 1 || m->bs1 == 1) ? pb : NULL;
    m->bt = m->direct ? NULL : malloc(sizeof(float) * (size_t)(K * N > 0 ? K * N : 1));
    m->at = malloc(sizeof(float) * (size_t)((K ? K : 1) * KMM_R));
    m->acc = malloc(sizeof(float) * (size_t)((N ? N : 1) * KMM_R));
    if ((!m->direct && !m->bt) || !m->at || !m->acc) {
        kmm_close(m);
        return KERR_ARGS;
    }
    return 0;
}

KHIDDEN void kmm_batch(struct kmm *m, int64_t ob) {
    if (m->direct) {
        m->bp = (const char *)m->direct + ob * (int64_t)kesize(m->B->dtype);
        m->bdt = m->B->dtype, m->s0 = m->bs0, m->s1 = m->bs1;
        return;
    }
    for (int64_t kk = 0; kk < m->K; kk++)
        for (int64_t j = 0; j < m->N; j++)
            m->bt[kk * m->N + j] = (float)kld(m->B->dtype, m->pb, ob + kk * m->bs0 + j * m->bs1);
    m->bp = m->bt, m->bdt = OPS_DT_FLOAT, m->s0 = m->N, m->s1 = 1;
}

KHIDDEN int kmm_group(struct kmm *m, int64_t oa, int64_t M, int64_t i0) {
    int R = M - i0 < KMM_R ? (int)(M - i0) : KMM_R;
    for (int64_t kk = 0; kk < m->K; kk++)
        for (int r = 0; r < KMM_R; r++)
            m->at[kk * KMM_R + r] =
                r < R ? (float)kld(m->A->dtype, m->pa, oa + (i0 + r) * m->as0 + kk * m->as1) : 0.0f;
    kmm_rows(m->at, m->bp, m->bdt, m->s0, m->s1, m->K, m->N, m->acc);
    return R;
}

KHIDDEN void kmm_close(struct kmm *m) {
    free(m->bt), free(m->at), free(m->acc);
    m->bt = m->at = m->acc = NULL;
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
