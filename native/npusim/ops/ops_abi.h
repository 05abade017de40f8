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
    int32_t pad;
};

/* An HCCL collective over the communicator's window (hccl.c describes the window): an
 * all-reduce, or a broadcast (kind) from rank `root`. */
#define OPS_COLL_ALLREDUCE 0u
#define OPS_COLL_BROADCAST 1u
struct ops_allreduce_args {
    uint64_t state;      /* host address of this process's struct hccl_comm_state */
    uint64_t window;     /* host address of this process's mapping of the communicator's window */
    uint64_t slot_bytes; /* bytes each rank may stage at once */
    uint64_t send, recv; /* device addresses */
    uint64_t count;      /* elements */
    uint64_t timeout_ms; /* HCCL_EXEC_TIMEOUT */
    uint32_t rank, nranks;
    int32_t dtype, op;   /* HcclDataType, HcclReduceOp (all-reduce) */
    uint32_t kind;       /* OPS_COLL_* */
    uint32_t root;       /* broadcast: the rank whose buffer every rank receives */
};

/* The window's header: per rank, a barrier generation (a futex word, shared between the ranks'
 * processes). */
#define HCCL_WINDOW_MAGIC 0x4e505553494d4843ull /* "NPUSIMHC" */
#define HCCL_WINDOW_HEADER 4096u
#define HCCL_MAX_RANKS 32u
struct hccl_window_rank {
    uint32_t gen; /* futex word */
    uint32_t pad[15];
};
struct hccl_window {
    uint64_t magic;
    uint32_t nranks;
    uint32_t pad;
    uint64_t slot_bytes;
    uint64_t pad2[5];
    struct hccl_window_rank ranks[HCCL_MAX_RANKS];
};


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
