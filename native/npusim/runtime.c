/* libruntime.so of the simulated NPU: the one runtime state of a process, under the rt* names of
 * the real libruntime.so (runtime src/runtime/api/api_c*.cc; prototypes of include/ and pkg_inc/).
 *
 * Both ACL front-ends (libacl_rt.so, libascendcl.so: acl.c) call these through the dynamic linker,
 * and this library calls the driver's user-space API (libascend_hal.so: hal.c) the same way, so a
 * tool interposing at any of the three layers meets what it would on a real node.
 *
 * What it holds: the snapshot state machine and its gate (GlobalStateManager,
 * src/runtime/feature/snapshot/ and src/runtime/core/inc/common/global_state_manager.hpp), the
 * snapshot callbacks (snapshot_callback_manager.cc), devices and their contexts, streams, events,
 * loaded kernel binaries, and the device's task scheduler: an engine thread per stream executes that
 * stream's tasks in order, asynchronously to the host, streams concurrently, with event waits
 * between them. Device memory itself is the driver's (hal.c).
 *
 * The gate: every entry point that changes resources waits while the process is LOCKED or
 * BACKED_UP (never fails), on every thread, as the GLOBAL_STATE_WAIT_IF_LOCKED sites of
 * src/runtime/api/api_c*.cc do; queries, every synchronize, context selection and the snapshot
 * calls pass. Work already queued keeps running after Lock (the device does not stop): Backup
 * synchronizes every stream first, with no timeout (snapshot_process_helper.cc,
 * SnapShotPreProcessBackup: ctx->Synchronize(-1)). docs/simulator.md lists each function's source.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hal.h"
#include "npusim.h"
#include "private_guard.h"
#include "npusim_kernel.h"
#include "rt.h"
#include "npusnap/quietthread.h"
#include "npusnap/timeutil.h"

#define MAX_DEV 64
#define NSTAGES NPUSNAP_STAGE_COUNT
#define CTX_BASE ((uintptr_t)0x7c000000) /* context handles: CTX_BASE + device id */

enum { ST_RUNNING = NPUSNAP_STATE_RUNNING, ST_LOCKED = NPUSNAP_STATE_LOCKED, ST_BACKED_UP = NPUSNAP_STATE_BACKED_UP };

struct cb {
    npusim_callback fn;
    void *args;
};

struct faults {
    int lock_timeout, backup, restore, unlock;
    int backup_code;
    long lock_wait_ms;
    long backup_hang_ms;
};

/* g_mu guards the state machine and the device table; g_eng guards streams, events, their queues
 * and the reports. Under g_eng: a stream's own work_cv wakes its idle thread (a task queued, stop);
 * g_eng_cv, broadcast only while someone waits on it, a task done (synchronize, event waits);
 * g_report_cv the callbacks' hand-over. One condition for all of these woke every stream thread and
 * waiter at every task: several needless context switches a launch. g_snap: one snapshot call at a
 * time. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv;
static pthread_mutex_t g_snap = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_cbmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_eng = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_eng_cv;
static int g_eng_waiters; /* threads in eng_wait (g_eng) */
static pthread_cond_t g_report_cv;
static pthread_mutex_t g_defmu = PTHREAD_MUTEX_INITIALIZER; /* before g_eng */

static int g_state = ST_RUNNING;
static int g_open[MAX_DEV];
/* aclrtSetDevice calls not yet matched by an aclrtResetDevice: the device is released only when
 * its count drops to 0, or by aclrtResetDeviceForce (CANN's aclrtResetDevice and
 * aclrtResetDeviceForce references; the runtime's rtDeviceResetForce test: a second forced reset
 * fails). Under g_mu. */
static int g_ref[MAX_DEV];
/* Held by aclrtSetDevice and by the aclrtResetDevice that releases a device, for the whole
 * release: CANN's primary context count (runtime reference.hpp, RefObject) is marked updating
 * while the last reset tears the context down, and a concurrent aclrtSetDevice (IncRef) waits
 * until the teardown is over, then opens the device afresh. Outside g_mu, g_eng and g_defmu. */
static pthread_mutex_t g_lifemu = PTHREAD_MUTEX_INITIALIZER;
static int g_default_dev = -1;
static __thread int t_dev = -1;
static struct cb *g_cbs[NSTAGES];
static int g_ncb[NSTAGES], g_cbcap[NSTAGES];
static int g_driver_backup;   /* the last Backup used the driver-backed flow */
static int g_backup_version;  /* the driver version it recorded */

/* ---------------------------------------------------------------- helpers */

static void apply_fault(struct faults *f, const char *key, const char *val) {
    if (!strcmp(key, "NPUSIM_FAULT_LOCK_TIMEOUT")) f->lock_timeout = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_BACKUP")) f->backup = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_RESTORE")) f->restore = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_UNLOCK")) f->unlock = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_BACKUP_CODE")) f->backup_code = atoi(val);
    else if (!strcmp(key, "NPUSIM_LOCK_WAIT_MS")) f->lock_wait_ms = atol(val);
    else if (!strcmp(key, "NPUSIM_BACKUP_HANG_MS")) f->backup_hang_ms = atol(val);
}

/* Faults come from the environment and from NPUSIM_FAULT_FILE (KEY=VALUE lines), re-read on every
 * snapshot call so that a test can switch them in a process that is already running. */
static void read_faults(struct faults *f) {
    static const char *keys[] = {"NPUSIM_FAULT_LOCK_TIMEOUT", "NPUSIM_FAULT_BACKUP", "NPUSIM_FAULT_RESTORE",
                                 "NPUSIM_FAULT_UNLOCK",       "NPUSIM_BACKUP_HANG_MS", "NPUSIM_FAULT_BACKUP_CODE",
                                 "NPUSIM_LOCK_WAIT_MS"};
    memset(f, 0, sizeof *f);
    f->lock_wait_ms = -1;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const char *v = getenv(keys[i]);
        if (v && *v) apply_fault(f, keys[i], v);
    }
    const char *path = getenv("NPUSIM_FAULT_FILE");
    FILE *fp = (path && *path) ? fopen(path, "re") : NULL;
    if (fp) {
        char line[256];
        while (fgets(line, sizeof line, fp)) {
            char *eq = strchr(line, '=');
            if (!eq) continue;
            *eq = '\0';
            char *key = line, *val = eq + 1;
            while (*key == ' ' || *key == '\t') key++;
            char *kend = key + strlen(key);
            while (kend > key && (kend[-1] == ' ' || kend[-1] == '\t')) *--kend = '\0';
            val[strcspn(val, "\r\n")] = '\0';
            apply_fault(f, key, val);
        }
        fclose(fp);
    }
}

/* The driver's answer as the runtime reports it (RT_GET_DRV_ERRCODE, then the ACL code). */
static int32_t drv_to_acl(drvError_t e) {
    switch (e) {
    case DRV_ERROR_NONE: return ACL_SUCCESS;
    case DRV_ERROR_OUT_OF_MEMORY: return ACL_ERROR_RT_MEMORY_ALLOCATION;
    case DRV_ERROR_SERVER_BUSY: return ACL_ERROR_RT_DEV_SETUP_ERROR;
    case DRV_ERROR_INVALID_VALUE:
    case DRV_ERROR_INVALID_DEVICE:
    case DRV_ERROR_INVALID_HANDLE:
    case DRV_ERROR_PARA_ERROR:
    case DRV_ERROR_OPER_NOT_PERMITTED: return ACL_ERROR_RT_PARAM_INVALID;
    default: return ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* daemon gone or protocol broken */
    }
}

/* ---------------------------------------------------------------- visible devices */

/* ASCEND_RT_VISIBLE_DEVICES: the device ids a process names (user ids 0..n-1) are indexes into
 * this list of the driver's logical ids, read once when the runtime starts. As the real runtime
 * (runtime src/runtime/core/src/runtime.cc: SplitString, Runtime::GetVisibleDevices,
 * ChgUserDevIdToDeviceId; src/runtime/api/impl/api_impl.cc: GetDeviceCount's retType;
 * docs/zh/env_vars/ASCEND_RT_VISIBLE_DEVICES.md): digits separated by single commas, read up to
 * the first other character or the first id the driver does not have; ids must ascend and differ,
 * else no device is usable (ACL_ERROR_RT_NO_DEVICE); a user id past the list is
 * ACL_ERROR_RT_INVALID_DEVICEID. The driver's logical ids are the devices of the process's
 * container, in physical order (hal.c, drvGetDevNum); the variable lives in the process's memory, so a
 * restored process keeps it. Everything above the driver layer (open devices, streams, callbacks,
 * aclrtGetDevice) speaks user ids; only calls into hal.c speak logical ids. */
static pthread_once_t g_vis_once = PTHREAD_ONCE_INIT;
static int g_vis_set;            /* the variable is set */
static int32_t g_vis_err;        /* the answer to every device call when the list is bad */
static uint32_t g_vis_cnt;       /* user device count */
static uint32_t g_vis_map[MAX_DEV]; /* user id -> driver logical id */

static void vis_init(void) {
    const char *in = getenv("ASCEND_RT_VISIBLE_DEVICES");
    if (!in) return;
    g_vis_set = 1;
    uint32_t ndev = 0;
    if (drvGetDevNum(&ndev) != DRV_ERROR_NONE || ndev > MAX_DEV) {
        g_vis_err = ACL_ERROR_RT_NO_DEVICE;
        return;
    }
    /* SplitString: digit runs; one comma between them; anything else ends the list */
    uint32_t tok[MAX_DEV];
    int ntok = 0;
    const char *p = in;
    if (*p >= '0' && *p <= '9') {
        while (*p && ntok < MAX_DEV) {
            char *end;
            errno = 0;
            unsigned long v = strtoul(p, &end, 10);
            tok[ntok++] = (errno || v > UINT32_MAX) ? UINT32_MAX : (uint32_t)v;
            p = end;
            if (*p != ',' || !(p[1] >= '0' && p[1] <= '9')) break;
            p++;
        }
    }
    uint32_t n = 0;
    for (int i = 0; i < ntok && n < ndev; i++) {
        if (tok[i] >= ndev) break; /* an id the driver does not have ends the list */
        if (n > 0 && tok[i] < g_vis_map[n - 1]) {
            g_vis_err = ACL_ERROR_RT_NO_DEVICE; /* not ascending */
            return;
        }
        for (uint32_t j = 0; j < n; j++)
            if (g_vis_map[j] == tok[i]) {
                g_vis_err = ACL_ERROR_RT_NO_DEVICE; /* duplicated */
                return;
            }
        g_vis_map[n++] = tok[i];
    }
    if (n == 0) g_vis_err = ACL_ERROR_RT_NO_DEVICE;
    g_vis_cnt = n;
}

/* The driver's logical id of user device ``user`` (ChgUserDevIdToDeviceId). */
static int32_t drv_dev(int32_t user, uint32_t *out) {
    pthread_once(&g_vis_once, vis_init);
    if (user < 0 || user >= MAX_DEV) return ACL_ERROR_RT_INVALID_DEVICEID;
    if (!g_vis_set) {
        *out = (uint32_t)user;
        return ACL_SUCCESS;
    }
    if (g_vis_err != ACL_SUCCESS || (uint32_t)user >= g_vis_cnt) return ACL_ERROR_RT_INVALID_DEVICEID;
    *out = g_vis_map[user];
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- the gate */

/* GlobalStateManager::WaitIfLocked: a resource-changing call waits while LOCKED or BACKED_UP. */
static int g_gated; /* calls waiting in gate() (for the lock trace) */

/* NPUSIM_ENTRY_DELAY_US=N (tests): every call sleeps N us right after passing the gate, as a
 * thread preempted there would on a busy node. Lock does not wait for such a call (it is past
 * its entry check, shared CANN notes "Lock"): the window a tool must close itself. */
static long entry_delay_us(void) {
    static long us = -1;
    long v = __atomic_load_n(&us, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *e = getenv("NPUSIM_ENTRY_DELAY_US");
        v = e && *e ? strtol(e, NULL, 10) : 0;
        if (v < 0) v = 0;
        __atomic_store_n(&us, v, __ATOMIC_RELAXED);
    }
    return v;
}

static void gate(void) {
    pthread_mutex_lock(&g_mu);
    while (g_state != ST_RUNNING) {
        g_gated++;
        pthread_cond_wait(&g_cv, &g_mu);
        g_gated--;
    }
    pthread_mutex_unlock(&g_mu);
    long delay = entry_delay_us();
    if (delay > 0) sleep_s((double)delay / 1e6);
}

static int current_device(void) {
    pthread_mutex_lock(&g_mu);
    int d = (t_dev >= 0 && g_open[t_dev]) ? t_dev : g_default_dev;
    pthread_mutex_unlock(&g_mu);
    return d;
}

static int open_devices(int32_t *ids, int max) { /* g_mu held */
    int n = 0;
    for (int d = 0; d < MAX_DEV; d++)
        if (g_open[d]) {
            if (n < max) ids[n] = d;
            n++;
        }
    return n;
}

/* ---------------------------------------------------------------- streams, events, the engine */

enum { T_KERNEL, T_COPY, T_FILL, T_RECORD, T_WAIT, T_RESET, T_CALLBACK };

struct event;
struct func;

struct task {
    int type;
    struct task *next;
    union {
        struct {
            struct func *fn;
            uint32_t blocks;
            void *args;
            size_t size;
        } k;
        struct {
            uint64_t dst, src, n;
            int host; /* host to host */
            uint8_t value;
        } c;
        struct {
            struct event *ev;
            uint64_t seq;
        } e;
        struct {
            void (*fn)(void *);
            void *data;
            int block;
        } cb;
    } u;
};

#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x4556454eu

struct stream {
    uint32_t magic;
    int32_t dev;
    uint32_t flags;
    int is_default;
    int stop;        /* destroy: the thread ends once the queue is empty */
    int abort;       /* force destroy: a wait in progress gives up */
    int running;     /* the thread has a task out of the queue */
    struct task *head, *tail;
    uint64_t submitted, done;
    int32_t error;   /* a task's fault, reported (and cleared) by the next synchronize */
    uint64_t reporter; /* the thread subscribed to its callbacks (aclrtSubscribeReport), 0: none */
    int subscribed;
    pthread_t thread;
    pthread_cond_t work_cv; /* g_eng: a task queued, or stop */
    struct stream *next;
};

struct event {
    uint32_t magic;
    uint32_t flags;
    int32_t dev;
    uint64_t recorded; /* records queued */
    uint64_t done;     /* the latest record executed */
    int reset;         /* reset executed after the last record: not recorded */
    double t_done;
    int refs;          /* queued tasks naming it: destroy waits for them */
    int destroyed;
};

static struct stream *g_streams;
static struct stream *g_default_stream[MAX_DEV];

/* Callbacks a stream reached, for the thread subscribed to it (aclrtProcessReport runs them). */
struct report {
    uint64_t thread;
    void (*fn)(void *);
    void *data;
    int waiter; /* a blocking task waits for it (and frees it); else ProcessReport frees it */
    int done;
    struct report *next;
};
static struct report *g_reports;

/* Waits on g_eng_cv (g_eng held); dl NULL: no limit. Returns ETIMEDOUT when dl passed. */
static int eng_wait(const struct timespec *dl) {
    g_eng_waiters++;
    int e = dl ? pthread_cond_timedwait(&g_eng_cv, &g_eng, dl) : pthread_cond_wait(&g_eng_cv, &g_eng);
    g_eng_waiters--;
    return e;
}

/* Something eng_wait waits for happened (g_eng held). */
static void eng_done(void) {
    if (g_eng_waiters) pthread_cond_broadcast(&g_eng_cv);
}

/* ---- kernels (npusim_kernel.h) */

#define BIN_MAGIC 0x42494e48u
#define FUNC_MAGIC 0x46554e43u

struct bin {
    uint32_t magic;
    void *dl;
};

struct func {
    uint32_t magic;
    struct bin *bin;
    npusim_kernel_fn fn;
};

/* A kernel's view of device memory: the driver's translation of each 2 MiB granule of the range
 * (the VMM granularity, so that a hole of a reserved range is seen), which must be one contiguous
 * host range. NULL: not allocated and mapped throughout (the kernel then faults). */
static void *kernel_dev_ptr(const npusim_kernel_ctx *ctx, uint64_t addr, size_t len) {
    (void)ctx;
    if (len == 0) len = 1;
    if (addr + len < addr) return NULL;
    UINT64 base;
    if (drvMemAddressTranslate(addr, &base) != DRV_ERROR_NONE) return NULL;
    const uint64_t gran = (uint64_t)2 << 20;
    for (uint64_t a = (addr & ~(gran - 1)) + gran; a < addr + len; a += gran) {
        UINT64 p;
        if (drvMemAddressTranslate(a, &p) != DRV_ERROR_NONE || p != base + (a - addr)) return NULL;
    }
    UINT64 last;
    if (drvMemAddressTranslate(addr + len - 1, &last) != DRV_ERROR_NONE || last != base + len - 1) return NULL;
    return (void *)(uintptr_t)base;
}

static int32_t run_task(struct stream *s, struct task *t) {
    switch (t->type) {
    case T_KERNEL: {
        npusim_kernel_ctx ctx = {kernel_dev_ptr, s, t->u.k.blocks, s->dev};
        return t->u.k.fn->fn(&ctx, t->u.k.args, t->u.k.size) == 0 ? ACL_SUCCESS : ACL_ERROR_RT_AICORE_EXCEPTION;
    }
    case T_COPY:
        if (t->u.c.host) {
            memmove((void *)(uintptr_t)t->u.c.dst, (const void *)(uintptr_t)t->u.c.src, t->u.c.n);
            return ACL_SUCCESS;
        }
        return drvMemcpy(t->u.c.dst, t->u.c.n, t->u.c.src, t->u.c.n) == DRV_ERROR_NONE ? ACL_SUCCESS
                                                                                      : ACL_ERROR_RT_AICORE_EXCEPTION;
    case T_FILL:
        return drvMemsetD8(t->u.c.dst, t->u.c.n, t->u.c.value, t->u.c.n) == DRV_ERROR_NONE
                   ? ACL_SUCCESS
                   : ACL_ERROR_RT_AICORE_EXCEPTION;
    case T_CALLBACK: {
        /* handed to the subscribed thread; a blocking one holds the stream until it has run */
        struct report *r = calloc(1, sizeof *r);
        if (!r) return ACL_ERROR_RT_MEMORY_ALLOCATION;
        pthread_mutex_lock(&g_eng);
        *r = (struct report){s->reporter, t->u.cb.fn, t->u.cb.data, t->u.cb.block, 0, NULL};
        struct report **pp = &g_reports;
        while (*pp) pp = &(*pp)->next;
        *pp = r;
        pthread_cond_broadcast(&g_report_cv);
        if (t->u.cb.block) {
            while (!r->done && !s->abort) pthread_cond_wait(&g_report_cv, &g_eng);
            if (r->done) free(r);
            else r->fn = NULL, r->waiter = 0; /* abandoned (force destroy): ProcessReport frees it */
        }
        pthread_mutex_unlock(&g_eng);
        return ACL_SUCCESS;
    }
    default: return ACL_SUCCESS;
    }
}

static void free_task(struct task *t) {
    if (t->type == T_KERNEL) free(t->u.k.args);
    free(t);
}

/* One stream's share of the device's task scheduler: its tasks in order, one at a time. Event
 * tasks are done under g_eng; a wait task blocks this stream (only) until its record executed. */
static void *stream_main(void *arg) {
    struct stream *s = arg;
    pthread_mutex_lock(&g_eng);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->work_cv, &g_eng);
        if (!s->head) break;
        struct task *t = s->head;
        s->running = 1;
        if (t->type == T_WAIT) {
            struct event *ev = t->u.e.ev;
            while (ev->done < t->u.e.seq && !s->abort) eng_wait(NULL);
        }
        int32_t rc = ACL_SUCCESS;
        if (t->type == T_RECORD) {
            struct event *ev = t->u.e.ev;
            if (t->u.e.seq > ev->done) ev->done = t->u.e.seq;
            ev->reset = 0;
            ev->t_done = now_s();
        } else if (t->type == T_RESET) {
            t->u.e.ev->reset = 1;
        } else if (t->type != T_WAIT && !(s->error && t->type != T_CALLBACK)) {
            /* after a fault the stream's later kernels and copies are not run (the synchronize
             * that reports the fault clears it) */
            pthread_mutex_unlock(&g_eng);
            rc = run_task(s, t);
            pthread_mutex_lock(&g_eng);
        }
        if (t->type == T_RECORD || t->type == T_WAIT || t->type == T_RESET) t->u.e.ev->refs--;
        if (rc != ACL_SUCCESS && !s->error) s->error = rc;
        s->head = t->next;
        if (!s->head) s->tail = NULL;
        s->running = 0;
        s->done++;
        eng_done();
        pthread_mutex_unlock(&g_eng);
        free_task(t);
        pthread_mutex_lock(&g_eng);
    }
    pthread_mutex_unlock(&g_eng);
    return NULL;
}

static int32_t stream_new(int32_t dev, uint32_t flags, int is_default, struct stream **out) {
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    s->magic = STREAM_MAGIC;
    s->dev = dev;
    s->flags = flags;
    s->is_default = is_default;
    pthread_cond_init(&s->work_cv, NULL);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setstacksize(&at, 1 << 20);
    /* A stream thread does what the device does on a node: it must take none of the job's signals
     * (a kill(getpid(), SIGUSR1) that the job blocked in its own threads would land here). */
    int e = npusnap_quiet_thread_create(&s->thread, &at, stream_main, s);
    pthread_attr_destroy(&at);
    if (e != 0) {
        pthread_cond_destroy(&s->work_cv);
        free(s);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    pthread_mutex_lock(&g_eng);
    s->next = g_streams;
    g_streams = s;
    pthread_mutex_unlock(&g_eng);
    *out = s;
    return ACL_SUCCESS;
}

/* A stream handle (g_eng held): NULL is the current device's default stream (rtSetDevice made it). */
static struct stream *stream_of_locked(void *h, int32_t *rc) {
    if (h) {
        for (struct stream *s = g_streams; s; s = s->next)
            if (s == h && s->magic == STREAM_MAGIC && !s->stop) return s;
        *rc = ACL_ERROR_RT_PARAM_INVALID;
        return NULL;
    }
    int d = current_device();
    if (d < 0) {
        *rc = ACL_ERROR_RT_CONTEXT_NULL;
        return NULL;
    }
    if (!g_default_stream[d]) *rc = ACL_ERROR_RT_CONTEXT_NULL;
    return g_default_stream[d];
}

static int event_ok(const struct event *ev) { return ev && ev->magic == EVENT_MAGIC && !ev->destroyed; }

/* Queue a task on a stream (NULL: the default stream). Takes the task. */
static int32_t submit(void *stream, struct task *t) {
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    struct stream *s = stream_of_locked(stream, &rc);
    if (s) {
        if (t->type == T_RECORD) t->u.e.seq = ++t->u.e.ev->recorded;
        if (t->type == T_WAIT) t->u.e.seq = t->u.e.ev->recorded;
        if (t->type == T_RECORD || t->type == T_WAIT || t->type == T_RESET) t->u.e.ev->refs++;
        t->next = NULL;
        if (s->tail) s->tail->next = t;
        else s->head = t;
        s->tail = t;
        s->submitted++;
        pthread_cond_signal(&s->work_cv);
    }
    pthread_mutex_unlock(&g_eng);
    if (!s) free_task(t);
    return rc;
}

/* Wait until the stream has done what was queued before this call (g_eng held); `timeout_ms` < 0:
 * no limit. The stream's fault, if any, is returned once. */
static int32_t stream_sync_locked(struct stream *s, int32_t timeout_ms) {
    uint64_t target = s->submitted;
    struct timespec dl = deadline_in(timeout_ms / 1000.0);
    while (s->done < target) {
        if (eng_wait(timeout_ms < 0 ? NULL : &dl) == ETIMEDOUT && s->done < target)
            return ACL_ERROR_RT_STREAM_SYNC_TIMEOUT;
    }
    int32_t rc = s->error;
    s->error = ACL_SUCCESS;
    return rc;
}

/* Every stream of `dev` (-1: of every device). */
static int32_t device_sync(int dev, int32_t timeout_ms) {
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    for (struct stream *s = g_streams; s; s = s->next) {
        if (s->stop || (dev >= 0 && s->dev != dev)) continue;
        int32_t r = stream_sync_locked(s, timeout_ms);
        if (r != ACL_SUCCESS && rc == ACL_SUCCESS) rc = r;
        if (r == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT) break;
    }
    pthread_mutex_unlock(&g_eng);
    return rc;
}

/* Destroy (after its queue drained): the thread ends and is joined. */
static void stream_destroy(struct stream *s) {
    pthread_mutex_lock(&g_eng);
    s->stop = 1;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&g_eng);
    pthread_join(s->thread, NULL);
    pthread_mutex_lock(&g_eng);
    for (struct stream **pp = &g_streams; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    for (int d = 0; d < MAX_DEV; d++)
        if (g_default_stream[d] == s) g_default_stream[d] = NULL;
    s->magic = 0;
    pthread_mutex_unlock(&g_eng);
    pthread_cond_destroy(&s->work_cv);
    free(s);
}

static void destroy_device_streams(int dev) {
    for (;;) {
        pthread_mutex_lock(&g_eng);
        struct stream *s = g_streams;
        while (s && s->dev != dev) s = s->next;
        pthread_mutex_unlock(&g_eng);
        if (!s) return;
        stream_destroy(s);
    }
}

/* ---------------------------------------------------------------- lifecycle */

/* Lock order: g_defmu, g_eng, g_mu. */
static void atfork_prepare(void) {
    pthread_mutex_lock(&g_defmu);
    pthread_mutex_lock(&g_eng);
    pthread_mutex_lock(&g_mu);
}

static void atfork_parent(void) {
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_eng);
    pthread_mutex_unlock(&g_defmu);
}

/* A forked child owns no device and none of the parent's streams (their threads are not in it). */
static void atfork_child(void) {
    /* not taken by atfork_prepare (a release may wait on callbacks): the holder is not in the
     * child, whose devices are all closed */
    pthread_mutex_init(&g_lifemu, NULL);
    g_streams = NULL;
    g_eng_waiters = 0;
    memset(g_default_stream, 0, sizeof g_default_stream);
    memset(g_open, 0, sizeof g_open);
    g_default_dev = -1;
    t_dev = -1;
    g_state = ST_RUNNING;
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_eng);
    pthread_mutex_unlock(&g_defmu);
}

__attribute__((constructor)) static void rt_init(void) {
    monotonic_cond_init(&g_cv);
    monotonic_cond_init(&g_eng_cv);
    monotonic_cond_init(&g_report_cv);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* A process that exits while locked is force-unlocked (CANN does this with an exit hook), so that
 * threads still blocked in device calls are released. */
__attribute__((destructor)) static void rt_fini(void) {
    pthread_mutex_lock(&g_mu);
    if (g_state != ST_RUNNING) {
        fprintf(stderr, "npusim: process %d exiting while %s: force-unlocked\n", (int)getpid(),
                g_state == ST_LOCKED ? "LOCKED" : "BACKED_UP");
        g_state = ST_RUNNING;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

/* ---------------------------------------------------------------- devices and contexts */

RT_API rtError_t rtSetDevice(int32_t devId) {
    uint32_t drv, ndev = 0;
    int32_t rc = drv_dev(devId, &drv);
    if (rc != ACL_SUCCESS) return rc;
    /* a driver id past the driver's count: RT_ERROR_DEVICE_ID (api_error.cc, SetDevice) */
    if (drvGetDevNum(&ndev) == DRV_ERROR_NONE && drv >= ndev) return ACL_ERROR_RT_INVALID_DEVICEID;
    gate();
    pthread_mutex_lock(&g_lifemu);
    rc = drv_to_acl(halDeviceOpen(drv, NULL, NULL));
    /* the device's default stream (NULL), one per device; g_defmu: one thread makes it */
    pthread_mutex_lock(&g_defmu);
    pthread_mutex_lock(&g_eng);
    int have = g_default_stream[devId] != NULL;
    pthread_mutex_unlock(&g_eng);
    struct stream *s = NULL;
    if (rc == ACL_SUCCESS && !have) rc = stream_new(devId, 0, 1, &s);
    if (s) {
        pthread_mutex_lock(&g_eng);
        g_default_stream[devId] = s;
        pthread_mutex_unlock(&g_eng);
    }
    pthread_mutex_unlock(&g_defmu);
    if (rc == ACL_SUCCESS) {
        pthread_mutex_lock(&g_mu);
        g_open[devId] = 1;
        g_ref[devId]++;
        t_dev = devId;
        if (g_default_dev < 0) g_default_dev = devId;
        pthread_mutex_unlock(&g_mu);
    }
    pthread_mutex_unlock(&g_lifemu);
    return rc;
}

static rtError_t device_reset(int32_t devId, int force) {
    uint32_t drv;
    int32_t vrc = drv_dev(devId, &drv);
    if (vrc != ACL_SUCCESS) return vrc;
    gate();
    pthread_mutex_lock(&g_lifemu);
    pthread_mutex_lock(&g_mu);
    int open = g_open[devId];
    int left = open && !force ? --g_ref[devId] : 0;
    pthread_mutex_unlock(&g_mu);
    if (!open || left > 0) { /* released already, or another aclrtSetDevice still holds it */
        pthread_mutex_unlock(&g_lifemu);
        return !open && force ? ACL_ERROR_RT_PARAM_INVALID : ACL_SUCCESS;
    }
    device_sync(devId, -1);
    destroy_device_streams(devId);
    int32_t rc = drv_to_acl(halDeviceClose(drv, NULL));
    pthread_mutex_lock(&g_mu);
    g_open[devId] = 0;
    g_ref[devId] = 0;
    if (t_dev == devId) t_dev = -1;
    if (g_default_dev == devId) {
        g_default_dev = -1;
        for (int d = 0; d < MAX_DEV; d++)
            if (g_open[d]) {
                g_default_dev = d;
                break;
            }
    }
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_lifemu);
    return rc;
}

RT_API rtError_t rtDeviceReset(int32_t devId) { return device_reset(devId, 0); }

RT_API rtError_t rtDeviceResetForce(int32_t devId) { return device_reset(devId, 1); }

RT_API rtError_t rtGetDevice(int32_t *devId) {
    if (!devId) return ACL_ERROR_RT_PARAM_INVALID;
    int d = current_device();
    if (d < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    *devId = d;
    return ACL_SUCCESS;
}

/* Not gated (a query): the driver's device count. */
RT_API rtError_t rtGetDeviceCount(int32_t *cnt) {
    if (!cnt) return ACL_ERROR_RT_PARAM_INVALID;
    pthread_once(&g_vis_once, vis_init);
    if (g_vis_set) {
        if (g_vis_err != ACL_SUCCESS) return g_vis_err;
        *cnt = (int32_t)g_vis_cnt;
        return ACL_SUCCESS;
    }
    uint32_t n = 0;
    int32_t rc = drv_to_acl(drvGetDevNum(&n));
    if (rc == ACL_SUCCESS) *cnt = (int32_t)n;
    return rc;
}

RT_API rtError_t rtDeviceSynchronizeWithTimeout(int32_t timeout) {
    int d = current_device();
    if (d < 0) return ACL_ERROR_UNINITIALIZE;
    if (timeout < -1 || timeout == 0) return ACL_ERROR_RT_PARAM_INVALID;
    return device_sync(d, timeout);
}

RT_API rtError_t rtDeviceSynchronize(void) { return rtDeviceSynchronizeWithTimeout(-1); }

/* Contexts: one per device (the default context rtSetDevice makes), an opaque non-NULL handle. */
RT_API rtError_t rtCtxGetCurrent(void **currentCtx) {
    if (!currentCtx) return ACL_ERROR_RT_PARAM_INVALID;
    int d = current_device();
    if (d < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    *currentCtx = (void *)(CTX_BASE + (uintptr_t)d);
    return ACL_SUCCESS;
}

RT_API rtError_t rtCtxSetCurrent(void *currentCtx) {
    uintptr_t v = (uintptr_t)currentCtx;
    if (v < CTX_BASE || v >= CTX_BASE + MAX_DEV) return ACL_ERROR_RT_PARAM_INVALID;
    int d = (int)(v - CTX_BASE);
    pthread_mutex_lock(&g_mu);
    int ok = g_open[d];
    if (ok) t_dev = d;
    pthread_mutex_unlock(&g_mu);
    return ok ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
}

#ifndef NPUSIM_STRICT_EXPORTS
/* Not a runtime function: the devices this process has open, for the npusimGetOpenDevices helper
 * of the non-strict front-ends. Absent from strict builds. */
RT_API int npusimRuntimeOpenDevices(int32_t *ids, int max) {
    NPUSIM_PRIVATE();
    if (!ids || max < 0) return -1;
    pthread_mutex_lock(&g_mu);
    int n = open_devices(ids, max);
    pthread_mutex_unlock(&g_mu);
    return n;
}
#endif

/* ---------------------------------------------------------------- memory */

RT_API rtError_t rtMalloc(void **devPtr, uint64_t size, uint32_t type, uint16_t moduleId) {
    (void)type, (void)moduleId;
    if (!devPtr || size == 0) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    int dev = current_device();
    if (dev < 0) return ACL_ERROR_UNINITIALIZE;
    uint32_t drv;
    int32_t rc = drv_dev(dev, &drv);
    if (rc != ACL_SUCCESS) return rc;
    /* On a node with the fault "untracked" (docs/simulator.md), ACL_MEM_MALLOC_HUGE_ONLY (1) goes
     * through a driver entry point that is not halMemAlloc, as a runtime that allocates huge pages
     * through another driver call would. */
#ifndef NPUSIM_STRICT_EXPORTS
    if (type == 1 && (npusimHalNodeFaults() & NPUSIM_CONFIG_FAULT_UNTRACKED))
        return drv_to_acl(npusimHalMemAllocHuge(devPtr, size, MEM_DEV | (unsigned long long)drv));
#endif
    return drv_to_acl(halMemAlloc(devPtr, size, MEM_DEV | (unsigned long long)drv));
}

RT_API rtError_t rtMallocCached(void **devPtr, uint64_t size, uint32_t type, uint16_t moduleId) {
    return rtMalloc(devPtr, size, type, moduleId);
}

RT_API rtError_t rtFree(void *devPtr) {
    if (!devPtr) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    return drv_to_acl(halMemFree(devPtr));
}

/* Host memory for copies (page-locked on a real node): ordinary memory here. */
RT_API rtError_t rtMallocHost(void **hostPtr, uint64_t size, uint16_t moduleId) {
    (void)moduleId;
    if (!hostPtr || size == 0) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    void *p = NULL;
    if (posix_memalign(&p, 64, size) != 0) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *hostPtr = p;
    return ACL_SUCCESS;
}

RT_API rtError_t rtFreeHost(void *hostPtr) {
    if (!hostPtr) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    free(hostPtr);
    return ACL_SUCCESS;
}

static int is_dev(const void *p) {
    UINT64 h;
    return drvMemAddressTranslate((DVdeviceptr)(uintptr_t)p, &h) == DRV_ERROR_NONE;
}

/* The checks of a copy: count within destMax, a known kind, device memory where the kind says. */
static int32_t copy_check(void *dst, uint64_t destMax, const void *src, uint64_t cnt, uint32_t kind) {
    if (!dst || !src || cnt > destMax || kind > 3) return ACL_ERROR_RT_PARAM_INVALID;
    if (kind == 0) return ACL_SUCCESS;
    if (current_device() < 0) return ACL_ERROR_UNINITIALIZE;
    if ((kind == 1 || kind == 3) && !is_dev(dst)) return ACL_ERROR_RT_PARAM_INVALID;
    if ((kind == 2 || kind == 3) && !is_dev(src)) return ACL_ERROR_RT_PARAM_INVALID;
    return ACL_SUCCESS;
}

/* Synchronous: returns when the bytes are there. Not ordered with queued stream work (as the real
 * synchronous copy: synchronize the stream first to read a kernel's result). */
RT_API rtError_t rtMemcpy(void *dst, uint64_t destMax, const void *src, uint64_t cnt, uint32_t kind) {
    gate();
    int32_t rc = copy_check(dst, destMax, src, cnt, kind);
    if (rc != ACL_SUCCESS || cnt == 0) return rc;
    if (kind == 0) {
        memmove(dst, src, cnt);
        return ACL_SUCCESS;
    }
    return drv_to_acl(drvMemcpy((DVdeviceptr)(uintptr_t)dst, destMax, (DVdeviceptr)(uintptr_t)src, cnt));
}

RT_API rtError_t rtMemcpyAsync(void *dst, uint64_t destMax, const void *src, uint64_t cnt, uint32_t kind,
                               void *stm) {
    gate();
    int32_t rc = copy_check(dst, destMax, src, cnt, kind);
    if (rc != ACL_SUCCESS) return rc;
    struct task *t = calloc(1, sizeof *t);
    if (!t) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    t->type = T_COPY;
    t->u.c.dst = (uint64_t)(uintptr_t)dst;
    t->u.c.src = (uint64_t)(uintptr_t)src;
    t->u.c.n = cnt;
    t->u.c.host = kind == 0;
    if (cnt == 0) t->u.c.host = 1;
    return submit(stm, t);
}

RT_API rtError_t rtMemset(void *devPtr, uint64_t destMax, uint32_t val, uint64_t cnt) {
    if (!devPtr || cnt > destMax) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    if (cnt == 0) return ACL_SUCCESS;
    return drv_to_acl(drvMemsetD8((DVdeviceptr)(uintptr_t)devPtr, destMax, (uint8_t)val, cnt));
}

RT_API rtError_t rtMemsetAsync(void *ptr, uint64_t destMax, uint32_t val, uint64_t cnt, void *stm) {
    if (!ptr || cnt > destMax) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    if (!is_dev(ptr)) return ACL_ERROR_RT_PARAM_INVALID;
    struct task *t = calloc(1, sizeof *t);
    if (!t) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    t->type = cnt ? T_FILL : T_COPY;
    t->u.c.dst = (uint64_t)(uintptr_t)ptr;
    t->u.c.n = cnt;
    t->u.c.value = (uint8_t)val;
    t->u.c.host = cnt == 0;
    return submit(stm, t);
}

/* Not gated (a query). memInfoType: the driver's physical memory of the current device. */
RT_API rtError_t rtMemGetInfoEx(uint32_t memInfoType, size_t *freeSize, size_t *totalSize) {
    (void)memInfoType;
    if (!freeSize || !totalSize) return ACL_ERROR_RT_PARAM_INVALID;
    int d = current_device();
    if (d < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    struct MemPhyInfo info;
    uint32_t drv;
    int32_t rc = drv_dev(d, &drv);
    if (rc == ACL_SUCCESS) rc = drv_to_acl(halMemGetInfo(drv, NPUSIM_MEM_INFO_TYPE_PHY_INFO, &info));
    if (rc == ACL_SUCCESS) {
        *freeSize = (size_t)info.free;
        *totalSize = (size_t)info.total;
    }
    return rc;
}

/* ---- VMM: torch_npu's expandable segments */

RT_API rtError_t rtReserveMemAddress(void **devPtr, size_t size, size_t alignment, void *devAddr, uint64_t flags) {
    if (!devPtr || size == 0) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    return drv_to_acl(halMemAddressReserve(devPtr, size, alignment, devAddr, flags));
}

RT_API rtError_t rtReleaseMemAddress(void *devPtr) {
    if (!devPtr) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    return drv_to_acl(halMemAddressFree(devPtr));
}

/* rtDrvMemProp_t as the ACL front-end fills it from aclrtPhysicalMemProp (acl.c). */
RT_API rtError_t rtMallocPhysical(void **handle, size_t size, const struct drv_mem_prop *prop, uint64_t flags) {
    if (!handle || !prop || size == 0) return ACL_ERROR_RT_PARAM_INVALID;
    struct drv_mem_prop p = *prop;
    int32_t rc = drv_dev((int32_t)prop->devid, &p.devid);
    if (rc != ACL_SUCCESS) return rc;
    gate();
    return drv_to_acl(halMemCreate((drv_mem_handle_t **)handle, size, &p, flags));
}

/* Not gated (a query, api_c.cc). */
RT_API rtError_t rtMemGetAllocationGranularity(const struct drv_mem_prop *prop, uint32_t option, size_t *granularity) {
    if (!prop || !granularity) return ACL_ERROR_RT_PARAM_INVALID;
    return drv_to_acl(halMemGetAllocationGranularity(prop, (int)option, granularity));
}

RT_API rtError_t rtFreePhysical(void *handle) {
    if (!handle) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    return drv_to_acl(halMemRelease(handle));
}

RT_API rtError_t rtMapMem(void *devPtr, size_t size, size_t offset, void *handle, uint64_t flags) {
    if (!devPtr || !handle || size == 0) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    return drv_to_acl(halMemMap(devPtr, size, offset, handle, flags));
}

RT_API rtError_t rtUnmapMem(void *devPtr) {
    if (!devPtr) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    return drv_to_acl(halMemUnmap(devPtr));
}

/* ---------------------------------------------------------------- streams and events */

RT_API rtError_t rtStreamCreateWithFlags(void **stm, int32_t priority, uint32_t flags) {
    (void)priority;
    if (!stm) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    int d = current_device();
    if (d < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    struct stream *s;
    int32_t rc = stream_new(d, flags, 0, &s);
    if (rc == ACL_SUCCESS) *stm = s;
    return rc;
}

RT_API rtError_t rtStreamCreate(void **stm, int32_t priority) { return rtStreamCreateWithFlags(stm, priority, 0); }

static rtError_t stream_destroy_checked(void *stm, int force) {
    if (!stm) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    struct stream *s = stream_of_locked(stm, &rc);
    if (s && s->is_default) s = NULL, rc = ACL_ERROR_RT_PARAM_INVALID;
    if (s && force) { /* drop what has not started; a wait in progress gives up */
        s->abort = 1;
        struct task *t = s->running ? s->head->next : s->head;
        if (s->running) s->head->next = NULL, s->tail = s->head;
        else s->head = s->tail = NULL;
        while (t) {
            struct task *n = t->next;
            /* a dropped record counts as reached, so that no other stream waits on it forever */
            if (t->type == T_RECORD && t->u.e.seq > t->u.e.ev->done) t->u.e.ev->done = t->u.e.seq;
            if (t->type == T_RECORD || t->type == T_WAIT || t->type == T_RESET) t->u.e.ev->refs--;
            s->done++;
            free_task(t);
            t = n;
        }
        pthread_cond_broadcast(&g_eng_cv);
        pthread_cond_broadcast(&g_report_cv);
    }
    pthread_mutex_unlock(&g_eng);
    if (s) stream_destroy(s); /* the thread drains the queue, then ends */
    return rc;
}

RT_API rtError_t rtStreamDestroy(void *stm) { return stream_destroy_checked(stm, 0); }
RT_API rtError_t rtStreamDestroyForce(void *stm) { return stream_destroy_checked(stm, 1); }

RT_API rtError_t rtStreamSynchronizeWithTimeout(void *stm, int32_t timeout) {
    if (timeout < -1 || timeout == 0) return ACL_ERROR_RT_PARAM_INVALID;
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    struct stream *s = stream_of_locked(stm, &rc);
    if (s) rc = stream_sync_locked(s, timeout);
    pthread_mutex_unlock(&g_eng);
    return rc;
}

RT_API rtError_t rtStreamSynchronize(void *stm) { return rtStreamSynchronizeWithTimeout(stm, -1); }

/* 0: everything queued is done; ACL_ERROR_RT_STREAM_NOT_COMPLETE otherwise. */
RT_API rtError_t rtStreamQuery(void *stm) {
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    struct stream *s = stream_of_locked(stm, &rc);
    if (s) rc = s->done == s->submitted ? ACL_SUCCESS : ACL_ERROR_RT_STREAM_NOT_COMPLETE;
    pthread_mutex_unlock(&g_eng);
    return rc;
}

RT_API rtError_t rtEventCreateWithFlag(void **evt, uint32_t flag) {
    if (!evt) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    int d = current_device();
    if (d < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    struct event *ev = calloc(1, sizeof *ev);
    if (!ev) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    ev->magic = EVENT_MAGIC;
    ev->flags = flag;
    ev->dev = d;
    *evt = ev;
    return ACL_SUCCESS;
}

RT_API rtError_t rtEventCreate(void **evt) { return rtEventCreateWithFlag(evt, 0); }
RT_API rtError_t rtEventCreateExWithFlag(void **evt, uint32_t flag) { return rtEventCreateWithFlag(evt, flag); }

static rtError_t event_task(void *evt, void *stm, int type) {
    gate();
    pthread_mutex_lock(&g_eng);
    int ok = event_ok(evt);
    pthread_mutex_unlock(&g_eng);
    if (!ok) return ACL_ERROR_RT_PARAM_INVALID;
    struct task *t = calloc(1, sizeof *t);
    if (!t) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    t->type = type;
    t->u.e.ev = evt;
    return submit(stm, t);
}

RT_API rtError_t rtEventRecord(void *evt, void *stm) { return event_task(evt, stm, T_RECORD); }
RT_API rtError_t rtEventReset(void *evt, void *stm) { return event_task(evt, stm, T_RESET); }
/* The stream waits (on the device) for the event's latest record queued before this call; an
 * event never recorded is no wait. */
RT_API rtError_t rtStreamWaitEvent(void *stm, void *evt) { return event_task(evt, stm, T_WAIT); }

RT_API rtError_t rtEventSynchronize(void *evt) {
    pthread_mutex_lock(&g_eng);
    int32_t rc = event_ok(evt) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
    if (rc == ACL_SUCCESS) {
        struct event *ev = evt;
        uint64_t target = ev->recorded;
        while (ev->done < target && !ev->destroyed) eng_wait(NULL);
    }
    pthread_mutex_unlock(&g_eng);
    return rc;
}

/* status: 1 (ACL_EVENT_RECORDED_STATUS_COMPLETE) once its latest record executed, else 0. */
RT_API rtError_t rtEventQueryStatus(void *evt, uint32_t *status) {
    if (!status) return ACL_ERROR_RT_PARAM_INVALID;
    pthread_mutex_lock(&g_eng);
    int32_t rc = event_ok(evt) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
    if (rc == ACL_SUCCESS) {
        struct event *ev = evt;
        *status = ev->recorded > 0 && ev->done >= ev->recorded && !ev->reset;
    }
    pthread_mutex_unlock(&g_eng);
    return rc;
}

RT_API rtError_t rtEventElapsedTime(float *timeInterval, void *startEvent, void *endEvent) {
    if (!timeInterval) return ACL_ERROR_RT_PARAM_INVALID;
    pthread_mutex_lock(&g_eng);
    int32_t rc = event_ok(startEvent) && event_ok(endEvent) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
    if (rc == ACL_SUCCESS) {
        struct event *a = startEvent, *b = endEvent;
        if (!a->recorded || !b->recorded || a->done < a->recorded || b->done < b->recorded)
            rc = ACL_ERROR_RT_EVENT_NOT_COMPLETE;
        else *timeInterval = (float)((b->t_done - a->t_done) * 1000.0);
    }
    pthread_mutex_unlock(&g_eng);
    return rc;
}

/* Destroyed once no queued task names it any more (the real runtime defers it likewise). */
RT_API rtError_t rtEventDestroy(void *evt) {
    gate();
    pthread_mutex_lock(&g_eng);
    int32_t rc = event_ok(evt) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
    if (rc == ACL_SUCCESS) {
        struct event *ev = evt;
        while (ev->refs > 0) eng_wait(NULL);
        ev->destroyed = 1;
        ev->magic = 0;
        eng_done();
        free(ev);
    }
    pthread_mutex_unlock(&g_eng);
    return rc;
}

/* Host callbacks (callback.cpp; api_c.cc, all four gated): a thread subscribes to a stream's
 * callbacks and runs them in aclrtProcessReport; aclrtLaunchCallback on a stream nobody subscribed
 * to is refused (107011). A blocking callback holds its stream until it has run. */
RT_API rtError_t rtSubscribeReport(uint64_t threadId, void *stm) {
    gate();
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    struct stream *s = stream_of_locked(stm, &rc);
    if (s && s->subscribed && s->reporter != threadId) rc = ACL_ERROR_RT_STREAM_SUBSCRIBE;
    else if (s) s->subscribed = 1, s->reporter = threadId;
    pthread_mutex_unlock(&g_eng);
    return rc;
}

RT_API rtError_t rtUnSubscribeReport(uint64_t threadId, void *stm) {
    gate();
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    struct stream *s = stream_of_locked(stm, &rc);
    if (s && (!s->subscribed || s->reporter != threadId)) rc = ACL_ERROR_RT_THREAD_SUBSCRIBE;
    else if (s) s->subscribed = 0, s->reporter = 0;
    pthread_mutex_unlock(&g_eng);
    return rc;
}

/* Runs one callback reported for the calling thread; waits up to `timeout` ms (-1: no limit) for
 * one, else ACL_ERROR_RT_REPORT_TIMEOUT. */
RT_API rtError_t rtProcessReport(int32_t timeout) {
    if (timeout < -1) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    uint64_t me = (uint64_t)pthread_self();
    struct timespec dl = deadline_in(timeout / 1000.0);
    pthread_mutex_lock(&g_eng);
    struct report *r = NULL;
    for (;;) {
        struct report **pp = &g_reports;
        while (*pp && ((*pp)->thread != me || (*pp)->done)) pp = &(*pp)->next;
        if (*pp) {
            r = *pp;
            *pp = r->next;
            break;
        }
        if (timeout < 0) pthread_cond_wait(&g_report_cv, &g_eng);
        else if (pthread_cond_timedwait(&g_report_cv, &g_eng, &dl) == ETIMEDOUT) break;
    }
    pthread_mutex_unlock(&g_eng);
    if (!r) return ACL_ERROR_RT_REPORT_TIMEOUT;
    pthread_mutex_lock(&g_eng);
    void (*fn)(void *) = r->fn;
    void *data = r->data;
    pthread_mutex_unlock(&g_eng);
    if (fn) fn(data);
    pthread_mutex_lock(&g_eng);
    if (r->waiter) {
        r->done = 1;
        pthread_cond_broadcast(&g_report_cv);
    } else {
        free(r);
    }
    pthread_mutex_unlock(&g_eng);
    return ACL_SUCCESS;
}

RT_API rtError_t rtCallbackLaunch(void (*callBackFunc)(void *), void *fnData, void *stm, bool isBlock) {
    if (!callBackFunc) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_eng);
    struct stream *s = stream_of_locked(stm, &rc);
    if (s && !s->subscribed) rc = ACL_ERROR_RT_STREAM_SUBSCRIBE;
    pthread_mutex_unlock(&g_eng);
    if (rc != ACL_SUCCESS) return rc;
    struct task *t = calloc(1, sizeof *t);
    if (!t) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    t->type = T_CALLBACK;
    t->u.cb.fn = callBackFunc;
    t->u.cb.data = fnData;
    t->u.cb.block = isBlock;
    return submit(stm, t);
}

/* ---------------------------------------------------------------- kernels */

RT_API rtError_t rtsBinaryLoadFromFile(const char *binPath, const void *optionalCfg, void **handle) {
    (void)optionalCfg;
    if (!binPath || !handle) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    struct bin *b = calloc(1, sizeof *b);
    if (!b) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    b->dl = dlopen(binPath, RTLD_NOW | RTLD_LOCAL);
    if (!b->dl) {
        fprintf(stderr, "npusim: cannot load kernel binary %s: %s\n", binPath, dlerror());
        free(b);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    b->magic = BIN_MAGIC;
    *handle = b;
    return ACL_SUCCESS;
}

RT_API rtError_t rtBinaryUnLoad(void *binHandle) {
    struct bin *b = binHandle;
    if (!b || b->magic != BIN_MAGIC) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    /* queued kernels of it must not outlive it: the device drains first */
    device_sync(-1, -1);
    b->magic = 0;
    dlclose(b->dl);
    free(b);
    return ACL_SUCCESS;
}

RT_API rtError_t rtsFuncGetByName(const void *binHandle, const char *kernelName, void **funcHandle) {
    const struct bin *b = binHandle;
    if (!b || b->magic != BIN_MAGIC || !kernelName || !funcHandle) return ACL_ERROR_RT_PARAM_INVALID;
    void *sym = dlsym(b->dl, kernelName);
    if (!sym) return ACL_ERROR_RT_PARAM_INVALID;
    struct func *f = calloc(1, sizeof *f);
    if (!f) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    f->magic = FUNC_MAGIC;
    f->bin = (struct bin *)b;
    memcpy(&f->fn, &sym, sizeof f->fn);
    *funcHandle = f;
    return ACL_SUCCESS;
}

/* The args are copied now (the real runtime copies host args into its args pool), so the caller
 * may reuse its buffer at once. */
RT_API rtError_t rtsLaunchKernelWithHostArgs(void *funcHandle, uint32_t numBlocks, void *stm, void *cfg,
                                             void *hostArgs, uint32_t argsSize, void *placeHolderArray,
                                             uint32_t placeHolderNum) {
    (void)cfg, (void)placeHolderArray, (void)placeHolderNum;
    struct func *f = funcHandle;
    if (!f || f->magic != FUNC_MAGIC || numBlocks == 0 || (argsSize && !hostArgs)) return ACL_ERROR_RT_PARAM_INVALID;
    gate();
    struct task *t = calloc(1, sizeof *t);
    void *a = argsSize ? malloc(argsSize) : NULL;
    if (!t || (argsSize && !a)) {
        free(t), free(a);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    if (argsSize) memcpy(a, hostArgs, argsSize);
    t->type = T_KERNEL;
    t->u.k.fn = f;
    t->u.k.blocks = numBlocks;
    t->u.k.args = a;
    t->u.k.size = argsSize;
    return submit(stm, t);
}

/* ---------------------------------------------------------------- snapshot */

/* RT_FEATURE_DFX_PROCESS_SNAPSHOT (api_c_snapshot.cc, CheckSnapShotFeatureSupport): Atlas A2
 * (Ascend910B*), A3 (Ascend910_93*) and Ascend 950 have it. The simulated chip is named by
 * NPUSIM_SOC_VERSION (default Ascend910B1); NPUSIM_NO_SNAPSHOT=1 also takes the feature away. */
static const char *soc_name(void) {
    const char *v = getenv("NPUSIM_SOC_VERSION");
    return v && *v ? v : "Ascend910B1";
}

static int no_snapshot(void) {
    const char *v = getenv("NPUSIM_NO_SNAPSHOT");
    if (v && *v && atoi(v) != 0) return 1;
    const char *soc = soc_name();
    return strncmp(soc, "Ascend910B", 10) != 0 && strncmp(soc, "Ascend910_93", 12) != 0 &&
           strncmp(soc, "Ascend950", 9) != 0;
}

static int get_state(void) {
    pthread_mutex_lock(&g_mu);
    int s = g_state;
    pthread_mutex_unlock(&g_mu);
    return s;
}

static void set_state(int s) {
    pthread_mutex_lock(&g_mu);
    g_state = s;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
#ifndef NPUSIM_STRICT_EXPORTS
    npusimHalSnapshotLocked(s != ST_RUNNING);
#endif
}

static int32_t cb_add(int stage, npusim_callback cb, void *args) {
    if (g_ncb[stage] == g_cbcap[stage]) {
        int cap = g_cbcap[stage] ? g_cbcap[stage] * 2 : 8;
        struct cb *p = realloc(g_cbs[stage], (size_t)cap * sizeof *p);
        if (!p) return ACL_ERROR_RT_MEMORY_ALLOCATION;
        g_cbs[stage] = p;
        g_cbcap[stage] = cap;
    }
    g_cbs[stage][g_ncb[stage]++] = (struct cb){cb, args};
    return ACL_SUCCESS;
}

/* snapshot_callback_manager.cc RegisterCallback: stage range, NULL callback, duplicate. */
RT_API rtError_t rtSnapShotCallbackRegister(int stage, npusim_callback callback, void *args) {
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* checked first (api_c_snapshot.cc) */
    if (stage < 0 || stage >= NSTAGES || !callback) return ACL_ERROR_RT_PARAM_INVALID;
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_cbmu);
    for (int i = 0; i < g_ncb[stage]; i++)
        if (g_cbs[stage][i].fn == callback) rc = ACL_ERROR_SNAPSHOT_REGISTER_CALLBACK_FAILED;
    if (rc == ACL_SUCCESS) rc = cb_add(stage, callback, args);
    pthread_mutex_unlock(&g_cbmu);
    return rc;
}

RT_API rtError_t rtSnapShotCallbackUnregister(int stage, npusim_callback callback) {
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    if (stage < 0 || stage >= NSTAGES || !callback) return ACL_ERROR_RT_PARAM_INVALID;
    int32_t rc = ACL_ERROR_RT_PARAM_INVALID;
    pthread_mutex_lock(&g_cbmu);
    for (int i = 0; i < g_ncb[stage]; i++)
        if (g_cbs[stage][i].fn == callback) {
            memmove(&g_cbs[stage][i], &g_cbs[stage][i + 1], (size_t)(g_ncb[stage] - i - 1) * sizeof(struct cb));
            g_ncb[stage]--;
            rc = ACL_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&g_cbmu);
    return rc;
}

/* InvokeCallbacks: callback-major -- each registered callback over every open device
 * (ProcessForAllOpenDevice), then the next (A0 A1 B0 B1), holding the callback mutex; the first
 * non-zero result gives 507912. Called without g_mu, so callbacks may query the runtime. */
static int32_t run_callbacks(int stage) {
    int32_t ids[MAX_DEV];
    pthread_mutex_lock(&g_mu);
    int nd = open_devices(ids, MAX_DEV);
    pthread_mutex_unlock(&g_mu);
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_cbmu);
    for (int i = 0; i < g_ncb[stage] && rc == ACL_SUCCESS; i++)
        for (int d = 0; d < nd && rc == ACL_SUCCESS; d++)
            if (g_cbs[stage][i].fn(ids[d], g_cbs[stage][i].args) != 0) rc = ACL_ERROR_SNAPSHOT_CALLBACK_FAILED;
    pthread_mutex_unlock(&g_cbmu);
    return rc;
}

/* NPUSIM_TRACE_LOCK=FILE (a test instrument of the simulated device, not a CANN feature): at each
 * Lock and at each Backup, append one line saying what the device and the runtime held at that
 * moment -- tasks queued per kind, tasks executing, calls waiting at the gate -- so that tests can
 * show where their snapshots landed (a kernel executing, copies queued, a launch held). */
static void trace_cut(const char *when) {
    const char *path = getenv("NPUSIM_TRACE_LOCK");
    if (!path || !*path) return;
    int kernels = 0, copies = 0, other = 0, running = 0, gated;
    pthread_mutex_lock(&g_mu);
    gated = g_gated;
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_lock(&g_eng);
    for (struct stream *st = g_streams; st; st = st->next) {
        running += st->running != 0;
        for (struct task *t = st->head; t; t = t->next) {
            if (t->type == T_KERNEL) kernels++;
            else if (t->type == T_COPY) copies++;
            else other++;
        }
    }
    pthread_mutex_unlock(&g_eng);
    FILE *f = fopen(path, "ae");
    if (!f) return;
    fprintf(f, "{\"pid\": %d, \"at\": \"%s\", \"kernels_queued\": %d, \"copies_queued\": %d, "
               "\"other_queued\": %d, \"running\": %d, \"gated\": %d}\n",
            (int)getpid(), when, kernels, copies, other, running, gated);
    fclose(f);
}

/* ApiImpl::SnapShotProcessLock: LOCK_PRE first (before the state check: it runs even when Lock then
 * fails), then GlobalStateManager::Locked: RUNNING required (507906), then the runtime's registered
 * background threads must park (NPUSIM_FAULT_LOCK_TIMEOUT: one never does; after the wait, 507905
 * and back to RUNNING). Calls in flight are neither waited for nor a reason to fail, and the
 * device keeps executing queued work. */
RT_API rtError_t rtSnapShotProcessLock(void) {
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = run_callbacks(NPUSIM_STAGE_LOCK_PRE);
    if (rc == ACL_SUCCESS && get_state() != ST_RUNNING) rc = ACL_ERROR_SNAPSHOT_LOCK_FAILED;
    if (rc == ACL_SUCCESS) {
        set_state(ST_LOCKED);
        trace_cut("lock");
        if (f.lock_timeout) {
            long ms = f.lock_wait_ms >= 0 ? f.lock_wait_ms : 60000;
            sleep_s((double)ms / 1000.0); /* polling a background thread that never parks */
            set_state(ST_RUNNING);
            rc = ACL_ERROR_SNAPSHOT_LOCK_TIMEOUT;
        }
    }
    pthread_mutex_unlock(&g_snap);
    return rc;
}

/* Backup (api_error.cc ApiErrorDecorator::SnapShotProcessBackup, then api_impl.cc, then
 * snapshot_process_helper.cc): LOCKED required (507908); BACKUP_PRE; in the driver-backed flow the
 * driver feature FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT (without it 207000, no fallback); every
 * stream synchronized with no timeout, and no active context at all gives RT_ERROR_CONTEXT_NULL
 * (107002, the state stays LOCKED); the driver's halProcessResBackup; BACKUP_POST; then
 * BACKED_UP. An underlying error (NPUSIM_FAULT_BACKUP_CODE, e.g. 207000 for an AICPU model) is
 * passed through as it is. */
static rtError_t backup(int driver) {
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = ACL_SUCCESS;
    if (get_state() != ST_LOCKED || f.backup) rc = ACL_ERROR_SNAPSHOT_BACKUP_FAILED;
    if (rc == ACL_SUCCESS) trace_cut("backup");
    if (rc == ACL_SUCCESS) rc = run_callbacks(NPUSIM_STAGE_BACKUP_PRE);
    if (rc == ACL_SUCCESS && driver && !halSupportFeature(0, NPUSIM_FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT))
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    if (rc == ACL_SUCCESS) {
        int32_t ids[MAX_DEV];
        pthread_mutex_lock(&g_mu);
        int nd = open_devices(ids, MAX_DEV);
        pthread_mutex_unlock(&g_mu);
        if (nd == 0) rc = ACL_ERROR_RT_CONTEXT_NULL;
    }
    if (rc == ACL_SUCCESS) rc = device_sync(-1, -1);
    if (rc == ACL_SUCCESS && f.backup_code) rc = f.backup_code;
    if (rc == ACL_SUCCESS) {
        if (f.backup_hang_ms > 0) sleep_s((double)f.backup_hang_ms / 1000.0);
        int version = 0;
        if (driver && halGetAPIVersion(&version) != DRV_ERROR_NONE) rc = ACL_ERROR_SNAPSHOT_BACKUP_FAILED;
        halProcResBackupInfo info;
        memset(&info, 0, sizeof info);
        info.reserve[0] = driver ? NPUSIM_BACKUP_DEVICE_MEM : 0;
        if (rc == ACL_SUCCESS && halProcessResBackup(&info) != DRV_ERROR_NONE) rc = ACL_ERROR_SNAPSHOT_BACKUP_FAILED;
        if (rc == ACL_SUCCESS) {
            g_driver_backup = driver;
            g_backup_version = version;
            rc = run_callbacks(NPUSIM_STAGE_BACKUP_POST);
            if (rc == ACL_SUCCESS) set_state(ST_BACKED_UP); /* else stays LOCKED */
        }
    }
    pthread_mutex_unlock(&g_snap);
    return rc;
}

RT_API rtError_t rtSnapShotProcessBackup(void) { return backup(0); }

/* Restore: BACKED_UP required (507909); RESTORE_PRE; in the driver-backed flow the driver feature
 * (207000 without it, no fallback), a driver-flow Backup and the same driver version (507909);
 * every device opened again and the driver's halProcessResRestore (507909 when it refuses, e.g.
 * another live process has the device); RESTORE_POST; then LOCKED. */
static rtError_t restore(int driver) {
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = ACL_SUCCESS;
    if (get_state() != ST_BACKED_UP || f.restore) rc = ACL_ERROR_SNAPSHOT_RESTORE_FAILED;
    if (rc == ACL_SUCCESS) rc = run_callbacks(NPUSIM_STAGE_RESTORE_PRE);
    if (rc == ACL_SUCCESS && driver && !halSupportFeature(0, NPUSIM_FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT))
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    if (rc == ACL_SUCCESS && driver) {
        int version = -1;
        if (!g_driver_backup || halGetAPIVersion(&version) != DRV_ERROR_NONE || version != g_backup_version)
            rc = ACL_ERROR_SNAPSHOT_RESTORE_FAILED;
    }
    if (rc == ACL_SUCCESS) {
        int32_t ids[MAX_DEV];
        pthread_mutex_lock(&g_mu);
        int nd = open_devices(ids, MAX_DEV);
        pthread_mutex_unlock(&g_mu);
        for (int d = 0; d < nd && rc == ACL_SUCCESS; d++) {
            uint32_t drv;
            if (drv_dev(ids[d], &drv) != ACL_SUCCESS || halDeviceOpen(drv, NULL, NULL) != DRV_ERROR_NONE)
                rc = ACL_ERROR_SNAPSHOT_RESTORE_FAILED;
        }
        halProcResRestoreInfo info;
        memset(&info, 0, sizeof info);
        if (rc == ACL_SUCCESS && nd > 0 && halProcessResRestore(&info) != DRV_ERROR_NONE)
            rc = ACL_ERROR_SNAPSHOT_RESTORE_FAILED;
    }
    if (rc == ACL_SUCCESS) {
        rc = run_callbacks(NPUSIM_STAGE_RESTORE_POST);
        if (rc == ACL_SUCCESS) set_state(ST_LOCKED);
    }
    pthread_mutex_unlock(&g_snap);
    return rc;
}

RT_API rtError_t rtSnapShotProcessRestore(void) { return restore(0); }

#ifdef NPUSIM_DRIVER_FLOW
/* The driver-backed flow of newer builds (runtime docs/zh/design/features/snapshot.md: the ACL
 * front-end calls these when args != NULL). */
RT_API rtError_t rtSnapShotProcessBackupWithArgs(const void *args) { return backup(args != NULL); }
RT_API rtError_t rtSnapShotProcessRestoreWithArgs(const void *args) { return restore(args != NULL); }
#endif

/* Unlock from LOCKED or BACKED_UP (the latter without Restore is a pure state change: the original
 * keeps running after a dump, its devices opened again); UNLOCK_POST runs after RUNNING. */
RT_API rtError_t rtSnapShotProcessUnlock(void) {
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = ACL_SUCCESS;
    int st = get_state();
    if ((st != ST_LOCKED && st != ST_BACKED_UP) || f.unlock) rc = ACL_ERROR_SNAPSHOT_UNLOCK_FAILED;
    else if (st == ST_BACKED_UP) {
        int32_t ids[MAX_DEV];
        pthread_mutex_lock(&g_mu);
        int nd = open_devices(ids, MAX_DEV);
        pthread_mutex_unlock(&g_mu);
        for (int d = 0; d < nd && rc == ACL_SUCCESS; d++) {
            uint32_t drv;
            if (drv_dev(ids[d], &drv) != ACL_SUCCESS || halDeviceOpen(drv, NULL, NULL) != DRV_ERROR_NONE)
                rc = ACL_ERROR_SNAPSHOT_UNLOCK_FAILED;
        }
    }
    if (rc == ACL_SUCCESS) {
        set_state(ST_RUNNING);
        rc = run_callbacks(NPUSIM_STAGE_UNLOCK_POST);
    }
    pthread_mutex_unlock(&g_snap);
    return rc;
}

/* Feature check first, then the NULL check (api_c_snapshot.cc): GetState(NULL) on a chip without
 * the feature is 207000. Never waits. */
RT_API rtError_t rtSnapShotProcessGetState(int *state) {
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    if (!state) return ACL_ERROR_RT_PARAM_INVALID;
    *state = get_state();
    return ACL_SUCCESS;
}

/* ---- the runtime's deliberate failures (native/npusim/failures.toml) */
#include "errmsg.h"
#define NPUSIM_FAILURES_RUNTIME
#include "failures.inc"
