/* Kernel arguments shared by the operator library (libopapi.so, opapi.c), HCCL (libhccl.so,
 * hccl.c) and the kernel binaries they launch (kernels.c, hccl_kernel.c). The args are copied by
 * aclrtLaunchKernel (npusim_kernel.h), so they hold values only: device addresses, shapes,
 * strides. Not a public CANN header. */
#ifndef NPUSIM_OPS_ABI_H
#define NPUSIM_OPS_ABI_H
#include <stdint.h>

#define OPS_MAX_DIMS 8

/* This process's side of a communicator, in host memory that outlives it (hccl.c never frees
 * it): whether the communicator may be used, and the collectives launched and not finished. */
struct hccl_comm_state {
    uint32_t valid;      /* 0 once a restore invalidated the communicator */
    uint32_t inflight;   /* futex word: HcclCommDestroy waits for 0 */
    int32_t async_error; /* HcclResult of the last collective that failed on a stream, for
                          * HcclGetCommAsyncError: HCCL_E_UNAVAIL, HCCL_E_TIMEOUT */
    uint32_t abort;      /* HcclCommDestroy: a collective still waiting for its peers gives up */
};

/* An HCCL collective over the communicator's window (hccl.c describes the window; hccl_kernel.c
 * how each kind moves data). Counts and displacements are in elements of dtype. */
enum ops_coll_kind {
    OPS_COLL_ALLREDUCE = 0,      /* recv = op over ranks of send (count) */
    OPS_COLL_BROADCAST = 1,      /* send == recv: root's buffer to every rank (count) */
    OPS_COLL_ALLGATHER = 2,      /* recv[j*count..] = send of rank j */
    OPS_COLL_REDUCE_SCATTER = 3, /* recv (count) = op over ranks j of send_j[sdispls_j[rank]..] */
    OPS_COLL_ALLTOALLV = 4,      /* recv[rdispls[j]..+recvcounts[j]] = send_j[sdispls_j[rank]..] */
    OPS_COLL_SEND = 5,           /* send (count) to rank `root` */
    OPS_COLL_RECV = 6,           /* recv (count) from rank `root` */
    OPS_COLL_BARRIER = 7,        /* no data */
    OPS_COLL_REDUCE = 8,         /* root's recv = op over ranks of send (count) */
};
#define HCCL_MAX_RANKS 32u
struct ops_hccl_args {
    uint64_t state;      /* host address of this process's struct hccl_comm_state */
    uint64_t window;     /* host address of this process's mapping of the communicator's window */
    uint64_t slot_bytes; /* bytes each rank may stage at once */
    uint64_t send, recv; /* device addresses */
    uint64_t count;      /* elements (see the kinds) */
    uint64_t timeout_ms; /* HCCL_EXEC_TIMEOUT */
    uint32_t rank, nranks;
    int32_t dtype, op;   /* HcclDataType, HcclReduceOp (reducing kinds) */
    uint32_t kind;       /* enum ops_coll_kind */
    uint32_t root;       /* broadcast: the source rank; send/recv: the peer */
    uint32_t esize;      /* bytes per element of dtype */
    uint32_t pad;
    /* all-to-all(v) (and the scatter and gather-v made of it), reduce-scatter(v): send side only;
     * in elements */
    uint64_t sendcounts[HCCL_MAX_RANKS], sdispls[HCCL_MAX_RANKS];
    uint64_t recvcounts[HCCL_MAX_RANKS], rdispls[HCCL_MAX_RANKS];
};

/* The window's header: per rank, a barrier generation of the all-rank collectives and a scratch
 * word; per ordered pair (i, j), the number of point-to-point barriers i has passed with j (a
 * send/recv involves two ranks only, so it must not move the all-rank generations). Futex words,
 * shared between the ranks' processes. */
#define HCCL_WINDOW_MAGIC 0x4e505553494d4843ull /* "NPUSIMHC" */
#define HCCL_WINDOW_HEADER 8192u
struct hccl_window_rank {
    uint32_t gen; /* futex word */
    uint32_t pad;
    uint64_t aux; /* a value a rank publishes before a barrier (all-to-all: its rounds) */
    uint32_t pad2[12];
};
struct hccl_window {
    uint64_t magic;
    uint32_t nranks;
    uint32_t pad;
    uint64_t slot_bytes;
    uint64_t pad2[5];
    struct hccl_window_rank ranks[HCCL_MAX_RANKS];
    uint32_t pair[HCCL_MAX_RANKS][HCCL_MAX_RANKS]; /* futex words: pair[i][j] written by i only */
};
_Static_assert(sizeof(struct hccl_window) <= HCCL_WINDOW_HEADER, "the window header");


/* ---------------------------------------------------------------- the generic operator launch
 *
 * Every operator of the generic family (op_*.c) launches the one kernel npusim_op with a
 * variable-length struct ops_args: a header, then ni int64 parameters, then ns double scalars,
 * then nt tensor views with their dtypes (inputs first, outputs last, as the operator's row in
 * ops_list.h says). Values only, as every kernel args block (aclrtLaunchKernel copies it). */

/* aclDataType of acl_base.h (CANN include/external/acl/acl_base.h). */
#define OPS_DT_FLOAT 0
#define OPS_DT_FLOAT16 1
#define OPS_DT_INT8 2
#define OPS_DT_INT32 3
#define OPS_DT_UINT8 4
#define OPS_DT_INT16 6
#define OPS_DT_INT64 9
#define OPS_DT_DOUBLE 11
#define OPS_DT_BOOL 12
#define OPS_DT_BF16 27

/* A strided view of device memory with its element type: element (i0..in) lives at
 * addr + esize(dtype) * (offset + sum(i[d] * stride[d])). */
struct ops_tensor {
    uint64_t addr;
    int64_t offset;
    int32_t ndim;
    int32_t dtype;
    int64_t shape[OPS_MAX_DIMS];
    int64_t stride[OPS_MAX_DIMS];
};

struct ops_args {
    uint32_t op; /* enum ops_op */
    uint32_t nt, ns, ni;
    /* int64_t ints[ni]; double scalars[ns]; struct ops_tensor t[nt]; */
};

#define OPS_ARGS_INTS(a) ((const int64_t *)((const struct ops_args *)(a) + 1))
#define OPS_ARGS_SCALARS(a) ((const double *)(OPS_ARGS_INTS(a) + (a)->ni))
#define OPS_ARGS_TENSORS(a) ((const struct ops_tensor *)(OPS_ARGS_SCALARS(a) + (a)->ns))

#include "ops_list.h"
enum ops_op {
#define OPS_ENUM(id, fn) OPS_OP_##id,
    OPS_KERNELS(OPS_ENUM)
#undef OPS_ENUM
        OPS_OP_COUNT
};

#endif
