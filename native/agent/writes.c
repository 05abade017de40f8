/* What the job writes to device memory, as far as its calls say: write tracking for incremental
 * snapshots (docs/device-memory.md, "Write tracking"). devmem.c keeps, per allocation and per
 * piece (NPUSNAP_DEVMEM_PIECE_BYTES), the epoch of the last write it was told of; an incremental
 * save copies only the pieces written since an earlier save. A write this file is not told of
 * would make a later image wrong, so every rule below errs towards "written":
 *
 *  - an aclnn operator writes the tensors its signature names as outputs: the non-const aclTensor
 *    and aclTensorList parameters of its GetWorkspaceSize, and those named ...Ref (CANN declares
 *    an in-place operator's selfRef const: its documentation says "input|output"). The
 *    signatures are read from the CANN install's operator headers ($ASCEND_HOME_PATH/include/
 *    aclnnop, and the custom operators' op_api/include under $ASCEND_OPP_PATH/vendors), once, on
 *    the first operator looked up. GetWorkspaceSize is wrapped through a libffi closure of that
 *    signature, which records the executor's output ranges; the operator's launch (aclnnXxx, the
 *    same four parameters for every operator) stamps them and its workspace before it runs and
 *    again after it returned, so that a save between its call and its return counts them, and a
 *    launch held by the runtime's lock across a save is stamped in the epoch in which it writes;
 *  - a launch whose executor was not recorded (an operator without a parsed signature, an output
 *    tensor this file did not see created, a repeatable executor whose addresses may change), a
 *    raw kernel launch, an aclop execution and every HCCL collective: everything is written;
 *  - copies and memsets (aclrtMemcpy*, aclrtMemset*, the job's drvMemcpy): their destination;
 *  - memory the job did not get through aclrtMalloc* / aclrtMapMem (the runtime's and HCCL's
 *    own): always written;
 *  - a writer-like name looked up that none of the above covers: the process's tracking is
 *    given up for good (every later save is full), and status says which name did it.
 *
 * Everything here is C and a mutex or two on the launch path: no Python, no lock of the runtime.
 */
#define _GNU_SOURCE
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

/* devmem.c */
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

/* ------------------------------------------------------------------ the real functions */

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

static const char *const WNAMES[W_N] = {
#define X(id, name, ret, params, args) #name,
    WRITERS(X)
#undef X
};

#define X(id, name, ret, params, args) API ret name params;
WRITERS(X)
#undef X

static void *const g_wwrappers[W_N] = {
#define X(id, name, ret, params, args) (void *)name,
    WRITERS(X)
#undef X
};

static void *volatile g_wreal[W_N];

static int is_wwrapper(void *p) {
    for (int i = 0; i < W_N; i++)
        if (g_wwrappers[i] == p) return 1;
    return 0;
}

static void *wreal(int i) {
    static const char *const libs[] = {"libopapi.so",   "libnnopbase.so",   "libacl_rt.so",        "libascendcl.so",
                                       "libruntime.so", "libacl_op_compiler.so", "libascend_hal.so"};
    void *p = g_wreal[i];
    if (p) return p;
    p = npusnap_next_definition(WNAMES[i], libs, sizeof libs / sizeof libs[0], is_wwrapper);
    if (p) g_wreal[i] = p;
    return p;
}

/* ------------------------------------------------------------------ pointer tables */

static size_t hash_ptr(const void *p, size_t buckets) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (size_t)(x & (buckets - 1));
}

struct extent {
    uintptr_t p;
    uint64_t n;
};

/* Tensors: descriptor -> the device bytes it may reach. */
#define T_BUCKETS 65536
struct tnode {
    const void *key;
    struct extent e;
    struct tnode *next;
};
static struct tnode *g_tensors[T_BUCKETS];
static pthread_mutex_t g_tmu = PTHREAD_MUTEX_INITIALIZER;

/* Tensor lists: descriptor -> its tensors (their extents, as they were when it was made). */
#define L_BUCKETS 4096
struct lnode {
    const void *key;
    size_t n;
    struct extent *e; /* e[i].n == UINT64_MAX: a tensor not seen made */
    struct lnode *next;
};
static struct lnode *g_lists[L_BUCKETS];

/* Executors: what their launch writes. */
#define E_BUCKETS 16384
struct enode {
    const void *key;
    const void *op; /* the operator whose GetWorkspaceSize made it */
    int all;        /* its writes are not known: everything */
    int repeatable;
    size_t n;
    struct extent *e;
    struct enode *next;
};
static struct enode *g_execs[E_BUCKETS];
static pthread_mutex_t g_emu = PTHREAD_MUTEX_INITIALIZER;

/* aclDataType (acl_base.h) -> bytes per element; an unknown type counts 16 (never too few). */
static uint64_t dtype_bytes(int32_t dt) {
    switch (dt) {
    case 0: case 3: case 8: case 33: return 4;          /* FLOAT, INT32, UINT32, COMPLEX32 */
    case 1: case 6: case 7: case 27: return 2;          /* FLOAT16, INT16, UINT16, BF16 */
    case 2: case 4: case 12: case 29: case 30: return 1; /* INT8, UINT8, BOOL, INT4, UINT1 */
    case 34: case 35: case 36: case 37: case 38: case 39: case 40: case 41: return 1; /* 8/6/4-bit floats */
    case 9: case 10: case 11: case 16: return 8;        /* INT64, UINT64, DOUBLE, COMPLEX64 */
    case 17: return 16;                                  /* COMPLEX128 */
    default: return 16;
    }
}

/* The bytes a tensor may reach from its storage address: the larger of its storage and the span
 * of its view (offset and strides), in elements of its type. */
static struct extent tensor_extent(const int64_t *vd, uint64_t vn, int32_t dt, const int64_t *st, int64_t off,
                                   const int64_t *sd, uint64_t sn, void *data) {
    uint64_t storage = 1, span = 1;
    for (uint64_t i = 0; sd && i < sn; i++) storage *= sd[i] > 0 ? (uint64_t)sd[i] : 0;
    for (uint64_t i = 0; vd && i < vn; i++) {
        if (vd[i] <= 0) {
            span = 0;
            break;
        }
        int64_t s = st ? st[i] : 1;
        span += (uint64_t)(vd[i] - 1) * (uint64_t)(s < 0 ? -s : s);
    }
    uint64_t view_end = span ? (uint64_t)(off > 0 ? off : 0) + span : 0;
    uint64_t elems = storage > view_end ? storage : view_end;
    return (struct extent){(uintptr_t)data, elems * dtype_bytes(dt)};
}

static int tensor_get(const void *t, struct extent *out) {
    int found = 0;
    pthread_mutex_lock(&g_tmu);
    for (struct tnode *n = g_tensors[hash_ptr(t, T_BUCKETS)]; n; n = n->next)
        if (n->key == t) {
            *out = n->e;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&g_tmu);
    return found;
}

/* ------------------------------------------------------------------ the wrappers */

/* A wrapped name whose real function is in no loaded library: never "success" for a call that
 * did nothing. */
#define REALW(idx, ret, params)                   \
    ret(*fn) params = (ret(*) params)wreal(idx);  \
    if (!fn) return (ret)missing(idx)

static int missing(int i) {
    agent_log("[writes] %s is not exported by the loaded CANN libraries", WNAMES[i]);
    return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
}

API void *aclCreateTensor(const int64_t *vd, uint64_t vn, int32_t dt, const int64_t *st, int64_t off, int32_t fmt,
                          const int64_t *sd, uint64_t sn, void *data) {
    void *(*fn)(const int64_t *, uint64_t, int32_t, const int64_t *, int64_t, int32_t, const int64_t *, uint64_t,
                void *) = (void *(*)(const int64_t *, uint64_t, int32_t, const int64_t *, int64_t, int32_t,
                                     const int64_t *, uint64_t, void *))wreal(W_CREATE_TENSOR);
    if (!fn) return NULL;
    void *t = fn(vd, vn, dt, st, off, fmt, sd, sn, data);
    if (!t) return t;
    struct tnode *n = malloc(sizeof *n);
    if (!n) {
        npusnap_devmem_untracked("aclCreateTensor (out of memory)");
        return t;
    }
    n->key = t;
    n->e = tensor_extent(vd, vn, dt, st, off, sd, sn, data);
    pthread_mutex_lock(&g_tmu);
    size_t b = hash_ptr(t, T_BUCKETS);
    struct tnode **pp = &g_tensors[b];
    while (*pp && (*pp)->key != t) pp = &(*pp)->next;
    if (*pp) { /* the descriptor's address again (its destroy was not seen) */
        (*pp)->e = n->e;
        free(n);
    } else {
        n->next = g_tensors[b];
        g_tensors[b] = n;
    }
    pthread_mutex_unlock(&g_tmu);
    return t;
}

API aclnnStatus aclDestroyTensor(const void *t) {
    REALW(W_DESTROY_TENSOR, aclnnStatus, (const void *));
    pthread_mutex_lock(&g_tmu);
    for (struct tnode **pp = &g_tensors[hash_ptr(t, T_BUCKETS)]; *pp; pp = &(*pp)->next)
        if ((*pp)->key == t) {
            struct tnode *n = *pp;
            *pp = n->next;
            free(n);
            break;
        }
    pthread_mutex_unlock(&g_tmu);
    return fn(t);
}

API void *aclCreateTensorList(const void *const *v, uint64_t count) {
    void *(*fn)(const void *const *, uint64_t) = (void *(*)(const void *const *, uint64_t))wreal(W_CREATE_LIST);
    if (!fn) return NULL;
    void *l = fn(v, count);
    if (!l) return l;
    struct lnode *n = calloc(1, sizeof *n);
    struct extent *e = calloc(count ? count : 1, sizeof *e);
    if (!n || !e) {
        free(n);
        free(e);
        npusnap_devmem_untracked("aclCreateTensorList (out of memory)");
        return l;
    }
    for (uint64_t i = 0; i < count; i++)
        if (!v || !v[i] || !tensor_get(v[i], &e[i])) e[i] = (struct extent){0, v && v[i] ? UINT64_MAX : 0};
    n->key = l;
    n->n = count;
    n->e = e;
    pthread_mutex_lock(&g_tmu);
    size_t b = hash_ptr(l, L_BUCKETS);
    n->next = g_lists[b];
    g_lists[b] = n;
    pthread_mutex_unlock(&g_tmu);
    return l;
}

API aclnnStatus aclDestroyTensorList(const void *l) {
    REALW(W_DESTROY_LIST, aclnnStatus, (const void *));
    pthread_mutex_lock(&g_tmu);
    for (struct lnode **pp = &g_lists[hash_ptr(l, L_BUCKETS)]; *pp; pp = &(*pp)->next)
        if ((*pp)->key == l) {
            struct lnode *n = *pp;
            *pp = n->next;
            free(n->e);
            free(n);
            break;
        }
    pthread_mutex_unlock(&g_tmu);
    return fn(l);
}

static void exec_drop_locked(const void *e) {
    for (struct enode **pp = &g_execs[hash_ptr(e, E_BUCKETS)]; *pp; pp = &(*pp)->next)
        if ((*pp)->key == e) {
            struct enode *n = *pp;
            *pp = n->next;
            free(n->e);
            free(n);
            return;
        }
}

static void exec_put(const void *key, const void *op, int all, struct extent *e, size_t n) {
    struct enode *node = calloc(1, sizeof *node);
    if (!node) {
        free(e);
        return; /* not recorded: its launch marks everything */
    }
    *node = (struct enode){key, op, all, 0, n, e, NULL};
    pthread_mutex_lock(&g_emu);
    exec_drop_locked(key);
    size_t b = hash_ptr(key, E_BUCKETS);
    node->next = g_execs[b];
    g_execs[b] = node;
    pthread_mutex_unlock(&g_emu);
}

API aclnnStatus aclSetAclOpExecutorRepeatable(void *e) {
    REALW(W_REPEATABLE, aclnnStatus, (void *));
    aclnnStatus rc = fn(e);
    pthread_mutex_lock(&g_emu);
    for (struct enode *n = g_execs[hash_ptr(e, E_BUCKETS)]; n; n = n->next)
        if (n->key == e) {
            /* Its addresses may be changed before each launch (aclSetInputTensorAddr ...). */
            n->repeatable = 1;
            n->all = 1;
        }
    pthread_mutex_unlock(&g_emu);
    return rc;
}

API aclnnStatus aclDestroyAclOpExecutor(void *e) {
    REALW(W_DESTROY_EXEC, aclnnStatus, (void *));
    pthread_mutex_lock(&g_emu);
    exec_drop_locked(e);
    pthread_mutex_unlock(&g_emu);
    return fn(e);
}

/* What the launch of an executor will write, taken before the launch runs: the launch may free a
 * non-repeatable executor, whose address another thread's next GetWorkspaceSize may get at once. */
struct taken {
    int all;
    size_t n;
    struct extent *e;
};

static struct taken take(const void *exec, const void *op) {
    struct taken t = {1, 0, NULL};
    pthread_mutex_lock(&g_emu);
    for (struct enode **pp = &g_execs[hash_ptr(exec, E_BUCKETS)]; *pp; pp = &(*pp)->next) {
        struct enode *node = *pp;
        if (node->key != exec) continue;
        if (node->op == op) {
            t.all = node->all;
            if (!t.all && node->repeatable) {
                t.e = node->n ? malloc(node->n * sizeof *t.e) : NULL;
                if (node->n && !t.e) t.all = 1;
                else if (node->n) memcpy(t.e, node->e, node->n * sizeof *t.e);
                t.n = node->n;
            } else if (!node->repeatable) {
                *pp = node->next;
                t.e = node->e;
                t.n = node->n;
                free(node);
            }
        }
        break;
    }
    pthread_mutex_unlock(&g_emu);
    return t;
}

/* Stamp what a launch writes, in the epoch current now (name NULL: before the call, not counted
 * as a call that wrote everything). Done before the call and again after it returned, since a
 * save may end the epoch between the two. Before: a save that comes after the call queued its
 * work but before the stamp after it (the thread preempted right there; Lock waits for calls
 * inside the runtime, not for this) drains that work into its cut, so it must count the pieces
 * as written. After: a launch held by the runtime's lock across a save writes in the next epoch,
 * which the next save must copy. Stamping twice only ever copies a piece more. */
static void stamp_ranges(const struct taken *t, const char *name) {
    if (t->all && name) npusnap_devmem_mark_all(name);
    else if (t->all) npusnap_devmem_mark_all_before();
    else
        for (size_t i = 0; i < t->n; i++) npusnap_devmem_mark(t->e[i].p, (size_t)t->e[i].n);
}

/* After the launch returned: stamp what it writes (in the epoch it writes in), and let go. */
static void stamp(struct taken *t, const char *name) {
    stamp_ranges(t, name);
    free(t->e);
    t->e = NULL;
}

/* A concurrent copy takes the destination first; the write is stamped before the call and once
 * it returned (stamp_ranges says why). */
#define STAMP_AFTER(call, dst, len)                               \
    npusnap_devmem_write_open();                                  \
    npusnap_devmem_before_write((uintptr_t)(dst), (size_t)(len)); \
    npusnap_devmem_mark((uintptr_t)(dst), (size_t)(len));         \
    aclError rc_ = call;                                          \
    npusnap_devmem_write_close();                                 \
    npusnap_devmem_mark((uintptr_t)(dst), (size_t)(len));         \
    return rc_

API aclError aclrtMemcpy(void *d, size_t dm, const void *s, size_t n, int k) {
    REALW(W_MEMCPY, aclError, (void *, size_t, const void *, size_t, int));
    STAMP_AFTER(fn(d, dm, s, n, k), d, n);
}
API aclError aclrtMemcpyAsync(void *d, size_t dm, const void *s, size_t n, int k, void *st) {
    REALW(W_MEMCPY_ASYNC, aclError, (void *, size_t, const void *, size_t, int, void *));
    STAMP_AFTER(fn(d, dm, s, n, k, st), d, n);
}
API aclError aclrtMemcpy2d(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, int k) {
    REALW(W_MEMCPY2D, aclError, (void *, size_t, const void *, size_t, size_t, size_t, int));
    STAMP_AFTER(fn(d, dp, s, sp, w, h, k), d, dp * h);
}
API aclError aclrtMemcpy2dAsync(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h, int k, void *st) {
    REALW(W_MEMCPY2D_ASYNC, aclError, (void *, size_t, const void *, size_t, size_t, size_t, int, void *));
    STAMP_AFTER(fn(d, dp, s, sp, w, h, k, st), d, dp * h);
}
API aclError aclrtMemset(void *d, size_t dm, int32_t v, size_t n) {
    REALW(W_MEMSET, aclError, (void *, size_t, int32_t, size_t));
    STAMP_AFTER(fn(d, dm, v, n), d, n);
}
API aclError aclrtMemsetAsync(void *d, size_t dm, int32_t v, size_t n, void *st) {
    REALW(W_MEMSET_ASYNC, aclError, (void *, size_t, int32_t, size_t, void *));
    STAMP_AFTER(fn(d, dm, v, n, st), d, n);
}

/* Inside an operator's launch (launch_handler): the kernels it launches through the runtime are
 * that operator's, whose writes its launch stamps. */
static __thread int t_in_op;

#define ALL_AFTER(call, name)                         \
    int mine_ = !t_in_op;                             \
    if (mine_) npusnap_devmem_write_open();           \
    if (mine_) npusnap_devmem_before_write_all();     \
    if (mine_) npusnap_devmem_mark_all_before();      \
    __typeof__(call) rc_ = call;                      \
    if (mine_) npusnap_devmem_write_close();          \
    if (mine_) npusnap_devmem_mark_all(name);         \
    return rc_

API aclError aclrtLaunchKernel(void *f, uint32_t b, const void *a, size_t n, void *st) {
    REALW(W_LAUNCH_KERNEL, aclError, (void *, uint32_t, const void *, size_t, void *));
    ALL_AFTER(fn(f, b, a, n, st), "aclrtLaunchKernel");
}
API int rtKernelLaunch(const void *f, uint32_t b, void *a, uint32_t n, void *sm, void *st) {
    REALW(W_RT_LAUNCH, int, (const void *, uint32_t, void *, uint32_t, void *, void *));
    ALL_AFTER(fn(f, b, a, n, sm, st), "rtKernelLaunch");
}
API int rtsLaunchKernelWithHostArgs(void *f, uint32_t b, void *st, void *cfg, void *a, uint32_t n, void *ph,
                                   uint32_t phn) {
    REALW(W_RTS_LAUNCH_HOST_ARGS, int, (void *, uint32_t, void *, void *, void *, uint32_t, void *, uint32_t));
    ALL_AFTER(fn(f, b, st, cfg, a, n, ph, phn), "rtsLaunchKernelWithHostArgs");
}
API aclError aclopExecuteV2(const char *t, int ni, void *id, void *in, int no, void *od, void *out, void *at,
                            void *st) {
    REALW(W_OP_EXEC_V2, aclError, (const char *, int, void *, void *, int, void *, void *, void *, void *));
    ALL_AFTER(fn(t, ni, id, in, no, od, out, at, st), "aclopExecuteV2");
}
API aclError aclopCompileAndExecute(const char *t, int ni, void *id, void *in, int no, void *od, void *out, void *at,
                                    int e, int c, const char *p, void *st) {
    REALW(W_OP_COMPILE_EXEC, aclError,
          (const char *, int, void *, void *, int, void *, void *, void *, int, int, const char *, void *));
    ALL_AFTER(fn(t, ni, id, in, no, od, out, at, e, c, p, st), "aclopCompileAndExecute");
}
API aclError aclopCompileAndExecuteV2(const char *t, int ni, void *id, void *in, int no, void *od, void *out,
                                      void *at, int e, int c, const char *p, void *st) {
    REALW(W_OP_COMPILE_EXEC_V2, aclError,
          (const char *, int, void *, void *, int, void *, void *, void *, int, int, const char *, void *));
    ALL_AFTER(fn(t, ni, id, in, no, od, out, at, e, c, p, st), "aclopCompileAndExecuteV2");
}

/* The job's own allocations: their writes are tracked (what the runtime allocates for itself
 * is not, and counts as always written). */
#define APP_ALLOC(idx, name)                                             \
    API aclError name(void **p, size_t n, int pol) {                     \
        REALW(idx, aclError, (void **, size_t, int));                    \
        aclError rc = fn(p, n, pol);                                     \
        if (rc == 0 && p && *p) npusnap_devmem_mark_app((uintptr_t)*p, n); \
        return rc;                                                       \
    }
APP_ALLOC(W_MALLOC, aclrtMalloc)
APP_ALLOC(W_MALLOC_ALIGN32, aclrtMallocAlign32)
APP_ALLOC(W_MALLOC_CACHED, aclrtMallocCached)

API aclError aclrtMapMem(void *v, size_t n, size_t off, void *h, uint64_t fl) {
    REALW(W_MAP_MEM, aclError, (void *, size_t, size_t, void *, uint64_t));
    aclError rc = fn(v, n, off, h, fl);
    if (rc == 0) npusnap_devmem_mark_app((uintptr_t)v, n);
    return rc;
}

/* ------------------------------------------------------------------ operator signatures */

enum { A_PTR, A_I8, A_U8, A_I16, A_U16, A_I32, A_U32, A_I64, A_U64, A_F32, A_F64 };
#define MAX_ARGS 48
#define NAME_MAX_LEN 128

struct op {
    char name[NAME_MAX_LEN]; /* aclnnXxx */
    int parsed;              /* its GetWorkspaceSize's signature was read from a header */
    int nargs;
    unsigned char type[MAX_ARGS];
    uint64_t out_tensor, out_list; /* bit i: parameter i is written (aclTensor*, aclTensorList*) */
    int opaque;                    /* a parameter reaches tensors this file cannot follow */
    void *real_gws, *real_launch;
    void *code_gws, *code_launch;
#ifdef NPUSNAP_HAVE_FFI
    ffi_cif cif;
    ffi_type *ft[MAX_ARGS];
#endif
    struct op *next;
};

static pthread_mutex_t g_omu = PTHREAD_MUTEX_INITIALIZER;
static struct op *g_ops; /* never freed: closures point at them */
static int g_sigs_read;
static size_t g_nsigs;

static struct op *op_find_locked(const char *name) {
    for (struct op *o = g_ops; o; o = o->next)
        if (!strcmp(o->name, name)) return o;
    return NULL;
}

static struct op *op_get_locked(const char *name) {
    struct op *o = op_find_locked(name);
    if (o || strlen(name) >= NAME_MAX_LEN) return o;
    o = calloc(1, sizeof *o);
    if (!o) return NULL;
    snprintf(o->name, sizeof o->name, "%s", name);
    o->next = g_ops;
    g_ops = o;
    return o;
}

static int is_ident(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

static int has_word(const char *s, size_t n, const char *w) {
    size_t wl = strlen(w);
    for (size_t i = 0; i + wl <= n; i++)
        if (!memcmp(s + i, w, wl) && (i == 0 || !is_ident(s[i - 1])) && (i + wl == n || !is_ident(s[i + wl])))
            return 1;
    return 0;
}

/* One parameter "TYPE NAME" (no default values in C). Returns its class; *tensor / *list are set
 * when it is an aclTensor* / aclTensorList* the operator writes; *opaque when it reaches tensors
 * in a way that is not followed. */
static int param_class(const char *s, size_t n, int *tensor, int *list, int *opaque) {
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n')) n--;
    while (n && (*s == ' ' || *s == '\t' || *s == '\n')) s++, n--;
    size_t e = n;
    while (e && is_ident(s[e - 1])) e--; /* the parameter's name: s[e..n) */
    const char *pname = s + e;
    size_t plen = n - e;
    size_t stars = 0;
    for (size_t i = 0; i < e; i++) stars += s[i] == '*';
    int is_list = has_word(s, e, "aclTensorList");
    int is_tensor = has_word(s, e, "aclTensor");
    *tensor = *list = 0;
    if (stars) {
        if ((is_tensor || is_list) && stars > 1) *opaque = 1;
        else if (is_tensor || is_list) {
            /* const before the star: an input, unless its name says it is written: CANN names
             * an in-place operand ...Ref and declares it const (its documentation says
             * "input|output"), and some declare an output list const ("out", "...Out"). */
            const char *star = memchr(s, '*', e);
            int is_const = has_word(s, (size_t)(star - s), "const");
            int named = memmem(pname, plen, "Ref", 3) || memmem(pname, plen, "Out", 3) ||
                        (plen >= 3 && !memcmp(pname, "out", 3));
            if (!is_const || named) {
                if (is_list) *list = 1;
                else *tensor = 1;
            }
        }
        return A_PTR;
    }
    if (has_word(s, e, "double")) return A_F64;
    if (has_word(s, e, "float")) return A_F32;
    if (has_word(s, e, "int64_t") || has_word(s, e, "long")) return A_I64;
    if (has_word(s, e, "uint64_t") || has_word(s, e, "size_t")) return A_U64;
    if (has_word(s, e, "int32_t") || has_word(s, e, "int")) return A_I32;
    if (has_word(s, e, "uint32_t") || has_word(s, e, "unsigned")) return A_U32;
    if (has_word(s, e, "int16_t") || has_word(s, e, "short")) return A_I16;
    if (has_word(s, e, "uint16_t")) return A_U16;
    if (has_word(s, e, "int8_t") || has_word(s, e, "char")) return A_I8;
    if (has_word(s, e, "uint8_t") || has_word(s, e, "bool")) return A_U8;
    return A_I32; /* an enum (aclDataType, aclFormat, ...) */
}

/* The index of the first aclTensor* parameter in "[a, close)" (0 if none). */
static int first_tensor_arg(const char *a, const char *close) {
    for (int i = 0; a < close; i++) {
        const char *comma = memchr(a, ',', (size_t)(close - a));
        const char *end = comma ? comma : close;
        if (has_word(a, (size_t)(end - a), "aclTensor")) return i;
        if (!comma) break;
        a = end + 1;
    }
    return 0;
}

/* Every "aclnnXxxGetWorkspaceSize(...)" declaration of one header. */
static void parse_header(const char *buf, size_t len) {
    static const char suffix[] = "GetWorkspaceSize";
    for (const char *p = buf; (p = memmem(p, len - (size_t)(p - buf), suffix, sizeof suffix - 1)); p++) {
        const char *paren = p + sizeof suffix - 1;
        while (paren < buf + len && (*paren == ' ' || *paren == '\n')) paren++;
        if (paren >= buf + len || *paren != '(') continue;
        const char *start = p;
        while (start > buf && is_ident(start[-1])) start--;
        size_t nlen = (size_t)(p - start);
        if (nlen < 6 || nlen >= NAME_MAX_LEN || memcmp(start, "aclnn", 5) != 0) continue;
        const char *close = memchr(paren, ')', len - (size_t)(paren - buf));
        if (!close) return;
        /* Only plain parameter lists: a function pointer, an array or "..." is not followed
         * (the operator is then not wrapped, and its launch counts as writing everything). */
        const char *end = close + 1;
        while (end < buf + len && (*end == ' ' || *end == '\n' || *end == '\t')) end++;
        if (memchr(paren + 1, '(', (size_t)(close - paren - 1)) || memchr(paren + 1, '[', (size_t)(close - paren - 1)) ||
            memmem(paren + 1, (size_t)(close - paren - 1), "...", 3) || end >= buf + len || (*end != ';' && *end != '{'))
            continue;
        char name[NAME_MAX_LEN];
        memcpy(name, start, nlen);
        name[nlen] = 0;
        struct op tmp;
        memset(&tmp, 0, sizeof tmp);
        const char *a = paren + 1;
        int ok = 1;
        while (a < close && tmp.nargs < MAX_ARGS) {
            const char *comma = memchr(a, ',', (size_t)(close - a));
            const char *end = comma ? comma : close;
            int t = 0, l = 0;
            tmp.type[tmp.nargs] = (unsigned char)param_class(a, (size_t)(end - a), &t, &l, &tmp.opaque);
            if (t) tmp.out_tensor |= 1ull << tmp.nargs;
            if (l) tmp.out_list |= 1ull << tmp.nargs;
            tmp.nargs++;
            a = end + 1;
            if (!comma) break;
        }
        /* An in-place operator writes its first tensor whatever its declaration says. */
        if (!strncmp(name, "aclnnInplace", 12))
            for (int i = 0; i < tmp.nargs; i++)
                if (tmp.type[i] == A_PTR && has_word(paren, (size_t)(close - paren), "aclTensor")) {
                    tmp.out_tensor |= 1ull << first_tensor_arg(paren + 1, close);
                    break;
                }
        /* ..., uint64_t *workspaceSize, aclOpExecutor **executor */
        if (a < close || tmp.nargs < 2 || tmp.type[tmp.nargs - 1] != A_PTR || tmp.type[tmp.nargs - 2] != A_PTR) ok = 0;
        if (!ok) continue;
        pthread_mutex_lock(&g_omu);
        struct op *o = op_get_locked(name);
        if (o && !o->parsed) {
            o->parsed = 1;
            o->nargs = tmp.nargs;
            memcpy(o->type, tmp.type, sizeof tmp.type);
            o->out_tensor = tmp.out_tensor;
            o->out_list = tmp.out_list;
            o->opaque = tmp.opaque;
            g_nsigs++;
        }
        pthread_mutex_unlock(&g_omu);
        p = close;
    }
}

static void read_headers(const char *dir, int depth) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat st;
        if (stat(path, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            if (depth > 0) read_headers(path, depth - 1);
            continue;
        }
        size_t nl = strlen(de->d_name);
        if (!S_ISREG(st.st_mode) || nl < 3 || strcmp(de->d_name + nl - 2, ".h") != 0 || st.st_size > (4 << 20)) continue;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        char *buf = malloc((size_t)st.st_size + 1);
        ssize_t got = buf ? read(fd, buf, (size_t)st.st_size) : -1;
        close(fd);
        if (got > 0) parse_header(buf, (size_t)got);
        free(buf);
    }
    closedir(d);
}

static void read_signatures(void) {
    const char *home = getenv("ASCEND_HOME_PATH");
    const char *opp = getenv("ASCEND_OPP_PATH");
    char dir[4096];
    if (home && *home) {
        snprintf(dir, sizeof dir, "%s/include/aclnnop", home);
        read_headers(dir, 2);
    }
    if (opp && *opp) {
        snprintf(dir, sizeof dir, "%s/vendors", opp);
        DIR *d = opendir(dir);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (de->d_name[0] == '.') continue;
            char inc[4096];
            snprintf(inc, sizeof inc, "%s/%s/op_api/include", dir, de->d_name);
            read_headers(inc, 1);
        }
        if (d) closedir(d);
    }
    agent_log("[writes] %zu operator signatures read from the CANN install's headers", g_nsigs);
}

static pthread_once_t g_sigs_once = PTHREAD_ONCE_INIT;
static void sigs_once(void) {
    read_signatures();
    g_sigs_read = 1;
}

#ifdef NPUSNAP_HAVE_FFI
static ffi_type *ffi_of(int t) {
    switch (t) {
    case A_I8: return &ffi_type_sint8;
    case A_U8: return &ffi_type_uint8;
    case A_I16: return &ffi_type_sint16;
    case A_U16: return &ffi_type_uint16;
    case A_I32: return &ffi_type_sint32;
    case A_U32: return &ffi_type_uint32;
    case A_I64: return &ffi_type_sint64;
    case A_U64: return &ffi_type_uint64;
    case A_F32: return &ffi_type_float;
    case A_F64: return &ffi_type_double;
    default: return &ffi_type_pointer;
    }
}

static void add_extent(struct extent **e, size_t *n, size_t *cap, struct extent x, int *all) {
    if (x.n == UINT64_MAX) {
        *all = 1;
        return;
    }
    if (!x.n) return;
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 8;
        struct extent *ne = realloc(*e, c * sizeof *ne);
        if (!ne) {
            *all = 1;
            return;
        }
        *e = ne;
        *cap = c;
    }
    (*e)[(*n)++] = x;
}

/* GetWorkspaceSize: call it, then record what the executor it made will write. */
static void gws_handler(ffi_cif *cif, void *ret, void **args, void *ud) {
    struct op *o = ud;
    ffi_call(cif, FFI_FN(o->real_gws), ret, args);
    if ((aclnnStatus)*(ffi_sarg *)ret != 0) return;
    void **exec_pp = *(void ***)args[o->nargs - 1];
    if (!exec_pp || !*exec_pp) return;
    struct extent *e = NULL;
    size_t n = 0, cap = 0;
    int all = o->opaque;
    for (int i = 0; i < o->nargs && !all; i++) {
        if (o->out_tensor >> i & 1) {
            const void *t = *(void **)args[i];
            struct extent x;
            if (!t) continue; /* an optional output not asked for */
            if (!tensor_get(t, &x)) x.n = UINT64_MAX; /* made behind the agent's back */
            add_extent(&e, &n, &cap, x, &all);
        } else if (o->out_list >> i & 1) {
            const void *l = *(void **)args[i];
            if (!l) continue;
            int found = 0;
            pthread_mutex_lock(&g_tmu);
            for (struct lnode *ln = g_lists[hash_ptr(l, L_BUCKETS)]; ln; ln = ln->next)
                if (ln->key == l) {
                    found = 1;
                    for (size_t k = 0; k < ln->n && !all; k++) add_extent(&e, &n, &cap, ln->e[k], &all);
                    break;
                }
            pthread_mutex_unlock(&g_tmu);
            if (!found) all = 1;
        }
    }
    if (all) {
        free(e);
        e = NULL;
        n = 0;
    }
    exec_put(*exec_pp, o, all, e, n);
}

/* The operator's launch: call it, then stamp what its executor writes. */
static ffi_cif g_launch_cif;
static ffi_type *g_launch_types[4];

static void launch_handler(ffi_cif *cif, void *ret, void **args, void *ud) {
    struct op *o = ud;
    struct taken t = take(*(void **)args[2], o);
    /* A concurrent copy takes what the kernels will write first. */
    npusnap_devmem_write_open();
    if (t.all) npusnap_devmem_before_write_all();
    for (size_t i = 0; i < t.n; i++) npusnap_devmem_before_write(t.e[i].p, (size_t)t.e[i].n);
    npusnap_devmem_before_write((uintptr_t)*(void **)args[0], (size_t)*(uint64_t *)args[1]);
    stamp_ranges(&t, NULL); /* and again after the call: stamp_ranges says why */
    npusnap_devmem_mark((uintptr_t)*(void **)args[0], (size_t)*(uint64_t *)args[1]);
    t_in_op++;
    ffi_call(cif, FFI_FN(o->real_launch), ret, args);
    t_in_op--;
    npusnap_devmem_write_close();
    stamp(&t, o->name);
    /* Its workspace (the caller's device memory) is the kernels' scratch: written too. */
    npusnap_devmem_mark((uintptr_t)*(void **)args[0], (size_t)*(uint64_t *)args[1]);
}

static pthread_once_t g_launch_once = PTHREAD_ONCE_INIT;
static int g_launch_ok;
static void launch_cif_init(void) {
    g_launch_types[0] = &ffi_type_pointer;
    g_launch_types[1] = &ffi_type_uint64;
    g_launch_types[2] = &ffi_type_pointer;
    g_launch_types[3] = &ffi_type_pointer;
    g_launch_ok = ffi_prep_cif(&g_launch_cif, FFI_DEFAULT_ABI, 4, &ffi_type_sint32, g_launch_types) == FFI_OK;
}

static void *make_closure(ffi_cif *cif, void (*fn)(ffi_cif *, void *, void **, void *), void *ud) {
    void *code = NULL;
    ffi_closure *cl = ffi_closure_alloc(sizeof(ffi_closure), &code);
    if (!cl) return NULL;
    if (ffi_prep_closure_loc(cl, cif, fn, ud, code) != FFI_OK) {
        ffi_closure_free(cl);
        return NULL;
    }
    return code;
}
#endif

/* Names that write device memory but are none of the above: looking one up gives the tracking
 * up (the process's later saves are full). */
static int writer_like(const char *n) {
    static const char *const prefixes[] = {"aclrtMemcpy", "aclrtMemset", "aclrtLaunch", "aclrtCmo", "aclrtReduce",
                                           "aclrtValueWrite", "rtKernelLaunch", "rtLaunch", "rtMemcpy", "rtMemset",
                                           "rtsLaunch", "rtsMemcpy", "aclopExecute", "aclopCompileAndExecute",
                                           "aclmdlExecute", "aclmdlRIExecute", "aclSetInputTensorAddr",
                                           "aclSetOutputTensorAddr", "aclSetDynamicInputTensorAddr",
                                           "aclSetDynamicOutputTensorAddr", "aclSetTensorAddr", "aclInitTensor"};
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
        if (!strncmp(n, prefixes[i], strlen(prefixes[i]))) return 1;
    return 0;
}

/* dlsym(handle, name) found p: the wrapper to hand out instead, or NULL (p as it is). */
void *npusnap_writes_wrapper_for(void *handle, const char *name, void *p, dlsym_fn ds) {
    if (!p) return NULL;
    for (int i = 0; i < W_N; i++)
        if (!strcmp(name, WNAMES[i])) {
            if (p == g_wwrappers[i]) return p;
            if (!g_wreal[i]) g_wreal[i] = p;
            return g_wwrappers[i];
        }
    if (strncmp(name, "aclnn", 5) != 0) {
        if (writer_like(name)) npusnap_devmem_untracked(name);
        return NULL;
    }
#ifdef NPUSNAP_HAVE_FFI
    size_t nl = strlen(name);
    static const char suffix[] = "GetWorkspaceSize";
    size_t sl = sizeof suffix - 1;
    int gws = nl > sl && !strcmp(name + nl - sl, suffix);
    char base[NAME_MAX_LEN];
    if (nl >= sizeof base) return NULL;
    memcpy(base, name, gws ? nl - sl : nl);
    base[gws ? nl - sl : nl] = 0;
    pthread_once(&g_sigs_once, sigs_once);
    void *code = NULL;
    int launch = 0;
    pthread_mutex_lock(&g_omu);
    struct op *o = op_find_locked(base);
    if (gws) {
        if (o && o->parsed) {
            if (!o->code_gws) {
                o->real_gws = p;
                for (int i = 0; i < o->nargs; i++) o->ft[i] = ffi_of(o->type[i]);
                if (ffi_prep_cif(&o->cif, FFI_DEFAULT_ABI, (unsigned)o->nargs, &ffi_type_sint32, o->ft) == FFI_OK)
                    o->code_gws = make_closure(&o->cif, gws_handler, o);
            }
            if (o->real_gws == p) code = o->code_gws;
        }
    } else {
        /* A launch: only an operator with two halves (its GetWorkspaceSize exists). */
        char partner[NAME_MAX_LEN + sizeof suffix];
        snprintf(partner, sizeof partner, "%s%s", name, suffix);
        launch = (o && o->parsed) || (ds && handle && ds(handle, partner));
        if (launch) {
            if (!o) o = op_get_locked(base);
            pthread_once(&g_launch_once, launch_cif_init);
            if (o && g_launch_ok && !o->code_launch) {
                o->real_launch = p;
                o->code_launch = make_closure(&g_launch_cif, launch_handler, o);
            }
            if (o && o->real_launch == p) code = o->code_launch;
        }
    }
    pthread_mutex_unlock(&g_omu);
    if (!code && launch) npusnap_devmem_untracked(name); /* a launch whose writes cannot be stamped */
    return code;
#else
    (void)handle;
    (void)ds;
    npusnap_devmem_untracked("aclnn operators (built without libffi)");
    return NULL;
#endif
}
