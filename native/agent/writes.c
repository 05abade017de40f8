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
#include "writes_int.h"

/* ------------------------------------------------------------------ the real functions */


const char *const WNAMES[W_N] = {
#define X(id, name, ret, params, args) #name,
    WRITERS(X)
#undef X
};


void *const g_wwrappers[W_N] = {
#define X(id, name, ret, params, args) (void *)name,
    WRITERS(X)
#undef X
};

void *volatile g_wreal[W_N];

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

size_t w_hash_ptr(const void *p, size_t buckets) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (size_t)(x & (buckets - 1));
}


/* Tensors: descriptor -> the device bytes it may reach. */
#define T_BUCKETS 65536
struct tnode {
    const void *key;
    struct extent e;
    struct tnode *next;
};
static struct tnode *g_tensors[T_BUCKETS];
pthread_mutex_t g_tmu = PTHREAD_MUTEX_INITIALIZER;

/* Tensor lists: descriptor -> its tensors (their extents, as they were when it was made). */
struct lnode *g_lists[L_BUCKETS];

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

int w_tensor_get(const void *t, struct extent *out) {
    int found = 0;
    pthread_mutex_lock(&g_tmu);
    for (struct tnode *n = g_tensors[w_hash_ptr(t, T_BUCKETS)]; n; n = n->next)
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
    size_t b = w_hash_ptr(t, T_BUCKETS);
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
    for (struct tnode **pp = &g_tensors[w_hash_ptr(t, T_BUCKETS)]; *pp; pp = &(*pp)->next)
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
        if (!v || !v[i] || !w_tensor_get(v[i], &e[i])) e[i] = (struct extent){0, v && v[i] ? UINT64_MAX : 0};
    n->key = l;
    n->n = count;
    n->e = e;
    pthread_mutex_lock(&g_tmu);
    size_t b = w_hash_ptr(l, L_BUCKETS);
    n->next = g_lists[b];
    g_lists[b] = n;
    pthread_mutex_unlock(&g_tmu);
    return l;
}

API aclnnStatus aclDestroyTensorList(const void *l) {
    REALW(W_DESTROY_LIST, aclnnStatus, (const void *));
    pthread_mutex_lock(&g_tmu);
    for (struct lnode **pp = &g_lists[w_hash_ptr(l, L_BUCKETS)]; *pp; pp = &(*pp)->next)
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
    for (struct enode **pp = &g_execs[w_hash_ptr(e, E_BUCKETS)]; *pp; pp = &(*pp)->next)
        if ((*pp)->key == e) {
            struct enode *n = *pp;
            *pp = n->next;
            free(n->e);
            free(n);
            return;
        }
}

void w_exec_put(const void *key, const void *op, int all, struct extent *e, size_t n) {
    struct enode *node = calloc(1, sizeof *node);
    if (!node) {
        free(e);
        return; /* not recorded: its launch marks everything */
    }
    *node = (struct enode){key, op, all, 0, n, e, NULL};
    pthread_mutex_lock(&g_emu);
    exec_drop_locked(key);
    size_t b = w_hash_ptr(key, E_BUCKETS);
    node->next = g_execs[b];
    g_execs[b] = node;
    pthread_mutex_unlock(&g_emu);
}

API aclnnStatus aclSetAclOpExecutorRepeatable(void *e) {
    REALW(W_REPEATABLE, aclnnStatus, (void *));
    aclnnStatus rc = fn(e);
    pthread_mutex_lock(&g_emu);
    for (struct enode *n = g_execs[w_hash_ptr(e, E_BUCKETS)]; n; n = n->next)
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

struct taken w_take(const void *exec, const void *op) {
    struct taken t = {1, 0, NULL};
    pthread_mutex_lock(&g_emu);
    for (struct enode **pp = &g_execs[w_hash_ptr(exec, E_BUCKETS)]; *pp; pp = &(*pp)->next) {
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
void w_stamp_ranges(const struct taken *t, const char *name) {
    if (t->all && name) npusnap_devmem_mark_all(name);
    else if (t->all) npusnap_devmem_mark_all_before();
    else
        for (size_t i = 0; i < t->n; i++) npusnap_devmem_mark(t->e[i].p, (size_t)t->e[i].n);
}

/* After the launch returned: stamp what it writes (in the epoch it writes in), and let go. */
void w_stamp(struct taken *t, const char *name) {
    w_stamp_ranges(t, name);
    free(t->e);
    t->e = NULL;
}

/* A concurrent copy takes the destination first; the write is stamped before the call and once
 * it returned (w_stamp_ranges says why). */
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
__thread int t_in_op;

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

