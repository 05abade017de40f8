/* Communicators that survive a snapshot (npusnap/hcclvirt.h, docs/distributed.md).
 *
 * Built into libnpusnap_agent.so. The application keeps the handle HCCL gave it; every HCCL name
 * that takes a communicator goes through a wrapper here (exported for programs linked against
 * libhccl, and handed out by the agent's dlsym() for the programs that look HCCL up, as torch_npu
 * does), which passes the communicator currently behind that handle. Nothing changes until a
 * Restore: then each communicator is marked stale, its calls wait (bounded), and the restore
 * command rebuilds it through HCCL's own public calls -- HcclGetRootInfo on the process that was
 * rank 0, HcclCommInitRootInfo[Config] on every rank with the rank, size and configuration the
 * application passed the first time -- after which the waiting calls go on with the new one.
 * Meanwhile HcclGetCommAsyncError reports no error on a stale communicator: none happened on the
 * application's communicator, which is being re-established (torch_npu's watchdog polls it every
 * second and tears the process down on the first error). A rebuild that fails, or that does not
 * come within NPUSNAP_HCCL_REBUILD_TIMEOUT seconds (default 600), marks the communicator failed:
 * its calls answer HCCL_E_UNAVAIL and its async error says so, as a broken link does on a device.
 *
 * Before Lock the agent holds new device-side calls (collectives, send/recv) here and waits until
 * no thread is inside one: a collective is then either wholly before the snapshot (launched, and
 * drained with the device) or wholly after it (launched after the restore, on the new
 * communicator) -- never caught half-way inside libhccl with the old communicator.
 *
 * Only public HCCL and ACL names are used; nothing here knows about the simulator. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "npusnap/hcclvirt.h"
#include "npusnap/timeutil.h"
#include "realsym.h"

#define API __attribute__((visibility("default")))

void npusnap_devmem_mark_all(const char *why); /* devmem.c: the write tracking */
void npusnap_devmem_mark_all_before(void);
void npusnap_devmem_before_write_all(void);    /* devmem.c: a concurrent copy */
void npusnap_devmem_write_open(void);          /* devmem.c: a writer in flight */
void npusnap_devmem_write_close(void);

typedef int HcclResult;
typedef void *HcclComm;
typedef void *aclrtStream;
typedef void *aclrtContext;
enum { HCCL_SUCCESS = 0, HCCL_E_PARA = 1, HCCL_E_PTR = 2, HCCL_E_MEMORY = 3, HCCL_E_NOT_FOUND = 6,
       HCCL_E_UNAVAIL = 7, HCCL_E_TIMEOUT = 9 };
#define CONFIG_MAX 4096 /* sizeof(HcclCommConfig) is about 2.3 KiB in CANN 9 */

/* ------------------------------------------------------------------ the real functions */

#define HCCL_CALLS(X)                                                                                                 \
    X(ALLREDUCE, HcclAllReduce, (void *s, void *r, uint64_t n, int dt, int op, HcclComm c, aclrtStream st),          \
      (s, r, n, dt, op, c, st))                                                                                       \
    X(BROADCAST, HcclBroadcast, (void *b, uint64_t n, int dt, uint32_t root, HcclComm c, aclrtStream st),            \
      (b, n, dt, root, c, st))                                                                                        \
    X(ALLGATHER, HcclAllGather, (void *s, void *r, uint64_t n, int dt, HcclComm c, aclrtStream st),                   \
      (s, r, n, dt, c, st))                                                                                           \
    X(ALLGATHERV, HcclAllGatherV,                                                                                     \
      (void *s, uint64_t n, void *r, const void *rc, const void *rd, int dt, HcclComm c, aclrtStream st),             \
      (s, n, r, rc, rd, dt, c, st))                                                                                   \
    X(REDUCESCATTER, HcclReduceScatter, (void *s, void *r, uint64_t n, int dt, int op, HcclComm c, aclrtStream st),  \
      (s, r, n, dt, op, c, st))                                                                                       \
    X(REDUCESCATTERV, HcclReduceScatterV,                                                                             \
      (void *s, const void *sc, const void *sd, void *r, uint64_t n, int dt, int op, HcclComm c, aclrtStream st),     \
      (s, sc, sd, r, n, dt, op, c, st))                                                                               \
    X(REDUCE, HcclReduce,                                                                                             \
      (void *s, void *r, uint64_t n, int dt, int op, uint32_t root, HcclComm c, aclrtStream st),                     \
      (s, r, n, dt, op, root, c, st))                                                                                 \
    X(SCATTER, HcclScatter, (void *s, void *r, uint64_t n, int dt, uint32_t root, HcclComm c, aclrtStream st),        \
      (s, r, n, dt, root, c, st))                                                                                     \
    X(SEND, HcclSend, (void *s, uint64_t n, int dt, uint32_t peer, HcclComm c, aclrtStream st),                      \
      (s, n, dt, peer, c, st))                                                                                        \
    X(RECV, HcclRecv, (void *r, uint64_t n, int dt, uint32_t peer, HcclComm c, aclrtStream st),                      \
      (r, n, dt, peer, c, st))                                                                                        \
    X(ALLTOALL, HcclAlltoAll,                                                                                         \
      (const void *s, uint64_t sn, int st_, const void *r, uint64_t rn, int rt, HcclComm c, aclrtStream st),          \
      (s, sn, st_, r, rn, rt, c, st))                                                                                 \
    X(ALLTOALLV, HcclAlltoAllV,                                                                                       \
      (const void *s, const void *sc, const void *sd, int st_, const void *r, const void *rc, const void *rd, int rt, \
       HcclComm c, aclrtStream st),                                                                                   \
      (s, sc, sd, st_, r, rc, rd, rt, c, st))                                                                         \
    X(BARRIER, HcclBarrier, (HcclComm c, aclrtStream st), (c, st))

enum {
#define X(id, name, params, args) H_##id,
    HCCL_CALLS(X)
#undef X
    H_N_LAUNCH,
    H_INIT = H_N_LAUNCH, H_INIT_CONFIG, H_DESTROY, H_ASYNC_ERROR, H_RANK_SIZE, H_RANK_ID, H_COMM_NAME, H_RESUME,
    H_N_WRAPPED,
    H_ROOT_INFO = H_N_WRAPPED, H_GET_CTX, H_SET_CTX,
    H_N_FUNCS
};

static const char *const HNAMES[H_N_FUNCS] = {
#define X(id, name, params, args) #name,
    HCCL_CALLS(X)
#undef X
    "HcclCommInitRootInfo", "HcclCommInitRootInfoConfig", "HcclCommDestroy", "HcclGetCommAsyncError",
    "HcclGetRankSize", "HcclGetRankId", "HcclGetCommName", "HcclCommResume",
    "HcclGetRootInfo", "aclrtGetCurrentContext", "aclrtSetCurrentContext",
};

#define X(id, name, params, args) API HcclResult name params;
HCCL_CALLS(X)
#undef X
API HcclResult HcclCommInitRootInfo(uint32_t n, const void *root, uint32_t rank, HcclComm *comm);
API HcclResult HcclCommInitRootInfoConfig(uint32_t n, const void *root, uint32_t rank, const void *config,
                                          HcclComm *comm);
API HcclResult HcclCommDestroy(HcclComm comm);
API HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *err);
API HcclResult HcclGetRankSize(HcclComm comm, uint32_t *n);
API HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank);
API HcclResult HcclGetCommName(HcclComm comm, char *name);
API HcclResult HcclCommResume(HcclComm comm);

static void *const g_hwrappers[H_N_WRAPPED] = {
#define X(id, name, params, args) (void *)name,
    HCCL_CALLS(X)
#undef X
    (void *)HcclCommInitRootInfo, (void *)HcclCommInitRootInfoConfig, (void *)HcclCommDestroy,
    (void *)HcclGetCommAsyncError, (void *)HcclGetRankSize, (void *)HcclGetRankId, (void *)HcclGetCommName,
    (void *)HcclCommResume,
};

static void *volatile g_hreal[H_N_FUNCS];

static int is_hwrapper(void *p) {
    for (int i = 0; i < H_N_WRAPPED; i++)
        if (g_hwrappers[i] == p) return 1;
    return 0;
}

/* The real function i: what dlsym() handed out, else the next definition after this library,
 * else the mapped libhccl.so (or, for the ACL names, libascendcl.so / libacl_rt.so). */
static void *hreal(int i) {
    static const char *const libs[] = {"libhccl.so", "libascendcl.so", "libacl_rt.so"};
    void *p = g_hreal[i];
    if (p) return p;
    p = npusnap_next_definition(HNAMES[i], libs, sizeof libs / sizeof libs[0], is_hwrapper);
    if (p) g_hreal[i] = p;
    return p;
}

/* Called by the agent's dlsym() for a name starting with "Hccl": the wrapper (remembering the
 * real function `p` that the lookup found), or NULL for a name not wrapped. */
void *npusnap_hccl_wrapper_for(const char *name, void *p) {
    for (int i = 0; i < H_N_WRAPPED; i++)
        if (!strcmp(name, HNAMES[i])) {
            if (!p || p == g_hwrappers[i]) return p;
            if (!g_hreal[i]) g_hreal[i] = p;
            return g_hwrappers[i];
        }
    return NULL;
}

/* ------------------------------------------------------------------ the communicators */

enum { VC_LIVE, VC_STALE, VC_FAILED };
static const char *const VC_NAMES[] = {"live", "stale", "failed"};

struct vcomm {
    HcclComm handle; /* what the application holds: the first communicator's handle */
    HcclComm real;   /* the communicator behind it now */
    int state;
    int rebuilding;  /* a rebuild runs now */
    char key[NPUSNAP_HCCL_KEY_HEX + 1];
    uint32_t nranks, rank;
    unsigned char *config; /* the configuration passed at init (NULL: HcclCommInitRootInfo) */
    size_t config_len;
    aclrtContext ctx; /* the context current on the thread that made it */
    uint64_t collectives;
    double stale_since;
    struct vcomm *next;
};

static pthread_mutex_t g_hmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_hcv;
static struct vcomm *g_vcomms;
static int g_hold;     /* before Lock .. the process runs again */
static int g_inflight; /* threads inside a real device-side HCCL call now */

static void hccl_atfork_child(void) {
    /* A forked child has no communicator of its own (HCCL does not survive fork). */
    g_vcomms = NULL;
    g_hold = 0;
    g_inflight = 0;
    pthread_mutex_init(&g_hmu, NULL);
}

__attribute__((constructor)) static void hccl_init(void) {
    monotonic_cond_init(&g_hcv);
    pthread_atfork(NULL, NULL, hccl_atfork_child);
}

static double rebuild_timeout_s(void) {
    const char *v = getenv("NPUSNAP_HCCL_REBUILD_TIMEOUT");
    double t = v && *v ? strtod(v, NULL) : 0;
    return t > 0 ? t : 600.0;
}

/* g_hmu held */
static struct vcomm *vfind(HcclComm handle) {
    for (struct vcomm *v = g_vcomms; v; v = v->next)
        if (v->handle == handle) return v;
    return NULL;
}

static struct vcomm *vfind_key(const char *key) {
    for (struct vcomm *v = g_vcomms; v; v = v->next)
        if (!strcmp(v->key, key)) return v;
    return NULL;
}

static void timed_wait(double deadline) {
    struct timespec ts;
    double until = deadline;
    double now = now_s();
    if (until > now + 1.0) until = now + 1.0; /* wake up now and then: deadlines move */
    ts.tv_sec = (time_t)until;
    ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
    pthread_cond_timedwait(&g_hcv, &g_hmu, &ts);
}

/* The communicator to pass for `handle`, once neither the pre-Lock hold (device-side calls,
 * `launch`) nor a pending rebuild keeps the call waiting. HCCL_SUCCESS, or HCCL_E_UNAVAIL for a
 * failed communicator. A device-side call counts as in flight until leave(). */
static HcclResult enter(HcclComm handle, int launch, HcclComm *real) {
    pthread_mutex_lock(&g_hmu);
    HcclResult rc = HCCL_SUCCESS;
    for (;;) {
        struct vcomm *v = vfind(handle);
        if (v && v->state == VC_STALE && now_s() > v->stale_since + rebuild_timeout_s()) v->state = VC_FAILED;
        if (v && v->state == VC_FAILED) {
            rc = HCCL_E_UNAVAIL;
            break;
        }
        if (!(launch && g_hold) && !(v && v->state == VC_STALE)) {
            *real = v ? v->real : handle;
            if (launch) {
                g_inflight++;
                if (v) v->collectives++;
            }
            break;
        }
        timed_wait(v && v->state == VC_STALE ? v->stale_since + rebuild_timeout_s() : now_s() + 1.0);
    }
    pthread_mutex_unlock(&g_hmu);
    return rc;
}

static void leave(void) {
    pthread_mutex_lock(&g_hmu);
    g_inflight--;
    pthread_cond_broadcast(&g_hcv);
    pthread_mutex_unlock(&g_hmu);
}

#define X(id, name, params, args)                                                 \
    API HcclResult name params {                                                  \
        HcclResult (*fn) params = (HcclResult(*) params)hreal(H_##id);            \
        if (!fn) return HCCL_E_NOT_FOUND;                                          \
        HcclResult res_ = enter(c, 1, &c);                                         \
        if (res_ != HCCL_SUCCESS) return res_;                                     \
        npusnap_devmem_write_open();                                               \
        npusnap_devmem_before_write_all(); /* a concurrent copy ends first */      \
        npusnap_devmem_mark_all_before(); /* and after: writes.c, stamp_ranges */  \
        res_ = fn args;                                                            \
        npusnap_devmem_write_close();                                              \
        leave();                                                                   \
        npusnap_devmem_mark_all(#name); /* receive and HCCL's own buffers */       \
        return res_;                                                               \
    }
HCCL_CALLS(X)
#undef X

/* Two 64-bit FNV-1a hashes of the root info: the same on every rank of one communicator. */
static void root_key(const void *root, char out[NPUSNAP_HCCL_KEY_HEX + 1]) {
    const unsigned char *p = root;
    uint64_t a = 0xcbf29ce484222325ull, b = 0x84222325cbf29ce4ull;
    for (size_t i = 0; i < NPUSNAP_HCCL_ROOT_BYTES; i++) {
        a = (a ^ p[i]) * 0x100000001b3ull;
        b = (b ^ p[NPUSNAP_HCCL_ROOT_BYTES - 1 - i]) * 0x100000001b3ull;
    }
    snprintf(out, NPUSNAP_HCCL_KEY_HEX + 1, "%016llx%016llx", (unsigned long long)a, (unsigned long long)b);
}

static void record(HcclComm comm, const void *root, uint32_t n, uint32_t rank, const void *config) {
    struct vcomm *v = calloc(1, sizeof *v);
    if (!v) return; /* untracked: it works until a restore, then fails loudly */
    v->handle = v->real = comm;
    v->nranks = n;
    v->rank = rank;
    root_key(root, v->key);
    if (config) {
        size_t len = *(const size_t *)config; /* HcclCommConfig's header starts with its size */
        if (len > CONFIG_MAX) len = CONFIG_MAX;
        v->config = malloc(len ? len : 1);
        if (v->config) {
            memcpy(v->config, config, len);
            v->config_len = len;
        }
    }
    aclrtContext ctx = NULL;
    int (*get_ctx)(aclrtContext *) = (int (*)(aclrtContext *))hreal(H_GET_CTX);
    if (get_ctx && get_ctx(&ctx) == 0) v->ctx = ctx;
    pthread_mutex_lock(&g_hmu);
    v->next = g_vcomms;
    g_vcomms = v;
    pthread_mutex_unlock(&g_hmu);
}

API HcclResult HcclCommInitRootInfo(uint32_t n, const void *root, uint32_t rank, HcclComm *comm) {
    HcclResult (*fn)(uint32_t, const void *, uint32_t, HcclComm *) =
        (HcclResult(*)(uint32_t, const void *, uint32_t, HcclComm *))hreal(H_INIT);
    if (!fn) return HCCL_E_NOT_FOUND;
    HcclResult rc = fn(n, root, rank, comm);
    if (rc == HCCL_SUCCESS && root && comm) record(*comm, root, n, rank, NULL);
    return rc;
}

API HcclResult HcclCommInitRootInfoConfig(uint32_t n, const void *root, uint32_t rank, const void *config,
                                          HcclComm *comm) {
    HcclResult (*fn)(uint32_t, const void *, uint32_t, const void *, HcclComm *) =
        (HcclResult(*)(uint32_t, const void *, uint32_t, const void *, HcclComm *))hreal(H_INIT_CONFIG);
    if (!fn) return HCCL_E_NOT_FOUND;
    HcclResult rc = fn(n, root, rank, config, comm);
    if (rc == HCCL_SUCCESS && root && comm && config) record(*comm, root, n, rank, config);
    return rc;
}

API HcclResult HcclCommDestroy(HcclComm comm) {
    HcclResult (*fn)(HcclComm) = (HcclResult(*)(HcclComm))hreal(H_DESTROY);
    if (!fn) return HCCL_E_NOT_FOUND;
    pthread_mutex_lock(&g_hmu);
    struct vcomm **pp = &g_vcomms, *v = NULL;
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->handle == comm) {
            v = *pp;
            *pp = v->next; /* no call reaches it from now on */
            break;
        }
    while (v && v->rebuilding) timed_wait(now_s() + 1.0);
    pthread_mutex_unlock(&g_hmu);
    HcclComm real = v ? v->real : comm;
    HcclResult rc = fn(real);
    if (v && v->state != VC_LIVE) rc = HCCL_SUCCESS; /* the invalid one is gone either way */
    if (v) {
        free(v->config);
        free(v);
    }
    return rc;
}

API HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *err) {
    HcclResult (*fn)(HcclComm, HcclResult *) = (HcclResult(*)(HcclComm, HcclResult *))hreal(H_ASYNC_ERROR);
    if (!fn) return HCCL_E_NOT_FOUND;
    if (!err) return HCCL_E_PTR;
    pthread_mutex_lock(&g_hmu);
    struct vcomm *v = vfind(comm);
    if (v && v->state == VC_STALE && now_s() > v->stale_since + rebuild_timeout_s()) v->state = VC_FAILED;
    int state = v ? v->state : VC_LIVE;
    HcclComm real = v ? v->real : comm;
    pthread_mutex_unlock(&g_hmu);
    if (state == VC_STALE) {
        *err = HCCL_SUCCESS; /* no error on the application's communicator: it is being rebuilt */
        return HCCL_SUCCESS;
    }
    if (state == VC_FAILED) {
        *err = HCCL_E_UNAVAIL;
        return HCCL_SUCCESS;
    }
    return fn(real, err);
}

/* The queries answer from what the application passed at init while the communicator is stale. */
static HcclResult query_u32(int which, HcclComm comm, uint32_t *out) {
    HcclResult (*fn)(HcclComm, uint32_t *) = (HcclResult(*)(HcclComm, uint32_t *))hreal(which);
    if (!fn) return HCCL_E_NOT_FOUND;
    if (!out) return HCCL_E_PTR;
    pthread_mutex_lock(&g_hmu);
    struct vcomm *v = vfind(comm);
    if (v && v->state != VC_LIVE) {
        *out = which == H_RANK_SIZE ? v->nranks : v->rank;
        pthread_mutex_unlock(&g_hmu);
        return HCCL_SUCCESS;
    }
    HcclComm real = v ? v->real : comm;
    pthread_mutex_unlock(&g_hmu);
    return fn(real, out);
}

API HcclResult HcclGetRankSize(HcclComm comm, uint32_t *n) { return query_u32(H_RANK_SIZE, comm, n); }
API HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank) { return query_u32(H_RANK_ID, comm, rank); }

API HcclResult HcclGetCommName(HcclComm comm, char *name) {
    HcclResult (*fn)(HcclComm, char *) = (HcclResult(*)(HcclComm, char *))hreal(H_COMM_NAME);
    if (!fn) return HCCL_E_NOT_FOUND;
    HcclComm real;
    HcclResult rc = enter(comm, 0, &real);
    return rc != HCCL_SUCCESS ? rc : fn(real, name);
}

API HcclResult HcclCommResume(HcclComm comm) {
    HcclResult (*fn)(HcclComm) = (HcclResult(*)(HcclComm))hreal(H_RESUME);
    if (!fn) return HCCL_E_NOT_FOUND;
    HcclComm real;
    HcclResult rc = enter(comm, 0, &real);
    return rc != HCCL_SUCCESS ? rc : fn(real);
}

/* ------------------------------------------------------------------ what the agent's ops call */

int npusnap_hccl_hold(double timeout_s) {
    pthread_mutex_lock(&g_hmu);
    g_hold = 1;
    double deadline = now_s() + timeout_s;
    while (g_inflight > 0 && now_s() < deadline) timed_wait(deadline);
    int rc = g_inflight > 0 ? -1 : 0;
    pthread_mutex_unlock(&g_hmu);
    return rc;
}

void npusnap_hccl_release(void) {
    pthread_mutex_lock(&g_hmu);
    g_hold = 0;
    pthread_cond_broadcast(&g_hcv);
    pthread_mutex_unlock(&g_hmu);
}

void npusnap_hccl_restored(void) {
    pthread_mutex_lock(&g_hmu);
    double now = now_s();
    for (struct vcomm *v = g_vcomms; v; v = v->next)
        if (v->state != VC_FAILED) {
            v->state = VC_STALE;
            v->stale_since = now;
        }
    pthread_mutex_unlock(&g_hmu);
}

size_t npusnap_hccl_comms(struct npusnap_hccl_comm_info *out, size_t max) {
    size_t n = 0;
    pthread_mutex_lock(&g_hmu);
    for (struct vcomm *v = g_vcomms; v; v = v->next, n++)
        if (n < max) {
            memcpy(out[n].key, v->key, sizeof out[n].key);
            out[n].rank = v->rank;
            out[n].nranks = v->nranks;
            out[n].state = VC_NAMES[v->state];
            out[n].collectives = v->collectives;
        }
    pthread_mutex_unlock(&g_hmu);
    return n;
}

static void seterr(char *err, size_t len, const char *fmt, const char *a, int code) {
    if (err && len) snprintf(err, len, fmt, a, code);
}

int npusnap_hccl_new_root(const char *key, char *root_hex, char *err, size_t errlen) {
    pthread_mutex_lock(&g_hmu);
    struct vcomm *v = vfind_key(key);
    int ok = v && v->rank == 0;
    aclrtContext ctx = v ? v->ctx : NULL;
    pthread_mutex_unlock(&g_hmu);
    if (!ok) {
        seterr(err, errlen, "no communicator %s of rank 0 here (%d)", key, HCCL_E_NOT_FOUND);
        return HCCL_E_NOT_FOUND;
    }
    HcclResult (*fn)(void *) = (HcclResult(*)(void *))hreal(H_ROOT_INFO);
    int (*set_ctx)(aclrtContext) = (int (*)(aclrtContext))hreal(H_SET_CTX);
    if (!fn) {
        seterr(err, errlen, "%s: HcclGetRootInfo is not in the process (%d)", key, HCCL_E_NOT_FOUND);
        return HCCL_E_NOT_FOUND;
    }
    if (ctx && set_ctx) set_ctx(ctx);
    unsigned char root[NPUSNAP_HCCL_ROOT_BYTES];
    memset(root, 0, sizeof root);
    HcclResult rc = fn(root);
    if (rc != HCCL_SUCCESS) {
        seterr(err, errlen, "HcclGetRootInfo for communicator %s failed with %d", key, rc);
        return rc;
    }
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < sizeof root; i++) {
        root_hex[2 * i] = hex[root[i] >> 4];
        root_hex[2 * i + 1] = hex[root[i] & 15];
    }
    root_hex[2 * sizeof root] = 0;
    return 0;
}

static int unhex(const char *s, unsigned char *out, size_t n) {
    if (strlen(s) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        int v = 0;
        for (int k = 0; k < 2; k++) {
            char c = s[2 * i + k];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            if (d < 0) return -1;
            v = v * 16 + d;
        }
        out[i] = (unsigned char)v;
    }
    return 0;
}

int npusnap_hccl_rebuild(const char *key, const char *root_hex, char *err, size_t errlen) {
    unsigned char root[NPUSNAP_HCCL_ROOT_BYTES];
    if (!*root_hex) { /* given up on: its calls answer HCCL_E_UNAVAIL now, not after the timeout */
        pthread_mutex_lock(&g_hmu);
        struct vcomm *v = vfind_key(key);
        if (v && v->state == VC_STALE && !v->rebuilding) v->state = VC_FAILED;
        int found = v != NULL;
        pthread_cond_broadcast(&g_hcv);
        pthread_mutex_unlock(&g_hmu);
        if (!found) seterr(err, errlen, "no communicator %s here (%d)", key, HCCL_E_NOT_FOUND);
        return found ? 0 : HCCL_E_NOT_FOUND;
    }
    if (unhex(root_hex, root, sizeof root) != 0) {
        seterr(err, errlen, "communicator %s: the root info is not %d hex bytes", key, NPUSNAP_HCCL_ROOT_BYTES);
        return HCCL_E_PARA;
    }
    pthread_mutex_lock(&g_hmu);
    struct vcomm *v = vfind_key(key);
    if (!v || v->state != VC_STALE || v->rebuilding) {
        pthread_mutex_unlock(&g_hmu);
        seterr(err, errlen, "no communicator %s awaits a rebuild here (%d)", key, HCCL_E_NOT_FOUND);
        return HCCL_E_NOT_FOUND;
    }
    v->rebuilding = 1;
    HcclComm old = v->real;
    pthread_mutex_unlock(&g_hmu);
    /* v stays: HcclCommDestroy waits for `rebuilding` before it frees one. */
    HcclResult (*destroy)(HcclComm) = (HcclResult(*)(HcclComm))hreal(H_DESTROY);
    int (*set_ctx)(aclrtContext) = (int (*)(aclrtContext))hreal(H_SET_CTX);
    if (v->ctx && set_ctx) set_ctx(v->ctx); /* HCCL makes it on the calling thread's device */
    /* The invalid one goes first: its name is unique in the process, and the new one takes it. */
    if (destroy) destroy(old);
    HcclComm fresh = NULL;
    HcclResult rc;
    if (v->config) {
        HcclResult (*fn)(uint32_t, const void *, uint32_t, const void *, HcclComm *) =
            (HcclResult(*)(uint32_t, const void *, uint32_t, const void *, HcclComm *))hreal(H_INIT_CONFIG);
        rc = fn ? fn(v->nranks, root, v->rank, v->config, &fresh) : HCCL_E_NOT_FOUND;
    } else {
        HcclResult (*fn)(uint32_t, const void *, uint32_t, HcclComm *) =
            (HcclResult(*)(uint32_t, const void *, uint32_t, HcclComm *))hreal(H_INIT);
        rc = fn ? fn(v->nranks, root, v->rank, &fresh) : HCCL_E_NOT_FOUND;
    }
    pthread_mutex_lock(&g_hmu);
    v->rebuilding = 0;
    if (rc == HCCL_SUCCESS) {
        v->real = fresh;
        v->state = VC_LIVE;
    } else {
        v->state = VC_FAILED;
    }
    pthread_cond_broadcast(&g_hcv);
    pthread_mutex_unlock(&g_hmu);
    if (rc != HCCL_SUCCESS) seterr(err, errlen, "communicator %s: HcclCommInitRootInfo failed with %d", key, rc);
    return rc;
}
