/* npusnap's own copy of a job's device memory across a snapshot (see npusnap/devmem.h and
 * docs/device-memory.md).
 *
 * Built into libnpusnap_agent.so, which `npusnap run` puts in LD_PRELOAD. It
 *
 *  - tracks every device allocation at the driver layer (libascend_hal.so): halMemAlloc/halMemFree
 *    and the virtual-memory calls behind expandable segments (halMemAddressReserve/Free,
 *    halMemCreate/Release, halMemMap/Unmap). Every way the runtime allocates ends there --
 *    aclrtMalloc*, aclrtReserveMemAddress + aclrtMallocPhysical + aclrtMapMem, functions looked up
 *    with dlsym(), allocations made inside the runtime -- so one table sees them all. dlsym() is
 *    interposed too, for callers that look the driver functions up themselves;
 *  - counts the job's driver copies (drvMemcpy) in flight, the one piece of device work that can
 *    still be running after the runtime's Lock (a call past the runtime's entry check runs to its
 *    end, cann-snapshot-api.md "Lock");
 *  - records which context each device the job opened uses (aclrtSetDevice, aclrtCreateContext,
 *    aclrtSetCurrentContext are followed, never held), so that the agent can select it to drain
 *    that device's queues;
 *  - copies the tracked memory with the driver's own copy, drvMemcpy, which the runtime's lock
 *    does not gate: after Lock (save) and after Restore, still LOCKED (reload).
 *
 * There is no gate of npusnap's own: the runtime's lock holds about 266 entry points on
 * every thread -- launches, copies, VMM, HCCL -- from Lock to Unlock, and the reload runs before
 * Unlock, so nothing of the job touches device memory between the copy and the reload.
 *
 * Only public CANN and driver functions are used (halMem*, drvMemcpy, aclrtGetCurrentContext,
 * aclrtSetCurrentContext, aclrtSynchronizeDeviceWithTimeout / aclrtSynchronizeDevice), the
 * process's own memory and the C library: nothing here knows about the simulator.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NPUSNAP_CONTRACT_CANN_NAMES /* ACL_SUCCESS, ...: no CANN header is included */
#include "npusnap/devmem.h"
#include "npusnap/quietthread.h"
#include "npusnap/timeutil.h"
#include "realsym.h"

void agent_log(const char *fmt, ...) __attribute__((format(printf, 1, 2))); /* log.c */
void npusnap_devmem_before_write(uintptr_t p, size_t n); /* the concurrent copy, below */
void npusnap_devmem_write_open(void);
void npusnap_devmem_write_close(void);
static void write_open(int gated);

void *npusnap_hccl_wrapper_for(const char *name, void *p); /* hccl.c */
void *npusnap_writes_wrapper_for(void *handle, const char *name, void *p, dlsym_fn ds); /* writes.c */

typedef int32_t aclError;
typedef int drvError_t; /* enum tagDrvError (driver ascend_hal_error.h): an int on the ABI */
typedef unsigned long long DVdeviceptr;
typedef struct drv_mem_handle drv_mem_handle_t;
struct drv_mem_prop { /* ascend_hal.h: the head is what npusnap reads */
    uint32_t side;
    uint32_t devid;
    uint32_t module_id;
    uint32_t pg_type;
    uint32_t mem_type;
    uint64_t reserve;
};
#define DRV_ERROR_NOT_SUPPORT 0xfffe
/* halMemAlloc's flag carries the device id in its low bits (MEM_DEVICE_ID of ascend_hal.h). */
#define HAL_FLAG_DEVID_MASK 0x3FFull

/* ------------------------------------------------------------------ the real functions */

enum {
    /* wrapped: the driver's allocation calls (tracked), its copy (counted) */
    F_HAL_ALLOC, F_HAL_FREE, F_HAL_RESERVE, F_HAL_ADDR_FREE, F_HAL_CREATE, F_HAL_RELEASE, F_HAL_MAP,
    F_HAL_UNMAP, F_DRV_MEMCPY,
    /* wrapped: the runtime calls that tell which context a device uses (followed, never held) */
    F_SET_DEVICE, F_RESET_DEVICE, F_RESET_DEVICE_FORCE, F_FINALIZE, F_CREATE_CTX, F_SET_CTX, F_DESTROY_CTX,
    N_WRAPPED,
    /* not wrapped, used by save/reload (queries, context selection, synchronize) */
    F_GET_DEVICE = N_WRAPPED, F_GET_CTX, F_SYNC_DEVICE, F_SYNC_DEVICE_TIMEOUT,
    N_FUNCS
};

static const char *const NAMES[N_FUNCS] = {
    "halMemAlloc", "halMemFree", "halMemAddressReserve", "halMemAddressFree", "halMemCreate", "halMemRelease",
    "halMemMap", "halMemUnmap", "drvMemcpy",
    "aclrtSetDevice", "aclrtResetDevice", "aclrtResetDeviceForce", "aclFinalize", "aclrtCreateContext", "aclrtSetCurrentContext",
    "aclrtDestroyContext", "aclrtGetDevice", "aclrtGetCurrentContext", "aclrtSynchronizeDevice", "aclrtSynchronizeDeviceWithTimeout",
};

static void *volatile g_real[N_FUNCS];
#define API __attribute__((visibility("default")))
API drvError_t halMemAlloc(void **, unsigned long long, unsigned long long);
API drvError_t halMemFree(void *);
API drvError_t halMemAddressReserve(void **, size_t, size_t, void *, uint64_t);
API drvError_t halMemAddressFree(void *);
API drvError_t halMemCreate(drv_mem_handle_t **, size_t, const struct drv_mem_prop *, uint64_t);
API drvError_t halMemRelease(drv_mem_handle_t *);
API drvError_t halMemMap(void *, size_t, size_t, drv_mem_handle_t *, uint64_t);
API drvError_t halMemUnmap(void *);
API drvError_t drvMemcpy(DVdeviceptr, size_t, DVdeviceptr, size_t);
API aclError aclrtSetDevice(int32_t);
API aclError aclrtResetDevice(int32_t);
API aclError aclrtResetDeviceForce(int32_t);
API aclError aclFinalize(void);
API aclError aclrtCreateContext(void **, int32_t);
API aclError aclrtSetCurrentContext(void *);
API aclError aclrtDestroyContext(void *);

/* Same order as the enum. */
static void *const g_wrappers[N_WRAPPED] = {
    (void *)halMemAlloc,    (void *)halMemFree,      (void *)halMemAddressReserve, (void *)halMemAddressFree,
    (void *)halMemCreate,   (void *)halMemRelease,   (void *)halMemMap,            (void *)halMemUnmap,
    (void *)drvMemcpy,      (void *)aclrtSetDevice,  (void *)aclrtResetDevice,     (void *)aclrtResetDeviceForce,
    (void *)aclFinalize,
    (void *)aclrtCreateContext, (void *)aclrtSetCurrentContext, (void *)aclrtDestroyContext,
};

static int is_wrapper(void *p) {
    for (int i = 0; i < N_WRAPPED; i++)
        if (g_wrappers[i] == p) return 1;
    return 0;
}

/* The CANN libraries a real function may live in (the driver's, the runtime's, ACL's). */
static const char *const LIBS[] = {"libascend_hal.so", "libacl_rt.so", "libascendcl.so", "libruntime.so"};

/* The real function `i`: what dlsym() handed out, else the next definition after this library
 * (programs linked against CANN), else the CANN library mapped in the process that exports it. */
static void *real(int i) {
    void *p = g_real[i];
    if (p) return p;
    p = npusnap_next_definition(NAMES[i], LIBS, sizeof LIBS / sizeof LIBS[0], is_wrapper);
    if (p) g_real[i] = p;
    return p;
}

/* ------------------------------------------------------------------ the tables */

enum { K_ALLOC = 0, K_VMM = 1, K_REGISTERED = 2 };

/* What is copied: a halMemAlloc allocation, a mapped VMM range (its contents are those of the
 * physical chunk behind it), or a range the application registered. */
struct alloc {
    uintptr_t ptr;
    size_t size;
    int32_t dev;
    int kind;
    int excluded;
    void *copy;  /* host copy (npusnap_devmem_save) */
    int in_file; /* copied into the file of npusnap_devmem_save_fd instead */
    /* Write tracking (writes.c): the epoch the allocation was made in, whether the job got it
     * through aclrtMalloc* / aclrtMapMem (else it is the runtime's own and always written), and
     * per piece the epoch of the last write the agent was told of (NULL: none yet). */
    uint32_t born;
    int app;
    uint32_t *gen;
};

struct range {
    uintptr_t start;
    size_t size;
};

struct handle {
    drv_mem_handle_t *h;
    size_t size;
    int32_t dev;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv; /* CLOCK_MONOTONIC */
/* The lock's hold on the job's writers (npusnap_devmem_hold_writers). */
static __thread int t_entered; /* this thread's outermost writer went through the entry */
static int g_entry_closed;     /* the lock's hold on writers (npusnap_devmem_hold_writers) */
static int g_writers_inside;   /* the job's outermost writer calls past their entry */
static pthread_mutex_t g_emu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_ecv; /* monotonic: devmem_init */
static struct alloc *g_allocs;
static size_t g_n, g_cap;
static struct range *g_excl;
static size_t g_nexcl, g_excl_cap;
static struct range *g_reserved; /* VMM address reservations (no contents of their own) */
static size_t g_nres, g_res_cap;
static struct handle *g_handles; /* VMM physical chunks */
static size_t g_nh, g_h_cap;
static int g_copies_inflight; /* the job's drvMemcpy calls running now */
/* Write tracking: a save happens at the end of an epoch and starts the next; a piece written
 * (as its stamp says) in an epoch later than save k's is copied by a save since k. */
#define PIECE ((size_t)NPUSNAP_DEVMEM_PIECE_BYTES)
static uint32_t g_epoch = 1;
static uint32_t g_all_gen;         /* every piece may have been written up to this epoch */
static char g_untracked[128];      /* a writer the agent cannot follow was looked up: every save full */
static uint64_t g_marks_all;       /* how many calls wrote what the agent cannot tell */
static char g_all_why[96];         /* the last of them */
#define LINEAGE 16
static struct {
    uint64_t id;
    uint32_t epoch;
} g_lineage[LINEAGE]; /* the last saves of this process's history, newest last */
static int g_nlineage;
static uint64_t g_since_id;         /* the next save copies only what changed since this save */
static int g_check_all;             /* ... but copies everything (a test of the tracking) */
static unsigned char *g_unchanged;  /* the last save: per piece in file order, 1 if not written since */
static size_t g_npieces;
static int g_since_used;            /* the last save was incremental */
static uint64_t g_save_id;
static uint32_t g_save_epoch;
static int g_saved;
static int g_interposed = -1; /* computed lazily */
#define MAX_DEVS 1024
/* Devices the job opened: per device, its aclrtSetDevice calls not yet matched by an
 * aclrtResetDevice (CANN counts them and releases the device at 0: until then its memory stays and
 * must be kept), at least 1 for a device only seen through a context. */
static unsigned g_devs[MAX_DEVS];
/* Held across the runtime's aclrtSetDevice / aclrtResetDevice and the count kept here, so that the
 * count changes in the runtime's order: a set in one thread racing the last reset in another must
 * not leave this count at 0 (memory forgotten) while the runtime still holds the device. Not taken
 * by atfork_prepare (the runtime's release may wait on callbacks); a child starts it afresh. */
static pthread_mutex_t g_life = PTHREAD_MUTEX_INITIALIZER;
static void *g_dev_ctx[MAX_DEVS];      /* a context of each such device, for synchronize */
static __thread int t_agent;           /* this thread copies for npusnap: its drvMemcpy is not the job's */

/* Whether this process ever opened a device, for a reader that cannot ask: a stopped process
 * runs no agent code, so npusnap reads this record through /proc/PID/mem (the symbol and layout
 * come from the contract; npusnap_cli/host/agentrecord.py). It only counts up: a device reset
 * leaves a runtime that was there, and "never opened" is the one answer npusnap acts on.
 *
 * A copy of the process (fork) starts a record of its own in its fork handler; one that has not
 * run it yet (stopped right after fork) or never will (clone without fork handlers) still holds
 * its parent's. So every device-opening call first claims the record for the calling process: a
 * record naming another pid means this process made no such call since it was copied, and owns
 * no device (a device context is the opening process's own; CANN does not survive fork). */
API struct npusnap_agent_record NPUSNAP_AGENT_RECORD_SYMBOL = {.magic = NPUSNAP_AGENT_RECORD_MAGIC};

static void record_start(void) {
    NPUSNAP_AGENT_RECORD_SYMBOL.opened = 0;
    __atomic_store_n(&NPUSNAP_AGENT_RECORD_SYMBOL.pid, (int32_t)getpid(), __ATOMIC_RELEASE);
}

/* The wrappers see the job's calls only when this library was preloaded: loaded before libc,
 * its definitions come first in the global scope. One loaded later (attach, a Python start()
 * without LD_PRELOAD) counts nothing, and its record says so. */
static int seen_libc;
static int before_libc(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    const char *name = info->dlpi_name ? info->dlpi_name : "";
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (!strncmp(base, "libc.so", 7) || !strncmp(base, "libc-", 5)) seen_libc = 1;
    if (info->dlpi_addr == (ElfW(Addr))data) return seen_libc ? 2 : 1;
    return 0;
}

static int loaded_before_libc(void) {
    Dl_info self;
    if (!dladdr((void *)loaded_before_libc, &self) || !self.dli_fbase) return 0;
    /* dlpi_addr is the load bias: the base of a shared object linked at 0 */
    seen_libc = 0;
    return dl_iterate_phdr(before_libc, self.dli_fbase) == 1;
}

int npusnap_devmem_preloaded(void) { return (int)NPUSNAP_AGENT_RECORD_SYMBOL.tracking; }

/* What runs after a device-opening call of the job succeeded (core.c's: a forked child's agent
 * starts then). Set once, by the library's constructor. */
static void (*g_on_device_open)(void);

void npusnap_devmem_on_device_open(void (*fn)(void)) { __atomic_store_n(&g_on_device_open, fn, __ATOMIC_RELEASE); }

static void device_opened(void) {
    void (*fn)(void) = __atomic_load_n(&g_on_device_open, __ATOMIC_ACQUIRE);
    if (fn) fn();
}

/* No lock: a copy made without fork handlers may hold one locked for ever. Every thread resets
 * (if the record is another process's) before it counts, so the count ends at one or more. */
static void record_opened(void) {
    int32_t me = (int32_t)getpid();
    if (__atomic_load_n(&NPUSNAP_AGENT_RECORD_SYMBOL.pid, __ATOMIC_ACQUIRE) != me) {
        __atomic_store_n(&NPUSNAP_AGENT_RECORD_SYMBOL.opened, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&NPUSNAP_AGENT_RECORD_SYMBOL.pid, me, __ATOMIC_RELEASE);
    }
    __atomic_fetch_add(&NPUSNAP_AGENT_RECORD_SYMBOL.opened, 1, __ATOMIC_RELAXED);
}

/* A forked child keeps only the forking thread: nothing of the job is in flight there, and it
 * holds no snapshot of its own (CANN does not survive fork either). */
static void atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void ws_after_fork(void);
static void atfork_child(void) {
    record_start();
    ws_after_fork();
    g_copies_inflight = 0;
    for (size_t i = 0; i < g_n; i++) {
        free(g_allocs[i].copy);
        g_allocs[i].copy = NULL;
        free(g_allocs[i].gen);
        g_allocs[i].gen = NULL;
    }
    g_n = g_nres = g_nh = 0;
    g_saved = 0;
    memset(g_devs, 0, sizeof g_devs);
    memset(g_dev_ctx, 0, sizeof g_dev_ctx);
    pthread_mutex_init(&g_life, NULL);
    pthread_mutex_unlock(&g_mu);
}

__attribute__((constructor)) static void devmem_init(void) {
    /* tracking before the pid: a reader takes a record with no pid yet as not filled in */
    NPUSNAP_AGENT_RECORD_SYMBOL.tracking = (uint32_t)loaded_before_libc();
    record_start();
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    monotonic_cond_init(&g_cv);
    monotonic_cond_init(&g_ecv);
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
    free(g_allocs[i].gen);
    g_allocs[i] = g_allocs[--g_n];
}

static int grow(void **arr, size_t *cap, size_t n, size_t elem) {
    if (n < *cap) return 0;
    size_t c = *cap ? *cap * 2 : 64;
    void *na = realloc(*arr, c * elem);
    if (!na) return -ENOMEM;
    *arr = na;
    *cap = c;
    return 0;
}

/* Allocations name the driver's device id (halMemAlloc's flag, halMemCreate's prop), the job's
 * contexts its user id (aclrtSetDevice): ASCEND_RT_VISIBLE_DEVICES, a comma-separated ascending
 * list of driver ids read by the runtime once at init, maps the user id (the index) to the driver
 * id (runtime src/runtime/core/src/runtime.cc, GetVisibleDevices, ChgUserDevIdToDeviceId). Read
 * here the same way; allocations are tracked under the user id. */
static pthread_once_t g_vis_once = PTHREAD_ONCE_INIT;
static int32_t g_vis[MAX_DEVS];
static int g_nvis = -1; /* -1: the variable is unset, the ids are the same */

static void vis_read(void) {
    const char *p = getenv("ASCEND_RT_VISIBLE_DEVICES");
    if (!p) return;
    g_nvis = 0;
    while (*p >= '0' && *p <= '9' && g_nvis < MAX_DEVS) {
        char *end;
        long v = strtol(p, &end, 10);
        g_vis[g_nvis++] = v > INT32_MAX ? -1 : (int32_t)v;
        if (*end != ',') break;
        p = end + 1;
    }
}

static int32_t user_dev(int32_t drv) {
    pthread_once(&g_vis_once, vis_read);
    if (g_nvis < 0 || drv < 0) return drv;
    for (int i = 0; i < g_nvis; i++)
        if (g_vis[i] == drv) return i;
    return -1;
}

/* g_mu held */
static int add(uintptr_t p, size_t n, int32_t dev, int kind) {
    record_opened();
    struct alloc *a = find(p);
    if (a) { /* the same address again (freed behind our back, or registered twice) */
        a->size = n;
        a->dev = dev;
        a->kind = kind;
        a->excluded = in_excluded(p, n);
        a->born = g_epoch;
        a->app = kind == K_REGISTERED;
        free(a->gen);
        a->gen = NULL;
        return 0;
    }
    if (grow((void **)&g_allocs, &g_cap, g_n, sizeof *g_allocs) != 0) return -ENOMEM;
    g_allocs[g_n++] = (struct alloc){p, n, dev, kind, in_excluded(p, n), NULL, 0, g_epoch, kind == K_REGISTERED, NULL};
    return 0;
}

static void untrack(uintptr_t p) {
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++)
        if (g_allocs[i].ptr == p && g_allocs[i].kind != K_REGISTERED) {
            drop_at(i);
            break;
        }
    pthread_mutex_unlock(&g_mu);
}

/* --- write tracking (writes.c tells what the job writes) ----------------------------------- */

static size_t pieces_of(const struct alloc *a) { return (a->size + PIECE - 1) / PIECE; }

/* The epoch of piece j's last write, as far as the agent knows (UINT32_MAX: always written). */
static uint32_t piece_gen(const struct alloc *a, size_t j) {
    if (!a->app || g_untracked[0]) return UINT32_MAX;
    uint32_t g = a->gen ? a->gen[j] : 0;
    if (a->born > g) g = a->born;
    if (g_all_gen > g) g = g_all_gen;
    return g;
}

/* [p, p + n) was written in this epoch (called after the call that writes it returned). */
void npusnap_devmem_mark(uintptr_t p, size_t n) {
    if (!n || t_agent) return;
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++) {
        struct alloc *a = &g_allocs[i];
        if (p >= a->ptr + a->size || p + n <= a->ptr || !a->app) continue;
        size_t np = pieces_of(a);
        if (!a->gen && !(a->gen = calloc(np ? np : 1, sizeof *a->gen))) {
            a->app = 0; /* untracked from now on: always written */
            continue;
        }
        uintptr_t lo = p > a->ptr ? p : a->ptr, hi = p + n < a->ptr + a->size ? p + n : a->ptr + a->size;
        for (size_t j = (lo - a->ptr) / PIECE; j <= (hi - 1 - a->ptr) / PIECE && j < np; j++) a->gen[j] = g_epoch;
    }
    pthread_mutex_unlock(&g_mu);
}

/* Everything may be written in this epoch, by a call about to be made (its stamp before the call,
 * writes.c): counted with the stamp after it, by npusnap_devmem_mark_all. */
void npusnap_devmem_mark_all_before(void) {
    if (t_agent) return;
    pthread_mutex_lock(&g_mu);
    g_all_gen = g_epoch;
    pthread_mutex_unlock(&g_mu);
}

void npusnap_devmem_mark_all(const char *why) {
    if (t_agent) return;
    pthread_mutex_lock(&g_mu);
    g_all_gen = g_epoch;
    g_marks_all++;
    snprintf(g_all_why, sizeof g_all_why, "%s", why ? why : "?");
    pthread_mutex_unlock(&g_mu);
}

/* The job got [p, p + n) through aclrtMalloc* / aclrtMapMem: its writes are the job's calls. */
void npusnap_devmem_mark_app(uintptr_t p, size_t n) {
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++)
        if (p < g_allocs[i].ptr + g_allocs[i].size && p + n > g_allocs[i].ptr) g_allocs[i].app = 1;
    pthread_mutex_unlock(&g_mu);
}

void npusnap_devmem_untracked(const char *name) {
    pthread_mutex_lock(&g_mu);
    if (!g_untracked[0]) {
        snprintf(g_untracked, sizeof g_untracked, "%s", name);
        agent_log("[writes] %s was looked up: its writes cannot be followed, every later save is full", name);
    }
    pthread_mutex_unlock(&g_mu);
}

API void npusnap_devmem_save_since(uint64_t since_id, int check_all) {
    pthread_mutex_lock(&g_mu);
    g_since_id = since_id;
    g_check_all = check_all;
    pthread_mutex_unlock(&g_mu);
}

API void npusnap_devmem_tracking(npusnap_devmem_tracking_info *out) {
    pthread_mutex_lock(&g_mu);
    memset(out, 0, sizeof *out);
    out->epoch = g_epoch;
    for (size_t i = 0; i < g_n; i++) out->app_bytes += g_allocs[i].app ? g_allocs[i].size : 0;
    out->marks_all = g_marks_all;
    snprintf(out->all_why, sizeof out->all_why, "%s", g_all_why);
    snprintf(out->untracked, sizeof out->untracked, "%s", g_untracked);
    out->nlineage = g_nlineage;
    for (int i = 0; i < g_nlineage; i++) {
        out->lineage_ids[i] = g_lineage[i].id;
        out->lineage_epochs[i] = g_lineage[i].epoch;
    }
    out->save_id = g_save_id;
    out->save_epoch = g_save_epoch;
    out->since_used = g_since_used;
    out->unchanged = g_unchanged;
    out->npieces = g_npieces;
    pthread_mutex_unlock(&g_mu);
}


static void note_oom(int rc) {
    if (rc != 0) agent_log("[devmem] out of memory tracking a device allocation");
}

static drvError_t missing(int i) {
    agent_log("[devmem] %s is not exported by the loaded CANN libraries", NAMES[i]);
    return i < F_SET_DEVICE ? DRV_ERROR_NOT_SUPPORT : ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
}

/* ------------------------------------------------------------------ the driver wrappers */

#define REAL(idx, type)                      \
    __typeof__(type) fn = (type)real(idx); \
    if (!fn) return missing(idx)

API drvError_t halMemAlloc(void **pp, unsigned long long size, unsigned long long flag) {
    REAL(F_HAL_ALLOC, drvError_t(*)(void **, unsigned long long, unsigned long long));
    drvError_t rc = fn(pp, size, flag);
    if (rc == 0 && pp && *pp) {
        pthread_mutex_lock(&g_mu);
        note_oom(add((uintptr_t)*pp, (size_t)size, user_dev((int32_t)(flag & HAL_FLAG_DEVID_MASK)), K_ALLOC));
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* Before memory goes away: a concurrent copy takes what it still needs of it first. */
static void before_release(uintptr_t p) {
    size_t n = 0;
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find(p);
    if (a) n = a->size;
    pthread_mutex_unlock(&g_mu);
    npusnap_devmem_before_write(p, n);
}

API drvError_t halMemFree(void *pp) {
    REAL(F_HAL_FREE, drvError_t(*)(void *));
    write_open(0); /* below the runtime's entry check */
    before_release((uintptr_t)pp);
    drvError_t rc = fn(pp);
    npusnap_devmem_write_close();
    if (rc == 0) untrack((uintptr_t)pp);
    return rc;
}

API drvError_t halMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr, uint64_t flag) {
    REAL(F_HAL_RESERVE, drvError_t(*)(void **, size_t, size_t, void *, uint64_t));
    drvError_t rc = fn(ptr, size, alignment, addr, flag);
    if (rc == 0 && ptr && *ptr) {
        record_opened();
        pthread_mutex_lock(&g_mu);
        int g = grow((void **)&g_reserved, &g_res_cap, g_nres, sizeof *g_reserved);
        if (g == 0) g_reserved[g_nres++] = (struct range){(uintptr_t)*ptr, size};
        note_oom(g);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemAddressFree(void *ptr) {
    REAL(F_HAL_ADDR_FREE, drvError_t(*)(void *));
    drvError_t rc = fn(ptr);
    if (rc == 0) {
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_nres; i++)
            if (g_reserved[i].start == (uintptr_t)ptr) {
                g_reserved[i] = g_reserved[--g_nres];
                break;
            }
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemCreate(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop, uint64_t flag) {
    REAL(F_HAL_CREATE, drvError_t(*)(drv_mem_handle_t **, size_t, const struct drv_mem_prop *, uint64_t));
    drvError_t rc = fn(handle, size, prop, flag);
    if (rc == 0 && handle && *handle) {
        record_opened();
        pthread_mutex_lock(&g_mu);
        int g = grow((void **)&g_handles, &g_h_cap, g_nh, sizeof *g_handles);
        if (g == 0) g_handles[g_nh++] = (struct handle){*handle, size, prop ? user_dev((int32_t)prop->devid) : -1};
        note_oom(g);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemRelease(drv_mem_handle_t *handle) {
    REAL(F_HAL_RELEASE, drvError_t(*)(drv_mem_handle_t *));
    drvError_t rc = fn(handle);
    if (rc == 0) {
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_nh; i++)
            if (g_handles[i].h == handle) {
                g_handles[i] = g_handles[--g_nh];
                break;
            }
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* A mapped VMM range is saved and reloaded by its virtual address, like an allocation: its bytes
 * are those of the physical chunk at `offset`. */
API drvError_t halMemMap(void *ptr, size_t size, size_t offset, drv_mem_handle_t *handle, uint64_t flag) {
    REAL(F_HAL_MAP, drvError_t(*)(void *, size_t, size_t, drv_mem_handle_t *, uint64_t));
    drvError_t rc = fn(ptr, size, offset, handle, flag);
    if (rc == 0 && ptr) {
        pthread_mutex_lock(&g_mu);
        int32_t dev = -1;
        for (size_t i = 0; i < g_nh; i++)
            if (g_handles[i].h == handle) dev = g_handles[i].dev;
        note_oom(add((uintptr_t)ptr, size, dev, K_VMM));
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

API drvError_t halMemUnmap(void *ptr) {
    REAL(F_HAL_UNMAP, drvError_t(*)(void *));
    write_open(0); /* below the runtime's entry check */
    before_release((uintptr_t)ptr);
    drvError_t rc = fn(ptr);
    npusnap_devmem_write_close();
    if (rc == 0) untrack((uintptr_t)ptr);
    return rc;
}

/* The job's driver copies are counted (a synchronous copy past the runtime's entry check when
 * Lock came still runs: save waits for it); npusnap's own copies (t_agent) are not. */
API drvError_t drvMemcpy(DVdeviceptr dst, size_t destMax, DVdeviceptr src, size_t n) {
    REAL(F_DRV_MEMCPY, drvError_t(*)(DVdeviceptr, size_t, DVdeviceptr, size_t));
    if (t_agent) return fn(dst, destMax, src, n);
    write_open(0); /* below the runtime's entry check */
    npusnap_devmem_before_write((uintptr_t)dst, n);
    npusnap_devmem_mark((uintptr_t)dst, n); /* and after it: writes.c, stamp_ranges */
    pthread_mutex_lock(&g_mu);
    g_copies_inflight++;
    pthread_mutex_unlock(&g_mu);
    drvError_t rc = fn(dst, destMax, src, n);
    npusnap_devmem_write_close();
    pthread_mutex_lock(&g_mu);
    if (--g_copies_inflight == 0) pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    npusnap_devmem_mark((uintptr_t)dst, n); /* the job's own driver copy writes its destination */
    return rc;
}

/* ------------------------------------------------------------------ the context wrappers */

static void remember_ctx(int32_t dev, int set_device) {
    aclError (*gc)(void **) = (aclError(*)(void **))real(F_GET_CTX);
    void *ctx = NULL;
    if (dev < 0 || dev >= MAX_DEVS) return;
    pthread_mutex_lock(&g_mu);
    if (set_device) g_devs[dev]++;
    else if (!g_devs[dev]) g_devs[dev] = 1;
    pthread_mutex_unlock(&g_mu);
    if (!gc || gc(&ctx) != ACL_SUCCESS || !ctx) return;
    pthread_mutex_lock(&g_mu);
    g_dev_ctx[dev] = ctx;
    pthread_mutex_unlock(&g_mu);
}

static void current_place(int32_t *dev) {
    *dev = -1;
    aclError (*gd)(int32_t *) = (aclError(*)(int32_t *))real(F_GET_DEVICE);
    if (gd && gd(dev) != ACL_SUCCESS) *dev = -1;
}

API aclError aclrtSetDevice(int32_t deviceId) {
    REAL(F_SET_DEVICE, aclError(*)(int32_t));
    pthread_mutex_lock(&g_life);
    aclError rc = fn(deviceId);
    if (rc == ACL_SUCCESS) remember_ctx(deviceId, 1);
    pthread_mutex_unlock(&g_life);
    if (rc == ACL_SUCCESS) {
        record_opened();
        device_opened();
    }
    return rc;
}

API aclError aclrtCreateContext(void **ctx, int32_t deviceId) {
    REAL(F_CREATE_CTX, aclError(*)(void **, int32_t));
    pthread_mutex_lock(&g_life);
    aclError rc = fn(ctx, deviceId);
    if (rc == ACL_SUCCESS) remember_ctx(deviceId, 0);
    pthread_mutex_unlock(&g_life);
    if (rc == ACL_SUCCESS) {
        record_opened();
        device_opened();
    }
    return rc;
}

API aclError aclrtSetCurrentContext(void *ctx) {
    REAL(F_SET_CTX, aclError(*)(void *));
    aclError rc = fn(ctx);
    if (rc == ACL_SUCCESS && !t_agent) {
        record_opened();
        int32_t dev;
        current_place(&dev);
        if (dev >= 0 && dev < MAX_DEVS) {
            pthread_mutex_lock(&g_mu);
            if (!g_devs[dev]) g_devs[dev] = 1;
            if (!g_dev_ctx[dev]) g_dev_ctx[dev] = ctx;
            pthread_mutex_unlock(&g_mu);
        }
        device_opened();
    }
    return rc;
}

/* A destroyed context must not be selected to drain its device: forget it (the device keeps its
 * primary context, which the next aclrtSetDevice / aclrtSetCurrentContext records again). */
API aclError aclrtDestroyContext(void *ctx) {
    REAL(F_DESTROY_CTX, aclError(*)(void *));
    aclError rc = fn(ctx);
    if (rc == ACL_SUCCESS && ctx) {
        pthread_mutex_lock(&g_mu);
        for (int d = 0; d < MAX_DEVS; d++)
            if (g_dev_ctx[d] == ctx) g_dev_ctx[d] = NULL;
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* The device released (count 0, or a forced reset): the runtime frees its memory through halMemFree
 * (untracked there); a range it released otherwise must not be copied from a device that is gone.
 * g_mu held. */
static void forget_device_locked(int32_t dev) {
    for (size_t i = 0; i < g_n;) {
        if (g_allocs[i].dev == dev && g_allocs[i].kind != K_REGISTERED) drop_at(i);
        else i++;
    }
    g_devs[dev] = 0;
    g_dev_ctx[dev] = NULL;
}

static aclError reset_device(int32_t deviceId, int func) {
    aclError (*fn)(int32_t) = (aclError(*)(int32_t))real(func);
    if (!fn) return missing(func);
    pthread_mutex_lock(&g_life);
    aclError rc = fn(deviceId);
    if (rc == ACL_SUCCESS && deviceId >= 0 && deviceId < MAX_DEVS) {
        pthread_mutex_lock(&g_mu);
        /* another aclrtSetDevice still holds the device: CANN keeps it, and its memory */
        if (func == F_RESET_DEVICE && g_devs[deviceId] > 1) g_devs[deviceId]--;
        else forget_device_locked(deviceId);
        pthread_mutex_unlock(&g_mu);
    }
    pthread_mutex_unlock(&g_life);
    return rc;
}

API aclError aclrtResetDevice(int32_t deviceId) { return reset_device(deviceId, F_RESET_DEVICE); }

/* Releases the device whatever its count (CANN's aclrtResetDeviceForce). */
API aclError aclrtResetDeviceForce(int32_t deviceId) { return reset_device(deviceId, F_RESET_DEVICE_FORCE); }

/* The aclFinalize the caller itself would reach: its own lookup scope's (a library dlopen'ed
 * RTLD_LOCAL, as Python loads torch_npu, reaches its libascendcl.so there, which the global scope
 * and RTLD_NEXT do not see), else real(). aclInit's state belongs to the ACL front-end that
 * served it, so finalizing another front-end would fail with ACL_ERROR_UNINITIALIZE. */
static aclError (*caller_finalize(void *ret))(void) {
    Dl_info info;
    dlsym_fn ds = npusnap_real_dlsym();
    if (ds && ret && dladdr(ret, &info) && info.dli_fname) {
        void *h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (h) {
            void *p = ds(h, "aclFinalize");
            dlclose(h); /* NOLOAD handle: only drops the reference it took */
            if (p && !is_wrapper(p)) return (aclError(*)(void))p;
        }
    }
    return (aclError(*)(void))real(F_FINALIZE);
}

API aclError aclFinalize(void) {
    aclError (*fn)(void) = caller_finalize(__builtin_return_address(0));
    if (!fn) return missing(F_FINALIZE);
    aclError rc = fn();
    if (rc == ACL_SUCCESS) {
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_n;) {
            if (g_allocs[i].kind != K_REGISTERED) drop_at(i);
            else i++;
        }
        g_nres = g_nh = 0;
        memset(g_devs, 0, sizeof g_devs);
        memset(g_dev_ctx, 0, sizeof g_dev_ctx);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* dlsym(): hand out the wrapper for a wrapped name, remembering the real function. Every other
 * lookup -- and every RTLD_NEXT lookup, whose meaning depends on the caller -- goes to the real
 * dlsym as a tail call, so that glibc still sees the original caller's return address. */
API void *dlsym(void *handle, const char *name) {
    dlsym_fn ds = npusnap_real_dlsym();
    if (handle != RTLD_NEXT && ((name[0] == 'a' && name[1] == 'c' && name[2] == 'l') || (name[0] == 'r' && name[1] == 't'))) {
        /* What writes device memory, and what tells where (writes.c). */
        void *p = ds(handle, name);
        void *w = npusnap_writes_wrapper_for(handle, name, p, ds);
        if (w) return w;
        if (name[0] == 'r' || (name[3] == 'n' && name[4] == 'n')) return p;
    }
    if (handle != RTLD_NEXT && name[0] == 'H' && name[1] == 'c' && name[2] == 'c' && name[3] == 'l') {
        /* HCCL's names that take a communicator: the agent's wrapper (hccl.c). */
        void *p = ds(handle, name);
        void *w = npusnap_hccl_wrapper_for(name, p);
        return w ? w : p;
    }
    if (handle != RTLD_NEXT && ((name[0] == 'h' && name[1] == 'a' && name[2] == 'l') ||
                                (name[0] == 'd' && name[1] == 'r' && name[2] == 'v') ||
                                (name[0] == 'a' && name[1] == 'c' && name[2] == 'l'))) {
        for (int i = 0; i < N_WRAPPED; i++)
            if (!strcmp(name, NAMES[i])) {
                void *p = ds(handle, name);
                if (!p || p == g_wrappers[i]) return p;
                if (i == F_FINALIZE) {
                    /* aclInit's state belongs to the ACL front-end that served it (libacl_rt and
                     * libascendcl each keep their own): the wrapper may stand only for the
                     * aclFinalize a direct call would reach, never pin another library's. A
                     * lookup in another front-end gets its own function, untracked. */
                    return p == real(i) ? g_wrappers[i] : p;
                }
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
         * finds our dlsym and the driver's allocation call first. (Not RTLD_DEFAULT: its scope
         * depends on the caller, and a -Bsymbolic library always finds itself first.) */
        dlsym_fn ds = npusnap_real_dlsym();
        void *main_handle = dlopen(NULL, RTLD_LAZY);
        g_interposed = ds && main_handle && ds(main_handle, "dlsym") == (void *)dlsym &&
                       ds(main_handle, "halMemAlloc") == (void *)halMemAlloc &&
                       ds(main_handle, "halMemMap") == (void *)halMemMap;
        if (main_handle) dlclose(main_handle);
    }
    return g_interposed;
}

static void free_copies_locked(void) {
    for (size_t i = 0; i < g_n; i++) {
        free(g_allocs[i].copy);
        g_allocs[i].copy = NULL;
        g_allocs[i].in_file = 0;
    }
    g_saved = 0;
}

typedef drvError_t (*memcpy_fn_t)(DVdeviceptr, size_t, DVdeviceptr, size_t);

/* n bytes from host memory at src to allocation a at offset off. 0, or -EIO with err set. */
static int copy_to_device(memcpy_fn_t memcpy_fn, const struct alloc *a, size_t off, const void *src, size_t n,
                          char *err, size_t errlen) {
    drvError_t c = memcpy_fn((DVdeviceptr)(a->ptr + off), n, (DVdeviceptr)(uintptr_t)src, n);
    if (c == 0) return 0;
    seterr(err, errlen, "drvMemcpy host to device of %zu bytes at %#lx (device %d) failed with %d", n,
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
 * (its page cache): the copy to the device is then the only copy, where reading into a buffer
 * first copies every byte twice (docs/benchmarks.md, "Measurements behind design choices").
 * Through *bounce (allocated on first use) where the file cannot be mapped. The caller checked that the file holds
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
 * runs meanwhile (it waits in the runtime's lock), so the other cores shorten both directions:
 *  - save: each thread copies its chunk off the device into its own buffer and writes it at its
 *    place in the file (pwrite); the CLI reserves the file's blocks first (image/streamhash.py).
 *    The file is then not written front to back, which is why npusnap's CLI hashes it only after
 *    the lock answered (pipelines/dump/devmemory.py);
 *  - reload: each thread copies its chunk from a mapping of the file to the device; the page-table
 *    work of the mappings goes in parallel even where the device copy itself is serialized.
 * What the threads gain is in docs/benchmarks.md ("Measurements behind design choices").
 * The driver's copy needs no context: each thread copies by address. */
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
    drvError_t rc = x->memcpy_fn((DVdeviceptr)(uintptr_t)buf, c->n, (DVdeviceptr)(a->ptr + c->a_off), c->n);
    if (rc != 0) {
        seterr(err, errlen, "drvMemcpy device to host of %zu bytes at %#lx (device %d) failed with %d", c->n,
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
    for (size_t i = 0; i < extra; i++)
        if (npusnap_quiet_thread_create(&th[started], NULL, xfer_main, x) == 0) started++;
    xfer_main(x);
    for (size_t i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&x->mu);
    if (x->ret != 0) seterr(err, errlen, "%s", x->err);
    return x->ret;
}

/* --- draining the device before the copy ------------------------------------------------- */

struct sync_job {
    aclError (*fn)(void);
    aclError rc;
    int done;
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    void *ctx;
};

static void *sync_thread(void *arg) {
    struct sync_job *j = arg;
    aclError (*sc)(void *) = (aclError(*)(void *))real(F_SET_CTX);
    t_agent = 1;
    if (sc && j->ctx) sc(j->ctx);
    aclError rc = j->fn();
    pthread_mutex_lock(j->mu);
    j->rc = rc;
    j->done = 1;
    pthread_cond_broadcast(j->cv);
    int free_it = j->done == 2;
    pthread_mutex_unlock(j->mu);
    if (free_it) free(j);
    return NULL;
}

/* Synchronize one device (its context selected on this thread), bounded by timeout_ms:
 * aclrtSynchronizeDeviceWithTimeout where the runtime has it; else aclrtSynchronizeDevice on a
 * thread of its own that is waited for until the deadline (a hung stream then leaves that thread
 * behind, parked in the runtime, and the save fails). 0, or -ETIMEDOUT / -EIO with err set. */
static int sync_device(int32_t dev, void *ctx, int timeout_ms, char *err, size_t errlen) {
    aclError (*sc)(void *) = (aclError(*)(void *))real(F_SET_CTX);
    aclError (*swt)(int32_t) = (aclError(*)(int32_t))real(F_SYNC_DEVICE_TIMEOUT);
    if (swt) {
        if (sc) sc(ctx);
        aclError rc = swt(timeout_ms > 0 ? timeout_ms : 1);
        if (rc == ACL_SUCCESS) return 0;
        seterr(err, errlen,
               "device %d did not finish its queued work within %d ms (aclrtSynchronizeDeviceWithTimeout: %d): a "
               "kernel or a collective is still running",
               dev, timeout_ms, rc);
        return -ETIMEDOUT;
    }
    aclError (*sync)(void) = (aclError(*)(void))real(F_SYNC_DEVICE);
    if (!sync) {
        seterr(err, errlen, "the runtime exports no aclrtSynchronizeDevice: cannot drain device %d", dev);
        return -ENOSYS;
    }
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    struct sync_job *j = calloc(1, sizeof *j);
    if (!j) return -ENOMEM;
    *j = (struct sync_job){sync, 0, 0, &mu, &cv, ctx};
    pthread_t th;
    int cr = npusnap_quiet_thread_create(&th, NULL, sync_thread, j);
    if (cr != 0) {
        free(j);
        seterr(err, errlen, "cannot start a thread to synchronize device %d", dev);
        return -cr;
    }
    pthread_detach(th);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&mu);
    int w = 0;
    while (!j->done && w != ETIMEDOUT) w = pthread_cond_timedwait(&cv, &mu, &dl);
    int ret = 0;
    if (!j->done) {
        j->done = 2; /* the thread frees it when (if) the runtime ever returns */
        seterr(err, errlen,
               "device %d did not finish its queued work within %d ms (aclrtSynchronizeDevice still waiting): a "
               "kernel or a collective is still running",
               dev, timeout_ms);
        ret = -ETIMEDOUT;
    } else {
        if (j->rc != ACL_SUCCESS) {
            seterr(err, errlen, "aclrtSynchronizeDevice (device %d) failed with %d", dev, j->rc);
            ret = -EIO;
        }
        free(j);
    }
    pthread_mutex_unlock(&mu);
    return ret;
}

/* After Lock: every device that holds tracked memory drains its queues (bounded), then the job's
 * driver copies still in flight end (bounded), then the devices drain once more (a launch that was
 * past the runtime's entry check when Lock came may have queued work after the first drain).
 * 0, or -errno with err set. */
static double g_drain_s;
static int quiesce_timed(int timeout_ms, char *err, size_t errlen);
static int quiesce(int timeout_ms, char *err, size_t errlen) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int rc = quiesce_timed(timeout_ms, err, errlen);
    clock_gettime(CLOCK_MONOTONIC, &b);
    g_drain_s = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    return rc;
}

API double npusnap_devmem_last_drain_s(void) { return g_drain_s; }

static int quiesce_timed(int timeout_ms, char *err, size_t errlen) {
    int32_t devs[64];
    void *ctxs[64];
    int nd = 0;
    pthread_mutex_lock(&g_mu);
    /* Every device holding tracked memory (it must have a known context), and every other device
     * the job opened (so that Backup's own synchronize, which has no timeout, finds them idle). */
    for (size_t i = 0; i < g_n; i++) {
        int32_t d = g_allocs[i].dev;
        if (g_allocs[i].excluded || d < 0 || d >= MAX_DEVS) continue;
        int seen = 0;
        for (int k = 0; k < nd; k++) seen |= devs[k] == d;
        if (!seen && nd < 64) {
            devs[nd] = d;
            ctxs[nd++] = g_dev_ctx[d];
        }
    }
    for (int32_t d = 0; d < MAX_DEVS && nd < 64; d++) {
        int seen = 0;
        for (int k = 0; k < nd; k++) seen |= devs[k] == d;
        if (!seen && g_devs[d] && g_dev_ctx[d]) {
            devs[nd] = d;
            ctxs[nd++] = g_dev_ctx[d];
        }
    }
    pthread_mutex_unlock(&g_mu);
    for (int k = 0; k < nd; k++)
        if (!ctxs[k]) {
            seterr(err, errlen,
                   "device %d holds tracked memory but npusnap saw no context of it (no aclrtSetDevice or "
                   "aclrtSetCurrentContext of the job): cannot drain its queued work",
                   devs[k]);
            return -ENODEV;
        }
    struct timespec t0, dl;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < nd; k++) {
            int rc = sync_device(devs[k], ctxs[k], timeout_ms, err, errlen);
            if (rc != 0) return rc;
        }
        if (pass) break;
        dl = t0;
        dl.tv_sec += timeout_ms / 1000;
        dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
        pthread_mutex_lock(&g_mu);
        int w = 0;
        while (g_copies_inflight > 0 && w != ETIMEDOUT) w = pthread_cond_timedwait(&g_cv, &g_mu, &dl);
        int left = g_copies_inflight;
        pthread_mutex_unlock(&g_mu);
        if (left > 0) {
            seterr(err, errlen, "%d device copy(ies) of the job were still running after %d ms", left, timeout_ms);
            return -ETIMEDOUT;
        }
    }
    return 0;
}

/* Copy every tracked allocation into fd: the header, one record per allocation, then their bytes
 * in record order, written by xfer_run. Holds g_mu. */
static int cc_plan_add(const struct alloc *a, off_t file_off, const unsigned char *unchanged);
API void npusnap_devmem_copy_cancel(void);
static int g_plan_next; /* the next save plans the job's allocations for a concurrent copy */

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
        struct dm_record r = {(uint64_t)a->ptr, (uint64_t)a->size, a->dev, a->kind};
        wr = write_full(fd, &r, sizeof r);
    }
    if (wr != 0) {
        seterr(err, errlen, "cannot write the device-memory file: %s", strerror(-wr));
        return wr;
    }
    int ret = 0;
    struct xfer x = {.fd = fd, .save = 1, .memcpy_fn = memcpy_fn};
    off_t data_off = (off_t)(sizeof h + h.count * sizeof(struct dm_record));
    /* Since an earlier save of this process's history: the pieces not written since are left
     * out (a hole in the file), and the CLI takes them from that save's image. */
    uint32_t since = 0;
    for (int i = 0; g_since_id && i < g_nlineage; i++)
        if (g_lineage[i].id == g_since_id) since = g_lineage[i].epoch;
    size_t npieces = 0;
    for (size_t i = 0; i < g_n; i++)
        if (!g_allocs[i].excluded) npieces += pieces_of(&g_allocs[i]);
    unsigned char *unchanged = calloc(npieces ? npieces : 1, 1);
    if (!unchanged) {
        seterr(err, errlen, "no host memory for the table of pieces");
        return -ENOMEM;
    }
    size_t k = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        const struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        if (g_plan_next && a->app) {
            /* Copied after Unlock while the job runs (cc_*): what the job writes first is
             * copied first. The runtime's own allocations, whose writes are not known, now. */
            for (size_t j = 0, np = pieces_of(a); j < np; j++, k++) unchanged[k] = since && piece_gen(a, j) <= since;
            if (cc_plan_add(a, data_off, unchanged + k - pieces_of(a)) != 0) {
                seterr(err, errlen, "no host memory for the plan of the concurrent copy");
                ret = -ENOMEM;
            }
            if (g_plan_next == 1) {
                data_off += (off_t)a->size;
                continue;
            }
            k -= pieces_of(a); /* 2: the full copy as well, a reference for the concurrent one */
        }
        for (size_t j = 0, np = pieces_of(a); j < np && ret == 0; j++, k++) {
            size_t off = j * PIECE, n = a->size - off < PIECE ? a->size - off : PIECE;
            unchanged[k] = since && piece_gen(a, j) <= since;
            if (!unchanged[k] || g_check_all) {
                struct xfer_chunk *last = x.n ? &x.chunks[x.n - 1] : NULL;
                if (last && last->a == a && last->a_off + last->n == off && last->n + n <= DM_SAVE_CHUNK)
                    last->n += n; /* the next piece of the same run */
                else if (xfer_add(&x, a, off, data_off + (off_t)off, n) != 0)
                    ret = -ENOMEM;
            }
        }
        data_off += (off_t)a->size;
        if (ret != 0) seterr(err, errlen, "no host memory for the list of device-memory copies");
    }
    if (ret == 0 && x.n) ret = xfer_run(&x, err, errlen);
    free(x.chunks);
    if (ret != 0) {
        free(unchanged);
        return ret;
    }
    /* The file may end in a hole: its size must still say where its data ends. */
    if (ftruncate(fd, data_off) != 0) {
        ret = -errno;
        seterr(err, errlen, "cannot size the device-memory file: %s", strerror(-ret));
        free(unchanged);
        return ret;
    }
    *written = (uint64_t)data_off;
    for (size_t i = 0; i < g_n; i++)
        if (!g_allocs[i].excluded) g_allocs[i].in_file = 1;
    free(g_unchanged);
    g_unchanged = unchanged;
    g_npieces = npieces;
    g_since_used = since != 0;
    /* This save ends the epoch: it joins the history, and writes from now on are the next's. */
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, GRND_NONBLOCK) != (ssize_t)sizeof id || !id)
        id = ((uint64_t)time(NULL) << 24) ^ ((uint64_t)getpid() << 8) ^ g_epoch ^ 0x9e3779b97f4a7c15ull;
    if (g_nlineage == LINEAGE) memmove(g_lineage, g_lineage + 1, (LINEAGE - 1) * sizeof g_lineage[0]);
    else g_nlineage++;
    g_lineage[g_nlineage - 1].id = id;
    g_lineage[g_nlineage - 1].epoch = g_epoch;
    g_save_id = id;
    g_save_epoch = g_epoch;
    g_epoch++;
    return 0;
}

/* Copy every tracked allocation to host memory, one malloc'd copy each (npusnap_devmem_save, for
 * a process without a device-memory file). Holds g_mu. */
static int save_in_process_locked(memcpy_fn_t memcpy_fn, char *err, size_t errlen) {
    int ret = 0;
    for (size_t i = 0; i < g_n && ret == 0; i++) {
        struct alloc *a = &g_allocs[i];
        if (a->excluded) continue;
        free(a->copy);
        a->copy = malloc(a->size ? a->size : 1);
        if (!a->copy) {
            seterr(err, errlen, "no host memory for a copy of %zu bytes of device memory", a->size);
            return -ENOMEM;
        }
        drvError_t c = memcpy_fn((DVdeviceptr)(uintptr_t)a->copy, a->size, (DVdeviceptr)a->ptr, a->size);
        if (c != 0) {
            seterr(err, errlen, "drvMemcpy device to host of %zu bytes at %#lx (device %d) failed with %d", a->size,
                   (unsigned long)a->ptr, a->dev, c);
            ret = -EIO;
        }
    }
    return ret;
}

static void cc_note_whole_at_cut(int planning);

/* Called by the agent after the runtime's Lock: drain (bounded), then copy with the driver. */
static int save_to(int fd, int timeout_ms, uint64_t *written, char *err, size_t errlen) {
    if (timeout_ms < 0) timeout_ms = 0;
    npusnap_devmem_copy_cancel(); /* a concurrent copy of an earlier dump that gave up, if any */
    t_agent = 1;
    int ret = quiesce(timeout_ms, err, errlen);
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)real(F_DRV_MEMCPY);
    pthread_mutex_lock(&g_mu);
    if (ret == 0 && g_n && !memcpy_fn) {
        seterr(err, errlen,
               "the driver's drvMemcpy (libascend_hal.so) is not available in this process: cannot copy device "
               "memory while the runtime is locked");
        ret = -ENOSYS;
    } else if (ret == 0) {
        ret = fd >= 0 ? save_file_locked(fd, memcpy_fn, written, err, errlen)
                      : save_in_process_locked(memcpy_fn, err, errlen);
    }
    if (ret != 0) free_copies_locked();
    else g_saved = 1;
    cc_note_whole_at_cut(ret == 0 && g_plan_next && fd >= 0);
    g_plan_next = 0;
    pthread_mutex_unlock(&g_mu);
    if (ret != 0) npusnap_devmem_copy_cancel(); /* a plan half made */
    t_agent = 0;
    return ret;
}

API int npusnap_devmem_drain(int timeout_ms, char *err, size_t errlen) {
    if (timeout_ms < 0) timeout_ms = 0;
    t_agent = 1;
    int rc = quiesce(timeout_ms, err, errlen);
    t_agent = 0;
    return rc;
}

API int npusnap_devmem_save(int timeout_ms, char *err, size_t errlen) {
    uint64_t unused = 0;
    return save_to(-1, timeout_ms, &unused, err, errlen);
}

/* --- the concurrent copy (dump --leave-running) -------------------------------------------
 *
 * At the cut (LOCKED, drained) the job's allocations are only planned: their pieces are copied
 * after Unlock by a thread of the agent while the job runs, and a call of the job that is about
 * to write a piece not yet copied copies it first (npusnap_devmem_before_write, called by every
 * wrapper writes.c counts as a writer, before the real call; a writer whose target is unknown
 * waits for the whole copy). So the image holds every piece as it was at the cut, and the job is
 * held only for the cut. Pieces: 0 copied or not needed, 1 to copy, 2 being copied. */
struct cc_range {
    uintptr_t ptr;
    size_t size;
    off_t file_off;
    unsigned char *state;
};
static struct {
    int planned;
    int active; /* the hooks copy first; read without the lock (atomically) on every call */
    int fd;
    memcpy_fn_t fn;
    struct cc_range *r;
    size_t n, cap, left, cursor_r, cursor_j;
    int err;
    char errmsg[256];
    uint64_t cow, background;
    int inside; /* threads in cc_piece_locked: the plan they read is not freed under them */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    int th_started;
    /* The last save was to plan, and all of it was copied at the cut (no allocation of the
     * job's own): the copy to wait for is complete, unlike a plan that was dropped. */
    int whole_at_cut;
} g_cc = {.fd = -1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* A save that was to plan: nothing planned means all of it was copied at the cut. */
static void cc_note_whole_at_cut(int planning) {
    pthread_mutex_lock(&g_cc.mu);
    g_cc.whole_at_cut = planning && !g_cc.planned;
    pthread_mutex_unlock(&g_cc.mu);
}

static void cc_clear_locked(void) {
    g_cc.active = 0;
    while (g_cc.inside) pthread_cond_wait(&g_cc.cv, &g_cc.mu);
    for (size_t i = 0; i < g_cc.n; i++) free(g_cc.r[i].state);
    free(g_cc.r);
    g_cc.r = NULL;
    g_cc.n = g_cc.cap = g_cc.left = g_cc.cursor_r = g_cc.cursor_j = 0;
    g_cc.planned = 0;
    g_cc.whole_at_cut = 0;
    g_cc.err = 0;
    g_cc.errmsg[0] = 0;
    if (g_cc.fd >= 0) close(g_cc.fd);
    g_cc.fd = -1;
}

/* Holds g_mu (the save). */
static int cc_plan_add(const struct alloc *a, off_t file_off, const unsigned char *unchanged) {
    size_t np = pieces_of(a);
    pthread_mutex_lock(&g_cc.mu);
    int rc = grow((void **)&g_cc.r, &g_cc.cap, g_cc.n, sizeof *g_cc.r);
    unsigned char *st = rc == 0 ? calloc(np ? np : 1, 1) : NULL;
    if (!st) rc = -ENOMEM;
    if (rc == 0) {
        size_t todo = 0;
        for (size_t j = 0; j < np; j++) todo += st[j] = g_check_all || !unchanged[j]; /* checked: all */
        g_cc.r[g_cc.n++] = (struct cc_range){a->ptr, a->size, file_off, st};
        g_cc.left += todo;
        g_cc.planned = 1;
    }
    pthread_mutex_unlock(&g_cc.mu);
    return rc;
}

static __thread char *t_cc_buf;

/* Copy piece j of range r (its state already 2); 0 or -errno. */
static int cc_copy(const struct cc_range *r, size_t j) {
    if (!t_cc_buf && !(t_cc_buf = malloc(PIECE))) return -ENOMEM;
    size_t off = j * PIECE, n = r->size - off < PIECE ? r->size - off : PIECE;
    int saved = t_agent;
    t_agent = 1;
    drvError_t rc = g_cc.fn((DVdeviceptr)(uintptr_t)t_cc_buf, n, (DVdeviceptr)(r->ptr + off), n);
    t_agent = saved;
    if (rc != 0) return -EIO;
    return pwrite_full(g_cc.fd, t_cc_buf, n, r->file_off + (off_t)off);
}

/* Take piece j of range i (held: g_cc.mu), copy it without the lock, mark it done. A piece
 * another thread is copying is waited for. */
static void cc_piece_locked(size_t i, size_t j, int cow) {
    struct cc_range *r = &g_cc.r[i];
    g_cc.inside++;
    while (r->state[j] == 2) pthread_cond_wait(&g_cc.cv, &g_cc.mu);
    if (r->state[j] != 1 || g_cc.err) {
        if (--g_cc.inside == 0) pthread_cond_broadcast(&g_cc.cv);
        return;
    }
    r->state[j] = 2;
    pthread_mutex_unlock(&g_cc.mu);
    int rc = cc_copy(r, j);
    pthread_mutex_lock(&g_cc.mu);
    g_cc.inside--;
    r->state[j] = 0;
    g_cc.left--;
    if (cow) g_cc.cow++;
    else g_cc.background++;
    if (rc != 0 && !g_cc.err) {
        g_cc.err = rc;
        snprintf(g_cc.errmsg, sizeof g_cc.errmsg, "copying %zu bytes at %#lx off the device failed (%s)", PIECE,
                 (unsigned long)(r->ptr + j * PIECE), strerror(-rc));
    }
    pthread_cond_broadcast(&g_cc.cv);
}

static void cc_cow_range(uintptr_t p, size_t n) {
    pthread_mutex_lock(&g_cc.mu);
    for (size_t i = 0; g_cc.active && i < g_cc.n; i++) {
        struct cc_range *r = &g_cc.r[i];
        if (p >= r->ptr + r->size || p + n <= r->ptr) continue;
        uintptr_t lo = p > r->ptr ? p : r->ptr, hi = p + n < r->ptr + r->size ? p + n : r->ptr + r->size;
        for (size_t j = (lo - r->ptr) / PIECE; g_cc.active && j <= (hi - 1 - r->ptr) / PIECE; j++)
            cc_piece_locked(i, j, 1);
    }
    pthread_mutex_unlock(&g_cc.mu);
}

static void cc_cow_all(void) {
    pthread_mutex_lock(&g_cc.mu);
    for (size_t i = 0; g_cc.active && i < g_cc.n && !g_cc.err; i++)
        for (size_t j = 0; g_cc.active && j < (g_cc.r[i].size + PIECE - 1) / PIECE; j++) cc_piece_locked(i, j, 1);
    while (g_cc.active && g_cc.left && !g_cc.err) pthread_cond_wait(&g_cc.cv, &g_cc.mu);
    pthread_mutex_unlock(&g_cc.mu);
}

/* Writers in flight. A call of the job takes its hook (below) and then enters the runtime, where
 * Lock may hold it at the gate: its hook ran before the copy was planned, and after Unlock it
 * writes. So every writer notes what it will write in a slot of its thread, open from before its
 * hook until its real call returned, and copy_start copies what the open slots name before
 * Unlock. The slot is noted before `active` is read, and copy_start sets `active` before it reads
 * the slots (both sequentially consistent): a writer either sees the copy or is seen by it. */
#define WS_SLOTS 512
#define WS_RANGES 16
struct wslot {
    int owned, busy, all, depth;
    size_t n;
    uintptr_t p[WS_RANGES];
    size_t len[WS_RANGES];
};
static struct wslot g_ws[WS_SLOTS];
static int g_ws_unslotted; /* open writers of threads that found no free slot: count as writing all */
static __thread struct wslot *t_ws;
static __thread int t_ws_none, t_ws_none_depth;
static pthread_key_t g_ws_key;
static pthread_once_t g_ws_once = PTHREAD_ONCE_INIT;

/* The child has only the forking thread: the other threads' slots are free there. */
static void ws_after_fork(void) {
    for (int i = 0; i < WS_SLOTS; i++)
        if (&g_ws[i] != t_ws) g_ws[i].owned = g_ws[i].busy = g_ws[i].depth = 0;
    g_ws_unslotted = t_ws_none_depth > 0;
    /* A hold of the parent's is not the child's, and only this thread may be inside a writer. */
    g_entry_closed = 0;
    g_writers_inside = t_entered;
    pthread_mutex_init(&g_emu, NULL);
    monotonic_cond_init(&g_ecv);
}

static void ws_release(void *slot) {
    struct wslot *w = slot;
    __atomic_store_n(&w->busy, 0, __ATOMIC_SEQ_CST);
    w->depth = 0;
    __atomic_store_n(&w->owned, 0, __ATOMIC_RELEASE);
}
static void ws_key_init(void) { (void)pthread_key_create(&g_ws_key, ws_release); }

static struct wslot *ws_claim(void) {
    pthread_once(&g_ws_once, ws_key_init);
    for (int i = 0; i < WS_SLOTS; i++) {
        int zero = 0;
        if (__atomic_compare_exchange_n(&g_ws[i].owned, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            (void)pthread_setspecific(g_ws_key, &g_ws[i]);
            return &g_ws[i];
        }
    }
    return NULL;
}

/* The lock's hold on the job's writers. A call past the runtime's entry check when Lock comes
 * runs to its end (shared CANN notes, "Lock"): a copy or a launch that had passed it would write
 * device memory, or queue work, after the drain, while the memory is being copied, and the image
 * would hold the old bytes for a host that saw the call return. So before Lock the agent closes
 * the entry of every writer (this thread's outermost write_open), waits until none is inside, and
 * opens it again once Lock returned: a writer that came meanwhile goes on into the runtime and
 * waits at its gate, never past it. Dekker-style: a writer counts itself in, then reads `closed`;
 * the hold sets `closed`, then reads the count (both sequentially consistent). */

static void entry_leave(void) {
    if (__atomic_sub_fetch(&g_writers_inside, 1, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_load_n(&g_entry_closed, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&g_emu);
        pthread_cond_broadcast(&g_ecv);
        pthread_mutex_unlock(&g_emu);
    }
}

static void entry_enter(void) {
    for (;;) {
        __atomic_add_fetch(&g_writers_inside, 1, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&g_entry_closed, __ATOMIC_SEQ_CST)) return;
        entry_leave();
        pthread_mutex_lock(&g_emu);
        while (__atomic_load_n(&g_entry_closed, __ATOMIC_SEQ_CST)) pthread_cond_wait(&g_ecv, &g_emu);
        pthread_mutex_unlock(&g_emu);
    }
}

API int npusnap_devmem_hold_writers(int timeout_ms) {
    __atomic_store_n(&g_entry_closed, 1, __ATOMIC_SEQ_CST);
    struct timespec dl = deadline_in(timeout_ms / 1000.0);
    pthread_mutex_lock(&g_emu);
    int w = 0;
    while (__atomic_load_n(&g_writers_inside, __ATOMIC_SEQ_CST) > 0 && w != ETIMEDOUT)
        w = pthread_cond_timedwait(&g_ecv, &g_emu, &dl);
    int left = __atomic_load_n(&g_writers_inside, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&g_emu);
    return left;
}

API void npusnap_devmem_release_writers(void) {
    pthread_mutex_lock(&g_emu);
    __atomic_store_n(&g_entry_closed, 0, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&g_ecv);
    pthread_mutex_unlock(&g_emu);
}

/* A writer opens its slot. ``gated``: a call of the runtime's API, above its entry check, which
 * the lock's hold keeps out; the driver's functions the runtime calls below that check (a copy,
 * a free, an unmap of a call already past it) are not held there, which would only delay them
 * into the copy. */
static void write_open(int gated) {
    if (t_agent) return;
    if (!t_ws && !t_ws_none && !(t_ws = ws_claim())) t_ws_none = 1;
    if (gated && (t_ws ? t_ws->depth : t_ws_none_depth) == 0) {
        entry_enter();
        t_entered = 1;
    }
    if (t_ws) {
        if (t_ws->depth++ == 0) {
            __atomic_store_n(&t_ws->n, 0, __ATOMIC_RELAXED);
            __atomic_store_n(&t_ws->all, 0, __ATOMIC_RELAXED);
        }
    } else if (t_ws_none_depth++ == 0) {
        __atomic_fetch_add(&g_ws_unslotted, 1, __ATOMIC_SEQ_CST);
    }
}

void npusnap_devmem_write_open(void) { write_open(1); }

void npusnap_devmem_write_close(void) {
    if (t_agent) return;
    if (t_ws) {
        if (t_ws->depth > 0 && --t_ws->depth == 0) __atomic_store_n(&t_ws->busy, 0, __ATOMIC_SEQ_CST);
    } else if (t_ws_none && t_ws_none_depth > 0 && --t_ws_none_depth == 0) {
        __atomic_fetch_sub(&g_ws_unslotted, 1, __ATOMIC_SEQ_CST);
    }
    if (t_entered && (t_ws ? t_ws->depth : t_ws_none_depth) == 0) {
        t_entered = 0;
        entry_leave();
    }
}

static void ws_note(uintptr_t p, size_t n, int all) {
    struct wslot *w = t_ws;
    if (!w || !w->depth) return;
    size_t k = __atomic_load_n(&w->n, __ATOMIC_RELAXED);
    if (all || k >= WS_RANGES) {
        __atomic_store_n(&w->all, 1, __ATOMIC_RELEASE);
    } else {
        w->p[k] = p;
        w->len[k] = n;
        __atomic_store_n(&w->n, k + 1, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&w->busy, 1, __ATOMIC_SEQ_CST);
}

/* copy_start, `active` set: what the writers in flight will write, copied now. */
static void cc_cow_open_writers(void) {
    int all = __atomic_load_n(&g_ws_unslotted, __ATOMIC_SEQ_CST) > 0;
    for (int i = 0; i < WS_SLOTS && !all; i++) {
        struct wslot *w = &g_ws[i];
        if (!__atomic_load_n(&w->busy, __ATOMIC_SEQ_CST)) continue;
        if (__atomic_load_n(&w->all, __ATOMIC_ACQUIRE)) {
            all = 1;
            break;
        }
        size_t n = __atomic_load_n(&w->n, __ATOMIC_ACQUIRE);
        for (size_t k = 0; k < n && k < WS_RANGES; k++) cc_cow_range(w->p[k], w->len[k]);
    }
    if (all) cc_cow_all();
}

/* Before a call of the job writes [p, p + n): copy the pieces there that are not copied yet. */
void npusnap_devmem_before_write(uintptr_t p, size_t n) {
    if (!n || t_agent) return;
    ws_note(p, n, 0);
    if (!__atomic_load_n(&g_cc.active, __ATOMIC_SEQ_CST)) return;
    cc_cow_range(p, n);
}

/* Before a call whose writes are not known: the whole copy first (this thread helps). */
void npusnap_devmem_before_write_all(void) {
    if (t_agent) return;
    ws_note(0, 0, 1);
    if (!__atomic_load_n(&g_cc.active, __ATOMIC_SEQ_CST)) return;
    cc_cow_all();
}

static void *cc_main(void *arg) {
    (void)arg;
    t_agent = 1;
    pthread_mutex_lock(&g_cc.mu);
    while (g_cc.left && !g_cc.err && g_cc.cursor_r < g_cc.n) {
        struct cc_range *r = &g_cc.r[g_cc.cursor_r];
        size_t np = (r->size + PIECE - 1) / PIECE;
        if (g_cc.cursor_j >= np) {
            g_cc.cursor_r++;
            g_cc.cursor_j = 0;
            continue;
        }
        cc_piece_locked(g_cc.cursor_r, g_cc.cursor_j++, 0);
    }
    while (g_cc.left && !g_cc.err) pthread_cond_wait(&g_cc.cv, &g_cc.mu); /* pieces others copy */
    g_cc.active = 0; /* done: the hooks are inert again */
    pthread_cond_broadcast(&g_cc.cv);
    pthread_mutex_unlock(&g_cc.mu);
    return NULL;
}

/* Stop the copy (held: g_cc.mu, released on return): the hooks inert, the copier joined, the
 * plan dropped. */
static void cc_end_locked(void) {
    g_cc.active = 0;
    pthread_cond_broadcast(&g_cc.cv);
    int th = g_cc.th_started;
    g_cc.th_started = 0;
    pthread_mutex_unlock(&g_cc.mu);
    if (th) pthread_join(g_cc.th, NULL);
    pthread_mutex_lock(&g_cc.mu);
    cc_clear_locked();
    g_cc.cow = g_cc.background = 0;
    pthread_mutex_unlock(&g_cc.mu);
}

/* After the cut, before Unlock: start copying the planned pieces into fd (kept: a dup). */
API int npusnap_devmem_copy_start(int fd, char *err, size_t errlen) {
    pthread_mutex_lock(&g_cc.mu);
    if (!g_cc.planned) {
        pthread_mutex_unlock(&g_cc.mu);
        return 0;
    }
    g_cc.fn = (memcpy_fn_t)real(F_DRV_MEMCPY);
    g_cc.fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (g_cc.fd < 0 || !g_cc.fn) {
        seterr(err, errlen, "cannot start the concurrent copy: %s", g_cc.fn ? strerror(errno) : "no drvMemcpy");
        cc_clear_locked();
        pthread_mutex_unlock(&g_cc.mu);
        return -EIO;
    }
    __atomic_store_n(&g_cc.active, 1, __ATOMIC_SEQ_CST);
    g_cc.th_started = npusnap_quiet_thread_create(&g_cc.th, NULL, cc_main, NULL) == 0;
    pthread_mutex_unlock(&g_cc.mu);
    if (!g_cc.th_started) cc_main(NULL); /* no thread: copy now, the job still locked */
    else cc_cow_open_writers();           /* still locked: what the gated calls will write */
    return 0;
}

/* Wait (at most timeout_ms) for the concurrent copy; 0 once it is complete (the plan is then
 * dropped), -ETIMEDOUT while it runs, -errno if it failed. What it did goes to *stats. */
API int npusnap_devmem_copy_wait(int timeout_ms, uint64_t stats[3], char *err, size_t errlen) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&g_cc.mu);
    if (!g_cc.planned && g_cc.whole_at_cut) {
        g_cc.whole_at_cut = 0;
        pthread_mutex_unlock(&g_cc.mu);
        if (stats) stats[0] = stats[1] = stats[2] = 0;
        return 0;
    }
    if (!g_cc.planned) {
        pthread_mutex_unlock(&g_cc.mu);
        seterr(err, errlen, "no concurrent copy was planned");
        return -ENOENT;
    }
    while (g_cc.active && !g_cc.err)
        if (pthread_cond_timedwait(&g_cc.cv, &g_cc.mu, &dl) == ETIMEDOUT) break;
    int rc = g_cc.err ? g_cc.err : g_cc.active ? -ETIMEDOUT : 0;
    if (stats) {
        stats[0] = g_cc.left;
        stats[1] = g_cc.cow;
        stats[2] = g_cc.background;
    }
    if (rc == -ETIMEDOUT) {
        seterr(err, errlen, "%zu pieces are still to copy", g_cc.left);
        pthread_mutex_unlock(&g_cc.mu);
        return rc;
    }
    if (rc != 0) seterr(err, errlen, "%s", g_cc.errmsg);
    cc_end_locked();
    return rc;
}

/* Drop a planned or running copy (a rollback, a restored process, a dump that gave up). */
API void npusnap_devmem_copy_cancel(void) {
    pthread_mutex_lock(&g_cc.mu);
    if (!g_cc.err) g_cc.err = -ECANCELED;
    cc_end_locked();
}

/* The next file save plans the job's allocations instead of copying them. */
API void npusnap_devmem_plan_next(int on) {
    pthread_mutex_lock(&g_mu);
    g_plan_next = on;
    pthread_mutex_unlock(&g_mu);
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
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)real(F_DRV_MEMCPY);
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
        seterr(err, errlen, "the driver's drvMemcpy is not available in this process");
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
    t_agent = 1;
    if (ret == 0 && x.n) ret = xfer_run(&x, err, errlen);
    t_agent = 0;
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
    memcpy_fn_t memcpy_fn = (memcpy_fn_t)real(F_DRV_MEMCPY);
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
            seterr(err, errlen, "the driver's drvMemcpy is not available in this process");
            ret = -ENOSYS;
            break;
        }
        t_agent = 1;
        ret = copy_to_device(memcpy_fn, a, 0, a->copy, a->size, err, errlen);
        t_agent = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return ret;
}

API void npusnap_devmem_finish(void) {
    pthread_mutex_lock(&g_mu);
    free_copies_locked();
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
    out->gate_closed = 0; /* no gate of npusnap's own: the runtime's lock holds the job */
    out->saved = g_saved;
    for (size_t i = 0; i < g_n; i++) out->vmm_bytes += g_allocs[i].kind == K_VMM ? g_allocs[i].size : 0;
    for (size_t i = 0; i < g_nres; i++) out->reserved_bytes += g_reserved[i].size;
    pthread_mutex_unlock(&g_mu);
}

/* The device ids the job opened (aclrtSetDevice / contexts followed) and has not reset, as the
 * wrappers saw them (real CANN has no query for "all open devices"; its callbacks name them).
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

/* How many allocations came from explicit registration: the agent's status tells them from the
 * allocations it saw being made. */
API uint64_t npusnap_devmem_registered_count(void) {
    pthread_mutex_lock(&g_mu);
    uint64_t n = 0;
    for (size_t i = 0; i < g_n; i++) n += g_allocs[i].kind == K_REGISTERED;
    pthread_mutex_unlock(&g_mu);
    return n;
}

API int npusnap_devmem_register(void *dev_ptr, size_t size) {
    if (!dev_ptr || !size) return -EINVAL;
    int32_t dev;
    current_place(&dev);
    if (dev >= 0) remember_ctx(dev, 0);
    pthread_mutex_lock(&g_mu);
    int rc = g_saved ? -EBUSY : add((uintptr_t)dev_ptr, size, dev, K_REGISTERED);
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
