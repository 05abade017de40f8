/* The simulated device's collective kernel: the kernel binary libhccl.so loads from
 * <tree>/opp/built-in/op_impl/ai_core/tbe/kernel/npusim/ and launches on the caller's stream.
 *
 * The ranks' processes share the communicator's window (a memfd both map, hccl.c), which stands
 * for the interconnect and the CCL buffers HCCL exchanges through on a real node ("CCL buffer",
 * sized by HCCL_BUFFSIZE or HcclCommConfig.hcclBufferSize). Each rank's engine, when its stream
 * reaches the collective, copies what it sends into its slot, meets the other ranks at a barrier,
 * reads what it receives from their slots (reducing in rank order, so every rank computes the same
 * bits, run after run), and meets them again before a slot is reused. Data larger than a slot
 * goes in rounds. Barriers wait on futex words in the window, with the HCCL_EXEC_TIMEOUT
 * deadline: a rank that never comes fails the kernel (an error on the stream, and the
 * communicator's async error HCCL_E_TIMEOUT, as HCCL reports an execution timeout), it does not
 * hang the stream. */
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
/* HcclDataType and HcclReduceOp of hccl_types.h */
#define DT_INT8 0
#define DT_INT16 1
#define DT_INT32 2
#define DT_FP16 3
#define DT_FP32 4
#define DT_INT64 5
#define DT_UINT64 6
#define DT_UINT8 7
#define DT_UINT16 8
#define DT_UINT32 9
#define DT_FP64 10
#define DT_BF16 11
#define RED_SUM 0
#define RED_PROD 1
#define RED_MAX 2
#define RED_MIN 3
#define KERR_ADDR 1
#define KERR_ARGS 2
#define KERR_TIMEOUT 3
#define KERR_COMM 4 /* the communicator was invalidated (a restore) before the kernel ran */
#define HCCL_E_UNAVAIL 7
#define HCCL_E_TIMEOUT 9

static void futex_wake(_Atomic uint32_t *w) { syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

/* The communicator's state of the kernel running on this thread: a destroy may ask it to stop. */
static _Thread_local struct hccl_comm_state *t_state;

/* Wait until *g has reached gen (wrapping compare), or the deadline passes (-1), or the
 * communicator is destroyed under the wait (-2). */
static int wait_gen(_Atomic uint32_t *g, uint32_t gen, double deadline) {
    for (;;) {
        uint32_t v = atomic_load(g);
        if ((int32_t)(v - gen) >= 0) return 0;
        if (t_state && atomic_load((_Atomic uint32_t *)&t_state->abort)) return -2;
        double left = deadline - now_s();
        if (left <= 0) return -1;
        /* Sleep until that rank moves (or 50 ms, to re-check the deadline). */
        struct timespec ts = {0, left < 0.05 ? (long)(left * 1e9) : 50000000L};
        syscall(SYS_futex, (uint32_t *)g, FUTEX_WAIT, v, &ts, NULL, 0);
    }
}

/* Every rank's generation reaches ours: the all-rank collectives. */
static int barrier(struct hccl_window *w, uint32_t rank, uint32_t nranks, double deadline) {
    _Atomic uint32_t *mine = (_Atomic uint32_t *)&w->ranks[rank].gen;
    uint32_t gen = atomic_fetch_add(mine, 1) + 1;
    futex_wake(mine);
    for (uint32_t j = 0; j < nranks; j++) {
        int r = wait_gen((_Atomic uint32_t *)&w->ranks[j].gen, gen, deadline);
        if (r != 0) return r;
    }
    return 0;
}

/* The peer has passed as many barriers with us as we have with it: send/recv. */
static int pair_barrier(struct hccl_window *w, uint32_t rank, uint32_t peer, double deadline) {
    _Atomic uint32_t *mine = (_Atomic uint32_t *)&w->pair[rank][peer];
    uint32_t gen = atomic_fetch_add(mine, 1) + 1;
    futex_wake(mine);
    return wait_gen((_Atomic uint32_t *)&w->pair[peer][rank], gen, deadline);
}

/* IEEE half and bfloat16 <-> float, round to nearest even (what the device's cast does). */
static float half_to_float(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else { /* subnormal */
        e = 113;
        while (!(m & 0x400)) m <<= 1, e--;
        u = s | (e << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t float_to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000, e = (u >> 23) & 0xff, m = u & 0x7fffff;
    if (e == 0xff) return (uint16_t)(s | 0x7c00 | (m ? 0x200 : 0));
    int32_t he = (int32_t)e - 112;
    if (he >= 0x1f) return (uint16_t)(s | 0x7c00);
    if (he <= 0) {
        if (he < -10) return (uint16_t)s;
        m |= 0x800000;
        uint32_t shift = (uint32_t)(14 - he), hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (hm & 1))) hm++;
        return (uint16_t)(s | hm);
    }
    uint32_t hm = m >> 13, rem = m & 0x1fff;
    uint32_t r = s | ((uint32_t)he << 10) | hm;
    if (rem > 0x1000 || (rem == 0x1000 && (hm & 1))) r++; /* may carry into the exponent: right */
    return (uint16_t)r;
}

static float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffff)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#define RED(d, s, op) ((op) == RED_SUM ? (d) + (s) : (op) == RED_PROD ? (d) * (s) : (op) == RED_MAX ? ((s) > (d) ? (s) : (d)) : ((s) < (d) ? (s) : (d)))
#define RED_LOOP(T)                                                                                                    \
    do {                                                                                                               \
        T *d = dst;                                                                                                    \
        const T *s = src;                                                                                              \
        for (uint64_t i = 0; i < n; i++) d[i] = (T)RED(d[i], s[i], op);                                                \
    } while (0)

/* dst = dst op src, element by element; half-width floats are rounded back after every step (one
 * rank's contribution at a time), as a device that adds in the tensor's own type does. */
static void reduce_into(void *dst, const void *src, uint64_t n, int dtype, int op) {
    switch (dtype) {
    case DT_INT8: RED_LOOP(int8_t); break;
    case DT_INT16: RED_LOOP(int16_t); break;
    case DT_INT32: RED_LOOP(int32_t); break;
    case DT_INT64: RED_LOOP(int64_t); break;
    case DT_FP32: RED_LOOP(float); break;
    case DT_FP16: {
        uint16_t *d = dst;
        const uint16_t *s = src;
        for (uint64_t i = 0; i < n; i++) d[i] = float_to_half(RED(half_to_float(d[i]), half_to_float(s[i]), op));
        break;
    }
    case DT_BF16: {
        uint16_t *d = dst;
        const uint16_t *s = src;
        for (uint64_t i = 0; i < n; i++) d[i] = float_to_bf16(RED(bf16_to_float(d[i]), bf16_to_float(s[i]), op));
        break;
    }
    }
}

/* A rank's slot in the window. */
#define SLOT(w, a, r) ((char *)(w) + HCCL_WINDOW_HEADER + (uint64_t)(r) * (a)->slot_bytes)

static uint64_t min_u64(uint64_t x, uint64_t y) { return x < y ? x : y; }

/* A failed wait as the kernel's error: the deadline (HCCL_EXEC_TIMEOUT), or a destroy. */
static int werr(int r) { return r == -2 ? KERR_COMM : KERR_TIMEOUT; }
#define WAIT(call)                                                                                                     \
    do {                                                                                                               \
        int wr_ = (call);                                                                                              \
        if (wr_ != 0) return werr(wr_);                                                                                \
    } while (0)

/* all-reduce, broadcast, all-gather: every rank stages one piece (the root only, for a
 * broadcast) of at most a slot per round. */
static int run_flat(const struct ops_hccl_args *a, struct hccl_window *w, char *send, char *recv, double deadline) {
    uint64_t bytes = a->count * a->esize, step = a->slot_bytes / a->esize * a->esize;
    int bcast = a->kind == OPS_COLL_BROADCAST, gather = a->kind == OPS_COLL_ALLGATHER;
    int skip = a->kind == OPS_COLL_REDUCE && a->rank != a->root; /* a reduce writes the root only */
    for (uint64_t done = 0; done < bytes; done += step) {
        uint64_t n = min_u64(bytes - done, step);
        if (!bcast || a->rank == a->root) memcpy(SLOT(w, a, a->rank), send + done, n);
        WAIT(barrier(w, a->rank, a->nranks, deadline));
        if (bcast) {
            if (a->rank != a->root) memcpy(recv + done, SLOT(w, a, a->root), n);
        } else if (gather) {
            for (uint32_t j = 0; j < a->nranks; j++) memcpy(recv + j * bytes + done, SLOT(w, a, j), n);
        } else if (!skip) {
            memcpy(recv + done, SLOT(w, a, 0), n);
            for (uint32_t j = 1; j < a->nranks; j++) reduce_into(recv + done, SLOT(w, a, j), n / a->esize, a->dtype, a->op);
        }
        WAIT(barrier(w, a->rank, a->nranks, deadline));
    }
    return 0;
}

/* reduce-scatter(v) and all-to-all(v): a slot is cut into one part per destination; a round moves
 * at most a part to each. The number of rounds is agreed first (each rank publishes its own, as
 * the counts may differ between ranks). A reduce-scatter receives `count` from every rank and
 * reduces them in rank order. */
static int run_exchange(const struct ops_hccl_args *a, struct hccl_window *w, char *send, char *recv,
                        double deadline) {
    uint32_t R = a->nranks, me = a->rank;
    uint64_t part = a->slot_bytes / R / 64 * 64;
    uint64_t sc[HCCL_MAX_RANKS], sd[HCCL_MAX_RANKS], rc[HCCL_MAX_RANKS], rd[HCCL_MAX_RANKS], most = 0;
    int reduce = a->kind == OPS_COLL_REDUCE_SCATTER;
    for (uint32_t k = 0; k < R; k++) { /* bytes */
        sc[k] = a->sendcounts[k] * a->esize, sd[k] = a->sdispls[k] * a->esize;
        if (reduce) rc[k] = a->count * a->esize, rd[k] = 0;
        else rc[k] = a->recvcounts[k] * a->esize, rd[k] = a->rdispls[k] * a->esize;
        most = sc[k] > most ? sc[k] : most;
        most = rc[k] > most ? rc[k] : most;
    }
    if (part < a->esize) return KERR_ARGS;
    part = part / a->esize * a->esize;
    uint64_t rounds = (most + part - 1) / part;
    atomic_store((_Atomic uint64_t *)&w->ranks[me].aux, rounds);
    WAIT(barrier(w, me, R, deadline));
    for (uint32_t j = 0; j < R; j++) {
        uint64_t v = atomic_load((_Atomic uint64_t *)&w->ranks[j].aux);
        rounds = v > rounds ? v : rounds;
    }
    WAIT(barrier(w, me, R, deadline)); /* aux read by all before reuse */
    for (uint64_t r = 0; r < rounds; r++) {
        uint64_t off = r * part;
        for (uint32_t k = 0; k < R; k++)
            if (off < sc[k]) memcpy(SLOT(w, a, me) + k * part, send + sd[k] + off, min_u64(sc[k] - off, part));
        WAIT(barrier(w, me, R, deadline));
        for (uint32_t j = 0; j < R; j++) {
            if (off >= rc[j]) continue;
            uint64_t n = min_u64(rc[j] - off, part);
            const char *src = SLOT(w, a, j) + me * part;
            if (!reduce) memcpy(recv + rd[j] + off, src, n);
            else if (j == 0) memcpy(recv + off, src, n);
            else reduce_into(recv + off, src, n / a->esize, a->dtype, a->op);
        }
        WAIT(barrier(w, me, R, deadline));
    }
    return 0;
}

/* send / recv: the pair meets on its own counters; the sender stages, the receiver copies. */
static int run_p2p(const struct ops_hccl_args *a, struct hccl_window *w, char *send, char *recv, double deadline) {
    uint64_t bytes = a->count * a->esize, step = a->slot_bytes / a->esize * a->esize;
    int sender = a->kind == OPS_COLL_SEND;
    uint32_t src_rank = sender ? a->rank : a->root;
    for (uint64_t done = 0; done < bytes; done += step) {
        uint64_t n = min_u64(bytes - done, step);
        if (sender) memcpy(SLOT(w, a, a->rank), send + done, n);
        WAIT(pair_barrier(w, a->rank, a->root, deadline));
        if (!sender) memcpy(recv + done, SLOT(w, a, src_rank), n);
        WAIT(pair_barrier(w, a->rank, a->root, deadline));
    }
    return 0;
}

/* The device bytes a kind reads (send) and writes (recv), for the address checks. */
static void extents(const struct ops_hccl_args *a, uint64_t *sbytes, uint64_t *rbytes) {
    uint64_t b = a->count * a->esize;
    *sbytes = *rbytes = b;
    switch (a->kind) {
    case OPS_COLL_ALLGATHER: *rbytes = b * a->nranks; break;
    case OPS_COLL_REDUCE: *rbytes = a->rank == a->root ? b : 0; break;
    case OPS_COLL_SEND: *rbytes = 0; break;
    case OPS_COLL_RECV: *sbytes = 0; break;
    case OPS_COLL_BARRIER: *sbytes = *rbytes = 0; break;
    case OPS_COLL_REDUCE_SCATTER:
    case OPS_COLL_ALLTOALLV:
        *sbytes = 0;
        if (a->kind == OPS_COLL_ALLTOALLV) *rbytes = 0;
        for (uint32_t k = 0; k < a->nranks; k++) {
            uint64_t s = (a->sdispls[k] + a->sendcounts[k]) * a->esize, r = (a->rdispls[k] + a->recvcounts[k]) * a->esize;
            *sbytes = a->sendcounts[k] && s > *sbytes ? s : *sbytes;
            if (a->kind == OPS_COLL_ALLTOALLV) *rbytes = a->recvcounts[k] && r > *rbytes ? r : *rbytes;
        }
        break;
    }
}

KAPI int npusim_hccl_collective(const npusim_kernel_ctx *ctx, const void *args, size_t args_size) {
    if (args_size != sizeof(struct ops_hccl_args)) return KERR_ARGS;
    const struct ops_hccl_args *a = args;
    struct hccl_comm_state *st = (struct hccl_comm_state *)(uintptr_t)a->state;
    _Atomic uint32_t *inflight = (_Atomic uint32_t *)&st->inflight;
    struct hccl_window *w = (struct hccl_window *)(uintptr_t)a->window;
    int rc = 0;
    t_state = st;
    /* Launched before a restore and run after it (it waited at the lock): the window is gone; or
     * the communicator is being destroyed. */
    if (!atomic_load((_Atomic uint32_t *)&st->valid) || atomic_load((_Atomic uint32_t *)&st->abort)) rc = KERR_COMM;
    uint64_t sbytes, rbytes;
    extents(a, &sbytes, &rbytes);
    char *send = sbytes && !rc ? ctx->dev_ptr(ctx, a->send, sbytes) : NULL;
    char *recv = rbytes && !rc ? ctx->dev_ptr(ctx, a->recv, rbytes) : NULL;
    if (!rc && ((sbytes && !send) || (rbytes && !recv))) rc = KERR_ADDR;
    double deadline = now_s() + (double)a->timeout_ms / 1000.0;
    if (!rc) switch (a->kind) {
        case OPS_COLL_ALLREDUCE:
        case OPS_COLL_REDUCE:
        case OPS_COLL_BROADCAST:
        case OPS_COLL_ALLGATHER: rc = run_flat(a, w, send, recv, deadline); break;
        case OPS_COLL_REDUCE_SCATTER:
        case OPS_COLL_ALLTOALLV: rc = run_exchange(a, w, send, recv, deadline); break;
        case OPS_COLL_SEND:
        case OPS_COLL_RECV: rc = run_p2p(a, w, send, recv, deadline); break;
        case OPS_COLL_BARRIER: {
            int r = barrier(w, a->rank, a->nranks, deadline);
            rc = r ? werr(r) : 0;
            break;
        }
        default: rc = KERR_ARGS;
        }
    if (rc == KERR_COMM || rc == KERR_TIMEOUT)
        atomic_store((_Atomic int32_t *)&st->async_error, rc == KERR_COMM ? HCCL_E_UNAVAIL : HCCL_E_TIMEOUT);
    t_state = NULL;
    atomic_fetch_sub(inflight, 1);
    futex_wake(inflight);
    return rc;
}
