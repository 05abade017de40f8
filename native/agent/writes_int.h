/* What the two files of the agent's write tracking share (libnpusnap_agent.so, internal).
 *
 * writes.c      the wrapped writers (tensors, executors, copies, launches, the job's own
 *               allocations) and the tables of what they reach;
 * writes_ops.c  the aclnn operators: their signatures read from CANN's headers, the libffi
 *               closures that record an executor's outputs and stamp them at its launch.
 */
#ifndef NPUSNAP_WRITES_INT_H
#define NPUSNAP_WRITES_INT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef NPUSNAP_HAVE_FFI
#include <ffi.h>
#endif

#define NPUSNAP_CONTRACT_CANN_NAMES /* ACL_ERROR_RT_FEATURE_NOT_SUPPORT: no CANN header is included */
#include "npusnap/contract.h"
#include "npusnap/devmem.h"
#include "realsym.h"

#define API __attribute__((visibility("default")))

typedef int32_t aclnnStatus;
typedef int aclError;

/* devmem.c, devmem_cc.c */
void npusnap_devmem_mark(uintptr_t p, size_t n);
void npusnap_devmem_mark_all(const char *why);
void npusnap_devmem_mark_all_before(void);
void npusnap_devmem_mark_app(uintptr_t p, size_t n);
void npusnap_devmem_untracked(const char *name);
void npusnap_devmem_before_write(uintptr_t p, size_t n);
void npusnap_devmem_before_write_all(void);
void npusnap_devmem_write_open(void);
void npusnap_devmem_write_close(void);
void agent_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));


#define WRITERS(X)                                                                                                  \
    X(CREATE_TENSOR, aclCreateTensor, void *,                                                                       \
      (const int64_t *vd, uint64_t vn, int32_t dt, const int64_t *st, int64_t off, int32_t fmt, const int64_t *sd,   \
       uint64_t sn, void *data),                                                                                     \
      (vd, vn, dt, st, off, fmt, sd, sn, data))                                                                      \
    X(DESTROY_TENSOR, aclDestroyTensor, aclnnStatus, (const void *t), (t))                                          \
    X(CREATE_LIST, aclCreateTensorList, void *, (const void *const *v, uint64_t n), (v, n))                         \
    X(DESTROY_LIST, aclDestroyTensorList, aclnnStatus, (const void *l), (l))                                        \
    X(REPEATABLE, aclSetAclOpExecutorRepeatable, aclnnStatus, (void *e), (e))                                        \
    X(DESTROY_EXEC, aclDestroyAclOpExecutor, aclnnStatus, (void *e), (e))                                            \
    X(MEMCPY, aclrtMemcpy, aclError, (void *d, size_t dm, const void *s, size_t n, int k), (d, dm, s, n, k))        \
    X(MEMCPY_ASYNC, aclrtMemcpyAsync, aclError, (void *d, size_t dm, const void *s, size_t n, int k, void *st),     \
      (d, dm, s, n, k, st))                                                                                          \
    X(MEMCPY2D, aclrtMemcpy2d, aclError,                                                                            \
      (void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, int k), (d, dp, s, sp, w, h, k))            \
    X(MEMCPY2D_ASYNC, aclrtMemcpy2dAsync, aclError,                                                                 \
      (void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, int k, void *st),                           \
      (d, dp, s, sp, w, h, k, st))                                                                                   \
    X(MEMSET, aclrtMemset, aclError, (void *d, size_t dm, int32_t v, size_t n), (d, dm, v, n))                      \
    X(MEMSET_ASYNC, aclrtMemsetAsync, aclError, (void *d, size_t dm, int32_t v, size_t n, void *st),               \
      (d, dm, v, n, st))                                                                                             \
    X(LAUNCH_KERNEL, aclrtLaunchKernel, aclError, (void *f, uint32_t b, const void *a, size_t n, void *st),        \
      (f, b, a, n, st))                                                                                              \
    X(RT_LAUNCH, rtKernelLaunch, int, (const void *f, uint32_t b, void *a, uint32_t n, void *sm, void *st),        \
      (f, b, a, n, sm, st))                                                                                          \
    X(RTS_LAUNCH_HOST_ARGS, rtsLaunchKernelWithHostArgs, int,                                                       \
      (void *f, uint32_t b, void *st, void *cfg, void *a, uint32_t n, void *ph, uint32_t phn),                      \
      (f, b, st, cfg, a, n, ph, phn))                                                                                \
    X(OP_EXEC_V2, aclopExecuteV2, aclError,                                                                         \
      (const char *t, int ni, void *id, void *in, int no, void *od, void *out, void *at, void *st),                  \
      (t, ni, id, in, no, od, out, at, st))                                                                          \
    X(OP_COMPILE_EXEC, aclopCompileAndExecute, aclError,                                                            \
      (const char *t, int ni, void *id, void *in, int no, void *od, void *out, void *at, int e, int c,               \
       const char *p, void *st),                                                                                     \
      (t, ni, id, in, no, od, out, at, e, c, p, st))                                                                 \
    X(OP_COMPILE_EXEC_V2, aclopCompileAndExecuteV2, aclError,                                                       \
      (const char *t, int ni, void *id, void *in, int no, void *od, void *out, void *at, int e, int c,               \
       const char *p, void *st),                                                                                     \
      (t, ni, id, in, no, od, out, at, e, c, p, st))                                                                 \
    X(MALLOC, aclrtMalloc, aclError, (void **p, size_t n, int pol), (p, n, pol))                                    \
    X(MALLOC_ALIGN32, aclrtMallocAlign32, aclError, (void **p, size_t n, int pol), (p, n, pol))                     \
    X(MALLOC_CACHED, aclrtMallocCached, aclError, (void **p, size_t n, int pol), (p, n, pol))                       \
    X(MAP_MEM, aclrtMapMem, aclError, (void *v, size_t n, size_t off, void *h, uint64_t fl), (v, n, off, h, fl))

enum {
#define X(id, name, ret, params, args) W_##id,
    WRITERS(X)
#undef X
    W_N
};

extern const char *const WNAMES[W_N];
extern void *const g_wwrappers[W_N];
extern void *volatile g_wreal[W_N];
#define X(id, name, ret, params, args) API ret name params;
WRITERS(X)
#undef X

struct extent {
    uintptr_t p;
    uint64_t n;
};

/* Tensor lists: descriptor -> its tensors (their extents, as they were when it was made). */
#define L_BUCKETS 4096
struct lnode {
    const void *key;
    size_t n;
    struct extent *e; /* e[i].n == UINT64_MAX: a tensor not seen made */
    struct lnode *next;
};
extern struct lnode *g_lists[L_BUCKETS];
extern pthread_mutex_t g_tmu; /* the tensor and list tables */

/* What the launch of an executor will write, taken before the launch runs. */
struct taken {
    int all;
    size_t n;
    struct extent *e;
};

size_t w_hash_ptr(const void *p, size_t buckets);
int w_tensor_get(const void *t, struct extent *out);
/* Record what the launch of executor key (made by operator op) writes; e is taken over. */
void w_exec_put(const void *key, const void *op, int all, struct extent *e, size_t n);
struct taken w_take(const void *exec, const void *op);
void w_stamp_ranges(const struct taken *t, const char *name);
void w_stamp(struct taken *t, const char *name);
/* Inside an operator's launch: the kernels it launches are its own. */
extern __thread int t_in_op;

#endif
