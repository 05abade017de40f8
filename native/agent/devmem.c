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
 * This file holds the tables and what reads them; the wrappers, the save and reload, and the
 * concurrent copy have files of their own (devmem_int.h lists them), which call into this one:
 * it never calls theirs (it finds the real functions past any definition of the agent's own).
 *
 * There is no gate of npusnap's own: the runtime's lock holds about 266 entry points on
 * every thread -- launches, copies, VMM, HCCL -- from Lock to Unlock, and the reload runs before
 * Unlock, so nothing of the job touches device memory between the copy and the reload.
 *
 * Only public CANN and driver functions are used (halMem*, drvMemcpy, aclrtGetCurrentContext,
 * aclrtSetCurrentContext, aclrtSynchronizeDeviceWithTimeout / aclrtSynchronizeDevice), the
 * process's own memory and the C library: nothing here knows about the simulator.
 */
#include "devmem_int.h"

/* ------------------------------------------------------------------ the real functions */


const char *const NAMES[N_FUNCS] = {
    "halMemAlloc", "halMemFree", "halMemAddressReserve", "halMemAddressFree", "halMemCreate", "halMemRelease",
    "halMemMap", "halMemUnmap", "drvMemcpy",
    "aclrtSetDevice", "aclrtResetDevice", "aclrtResetDeviceForce", "aclFinalize", "aclrtCreateContext", "aclrtSetCurrentContext",
    "aclrtDestroyContext", "aclrtGetDevice", "aclrtGetCurrentContext", "aclrtSynchronizeDevice", "aclrtSynchronizeDeviceWithTimeout",
};

void *volatile g_real[N_FUNCS];

/* The CANN libraries a real function may live in (the driver's, the runtime's, ACL's). */
static const char *const LIBS[] = {"libascend_hal.so", "libacl_rt.so", "libascendcl.so", "libruntime.so"};

/* The real function `i`: what dlsym() handed out, else the next definition after this library
 * (programs linked against CANN), else the CANN library mapped in the process that exports it. */
void *dm_real(int i) {
    void *p = g_real[i];
    if (p) return p;
    p = npusnap_next_definition(NAMES[i], LIBS, sizeof LIBS / sizeof LIBS[0], npusnap_is_agents);
    if (p) g_real[i] = p;
    return p;
}

/* ------------------------------------------------------------------ the tables */


pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_cv; /* CLOCK_MONOTONIC */
struct alloc *g_allocs;
size_t g_n, g_cap;
struct range *g_excl;
size_t g_nexcl, g_excl_cap;
struct range *g_reserved; /* VMM address reservations (no contents of their own) */
size_t g_nres, g_res_cap;
struct handle *g_handles; /* VMM physical chunks */
size_t g_nh, g_h_cap;
int g_copies_inflight; /* the job's drvMemcpy calls running now */
/* Write tracking: a save happens at the end of an epoch and starts the next; a piece written
 * (as its stamp says) in an epoch later than save k's is copied by a save since k. */
uint32_t g_epoch = 1;
uint32_t g_all_gen;         /* every piece may have been written up to this epoch */
char g_untracked[128];      /* a writer the agent cannot follow was looked up: every save full */
uint64_t g_marks_all;       /* how many calls wrote what the agent cannot tell */
char g_all_why[96];         /* the last of them */
struct dm_lineage g_lineage[LINEAGE]; /* the last saves of this process's history, newest last */
int g_nlineage;
uint64_t g_since_id;         /* the next save copies only what changed since this save */
int g_check_all;             /* ... but copies everything (a test of the tracking) */
unsigned char *g_unchanged;  /* the last save: per piece in file order, 1 if not written since */
size_t g_npieces;
int g_since_used;            /* the last save was incremental */
uint64_t g_save_id;
uint32_t g_save_epoch;
int g_saved;
int g_interposed = -1; /* computed lazily */
/* Devices the job opened: per device, its aclrtSetDevice calls not yet matched by an
 * aclrtResetDevice (CANN counts them and releases the device at 0: until then its memory stays and
 * must be kept), at least 1 for a device only seen through a context. */
unsigned g_devs[MAX_DEVS];
/* Held across the runtime's aclrtSetDevice / aclrtResetDevice and the count kept here, so that the
 * count changes in the runtime's order: a set in one thread racing the last reset in another must
 * not leave this count at 0 (memory forgotten) while the runtime still holds the device. Not taken
 * by atfork_prepare (the runtime's release may wait on callbacks); a child starts it afresh. */
pthread_mutex_t g_life = PTHREAD_MUTEX_INITIALIZER;
void *g_dev_ctx[MAX_DEVS];      /* a context of each such device, for synchronize */
__thread int t_agent;           /* this thread copies for npusnap: its drvMemcpy is not the job's */

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

void dm_device_opened(void) {
    void (*fn)(void) = __atomic_load_n(&g_on_device_open, __ATOMIC_ACQUIRE);
    if (fn) fn();
}

/* No lock: a copy made without fork handlers may hold one locked for ever. Every thread resets
 * (if the record is another process's) before it counts, so the count ends at one or more. */
void dm_record_opened(void) {
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
static void atfork_child(void) {
    record_start();
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
}

void dm_seterr(char *err, size_t len, const char *fmt, ...) {
    if (!err || !len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

int dm_in_excluded(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nexcl; i++)
        if (p >= g_excl[i].start && p + n <= g_excl[i].start + g_excl[i].size) return 1;
    return 0;
}

struct alloc *dm_find(uintptr_t p) {
    for (size_t i = 0; i < g_n; i++)
        if (g_allocs[i].ptr == p) return &g_allocs[i];
    return NULL;
}

void dm_drop_at(size_t i) {
    free(g_allocs[i].copy);
    free(g_allocs[i].gen);
    g_allocs[i] = g_allocs[--g_n];
}

int dm_grow(void **arr, size_t *cap, size_t n, size_t elem) {
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

int32_t dm_user_dev(int32_t drv) {
    pthread_once(&g_vis_once, vis_read);
    if (g_nvis < 0 || drv < 0) return drv;
    for (int i = 0; i < g_nvis; i++)
        if (g_vis[i] == drv) return i;
    return -1;
}

/* g_mu held */
int dm_add(uintptr_t p, size_t n, int32_t dev, int kind) {
    dm_record_opened();
    struct alloc *a = dm_find(p);
    if (a) { /* the same address again (freed behind our back, or registered twice) */
        a->size = n;
        a->dev = dev;
        a->kind = kind;
        a->excluded = dm_in_excluded(p, n);
        a->born = g_epoch;
        a->app = kind == K_REGISTERED;
        free(a->gen);
        a->gen = NULL;
        return 0;
    }
    if (dm_grow((void **)&g_allocs, &g_cap, g_n, sizeof *g_allocs) != 0) return -ENOMEM;
    g_allocs[g_n++] = (struct alloc){p, n, dev, kind, dm_in_excluded(p, n), NULL, 0, g_epoch, kind == K_REGISTERED, NULL};
    return 0;
}

void dm_untrack(uintptr_t p) {
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++)
        if (g_allocs[i].ptr == p && g_allocs[i].kind != K_REGISTERED) {
            dm_drop_at(i);
            break;
        }
    pthread_mutex_unlock(&g_mu);
}

/* --- write tracking (writes.c tells what the job writes) ----------------------------------- */

size_t dm_pieces_of(const struct alloc *a) { return (a->size + PIECE - 1) / PIECE; }

/* The epoch of piece j's last write, as far as the agent knows (UINT32_MAX: always written). */
uint32_t dm_piece_gen(const struct alloc *a, size_t j) {
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
        size_t np = dm_pieces_of(a);
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


void dm_remember_ctx(int32_t dev, int set_device) {
    aclError (*gc)(void **) = (aclError(*)(void **))dm_real(F_GET_CTX);
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

void dm_current_place(int32_t *dev) {
    *dev = -1;
    aclError (*gd)(int32_t *) = (aclError(*)(int32_t *))dm_real(F_GET_DEVICE);
    if (gd && gd(dev) != ACL_SUCCESS) *dev = -1;
}

int dm_pwrite_full(int fd, const char *p, size_t n, off_t off) {
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

void dm_note_oom(int rc) {
    if (rc != 0) agent_log("[devmem] out of memory tracking a device allocation");
}

drvError_t dm_missing(int i) {
    agent_log("[devmem] %s is not exported by the loaded CANN libraries", NAMES[i]);
    return i < F_SET_DEVICE ? DRV_ERROR_NOT_SUPPORT : ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
}

int dm_interposed(void) {
    if (g_interposed < 0) {
        /* Preloaded: the program's own search list (main program, LD_PRELOAD, its libraries)
         * finds our dlsym and the driver's allocation call first. (Not RTLD_DEFAULT: its scope
         * depends on the caller, and a -Bsymbolic library always finds itself first.) */
        dlsym_fn ds = npusnap_real_dlsym();
        void *main_handle = dlopen(NULL, RTLD_LAZY);
        g_interposed = ds && main_handle && npusnap_is_agents(ds(main_handle, "dlsym")) &&
                       npusnap_is_agents(ds(main_handle, "halMemAlloc")) &&
                       npusnap_is_agents(ds(main_handle, "halMemMap"));
        if (main_handle) dlclose(main_handle);
    }
    return g_interposed;
}

void dm_free_copies_locked(void) {
    for (size_t i = 0; i < g_n; i++) {
        free(g_allocs[i].copy);
        g_allocs[i].copy = NULL;
        g_allocs[i].in_file = 0;
    }
    g_saved = 0;
}

API void npusnap_devmem_finish(void) {
    pthread_mutex_lock(&g_mu);
    dm_free_copies_locked();
    pthread_mutex_unlock(&g_mu);
}

API void npusnap_devmem_get_info(npusnap_devmem_info *out) {
    if (!out) return;
    int ip = dm_interposed();
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
    dm_current_place(&dev);
    if (dev >= 0) dm_remember_ctx(dev, 0);
    pthread_mutex_lock(&g_mu);
    int rc = g_saved ? -EBUSY : dm_add((uintptr_t)dev_ptr, size, dev, K_REGISTERED);
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
        if (dm_in_excluded(g_allocs[i].ptr, g_allocs[i].size)) g_allocs[i].excluded = 1;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

