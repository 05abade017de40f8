/* The simulated device's collective kernel: the kernel binary libhccl.so loads from
 * <tree>/opp/built-in/op_impl/ai_core/tbe/kernel/npusim/ and launches on the caller's stream.
 *
 * The ranks' processes share the communicator's window (a memfd both map, hccl.c), which stands
 * for the interconnect and the CCL buffers HCCL exchanges through on a real node. Each rank's
 * engine, when its stream reaches the all-reduce, copies its share of the input into its slot,
 * meets the other ranks at a barrier, reduces every rank's slot in rank order into its output
 * (so every rank computes the same bits), and meets them again before a slot is reused. Barriers
 * wait on futex words in the window, with the HCCL_EXEC_TIMEOUT deadline: a rank that never comes
 * fails the kernel (an error on the stream), it does not hang it. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../npusim_kernel.h"
#include "npusnap/timeutil.h"
#include "ops_abi.h"

#define KAPI __attribute__((visibility("default")))
#define HCCL_DATA_TYPE_INT32 2
#define HCCL_DATA_TYPE_FP32 4
#define HCCL_REDUCE_SUM 0
#define HCCL_REDUCE_PROD 1
#define HCCL_REDUCE_MAX 2
#define HCCL_REDUCE_MIN 3
#define KERR_ADDR 1
#define KERR_ARGS 2
#define KERR_TIMEOUT 3
#define KERR_COMM 4 /* the communicator was invalidated (a restore) before the kernel ran */
#define HCCL_E_UNAVAIL 7
#define HCCL_E_TIMEOUT 9

static void futex_wake(_Atomic uint32_t *w) { syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

/* Every rank's generation reaches `gen`, or the deadline passes (-1). */
static int barrier(struct hccl_window *w, uint32_t rank, uint32_t nranks, double deadline) {
    _Atomic uint32_t *mine = (_Atomic uint32_t *)&w->ranks[rank].gen;
    uint32_t gen = atomic_fetch_add(mine, 1) + 1;
    futex_wake(mine);
    for (uint32_t j = 0; j < nranks; j++) {
        _Atomic uint32_t *g = (_Atomic uint32_t *)&w->ranks[j].gen;
        for (;;) {
            uint32_t v = atomic_load(g);
            if ((int32_t)(v - gen) >= 0) break;
            double left = deadline - now_s();
            if (left <= 0) return -1;
            /* Sleep until that rank moves (or 50 ms, to re-check the deadline). */
            struct timespec ts = {0, left < 0.05 ? (long)(left * 1e9) : 50000000L};
            syscall(SYS_futex, (uint32_t *)g, FUTEX_WAIT, v, &ts, NULL, 0);
        }
    }
    return 0;
}

static void reduce_into(void *dst, const void *src, uint64_t n, int dtype, int op, int first) {
    if (dtype == HCCL_DATA_TYPE_FP32) {
        float *d = dst;
        const float *s = src;
        for (uint64_t i = 0; i < n; i++) {
            if (first) d[i] = s[i];
            else if (op == HCCL_REDUCE_SUM) d[i] += s[i];
            else if (op == HCCL_REDUCE_PROD) d[i] *= s[i];
            else if (op == HCCL_REDUCE_MAX) d[i] = s[i] > d[i] ? s[i] : d[i];
            else d[i] = s[i] < d[i] ? s[i] : d[i];
        }
    } else {
        int32_t *d = dst;
        const int32_t *s = src;
        for (uint64_t i = 0; i < n; i++) {
            if (first) d[i] = s[i];
            else if (op == HCCL_REDUCE_SUM) d[i] += s[i];
            else if (op == HCCL_REDUCE_PROD) d[i] *= s[i];
            else if (op == HCCL_REDUCE_MAX) d[i] = s[i] > d[i] ? s[i] : d[i];
            else d[i] = s[i] < d[i] ? s[i] : d[i];
        }
    }
}

/* Both collectives: an all-reduce, or a broadcast (send == recv, the root's buffer to all). */
KAPI int npusim_hccl_allreduce(const npusim_kernel_ctx *ctx, const void *args, size_t args_size) {
    if (args_size != sizeof(struct ops_allreduce_args)) return KERR_ARGS;
    const struct ops_allreduce_args *a = args;
    struct hccl_comm_state *st = (struct hccl_comm_state *)(uintptr_t)a->state;
    _Atomic uint32_t *inflight = (_Atomic uint32_t *)&st->inflight;
    struct hccl_window *w = (struct hccl_window *)(uintptr_t)a->window;
    int rc = 0;
    /* Launched before a restore and run after it (it waited at the lock): the window is gone. */
    if (!atomic_load((_Atomic uint32_t *)&st->valid)) rc = KERR_COMM;
    uint64_t bytes = a->count * 4; /* fp32 and int32 */
    char *send = bytes && !rc ? ctx->dev_ptr(ctx, a->send, bytes) : NULL;
    char *recv = bytes && !rc ? ctx->dev_ptr(ctx, a->recv, bytes) : NULL;
    if (bytes && !rc && (!send || !recv)) rc = KERR_ADDR;
    double deadline = now_s() + (double)a->timeout_ms / 1000.0;
    char *slots = (char *)w + HCCL_WINDOW_HEADER;
    int bcast = a->kind == OPS_COLL_BROADCAST;
    for (uint64_t done = 0; rc == 0 && done < bytes; done += a->slot_bytes) {
        uint64_t n = bytes - done < a->slot_bytes ? bytes - done : a->slot_bytes;
        if (!bcast || a->rank == a->root) memcpy(slots + a->rank * a->slot_bytes, send + done, n);
        if (barrier(w, a->rank, a->nranks, deadline) != 0) {
            rc = KERR_TIMEOUT;
            break;
        }
        if (bcast && a->rank != a->root) memcpy(recv + done, slots + a->root * a->slot_bytes, n);
        for (uint32_t j = 0; !bcast && j < a->nranks; j++)
            reduce_into(recv + done, slots + j * a->slot_bytes, n / 4, a->dtype, a->op, j == 0);
        if (barrier(w, a->rank, a->nranks, deadline) != 0) rc = KERR_TIMEOUT;
    }
    if (rc == KERR_COMM || rc == KERR_TIMEOUT)
        atomic_store((_Atomic int32_t *)&st->async_error, rc == KERR_COMM ? HCCL_E_UNAVAIL : HCCL_E_TIMEOUT);
    atomic_fetch_sub(inflight, 1);
    futex_wake(inflight);
    return rc;
}
