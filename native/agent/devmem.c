/* npusnap's own copy of a job's device memory across a snapshot (see npusnap/devmem.h and
 * docs/device-memory.md).
 *
 * Built into libnpusnap_agent.so, which `npusnap run` puts in LD_PRELOAD. It
 *
 *  - interposes the ACL calls that allocate, free, write or otherwise change device resources
 *    (list in WRAPPED below), both for programs linked against libacl_rt.so / libascendcl.so
 *    (ordinary symbol interposition) and for programs that look them up with dlsym() -- Python's
 *    ctypes does, and LD_PRELOAD alone does not catch that -- by interposing dlsym() too;
 *  - keeps the table of live device allocations those calls produce;
 *  - runs npusnap's gate: while it is closed, every wrapped call of the job waits (never fails)
 *    before it reaches the runtime, until npusnap_devmem_finish() opens it again;
 *  - copies the tracked allocations to host memory before Lock (save) and back to the same
 *    device addresses after Restore and Unlock (reload).
 *
 * It uses only public CANN functions (aclrtMalloc, aclrtMemcpy, aclrtSynchronizeDevice,
 * aclrtGetDevice, aclrtGetCurrentContext, aclrtSetCurrentContext), the process's own memory and
 * the C library: nothing here knows about the simulator.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NPUSNAP_CONTRACT_CANN_NAMES /* ACL_SUCCESS, ...: no CANN header is included */
#include "npusnap/devmem.h"

typedef int32_t aclError;
#define ACL_MEMCPY_HOST_TO_DEVICE 1
#define ACL_MEMCPY_DEVICE_TO_HOST 2

/* ------------------------------------------------------------------ the real functions */

enum {
    F_MALLOC, F_MALLOC_CACHED, F_MALLOC_ALIGN32, F_FREE, F_MEMCPY, F_MEMCPY_ASYNC, F_MEMSET,
    F_MEMSET_ASYNC, F_SET_DEVICE, F_RESET_DEVICE, F_FINALIZE, F_CREATE_STREAM, F_DESTROY_STREAM,
    F_MDL_EXECUTE, F_MDL_EXECUTE_ASYNC,
    N_WRAPPED,
    /* not wrapped, used by save/reload (queries and context selection) */
    F_GET_DEVICE = N_WRAPPED, F_GET_CTX, F_SET_CTX, F_SYNC_DEVICE,
    N_FUNCS
};

static const char *const NAMES[N_FUNCS] = {
    "aclrtMalloc", "aclrtMallocCached", "aclrtMallocAlign32", "aclrtFree", "aclrtMemcpy",
    "aclrtMemcpyAsync", "aclrtMemset", "aclrtMemsetAsync", "aclrtSetDevice", "aclrtResetDevice",
    "aclFinalize", "aclrtCreateStream", "aclrtDestroyStream", "aclmdlExecute", "aclmdlExecuteAsync",
    "aclrtGetDevice", "aclrtGetCurrentContext", "aclrtSetCurrentContext", "aclrtSynchronizeDevice",
};

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn g_real_dlsym;
static void *volatile g_real[N_FUNCS];
#define API __attribute__((visibility("default")))
API aclError aclrtMalloc(void **, size_t, int);
API aclError aclrtMallocCached(void **, size_t, int);
API aclError aclrtMallocAlign32(void **, size_t, int);
API aclError aclrtFree(void *);
API aclError aclrtMemcpy(void *, size_t, const void *, size_t, int);
API aclError aclrtMemcpyAsync(void *, size_t, const void *, size_t, int, void *);
API aclError aclrtMemset(void *, size_t, int32_t, size_t);
API aclError aclrtMemsetAsync(void *, size_t, int32_t, size_t, void *);
API aclError aclrtSetDevice(int32_t);
API aclError aclrtResetDevice(int32_t);
API aclError aclFinalize(void);
API aclError aclrtCreateStream(void **);
API aclError aclrtDestroyStream(void *);
API aclError aclmdlExecute(uint32_t, const void *, void *);
API aclError aclmdlExecuteAsync(uint32_t, const void *, void *, void *);

/* Same order as the enum. */
static void *const g_wrappers[N_WRAPPED] = {
    (void *)aclrtMalloc,        (void *)aclrtMallocCached, (void *)aclrtMallocAlign32, (void *)aclrtFree,
    (void *)aclrtMemcpy,        (void *)aclrtMemcpyAsync,  (void *)aclrtMemset,        (void *)aclrtMemsetAsync,
    (void *)aclrtSetDevice,     (void *)aclrtResetDevice,  (void *)aclFinalize,        (void *)aclrtCreateStream,
    (void *)aclrtDestroyStream, (void *)aclmdlExecute,     (void *)aclmdlExecuteAsync,
};
static volatile int g_resolved_from_lib;

static dlsym_fn real_dlsym(void) {
    dlsym_fn f = __atomic_load_n(&g_real_dlsym, __ATOMIC_ACQUIRE);
    if (f) return f;
    f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!f) f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&g_real_dlsym, f, __ATOMIC_RELEASE);
    return f;
}

static int is_wrapper(void *p) {
    for (int i = 0; i < N_WRAPPED; i++)
        if (g_wrappers[i] == p) return 1;
    return 0;
}

/* Fill every missing real function from the library that holds `known` (a real ACL function). */
static void resolve_from(void *known) {
    Dl_info info;
    if (!known || !dladdr(known, &info) || !info.dli_fname) return;
    void *h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return;
    dlsym_fn ds = real_dlsym();
    for (int i = 0; i < N_FUNCS; i++) {
        if (g_real[i]) continue;
        void *p = ds(h, NAMES[i]);
        if (p && !is_wrapper(p)) g_real[i] = p;
    }
    dlclose(h); /* NOLOAD handle: only drops the reference it took */
    g_resolved_from_lib = 1;
}

static int find_acl_lib(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    const char *name = info->dlpi_name;
    if (!name || !*name) return 0;
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (!strncmp(base, "libacl_rt.so", 12) || !strncmp(base, "libascendcl.so", 14)) {
        snprintf((char *)data, 4096, "%s", name);
        return 1;
    }
    return 0;
}

/* The real function `i`: from what dlsym() handed out, else the next definition after this
 * library (programs linked against libacl), else the ACL library mapped in the process. */
static void *real(int i) {
    void *p = g_real[i];
    if (p) return p;
    dlsym_fn ds = real_dlsym();
    if (ds) {
        p = ds(RTLD_NEXT, NAMES[i]);
        if (p && !is_wrapper(p)) {
            g_real[i] = p;
            resolve_from(p);
            return p;
        }
    }
    for (int k = 0; k < N_FUNCS; k++)
        if (g_real[k]) {
            resolve_from(g_real[k]);
            if (g_real[i]) return g_real[i];
        }
    char path[4096] = "";
    dl_iterate_phdr(find_acl_lib, path);
    if (path[0] && ds) {
        void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
        if (h) {
            void *q = ds(h, NAMES[i]);
            dlclose(h);
            if (q && !is_wrapper(q)) {
                g_real[i] = q;
                resolve_from(q);
            }
        }
    }
    return g_real[i];
}

/* ------------------------------------------------------------------ allocations and the gate */

struct alloc {
    uintptr_t ptr;
    size_t size;
    int32_t dev;
    void *ctx;
    int registered; /* came from npusnap_devmem_register, not from an interposed call */
    int excluded;
    void *copy;  /* host copy (npusnap_devmem_save) */
    int in_file; /* copied into the file of npusnap_devmem_save_fd instead */
};

struct range {
    uintptr_t start;
    size_t size;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv; /* CLOCK_MONOTONIC */
static struct alloc *g_allocs;
static size_t g_n, g_cap;
static struct range *g_excl;
static size_t g_nexcl, g_excl_cap;
static int g_gate_closed;
static int g_inflight;
static int g_saved;
static int g_interposed = -1; /* computed lazily */
#define MAX_DEVS 1024
static unsigned char g_devs[MAX_DEVS]; /* devices the job opened (aclrtSetDevice .. ResetDevice) */
static __thread int t_depth;

/* A forked child keeps only the forking thread: nothing of the job is in flight there, and it
 * holds no snapshot of its own (CANN does not survive fork either). */
static void atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void atfork_child(void) {
    g_inflight = 0;
    g_gate_closed = 0;
    for (size_t i = 0; i < g_n; i++) {
        free(g_allocs[i].copy);
        g_allocs[i].copy = NULL;
    }
    g_n = 0;
    g_saved = 0;
    memset(g_devs, 0, sizeof g_devs);
    pthread_mutex_unlock(&g_mu);
}

__attribute__((constructor)) static void devmem_init(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cv, &ca);
    pthread_condattr_destroy(&ca);
}

static void seterr(char *err, size_t len, const char *fmt, ...) {
    if (!err || !len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

static int in_excluded(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nexcl; i++)
        if (p >= g_excl[i].start && p + n <= g_excl[i].start + g_excl[i].size) return 1;
    return 0;
}

static struct alloc *find(uintptr_t p) {
    for (size_t i = 0; i < g_n; i++)
        if (g_allocs[i].ptr == p) return &g_allocs[i];
    return NULL;
}

static void drop_at(size_t i) {
    free(g_allocs[i].copy);
    g_allocs[i] = g_allocs[--g_n];
}

/* g_mu held */
static int add(uintptr_t p, size_t n, int32_t dev, void *ctx, int registered) {
    struct alloc *a = find(p);
    if (a) { /* the same address again (freed behind our back, or registered twice) */
        a->size = n;
        a->dev = dev;
        a->ctx = ctx;
        a->registered = registered;
        a->excluded = in_excluded(p, n);
        return 0;
    }
    if (g_n == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 64;
        struct alloc *na = realloc(g_allocs, cap * sizeof *na);
        if (!na) return -ENOMEM;
        g_allocs = na;
        g_cap = cap;
    }
    g_allocs[g_n++] = (struct alloc){p, n, dev, ctx, registered, in_excluded(p, n), NULL, 0};
    return 0;
}

/* Every wrapped call passes here first. A call made from inside another wrapped call (the
 * runtime calling its own exported functions) is not held a second time. */
static int gate_enter(void) {
    if (t_depth++ > 0) return 0;
    pthread_mutex_lock(&g_mu);
    while (g_gate_closed) pthread_cond_wait(&g_cv, &g_mu);
    g_inflight++;
    pthread_mutex_unlock(&g_mu);
    return 1;
}

static void gate_leave(int counted) {
    t_depth--;
    if (!counted) return;
    pthread_mutex_lock(&g_mu);
    g_inflight--;
    if (g_gate_closed) pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

static void current_place(int32_t *dev, void **ctx) {
    *dev = -1;
    *ctx = NULL;
    aclError (*gd)(int32_t *) = (aclError(*)(int32_t *))real(F_GET_DEVICE);
    aclError (*gc)(void **) = (aclError(*)(void **))real(F_GET_CTX);
    if (gd && gd(dev) != ACL_SUCCESS) *dev = -1;
    if (gc && gc(ctx) != ACL_SUCCESS) *ctx = NULL;
}

static void track_new(void **devPtr, size_t size) {
    int32_t dev;
    void *ctx;
    current_place(&dev, &ctx);
    pthread_mutex_lock(&g_mu);
    if (add((uintptr_t)*devPtr, size, dev, ctx, 0) != 0)
        fprintf(stderr, "npusnap-agent: [devmem] out of memory tracking a device allocation\n");
    pthread_mutex_unlock(&g_mu);
}

static void untrack(uintptr_t p) {
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++)
        if (g_allocs[i].ptr == p) {
            drop_at(i);
            break;
        }
    pthread_mutex_unlock(&g_mu);
}

static void untrack_device(int32_t dev) {
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n;) {
        if (g_allocs[i].dev == dev && !g_allocs[i].registered) drop_at(i);
        else i++;
    }
    pthread_mutex_unlock(&g_mu);
}

static aclError missing(int i) {
    fprintf(stderr, "npusnap-agent: [devmem] %s is not exported by the loaded CANN runtime\n", NAMES[i]);
    return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
}

/* ------------------------------------------------------------------ the wrappers */

#define CALL(idx, type, ...)                                                                      \
    do {                                                                                          \
        __typeof__(type) fn = (type)real(idx);                                                          \
        if (!fn) return missing(idx);                                                             \
        int counted_ = gate_enter();                                                              \
        aclError rc_ = fn(__VA_ARGS__);                                                           \
        gate_leave(counted_);                                                                     \
        return rc_;                                                                               \
    } while (0)

typedef aclError (*malloc_t)(void **, size_t, int);

static aclError do_malloc(int idx, void **devPtr, size_t size, int policy) {
    malloc_t fn = (malloc_t)real(idx);
    if (!fn) return missing(idx);
    int counted = gate_enter();
    aclError rc = fn(devPtr, size, policy);
    if (rc == ACL_SUCCESS && devPtr && *devPtr && counted) track_new(devPtr, size);
    gate_leave(counted);
    return rc;
}

API aclError aclrtMalloc(void **devPtr, size_t size, int policy) { return do_malloc(F_MALLOC, devPtr, size, policy); }
API aclError aclrtMallocCached(void **devPtr, size_t size, int policy) {
    return do_malloc(F_MALLOC_CACHED, devPtr, size, policy);
}
API aclError aclrtMallocAlign32(void **devPtr, size_t size, int policy) {
    return do_malloc(F_MALLOC_ALIGN32, devPtr, size, policy);
}

API aclError aclrtFree(void *devPtr) {
    aclError (*fn)(void *) = (aclError(*)(void *))real(F_FREE);
    if (!fn) return missing(F_FREE);
    int counted = gate_enter();
    aclError rc = fn(devPtr);
    if (rc == ACL_SUCCESS && counted) untrack((uintptr_t)devPtr);
    gate_leave(counted);
    return rc;
}

API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    CALL(F_MEMCPY, aclError(*)(void *, size_t, const void *, size_t, int), dst, destMax, src, count, kind);
}
API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, int kind, void *stream) {
    CALL(F_MEMCPY_ASYNC, aclError(*)(void *, size_t, const void *, size_t, int, void *), dst, destMax, src, count,
         kind, stream);
}
API aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    CALL(F_MEMSET, aclError(*)(void *, size_t, int32_t, size_t), devPtr, maxCount, value, count);
}
API aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, void *stream) {
    CALL(F_MEMSET_ASYNC, aclError(*)(void *, size_t, int32_t, size_t, void *), devPtr, maxCount, value, count,
         stream);
}
API aclError aclrtSetDevice(int32_t deviceId) {
    aclError (*fn)(int32_t) = (aclError(*)(int32_t))real(F_SET_DEVICE);
    if (!fn) return missing(F_SET_DEVICE);
    int counted = gate_enter();
    aclError rc = fn(deviceId);
    if (rc == ACL_SUCCESS && deviceId >= 0 && deviceId < MAX_DEVS) {
        pthread_mutex_lock(&g_mu);
        g_devs[deviceId] = 1;
        pthread_mutex_unlock(&g_mu);
    }
    gate_leave(counted);
    return rc;
}

API aclError aclrtResetDevice(int32_t deviceId) {
    aclError (*fn)(int32_t) = (aclError(*)(int32_t))real(F_RESET_DEVICE);
    if (!fn) return missing(F_RESET_DEVICE);
    int counted = gate_enter();
    aclError rc = fn(deviceId);
    if (rc == ACL_SUCCESS && counted) untrack_device(deviceId);
    if (rc == ACL_SUCCESS && deviceId >= 0 && deviceId < MAX_DEVS) {
        pthread_mutex_lock(&g_mu);
        g_devs[deviceId] = 0;
        pthread_mutex_unlock(&g_mu);
    }
    gate_leave(counted);
    return rc;
}

API aclError aclFinalize(void) {
    aclError (*fn)(void) = (aclError(*)(void))real(F_FINALIZE);
    if (!fn) return missing(F_FINALIZE);
    int counted = gate_enter();
    aclError rc = fn();
    if (rc == ACL_SUCCESS && counted) {
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_n;) {
            if (!g_allocs[i].registered) drop_at(i);
            else i++;
        }
        memset(g_devs, 0, sizeof g_devs);
        pthread_mutex_unlock(&g_mu);
    }
    gate_leave(counted);
    return rc;
}

API aclError aclrtCreateStream(void **stream) { CALL(F_CREATE_STREAM, aclError(*)(void **), stream); }
API aclError aclrtDestroyStream(void *stream) { CALL(F_DESTROY_STREAM, aclError(*)(void *), stream); }
API aclError aclmdlExecute(uint32_t modelId, const void *input, void *output) {
    CALL(F_MDL_EXECUTE, aclError(*)(uint32_t, const void *, void *), modelId, input, output);
}
API aclError aclmdlExecuteAsync(uint32_t modelId, const void *input, void *output, void *stream) {
    CALL(F_MDL_EXECUTE_ASYNC, aclError(*)(uint32_t, const void *, void *, void *), modelId, input, output, stream);
}

/* dlsym(): hand out the wrapper for a wrapped ACL name, remembering the real function. Every
 * other lookup -- and every RTLD_NEXT lookup, whose meaning depends on the caller -- goes to the
 * real dlsym as a tail call, so that glibc still sees the original caller's return address. */
API void *dlsym(void *handle, const char *name) {
    dlsym_fn ds = real_dlsym();
    if (handle != RTLD_NEXT && name[0] == 'a' && name[1] == 'c' && name[2] == 'l') {
        for (int i = 0; i < N_WRAPPED; i++)
            if (!strcmp(name, NAMES[i])) {
                void *p = ds(handle, name);
                if (!p || p == g_wrappers[i]) return p;
                if (!g_real[i]) g_real[i] = p;
                return g_wrappers[i];
            }
    }
    return ds(handle, name);
}

/* ------------------------------------------------------------------ save / reload / finish */

static int interposed(void) {
    if (g_interposed < 0) {
        /* Preloaded: the program's own search list (main program, LD_PRELOAD, its libraries)
         * finds our dlsym and aclrtMalloc first. (Not RTLD_DEFAULT: its scope depends on the
         * caller, and a -Bsymbolic library always finds itself first.) */
        dlsym_fn ds = real_dlsym();
        void *main_handle = dlopen(NULL, RTLD_LAZY);
        g_interposed = ds && main_handle && ds(main_handle, "dlsym") == (void *)dlsym &&
                       ds(main_handle, "aclrtMalloc") == (void *)aclrtMalloc;
        if (main_handle) dlclose(main_handle);
    }
    return g_interposed;
}

static void open_gate_locked(void) {
    g_gate_closed = 0;
    pthread_cond_broadcast(&g_cv);
}

/* Select the allocation's context on this (the agent's) thread, if the runtime has contexts. */
static void use_ctx(void *ctx) {
    aclError (*sc)(void *) = (aclError(*)(void *))real(F_SET_CTX);
    if (sc && ctx) sc(ctx);
}

static void free_copies_locked(void) {
    for (size_t i = 0; i < g_n; i++) {
        free(g_allocs[i].copy);
        g_allocs[i].copy = NULL;
        g_allocs[i].in_file = 0;
    }
    g_saved = 0;
}

/* Close the gate and wait (at most timeout_ms) for the job's device calls in flight. 0 with the
 * gate closed, or -errno with err set and the gate open. */
static int close_gate_and_wait(int timeout_ms, char *err, size_t errlen) {
    if (timeout_ms < 0) timeout_ms = 0;
    pthread_mutex_lock(&g_mu);
    if (g_gate_closed) {
        pthread_mutex_unlock(&g_mu);
        seterr(err, errlen, "npusnap's device gate is already closed (a snapshot is in progress)");
        return -EBUSY;
    }
    g_gate_closed = 1;
    struct timespec t0, dl;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    dl = t0;
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    int rc = 0;
    while (g_inflight > 0 && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&g_cv, &g_mu, &dl);
    if (g_inflight > 0) {
        int n = g_inflight;
        open_gate_locked();
        pthread_mutex_unlock(&g_mu);
        seterr(err, errlen,
               "%d device call(s) of the job were still running after %d ms; nothing was locked", n,
               timeout_ms);
        return -ETIMEDOUT;
    }
    pthread_mutex_unlock(&g_mu);
    return 0;
}

typedef aclError (*memcpy_fn_t)(void *, size_t, const void *, size_t, int);

/* n bytes from host memory at src to allocation a at offset off (its context selected). 0, or
 * -EIO with err set. */
static int copy_to_device(memcpy_fn_t memcpy_fn, const struct alloc *a, size_t off, const void *src, size_t n,
                          char *err, size_t errlen) {
    aclError c = memcpy_fn((void *)(a->ptr + off), n, src, n, ACL_MEMCPY_HOST_TO_DEVICE);
    if (c == ACL_SUCCESS) return 0;
    seterr(err, errlen, "aclrtMemcpy host to device of %zu bytes at %#lx (device %d) failed with %d", n,
           (unsigned long)(a->ptr + off), a->dev, c);
    return -EIO;
}

/* The file form of the copies (npusnap_devmem_save_fd): a header, one record per copied
 * allocation, then their bytes in record order. Reload checks the records against the table
 * the restored process holds, so a file of another process or another dump is refused. */
#define DM_MAGIC NPUSNAP_DEVMEM_FILE_MAGIC
/* Copy steps: a save's small enough to stay in the CPU's cache between the copy off the device
 * and the write into the file (64 MiB ones did not); a reload's maps the file a step at a time. */
#define DM_SAVE_CHUNK ((size_t)4 << 20)
#define DM_LOAD_CHUNK ((size_t)16 << 20)
/* The header and the records are the contract's (native/contract/npusnap.toml, contract.h). */
#define dm_header npusnap_devmem_file_header
#define dm_record npusnap_devmem_file_record

static int write_full(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return w < 0 ? -errno : -EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_full(int fd, void *buf, size_t n, off_t off) {
    char *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n, off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        if (r == 0) return -ENODATA; /* the file is shorter than its records say */
        p += r;
        n -= (size_t)r;
        off += r;
    }
    return 0;
}

/* n bytes of fd at off to allocation a at a_off. Straight from a read-only mapping of the file
 * (its page cache): the copy to the device is then the only copy, twice as fast as reading into
 * a buffer first (0.21 against 0.42 s/GiB in a microbenchmark here). Through *bounce (allocated
 * on first use) where the file cannot be mapped. The caller checked that the file holds
 * [off, off + n): a mapping past its end would fault (SIGBUS), so only truncating the image
 * under a running restore could make it. */
static int file_to_device(int fd, off_t off, size_t n, memcpy_fn_t memcpy_fn, const struct alloc *a, size_t a_off,
                          char **bounce, char *err, size_t errlen) {
    long pg = sysconf(_SC_PAGESIZE);
    off_t base = off - off % (pg > 0 ? pg : 4096);
    size_t delta = (size_t)(off - base);
    void *m = mmap(NULL, n + delta, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, base);
    if (m != MAP_FAILED) {
        int ret = copy_to_device(memcpy_fn, a, a_off, (const char *)m + delta, n, err, errlen);
        munmap(m, n + delta);
        return ret;
    }
    if (!*bounce && !(*bounce = malloc(DM_LOAD_CHUNK))) {
        seterr(err, errlen, "no host memory for a %zu-byte copy buffer", DM_LOAD_CHUNK);
        return -ENOMEM;
    }
    int ret = read_full(fd, *bounce, n, off);
    if (ret != 0) {
        seterr(err, errlen, "cannot read the device-memory file: %s", strerror(-ret));
        return ret;
    }
    return copy_to_device(memcpy_fn, a, a_off, *bounce, n, err, errlen);
}

/* The copies between the device and the image's file, spread over a few threads: each takes the
 * next chunk (an allocation's range <-> a range of the file) until none is left or one failed.
 * A copy and its page-cache write or mapping go at one core's pace, and nothing else of the job
 * runs meanwhile (it waits at npusnap's gate), so the other cores shorten both directions:
 *  - save: each thread copies its chunk off the device into its own buffer and writes it at its
 *    place in the file (pwrite). 1 GiB here: the lock phase went from 0.79 to 0.44-0.49 s
 *    (medians of 5; the CLI reserves the file's blocks first, see image/streamhash.py). The file
 *    is then not written front to back, which is why npusnap's CLI hashes it only after the lock
 *    answered (pipelines/dump.py);
 *  - reload: each thread copies its chunk from a mapping of the file to the device. 1 GiB here:
 *    0.40 s on one thread, 0.25 s on two (perf timelines of a restore; the simulator serializes
 *    the memcpy itself, not the page-table work).
 * Each thread selects the allocation's context itself, as CANN contexts are per thread. */
#define DM_THREADS 4
struct xfer_chunk {
    const struct alloc *a;
    size_t a_off;
    off_t file_off;
    size_t n;
};
struct xfer {
    int fd;
    int save; /* device -> file; else file -> device */
    memcpy_fn_t memcpy_fn;
    struct xfer_chunk *chunks;
    size_t n, cap, next;
    int ret;
    char err[512];
    pthread_mutex_t mu;
};

/* Append a chunk; 0 or -ENOMEM. */
static int xfer_add(struct xfer *x, const struct alloc *a, size_t a_off, off_t file_off, size_t n) {
    if (x->n == x->cap) {
        size_t cap = x->cap ? 2 * x->cap : 64;
        struct xfer_chunk *c = realloc(x->chunks, cap * sizeof *c);
        if (!c) return -ENOMEM;
        x->chunks = c;
        x->cap = cap;
    }
    x->chunks[x->n++] = (struct xfer_chunk){a, a_off, file_off, n};
    return 0;
}

static int pwrite_full(int fd, const char *p, size_t n, off_t off) {
    while (n) {
        ssize_t w = pwrite(fd, p, n, off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return w < 0 ? -errno : -EIO;
        p += w;
        n -= (size_t)w;
        off += w;
    }
    return 0;
}

/* Queue allocation a in chunks of at most `chunk` bytes, its bytes at *file_off of the file
 * (advanced past them); 0 or -ENOMEM. */
static int xfer_add_alloc(struct xfer *x, const struct alloc *a, size_t chunk, off_t *file_off) {
    for (size_t off = 0; off < a->size; off += chunk) {
        size_t n = a->size - off < chunk ? a->size - off : chunk;
        if (xfer_add(x, a, off, *file_off, n) != 0) return -ENOMEM;
        *file_off += (off_t)n;
    }
    return 0;
}

/* One save chunk through buf (DM_SAVE_CHUNK bytes): 0, or -errno with err set. */
static int save_chunk(const struct xfer *x, const struct xfer_chunk *c, char *buf, char *err, size_t errlen) {
    const struct alloc *a = c->a;
    aclError rc = x->memcpy_fn(buf, c->n, (const void *)(a->ptr + c->a_off), c->n, ACL_MEMCPY_DEVICE_TO_HOST);
    if (rc != ACL_SUCCESS) {
        seterr(err, errlen, "aclrtMemcpy device to host of %zu bytes at %#lx (device %d) failed with %d", c->n,
               (unsigned long)(a->ptr + c->a_off), a->dev, rc);
        return -EIO;
    }
    int wr = pwrite_full(x->fd, buf, c->n, c->file_off);
    if (wr != 0) seterr(err, errlen, "cannot write the device-memory file: %s", strerror(-wr));
    return wr;
}

static void *xfer_main(void *arg) {
    struct xfer *x = arg;
    char *buf = NULL; /* save: the chunk's host copy; reload: a bounce buffer if mapping fails */
    char err[512] = "";
    if (x->save && !(buf = malloc(DM_SAVE_CHUNK))) {
        pthread_mutex_lock(&x->mu);
        if (x->ret == 0) {
            x->ret = -ENOMEM;
            snprintf(x->err, sizeof x->err, "no host memory for a %zu-byte copy buffer", DM_SAVE_CHUNK);
        }
        pthread_mutex_unlock(&x->mu);
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&x->mu);
        const struct xfer_chunk *c = x->ret == 0 && x->next < x->n ? &x->chunks[x->next++] : NULL;
        pthread_mutex_unlock(&x->mu);
        if (!c) break;
        use_ctx(c->a->ctx);
        int rc = x->save ? save_chunk(x, c, buf, err, sizeof err)
                         : file_to_device(x->fd, c->file_off, c->n, x->memcpy_fn, c->a, c->a_off, &buf, err,
                                          sizeof err);
        if (rc != 0) {
            pthread_mutex_lock(&x->mu);
            if (x->ret == 0) {
                x->ret = rc;
                snprintf(x->err, sizeof x->err, "%s", err);
            }
            pthread_mutex_unlock(&x->mu);
        }
    }
    free(buf);
    return NULL;
}

/* Run the chunks on this thread and up to DM_THREADS - 1 more (fewer on fewer cores; none if
 * they cannot be created). 0, or the first failed chunk's error (err set). */
static int xfer_run(struct xfer *x, char *err, size_t errlen) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    size_t extra = cores > 1 ? (size_t)(cores < DM_THREADS ? cores : DM_THREADS) - 1 : 0;
    if (extra > x->n) extra = x->n ? x->n - 1 : 0;
    pthread_t th[DM_THREADS];
    size_t started = 0;
    pthread_mutex_init(&x->mu, NULL);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the job's signals must not land on these threads */
    for (size_t i = 0; i < extra; i++)
        if (pthread_create(&th[started], NULL, xfer_main, x) == 0) started++;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    xfer_main(x);
    for (size_t i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&x->mu);
    if (x->ret != 0) seterr(err, errlen, "%s", x->err);
    return x->ret;
}

/* Queued asynchronous work must finish before the bytes are read: synchronize the device of
 * every context the copied allocations use, once each. 0, or -EIO with err set. */
static int sync_contexts_locked(char *err, size_t errlen) {
    aclError (*sync)(void) = (aclError(*)(void))real(F_SYNC_DEVICE);
    void *synced[64];
    int nsynced = 0;
    for (size_t i = 0; i < g_n && sync; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        int seen = 0;
        for (int k = 0; k < nsynced; k++) seen |= synced[k] == a->ctx;
        if (seen) continue;
        use_ctx(a->ctx);
        aclError src = sync();
        if (src != ACL_SUCCESS) {
            seterr(err, errlen, "aclrtSynchronizeDevice (device %d) failed with %d", a->dev, src);
            return -EIO;
        }
        if (nsynced < 64) synced[nsynced++] = a->ctx;
    }
    return 0;
}

/* Copy every tracked allocation (gate closed, nothing in flight) into fd: the header, one record
 * per allocation, then their bytes in record order, written by xfer_run. Holds g_mu. */
static int save_file_locked(int fd, memcpy_fn_t memcpy_fn, uint64_t *written, char *err, size_t errlen) {
    struct dm_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, DM_MAGIC, sizeof DM_MAGIC);
    for (size_t i = 0; i < g_n; i++)
        if (!g_allocs[i].excluded) {
            h.count++;
            h.bytes += g_allocs[i].size;
        }
    int wr = write_full(fd, &h, sizeof h);
    for (size_t i = 0; i < g_n && wr == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        struct dm_record r = {(uint64_t)a->ptr, (uint64_t)a->size, a->dev, 0};
        wr = write_full(fd, &r, sizeof r);
    }
    if (wr != 0) {
        seterr(err, errlen, "cannot write the device-memory file: %s", strerror(-wr));
        return wr;
    }
    int ret = sync_contexts_locked(err, errlen);
    struct xfer x = {.fd = fd, .save = 1, .memcpy_fn = memcpy_fn};
    off_t data_off = (off_t)(sizeof h + h.count * sizeof(struct dm_record));
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        const struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        if (xfer_add_alloc(&x, a, DM_SAVE_CHUNK, &data_off) != 0) {
            seterr(err, errlen, "no host memory for the list of device-memory copies");
            ret = -ENOMEM;
        }
    }
    if (ret == 0 && x.n) ret = xfer_run(&x, err, errlen);
    free(x.chunks);
    if (ret != 0) return ret;
    *written = (uint64_t)data_off;
    for (size_t i = 0; i < g_n; i++)
        if (!g_allocs[i].excluded) g_allocs[i].in_file = 1;
    return 0;
}

/* Copy every tracked allocation (gate closed, nothing in flight) to host memory, one malloc'd copy
 * each (npusnap_devmem_save, for a process without a device-memory file). Holds g_mu. */
static int save_in_process_locked(memcpy_fn_t memcpy_fn, char *err, size_t errlen) {
    int ret = sync_contexts_locked(err, errlen);
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        use_ctx(a->ctx);
        free(a->copy);
        a->copy = malloc(a->size ? a->size : 1);
        if (!a->copy) {
            seterr(err, errlen, "no host memory for a copy of %zu bytes of device memory", a->size);
            return -ENOMEM;
        }
        aclError c = memcpy_fn(a->copy, a->size, (const void *)a->ptr, a->size, ACL_MEMCPY_DEVICE_TO_HOST);
        if (c != ACL_SUCCESS) {
            seterr(err, errlen, "aclrtMemcpy device to host of %zu bytes at %#lx (device %d) failed with %d",
                   a->size, (unsigned long)a->ptr, a->dev, c);
            ret = -EIO;
        }
    }
    return ret;
}

static int save_to(int fd, int timeout_ms, uint64_t *written, char *err, size_t errlen) {
    int rc = close_gate_and_wait(timeout_ms, err, errlen);
    if (rc != 0) return rc;
    /* The gate is closed and nothing is in flight: the table cannot change under us except by
     * npusnap_devmem_register/exclude, which take g_mu. */
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)real(F_MEMCPY);
    pthread_mutex_lock(&g_mu);
    int ret = 0;
    if (g_n && !memcpy_fn) {
        seterr(err, errlen, "aclrtMemcpy is not available in this process: cannot copy device memory");
        ret = -ENOSYS;
    } else {
        ret = fd >= 0 ? save_file_locked(fd, memcpy_fn, written, err, errlen)
                      : save_in_process_locked(memcpy_fn, err, errlen);
    }
    if (ret != 0) {
        free_copies_locked();
        open_gate_locked();
    } else {
        g_saved = 1;
    }
    pthread_mutex_unlock(&g_mu);
    return ret;
}

API int npusnap_devmem_save(int timeout_ms, char *err, size_t errlen) {
    uint64_t unused = 0;
    return save_to(-1, timeout_ms, &unused, err, errlen);
}

API int npusnap_devmem_save_fd(int fd, int timeout_ms, uint64_t *written, char *err, size_t errlen) {
    uint64_t n = 0;
    if (fd < 0) {
        seterr(err, errlen, "no file to write the device memory into");
        return -EBADF;
    }
    int rc = save_to(fd, timeout_ms, &n, err, errlen);
    if (written) *written = n;
    return rc;
}

API int npusnap_devmem_reload_fd(int fd, char *err, size_t errlen) {
    pthread_mutex_lock(&g_mu);
    if (!g_saved) {
        pthread_mutex_unlock(&g_mu);
        seterr(err, errlen, "no saved device memory to reload");
        return -ENOENT;
    }
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)real(F_MEMCPY);
    struct dm_header h;
    int ret = read_full(fd, &h, sizeof h, 0);
    uint64_t want = 0;
    for (size_t i = 0; i < g_n; i++) want += g_allocs[i].in_file;
    if (ret != 0) {
        seterr(err, errlen, "cannot read the device-memory file's header: %s", strerror(-ret));
    } else if (memcmp(h.magic, DM_MAGIC, sizeof DM_MAGIC) != 0) {
        seterr(err, errlen, "the device-memory file is not one (bad magic)");
        ret = -EINVAL;
    } else if (h.count != want) {
        seterr(err, errlen, "the device-memory file holds %llu allocations, this process saved %llu into it",
               (unsigned long long)h.count, (unsigned long long)want);
        ret = -EINVAL;
    } else if (!memcpy_fn && want) {
        seterr(err, errlen, "aclrtMemcpy is not available in this process");
        ret = -ENOSYS;
    }
    off_t rec_off = sizeof h;
    off_t data_off = (off_t)(sizeof h + h.count * sizeof(struct dm_record));
    struct stat st;
    if (ret == 0 && fstat(fd, &st) != 0) {
        ret = -errno;
        seterr(err, errlen, "cannot stat the device-memory file: %s", strerror(-ret));
    } else if (ret == 0 && (uint64_t)st.st_size < (uint64_t)data_off + h.bytes) {
        /* Checked before anything is mapped: see file_to_device. */
        seterr(err, errlen, "the device-memory file has %lld bytes, its records need %llu", (long long)st.st_size,
               (unsigned long long)((uint64_t)data_off + h.bytes));
        ret = -ENODATA;
    }
    struct xfer x = {.fd = fd, .memcpy_fn = memcpy_fn};
    uint64_t mapped_total = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (!a->in_file) continue;
        struct dm_record r;
        ret = read_full(fd, &r, sizeof r, rec_off);
        rec_off += sizeof r;
        if (ret != 0) {
            seterr(err, errlen, "cannot read the device-memory file's records: %s", strerror(-ret));
            break;
        }
        if (r.ptr != (uint64_t)a->ptr || r.size != (uint64_t)a->size || r.dev != a->dev) {
            seterr(err, errlen,
                   "the device-memory file does not match this process: it has %llu bytes at %#llx on device %d "
                   "where the process has %zu bytes at %#lx on device %d",
                   (unsigned long long)r.size, (unsigned long long)r.ptr, r.dev, a->size, (unsigned long)a->ptr,
                   a->dev);
            ret = -EINVAL;
            break;
        }
        mapped_total += a->size;
        if (mapped_total > h.bytes) {
            seterr(err, errlen, "the device-memory file's records add up to more than its header's %llu bytes",
                   (unsigned long long)h.bytes);
            ret = -EINVAL;
            break;
        }
        if (xfer_add_alloc(&x, a, DM_LOAD_CHUNK, &data_off) != 0) {
            seterr(err, errlen, "no host memory for the reload's list of copies");
            ret = -ENOMEM;
        }
    }
    if (ret == 0 && x.n) ret = xfer_run(&x, err, errlen);
    free(x.chunks);
    pthread_mutex_unlock(&g_mu);
    return ret;
}

API int npusnap_devmem_reload(char *err, size_t errlen) {
    pthread_mutex_lock(&g_mu);
    if (!g_saved) {
        pthread_mutex_unlock(&g_mu);
        seterr(err, errlen, "no saved device memory to reload");
        return -ENOENT;
    }
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)real(F_MEMCPY);
    int ret = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++)
        if (g_allocs[i].in_file) {
            seterr(err, errlen, "the device memory was saved into a file of the image: reloading needs that file");
            ret = -ENOENT;
        }
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded || !a->copy) continue;
        if (!memcpy_fn) {
            seterr(err, errlen, "aclrtMemcpy is not available in this process");
            ret = -ENOSYS;
            break;
        }
        use_ctx(a->ctx);
        ret = copy_to_device(memcpy_fn, a, 0, a->copy, a->size, err, errlen);
    }
    pthread_mutex_unlock(&g_mu);
    return ret;
}

API void npusnap_devmem_finish(void) {
    pthread_mutex_lock(&g_mu);
    free_copies_locked();
    open_gate_locked();
    pthread_mutex_unlock(&g_mu);
}

API void npusnap_devmem_get_info(npusnap_devmem_info *out) {
    if (!out) return;
    int ip = interposed();
    pthread_mutex_lock(&g_mu);
    memset(out, 0, sizeof *out);
    for (size_t i = 0; i < g_n; i++) {
        out->allocations++;
        out->bytes += g_allocs[i].size;
        if (g_allocs[i].excluded) out->excluded_bytes += g_allocs[i].size;
        if (g_allocs[i].copy || g_allocs[i].in_file) out->saved_bytes += g_allocs[i].size;
        if (g_allocs[i].in_file) out->in_file = 1;
    }
    out->interposed = ip;
    out->gate_closed = g_gate_closed;
    out->saved = g_saved;
    pthread_mutex_unlock(&g_mu);
}

/* Extra (not in the original header): the device ids the job opened with aclrtSetDevice and has
 * not reset, as seen by the interposed calls (real CANN has no query for "all open devices").
 * Writes at most max ids; returns how many there are. */
API int npusnap_devmem_devices(int32_t *ids, int max) {
    int n = 0;
    pthread_mutex_lock(&g_mu);
    for (int d = 0; d < MAX_DEVS; d++)
        if (g_devs[d]) {
            if (ids && n < max) ids[n] = d;
            n++;
        }
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* Extra (not in the original header): how many allocations came from explicit registration. */
API uint64_t npusnap_devmem_registered_count(void) {
    pthread_mutex_lock(&g_mu);
    uint64_t n = 0;
    for (size_t i = 0; i < g_n; i++) n += g_allocs[i].registered != 0;
    pthread_mutex_unlock(&g_mu);
    return n;
}

API int npusnap_devmem_register(void *dev_ptr, size_t size) {
    if (!dev_ptr || !size) return -EINVAL;
    int32_t dev;
    void *ctx;
    current_place(&dev, &ctx);
    pthread_mutex_lock(&g_mu);
    int rc = g_saved ? -EBUSY : add((uintptr_t)dev_ptr, size, dev, ctx, 1);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API int npusnap_devmem_exclude(void *dev_ptr, size_t size) {
    if (!dev_ptr || !size) return -EINVAL;
    pthread_mutex_lock(&g_mu);
    if (g_saved) {
        pthread_mutex_unlock(&g_mu);
        return -EBUSY;
    }
    if (g_nexcl == g_excl_cap) {
        size_t cap = g_excl_cap ? g_excl_cap * 2 : 16;
        struct range *nr = realloc(g_excl, cap * sizeof *nr);
        if (!nr) {
            pthread_mutex_unlock(&g_mu);
            return -ENOMEM;
        }
        g_excl = nr;
        g_excl_cap = cap;
    }
    g_excl[g_nexcl++] = (struct range){(uintptr_t)dev_ptr, size};
    for (size_t i = 0; i < g_n; i++)
        if (in_excluded(g_allocs[i].ptr, g_allocs[i].size)) g_allocs[i].excluded = 1;
    pthread_mutex_unlock(&g_mu);
    return 0;
}
