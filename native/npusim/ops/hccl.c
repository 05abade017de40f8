/* libhccl.so of the simulated CANN tree: collectives between ranks in different processes.
 *
 * Real prototypes of hccl/hccl.h and hccl_types.h (CANN 8.x/9.x, as torch_npu 2.13 carries them in
 * third_party/hccl): HcclGetRootInfo, HcclCommInitRootInfo, HcclCommInitRootInfoConfig,
 * HcclGetCommConfigCapability, HcclGetCommName, HcclGetRankSize, HcclGetRankId,
 * HcclGetCommAsyncError, HcclGetErrorString, HcclSetConfig/HcclGetConfig, HcclCommResume (refuses),
 * HcclCommDestroy, and the collectives HcclAllReduce, HcclBroadcast, HcclAllGather(V),
 * HcclReduceScatter(V), HcclReduce, HcclScatter, HcclSend, HcclRecv, HcclAlltoAll(V),
 * HcclBarrier. What torch_npu looks up and this library does not export (HcclCommInitClusterInfo
 * Config, HcclCreateSubCommConfig, HcclBatchSendRecv, HcclCommRegister...) makes torch_npu take
 * its other path (root info, no sub-communicators) or fail its own lookup check; nothing here
 * answers success without doing the work.
 *
 * The simulated interconnect: a communicator is a window (one memfd: a slot per rank of the
 * CCL buffer size -- HcclCommConfig.hcclBufferSize, else HCCL_BUFFSIZE, else HCCL's default 200
 * MiB; pages are only used as data passes -- plus a header of barrier words) that every rank maps. The root rank makes it and
 * hands it to the others over the unix socket its root info names (the analogue of the TCP
 * rendezvous of real root info), with the HCCL_CONNECT_TIMEOUT deadline; then the socket is gone.
 * A collective is a kernel (hccl_kernel.c) launched on the caller's stream with the runtime's
 * aclrtLaunchKernel: it is queued, runs when the stream reaches it, and waits at the snapshot lock
 * like any launch; the ranks' engines exchange data through the window.
 *
 * Snapshots, as HCCL's SnapshotControl does (hccl source: snapshot_control.cc): the library
 * registers LOCK_PRE, UNLOCK_POST and RESTORE_POST callbacks itself when its first communicator
 * is made. Communicators are not part of a backup: RESTORE_POST marks every communicator invalid
 * and drops its window, and a collective on it returns HCCL_E_UNAVAIL until the application has
 * destroyed it and built a new one (vllm-ascend rebuilds its groups after a restore; torch_npu
 * has reinit_process_group(rebuild_link=True)), and so do HcclGetRankSize, HcclGetRankId,
 * HcclGetCommName and HcclCommResume; HcclGetCommAsyncError reports HCCL_E_UNAVAIL from the
 * restore on, which torch_npu's watchdog polls every second and, by default, takes the process
 * down for, as it would on a device whose communicator broke. One that
 * was launched before the lock and reached the stream after the restore fails there (an error on
 * the stream, HcclGetCommAsyncError says HCCL_E_UNAVAIL) without touching memory. LOCK_PRE and
 * UNLOCK_POST keep the status; a process that is unlocked without a restore keeps its
 * communicators. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <stddef.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "npusnap/contract.h"
#include "npusnap/timeutil.h"
#include "ops_abi.h"

#define API __attribute__((visibility("default")))

typedef int32_t aclError;
typedef void *aclrtStream;

typedef enum {
    HCCL_SUCCESS = 0,
    HCCL_E_PARA = 1,
    HCCL_E_PTR = 2,
    HCCL_E_MEMORY = 3,
    HCCL_E_INTERNAL = 4,
    HCCL_E_NOT_SUPPORT = 5,
    HCCL_E_NOT_FOUND = 6,
    HCCL_E_UNAVAIL = 7,
    HCCL_E_SYSCALL = 8,
    HCCL_E_TIMEOUT = 9,
    HCCL_E_TCP_CONNECT = 11,
    HCCL_E_RUNTIME = 15,
} HcclResult;

/* HcclDataType and HcclReduceOp of hccl_types.h */
enum {
    HCCL_DATA_TYPE_INT8 = 0, HCCL_DATA_TYPE_INT16 = 1, HCCL_DATA_TYPE_INT32 = 2, HCCL_DATA_TYPE_FP16 = 3,
    HCCL_DATA_TYPE_FP32 = 4, HCCL_DATA_TYPE_INT64 = 5, HCCL_DATA_TYPE_BFP16 = 11,
};
enum { HCCL_REDUCE_SUM = 0, HCCL_REDUCE_PROD = 1, HCCL_REDUCE_MAX = 2, HCCL_REDUCE_MIN = 3 };
#define HCCL_ROOT_INFO_BYTES 4108
typedef struct HcclRootInfoDef {
    char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

/* HcclCommConfig of hccl_types.h (CANN 8.x/9.x; torch_npu 2.13 third_party/hccl): a 24-byte
 * header {size_t size; uint32_t magicWord; uint32_t version; uint64_t reserved} written by the
 * inline HcclCommConfigInit, then the fields. A caller built against an older header passes a
 * smaller `size` (torch_npu forces 32 when the comm-name capability is absent): only the fields
 * inside `size` are read. */
#define HCCL_COMM_CONFIG_MAGIC_WORD 0xf0f0f0f0u
#define HCCL_COMM_BUFFSIZE_CONFIG_NOT_SET 0xffffffffu
#define HCCL_COMM_DETERMINISTIC_CONFIG_NOT_SET 0xffffffffu
#define COMM_NAME_MAX_LENGTH 128
typedef struct HcclCommConfigDef {
    char reserved[24];
    uint32_t hcclBufferSize;
    uint32_t hcclDeterministic;
    char hcclCommName[COMM_NAME_MAX_LENGTH];
    char hcclUdi[128];
    uint32_t hcclOpExpansionMode;
    uint32_t hcclRdmaTrafficClass;
    uint32_t hcclRdmaServiceLevel;
    uint32_t hcclWorldRankID;
    uint64_t hcclJobID;
    uint8_t aclGraphZeroCopyEnable;
    int32_t hcclExecTimeOut;
    char hcclAlgo[1600];
    char hcclRetryEnable[50];
    char hcclRetryParams[128];
    char hcclBufferName[128];
    uint32_t hcclQos;
} HcclCommConfig;
struct config_info {
    size_t size;
    uint32_t magicWord;
    uint32_t version;
    uint64_t reserved;
};
/* HcclCommConfigCapability: the capability number is one past the last field honoured;
 * torch_npu tests `capability > field` (HcclCompile.h isHcclFeatureSupported). Honoured here:
 * HCCL_COMM_CONFIG_BUFFER_SIZE (0), _DETERMINISTIC (1), _COMM_NAME (2). */
#define HCCL_COMM_CONFIG_COMM_NAME 2
/* HcclConfig of hccl_types.h, for HcclSetConfig / HcclGetConfig */
#define HCCL_DETERMINISTIC 0
union HcclConfigValue {
    int32_t value;
};
typedef void *HcclComm;

/* Runtime functions (include/external/acl/acl_rt.h). */
extern aclError aclrtGetDevice(int32_t *deviceId);
extern aclError aclrtBinaryLoadFromFile(const char *binPath, void *options, void **binHandle);
extern aclError aclrtBinaryGetFunction(const void *binHandle, const char *kernelName, void **funcHandle);
extern aclError aclrtLaunchKernel(void *funcHandle, uint32_t numBlocks, const void *argsData, size_t argsSize,
                                  aclrtStream stream);
extern aclError aclrtSnapShotCallbackRegister(int stage, uint32_t (*cb)(int32_t, void *), void *args);

#define STAGE_LOCK_PRE NPUSNAP_STAGE_LOCK_PRE
#define STAGE_RESTORE_POST NPUSNAP_STAGE_RESTORE_POST
#define STAGE_UNLOCK_POST NPUSNAP_STAGE_UNLOCK_POST

#define ROOT_MAGIC "npusim-hccl-root-1"
#define KERNEL_DIR "opp/built-in/op_impl/ai_core/tbe/kernel/npusim"
#define KERNEL_BIN "libnpusim_hccl_kernels.so"

struct root_info { /* what HcclRootInfo.internal holds */
    char magic[32];
    char path[108]; /* the root's rendezvous socket */
    uint64_t nonce;
    int32_t root_pid;
};

struct hello { /* a rank to the root */
    uint64_t nonce;
    uint32_t rank, nranks;
};

struct welcome { /* the root to a rank, with the window's memfd */
    int32_t status; /* HcclResult */
    uint32_t pad;
    uint64_t window_bytes, slot_bytes;
};

struct comm {
    char name[COMM_NAME_MAX_LENGTH]; /* HcclGetCommName */
    uint32_t rank, nranks;
    uint32_t deterministic;          /* always honoured: the reduction order is fixed (rank order) */
    double exec_timeout_s;           /* HCCL_EXEC_TIMEOUT when the communicator was made */
    int32_t device;
    int destroyed;                /* HcclCommDestroy'd: kept, never reused (kernels may hold state) */
    struct hccl_comm_state state; /* valid: 0 once a Restore happened, the communicator must be rebuilt */
    struct hccl_window *window;
    size_t window_bytes;
    uint64_t slot_bytes;
    struct comm *next;
};

enum { SNAP_DEFAULT, SNAP_PRE, SNAP_RESTORED };

/* g_mu guards the communicators and listeners; the snapshot callbacks take it. Nothing that may
 * wait at the runtime's lock (a gated call) or take the runtime's callback mutex (registration)
 * runs holding it: those have mutexes of their own, which no callback takes. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER; /* register_callbacks */
static pthread_mutex_t g_bin_mu = PTHREAD_MUTEX_INITIALIZER; /* the kernel binary */
static struct comm *g_comms;
static int g_snap_status = SNAP_DEFAULT;
static int g_registered;
static struct listener {
    struct root_info info;
    int fd;
    struct listener *next;
} *g_listeners;
static void *g_bin, *g_func;

/* A positive number from the environment (seconds, MiB), or the default. */
static double env_positive(const char *name, double dflt) {
    const char *v = getenv(name);
    double s = v && *v ? atof(v) : dflt;
    return s > 0 ? s : dflt;
}

/* ---------------------------------------------------------------- snapshot callbacks */

static uint32_t on_lock_pre(int32_t dev, void *args) {
    (void)dev, (void)args;
    pthread_mutex_lock(&g_mu);
    if (g_snap_status != SNAP_RESTORED) g_snap_status = SNAP_PRE;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

static uint32_t on_restore_post(int32_t dev, void *args) {
    (void)args;
    pthread_mutex_lock(&g_mu);
    g_snap_status = SNAP_RESTORED;
    for (struct comm *c = g_comms; c; c = c->next)
        if (c->device == dev && !c->destroyed && atomic_load((_Atomic uint32_t *)&c->state.valid)) {
            /* The peers' view of this window belongs to the processes that were dumped: the
             * transport is not restored, and a collective must not use it. A collective launched
             * before the lock and still waiting at it sees `valid` and fails; the window goes once
             * none is in flight (here, or in HcclCommDestroy). */
            atomic_store((_Atomic uint32_t *)&c->state.valid, 0);
            /* What the watchdog's HcclGetCommAsyncError sees from now on. */
            atomic_store((_Atomic int32_t *)&c->state.async_error, HCCL_E_UNAVAIL);
            if (atomic_load((_Atomic uint32_t *)&c->state.inflight) == 0) {
                munmap(c->window, c->window_bytes);
                c->window = NULL;
            }
        }
    pthread_mutex_unlock(&g_mu);
    return 0;
}

static uint32_t on_unlock_post(int32_t dev, void *args) {
    (void)dev, (void)args;
    pthread_mutex_lock(&g_mu);
    g_snap_status = SNAP_DEFAULT;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

static HcclResult register_callbacks(void) {
    pthread_mutex_lock(&g_reg_mu);
    HcclResult rc = HCCL_SUCCESS;
    if (!g_registered) {
        if (aclrtSnapShotCallbackRegister(STAGE_LOCK_PRE, on_lock_pre, NULL) != 0 ||
            aclrtSnapShotCallbackRegister(STAGE_UNLOCK_POST, on_unlock_post, NULL) != 0 ||
            aclrtSnapShotCallbackRegister(STAGE_RESTORE_POST, on_restore_post, NULL) != 0)
            rc = HCCL_E_RUNTIME;
        else
            g_registered = 1;
    }
    pthread_mutex_unlock(&g_reg_mu);
    return rc;
}

/* ---------------------------------------------------------------- rendezvous */

static int send_all(int fd, const void *p, size_t n, int passfd) {
    struct iovec iov = {(void *)p, n};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (passfd >= 0) {
        memset(&ctl, 0, sizeof ctl);
        msg.msg_control = ctl.buf;
        msg.msg_controllen = sizeof ctl.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &passfd, sizeof(int));
    }
    ssize_t w;
    do w = sendmsg(fd, &msg, MSG_NOSIGNAL);
    while (w < 0 && errno == EINTR);
    return w == (ssize_t)n ? 0 : -1;
}

/* Wait until fd is readable (or writable) before the deadline. */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0) return -1;
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r > 0) return 0;
        if (r < 0 && errno != EINTR) return -1;
    }
}

static int recv_msg(int fd, void *p, size_t n, int *gotfd, double deadline) {
    if (wait_fd(fd, POLLIN, deadline) != 0) return -1;
    struct iovec iov = {p, n};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t r;
    do r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    while (r < 0 && errno == EINTR);
    if (gotfd) *gotfd = -1;
    for (struct cmsghdr *c = r > 0 ? CMSG_FIRSTHDR(&msg) : NULL; c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && gotfd) memcpy(gotfd, CMSG_DATA(c), sizeof(int));
    return r == (ssize_t)n ? 0 : -1;
}

API HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo) {
    if (!rootInfo) return HCCL_E_PTR;
    struct listener *l = calloc(1, sizeof *l);
    if (!l) return HCCL_E_MEMORY;
    snprintf(l->info.magic, sizeof l->info.magic, "%s", ROOT_MAGIC);
    if (getrandom(&l->info.nonce, sizeof l->info.nonce, 0) != sizeof l->info.nonce) l->info.nonce = (uint64_t)now_s();
    l->info.root_pid = getpid();
    const char *tmp = getenv("TMPDIR");
    snprintf(l->info.path, sizeof l->info.path, "%s/npusim-hccl-%d-%016llx.sock", tmp && *tmp ? tmp : "/tmp",
             (int)getpid(), (unsigned long long)l->info.nonce);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", l->info.path);
    l->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (l->fd < 0 || bind(l->fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(l->fd, HCCL_MAX_RANKS) != 0) {
        if (l->fd >= 0) close(l->fd);
        free(l);
        return HCCL_E_SYSCALL;
    }
    memset(rootInfo, 0, sizeof *rootInfo);
    memcpy(rootInfo->internal, &l->info, sizeof l->info);
    pthread_mutex_lock(&g_mu);
    l->next = g_listeners;
    g_listeners = l;
    pthread_mutex_unlock(&g_mu);
    return HCCL_SUCCESS;
}

static struct listener *take_listener(const struct root_info *ri) {
    pthread_mutex_lock(&g_mu);
    struct listener **pp = &g_listeners, *l = NULL;
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->info.nonce == ri->nonce && !strcmp((*pp)->info.path, ri->path)) {
            l = *pp;
            *pp = l->next;
            break;
        }
    pthread_mutex_unlock(&g_mu);
    return l;
}

/* The root: accept every other rank, make the window, hand it out. Returns the window fd. */
static HcclResult root_rendezvous(struct listener *l, uint32_t nranks, uint32_t rank, double deadline, int *wfd,
                                  uint64_t *wbytes, uint64_t *slot, uint64_t mib) {
    int peers[HCCL_MAX_RANKS];
    int npeers = 0;
    HcclResult rc = HCCL_SUCCESS;
    uint8_t seen[HCCL_MAX_RANKS] = {0};
    seen[rank] = 1;
    while (rc == HCCL_SUCCESS && npeers < (int)nranks - 1) {
        if (wait_fd(l->fd, POLLIN, deadline) != 0) {
            rc = HCCL_E_TIMEOUT;
            break;
        }
        int c = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) continue;
        struct hello h;
        if (recv_msg(c, &h, sizeof h, NULL, deadline) != 0 || h.nonce != l->info.nonce || h.nranks != nranks ||
            h.rank >= nranks || seen[h.rank]) {
            close(c); /* a stranger, or a rank that disagrees: it gets no window */
            continue;
        }
        seen[h.rank] = 1;
        peers[npeers++] = c;
    }
    *slot = mib << 20;
    *wbytes = HCCL_WINDOW_HEADER + (uint64_t)nranks * *slot;
    *wfd = -1;
    if (rc == HCCL_SUCCESS) {
        *wfd = memfd_create("npusim-hccl-window", MFD_CLOEXEC);
        if (*wfd < 0 || ftruncate(*wfd, (off_t)*wbytes) != 0) rc = HCCL_E_MEMORY;
    }
    struct welcome w = {rc, 0, *wbytes, *slot};
    for (int i = 0; i < npeers; i++) {
        if (send_all(peers[i], &w, sizeof w, rc == HCCL_SUCCESS ? *wfd : -1) != 0 && rc == HCCL_SUCCESS)
            rc = HCCL_E_TCP_CONNECT;
        close(peers[i]);
    }
    return rc;
}

static HcclResult rank_rendezvous(const struct root_info *ri, uint32_t nranks, uint32_t rank, double deadline,
                                  int *wfd, uint64_t *wbytes, uint64_t *slot) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", ri->path);
    int fd = -1;
    while (fd < 0) {
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return HCCL_E_SYSCALL;
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) break;
        close(fd);
        fd = -1;
        if (now_s() >= deadline) return HCCL_E_TCP_CONNECT;
        struct timespec ts = {0, 20000000L}; /* the root is not listening yet */
        nanosleep(&ts, NULL);
    }
    struct hello h = {ri->nonce, rank, nranks};
    struct welcome w;
    HcclResult rc = HCCL_SUCCESS;
    if (send_all(fd, &h, sizeof h, -1) != 0 || recv_msg(fd, &w, sizeof w, wfd, deadline) != 0) rc = HCCL_E_TCP_CONNECT;
    else if (w.status != HCCL_SUCCESS) rc = (HcclResult)w.status;
    else if (*wfd < 0) rc = HCCL_E_INTERNAL;
    close(fd);
    if (rc == HCCL_SUCCESS) {
        *wbytes = w.window_bytes;
        *slot = w.slot_bytes;
    }
    return rc;
}

/* Both init calls. The CCL buffer (one slot per rank of the window) is the root's: HCCL requires
 * every rank to pass the same configuration. */
static HcclResult init_comm(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, uint64_t buf_mib,
                            uint32_t deterministic, const char *name, HcclComm *comm) {
    if (!rootInfo || !comm) return HCCL_E_PTR;
    if (nRanks == 0 || nRanks > HCCL_MAX_RANKS || rank >= nRanks) return HCCL_E_PARA;
    struct root_info ri;
    memcpy(&ri, rootInfo->internal, sizeof ri);
    if (strncmp(ri.magic, ROOT_MAGIC, sizeof ri.magic) != 0) return HCCL_E_PARA;
    int32_t dev = -1;
    if (aclrtGetDevice(&dev) != 0) return HCCL_E_RUNTIME; /* no device set on this thread */
    HcclResult rc = register_callbacks();
    if (rc != HCCL_SUCCESS) return rc;
    double deadline = now_s() + env_positive("HCCL_CONNECT_TIMEOUT", 120.0);
    struct listener *l = take_listener(&ri);
    int wfd = -1;
    uint64_t wbytes = 0, slot = 0;
    if (l) {
        rc = root_rendezvous(l, nRanks, rank, deadline, &wfd, &wbytes, &slot, buf_mib);
        close(l->fd);
        unlink(l->info.path);
        free(l);
    } else if (nRanks == 1) {
        return HCCL_E_PARA; /* a one-rank group is made by the process that got the root info */
    } else {
        rc = rank_rendezvous(&ri, nRanks, rank, deadline, &wfd, &wbytes, &slot);
    }
    if (rc != HCCL_SUCCESS) {
        if (wfd >= 0) close(wfd);
        return rc;
    }
    void *m = mmap(NULL, wbytes, PROT_READ | PROT_WRITE, MAP_SHARED, wfd, 0);
    close(wfd);
    if (m == MAP_FAILED) return HCCL_E_MEMORY;
    struct hccl_window *w = m;
    if (l) {
        w->nranks = nRanks;
        w->slot_bytes = slot;
        atomic_store((_Atomic uint64_t *)&w->magic, HCCL_WINDOW_MAGIC);
    }
    struct comm *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(m, wbytes);
        return HCCL_E_MEMORY;
    }
    *c = (struct comm){.rank = rank, .nranks = nRanks, .deterministic = deterministic, .device = dev,
                       .state = {.valid = 1}, .window = w, .window_bytes = wbytes, .slot_bytes = slot};
    c->exec_timeout_s = env_positive("HCCL_EXEC_TIMEOUT", 1836.0);
    if (name && *name) snprintf(c->name, sizeof c->name, "%s", name);
    else /* HCCL names a communicator made without a name after its root info's identifier */
        snprintf(c->name, sizeof c->name, "npusim_%d_%016llx", (int)ri.root_pid, (unsigned long long)ri.nonce);
    pthread_mutex_lock(&g_mu);
    c->next = g_comms;
    g_comms = c;
    pthread_mutex_unlock(&g_mu);
    *comm = c;
    return HCCL_SUCCESS;
}

/* HCCL_BUFFSIZE, in MiB (HCCL's environment variable; 200 when unset, its documented default). */
static uint64_t env_buffsize_mib(void) { return (uint64_t)env_positive("HCCL_BUFFSIZE", 200.0); }

API HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm) {
    return init_comm(nRanks, rootInfo, rank, env_buffsize_mib(), 0, NULL, comm);
}

/* HcclCommInitRootInfoConfig (hccl.h): the configuration's header must carry HCCL's magic word;
 * hcclBufferSize (MiB, >= 1; "not set" falls back to HCCL_BUFFSIZE), hcclDeterministic (0, 1 or
 * "not set") and hcclCommName (the name HcclGetCommName reports) are honoured; the other fields
 * choose algorithms, links and QoS of a real fabric and change nothing here. */
API HcclResult HcclCommInitRootInfoConfig(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                          const HcclCommConfig *config, HcclComm *comm) {
    if (!config) return HCCL_E_PTR;
    struct config_info hdr;
    memcpy(&hdr, config, sizeof hdr);
    if (hdr.magicWord != HCCL_COMM_CONFIG_MAGIC_WORD) return HCCL_E_PARA;
    size_t have = hdr.size;
    uint64_t mib = env_buffsize_mib();
    uint32_t det = 0;
    char name[COMM_NAME_MAX_LENGTH] = "";
    if (have >= offsetof(HcclCommConfig, hcclBufferSize) + sizeof(uint32_t) &&
        config->hcclBufferSize != HCCL_COMM_BUFFSIZE_CONFIG_NOT_SET) {
        if (config->hcclBufferSize == 0) return HCCL_E_PARA;
        mib = config->hcclBufferSize;
    }
    if (have >= offsetof(HcclCommConfig, hcclDeterministic) + sizeof(uint32_t) &&
        config->hcclDeterministic != HCCL_COMM_DETERMINISTIC_CONFIG_NOT_SET) {
        if (config->hcclDeterministic > 1) return HCCL_E_PARA;
        det = config->hcclDeterministic;
    }
    if (have >= offsetof(HcclCommConfig, hcclCommName) + COMM_NAME_MAX_LENGTH) {
        if (!memchr(config->hcclCommName, 0, COMM_NAME_MAX_LENGTH)) return HCCL_E_PARA;
        snprintf(name, sizeof name, "%s", config->hcclCommName);
        pthread_mutex_lock(&g_mu); /* a name is unique in the process */
        int taken = 0;
        for (struct comm *c = g_comms; c && *name; c = c->next)
            if (!c->destroyed && !strcmp(c->name, name)) taken = 1;
        pthread_mutex_unlock(&g_mu);
        if (taken) return HCCL_E_PARA;
    }
    return init_comm(nRanks, rootInfo, rank, mib, det, name, comm);
}

API uint32_t HcclGetCommConfigCapability(void) { return HCCL_COMM_CONFIG_COMM_NAME + 1; }

/* The process-wide deterministic switch (HcclSetConfig / HcclGetConfig, HCCL_DETERMINISTIC 0 or
 * 1). Reductions here always run in rank order, so both settings give the same bits. */
static int32_t g_deterministic;
API HcclResult HcclSetConfig(int config, union HcclConfigValue value) {
    if (config != HCCL_DETERMINISTIC) return HCCL_E_NOT_SUPPORT;
    if (value.value != 0 && value.value != 1) return HCCL_E_PARA;
    __atomic_store_n(&g_deterministic, value.value, __ATOMIC_RELAXED);
    return HCCL_SUCCESS;
}

API HcclResult HcclGetConfig(int config, union HcclConfigValue *value) {
    if (!value) return HCCL_E_PTR;
    if (config != HCCL_DETERMINISTIC) return HCCL_E_NOT_SUPPORT;
    value->value = __atomic_load_n(&g_deterministic, __ATOMIC_RELAXED);
    return HCCL_SUCCESS;
}

static struct comm *find_comm(HcclComm h) {
    for (struct comm *c = g_comms; c; c = c->next)
        if (c == h && !c->destroyed) return c;
    return NULL;
}

/* A communicator a Restore invalidated answers HCCL_E_UNAVAIL ("resource unavailable") to every
 * call but HcclGetCommAsyncError (which reports that error) and HcclCommDestroy. */
static HcclResult usable(struct comm *c) {
    if (!c) return HCCL_E_PARA;
    return atomic_load((_Atomic uint32_t *)&c->state.valid) ? HCCL_SUCCESS : HCCL_E_UNAVAIL;
}

API HcclResult HcclGetRankSize(HcclComm comm, uint32_t *rankSize) {
    if (!comm || !rankSize) return HCCL_E_PTR;
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    HcclResult rc = usable(c);
    if (rc == HCCL_SUCCESS) *rankSize = c->nranks;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank) {
    if (!comm || !rank) return HCCL_E_PTR;
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    HcclResult rc = usable(c);
    if (rc == HCCL_SUCCESS) *rank = c->rank;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* commName: a buffer of COMM_NAME_MAX_LENGTH (128) bytes, as torch_npu passes. */
API HcclResult HcclGetCommName(HcclComm comm, char *commName) {
    if (!comm || !commName) return HCCL_E_PTR;
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    HcclResult rc = usable(c);
    if (rc == HCCL_SUCCESS) memcpy(commName, c->name, COMM_NAME_MAX_LENGTH);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* HcclCommResume clears a communicator that HcclCommSuspend stopped after a device fault (the
 * step-retry path torch_npu takes in restart_device and reinit_process_group(rebuild_link=False)).
 * Nothing public says what it does to a communicator whose links a snapshot Restore dropped, and
 * nothing here suspends one, so it refuses: the application destroys the communicator and
 * builds a new one (what reinit_process_group(rebuild_link=True) and vllm-ascend do). */
API HcclResult HcclCommResume(HcclComm comm) {
    if (!comm) return HCCL_E_PTR;
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    HcclResult rc = usable(c);
    pthread_mutex_unlock(&g_mu);
    return rc == HCCL_SUCCESS ? HCCL_E_NOT_SUPPORT : rc;
}

/* Short names, as HCCL's own strings say them. */
API const char *HcclGetErrorString(HcclResult code) {
    static const char *const names[] = {
        "no error", "parameter error", "empty pointer", "memory error", "internal error",
        "not support feature", "not found specific resource", "resource unavailable",
        "call system interface error", "timeout", "open file fail", "tcp connect fail",
        "roce connect fail", "tcp transfer fail", "roce transfer fail", "call runtime api fail",
        "call driver api fail", "call profiling api fail", "call cce api fail", "call network api fail",
        "try again", "error cqe", "error communicator suspending", "retry constraint", "out of memory"};
    return (unsigned)code < sizeof names / sizeof *names ? names[code] : "unknown error";
}

/* The error of a collective that failed on a stream after it was launched (its kernel found the
 * communicator invalidated by a restore, or a peer never came): what real HCCL reports here for
 * errors of its asynchronous tasks. HCCL_SUCCESS when there was none. */
API HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *asyncError) {
    if (!comm || !asyncError) return HCCL_E_PTR;
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    if (c) *asyncError = (HcclResult)atomic_load((_Atomic int32_t *)&c->state.async_error);
    pthread_mutex_unlock(&g_mu);
    return c ? HCCL_SUCCESS : HCCL_E_PARA;
}

static void *collective_kernel_locked(aclError *rc) {
    *rc = 0;
    if (g_func) return g_func;
    Dl_info info;
    char self[PATH_MAX], path[PATH_MAX + 128];
    if (!dladdr((void *)collective_kernel_locked, &info) || !info.dli_fname || !realpath(info.dli_fname, self)) {
        *rc = -1;
        return NULL;
    }
    for (int up = 0; up < 2; up++) { /* <tree>/lib64/libhccl.so -> <tree> */
        char *s = strrchr(self, '/');
        if (s) *s = '\0';
    }
    snprintf(path, sizeof path, "%s/%s/%s", self, KERNEL_DIR, KERNEL_BIN);
    if (!g_bin && (*rc = aclrtBinaryLoadFromFile(path, NULL, &g_bin)) != 0) {
        fprintf(stderr, "libhccl: cannot load the kernel binary %s: error %d\n", path, *rc);
        g_bin = NULL;
        return NULL;
    }
    *rc = aclrtBinaryGetFunction(g_bin, "npusim_hccl_collective", &g_func);
    return *rc == 0 ? g_func : NULL;
}

static void *collective_kernel(aclError *rc) {
    pthread_mutex_lock(&g_bin_mu);
    void *f = collective_kernel_locked(rc);
    pthread_mutex_unlock(&g_bin_mu);
    return f;
}

/* Element sizes of HcclDataType (hccl_types.h), 0 for a type no collective here moves. */
static uint32_t dtype_size(int dt) {
    static const uint8_t sz[] = {1, 2, 4, 2, 4, 8, 8, 1, 2, 4, 8, 2}; /* INT8 .. BFP16 */
    return dt >= 0 && dt < (int)sizeof sz ? sz[dt] : 0;
}

/* The types and operations HCCL reduces on Atlas A2/A3 (HcclAllReduce, HcclReduceScatter:
 * "int8, int16, int32, int64, float16, float32, bfp16"; "prod" not for int16 and bfp16). The
 * moving collectives (all-gather, broadcast, all-to-all, send/recv) take every type of the
 * list up to bfp16. */
static HcclResult check_reduce(int dt, int op) {
    if (op < HCCL_REDUCE_SUM || op > HCCL_REDUCE_MIN) return HCCL_E_PARA;
    if (dt != HCCL_DATA_TYPE_INT8 && dt != HCCL_DATA_TYPE_INT16 && dt != HCCL_DATA_TYPE_INT32 &&
        dt != HCCL_DATA_TYPE_INT64 && dt != HCCL_DATA_TYPE_FP16 && dt != HCCL_DATA_TYPE_FP32 &&
        dt != HCCL_DATA_TYPE_BFP16)
        return HCCL_E_NOT_SUPPORT;
    if (op == HCCL_REDUCE_PROD && (dt == HCCL_DATA_TYPE_INT16 || dt == HCCL_DATA_TYPE_BFP16)) return HCCL_E_NOT_SUPPORT;
    return HCCL_SUCCESS;
}

/* Queue one collective on the stream: checked on the host, run by the kernel on the engine. `a`
 * holds the kind, buffers, counts, dtype, op and root/peer; the communicator's part is filled in
 * here. */
static HcclResult launch_collective(struct ops_hccl_args *a, HcclComm comm, aclrtStream stream) {
    if (!comm) return HCCL_E_PTR;
    a->esize = dtype_size(a->dtype);
    if (!a->esize) return HCCL_E_NOT_SUPPORT;
    if (a->kind == OPS_COLL_ALLREDUCE || a->kind == OPS_COLL_REDUCE_SCATTER || a->kind == OPS_COLL_REDUCE) {
        HcclResult r = check_reduce(a->dtype, a->op);
        if (r != HCCL_SUCCESS) return r;
    }
    aclError arc = 0;
    void *f = collective_kernel(&arc); /* may wait at the snapshot lock: not under g_mu */
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    HcclResult rc = HCCL_SUCCESS;
    if (!c) rc = HCCL_E_PARA;
    else if (!atomic_load((_Atomic uint32_t *)&c->state.valid)) rc = HCCL_E_UNAVAIL;
    else if (a->root >= c->nranks) rc = HCCL_E_PARA;
    else if ((a->kind == OPS_COLL_SEND || a->kind == OPS_COLL_RECV) && a->root == c->rank) rc = HCCL_E_PARA;
    if (rc == HCCL_SUCCESS && !f) rc = HCCL_E_RUNTIME;
    if (rc == HCCL_SUCCESS) {
        a->state = (uint64_t)(uintptr_t)&c->state;
        a->window = (uint64_t)(uintptr_t)c->window;
        a->slot_bytes = c->slot_bytes;
        a->timeout_ms = (uint64_t)(c->exec_timeout_s * 1000.0);
        a->rank = c->rank;
        a->nranks = c->nranks;
        /* Counted before the launch: HcclCommDestroy waits for the kernel to let go of the window. */
        atomic_fetch_add((_Atomic uint32_t *)&c->state.inflight, 1);
    }
    pthread_mutex_unlock(&g_mu);
    if (rc != HCCL_SUCCESS) return rc;
    /* Outside g_mu: the launch may wait at the snapshot lock, whose callbacks take g_mu. */
    arc = aclrtLaunchKernel(f, 1, a, sizeof *a, stream);
    if (arc != 0) {
        atomic_fetch_sub((_Atomic uint32_t *)&c->state.inflight, 1);
        syscall(SYS_futex, &c->state.inflight, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        return HCCL_E_RUNTIME;
    }
    return HCCL_SUCCESS;
}

#define BUFS_OK(n, ...) ((n) == 0 || (__VA_ARGS__))

API HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, int dataType, int op, HcclComm comm,
                             aclrtStream stream) {
    if (!BUFS_OK(count, sendBuf && recvBuf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_ALLREDUCE, .send = (uintptr_t)sendBuf, .recv = (uintptr_t)recvBuf,
                              .count = count, .dtype = dataType, .op = op};
    return launch_collective(&a, comm, stream);
}

/* In place: the root's buf goes to every rank's buf. */
API HcclResult HcclBroadcast(void *buf, uint64_t count, int dataType, uint32_t root, HcclComm comm,
                             aclrtStream stream) {
    if (!BUFS_OK(count, buf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_BROADCAST, .send = (uintptr_t)buf, .recv = (uintptr_t)buf,
                              .count = count, .dtype = dataType, .root = root};
    return launch_collective(&a, comm, stream);
}

/* recvBuf holds rankSize * sendCount elements, rank j's sendBuf at j * sendCount. */
API HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, int dataType, HcclComm comm,
                             aclrtStream stream) {
    if (!BUFS_OK(sendCount, sendBuf && recvBuf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_ALLGATHER, .send = (uintptr_t)sendBuf, .recv = (uintptr_t)recvBuf,
                              .count = sendCount, .dtype = dataType};
    return launch_collective(&a, comm, stream);
}

/* The rank size of a usable communicator (0 if not: the launch then answers why). */
static uint32_t rank_size(HcclComm comm) {
    uint32_t n = 0;
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    if (c) n = c->nranks;
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* sendBuf holds rankSize * recvCount elements; rank r receives the reduction of every rank's
 * r-th block. */
API HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, int dataType, int op,
                                 HcclComm comm, aclrtStream stream) {
    if (!BUFS_OK(recvCount, sendBuf && recvBuf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_REDUCE_SCATTER, .send = (uintptr_t)sendBuf,
                              .recv = (uintptr_t)recvBuf, .count = recvCount, .dtype = dataType, .op = op};
    uint32_t n = rank_size(comm);
    for (uint32_t k = 0; k < n; k++) a.sendcounts[k] = recvCount, a.sdispls[k] = k * recvCount;
    return launch_collective(&a, comm, stream);
}

/* The V form (hccl.h): sendCounts[k] elements at sendDispls[k] go to rank k (uint64_t host
 * arrays of rankSize, as torch_npu passes); every rank receives recvCount, which must equal what
 * each rank sends it. */
API HcclResult HcclReduceScatterV(void *sendBuf, const void *sendCounts, const void *sendDispls, void *recvBuf,
                                  uint64_t recvCount, int dataType, int op, HcclComm comm, aclrtStream stream) {
    if (!sendCounts || !sendDispls || !BUFS_OK(recvCount, sendBuf && recvBuf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_REDUCE_SCATTER, .send = (uintptr_t)sendBuf,
                              .recv = (uintptr_t)recvBuf, .count = recvCount, .dtype = dataType, .op = op};
    uint32_t n = rank_size(comm);
    const uint64_t *sc = sendCounts, *sd = sendDispls;
    for (uint32_t k = 0; k < n; k++) {
        if (sc[k] != recvCount) return HCCL_E_PARA; /* a block of another size can't be reduced */
        a.sendcounts[k] = sc[k], a.sdispls[k] = sd[k];
    }
    return launch_collective(&a, comm, stream);
}

/* Only the root's recvBuf is written (hccl.h HcclReduce). */
API HcclResult HcclReduce(void *sendBuf, void *recvBuf, uint64_t count, int dataType, int op, uint32_t root,
                          HcclComm comm, aclrtStream stream) {
    if (!BUFS_OK(count, sendBuf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_REDUCE, .send = (uintptr_t)sendBuf, .recv = (uintptr_t)recvBuf,
                              .count = count, .dtype = dataType, .op = op, .root = root};
    return launch_collective(&a, comm, stream);
}

/* The root's sendBuf holds rankSize * recvCount elements; rank k receives block k. Moved as an
 * all-to-all in which only the root sends. */
API HcclResult HcclScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, int dataType, uint32_t root,
                           HcclComm comm, aclrtStream stream) {
    uint32_t n = rank_size(comm), me = 0;
    if (n && root >= n) return HCCL_E_PARA;
    HcclResult rc = HcclGetRankId(comm, &me);
    if (rc != HCCL_SUCCESS) return rc;
    if (!BUFS_OK(recvCount, recvBuf && (me != root || sendBuf))) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_ALLTOALLV, .send = (uintptr_t)sendBuf, .recv = (uintptr_t)recvBuf,
                              .dtype = dataType};
    for (uint32_t k = 0; me == root && k < n; k++) a.sendcounts[k] = recvCount, a.sdispls[k] = k * recvCount;
    a.recvcounts[root] = recvCount;
    return launch_collective(&a, comm, stream);
}

/* recvCounts[j] elements of rank j land at recvDispls[j] (uint64_t host arrays); each rank sends
 * sendCount, which must be what the others expect from it. */
API HcclResult HcclAllGatherV(void *sendBuf, uint64_t sendCount, void *recvBuf, const void *recvCounts,
                              const void *recvDispls, int dataType, HcclComm comm, aclrtStream stream) {
    if (!recvCounts || !recvDispls) return HCCL_E_PTR;
    uint32_t n = rank_size(comm);
    struct ops_hccl_args a = {.kind = OPS_COLL_ALLTOALLV, .send = (uintptr_t)sendBuf, .recv = (uintptr_t)recvBuf,
                              .dtype = dataType};
    const uint64_t *rcn = recvCounts, *rd = recvDispls;
    uint64_t rtot = 0;
    for (uint32_t k = 0; k < n; k++) {
        a.sendcounts[k] = sendCount, a.sdispls[k] = 0;
        a.recvcounts[k] = rcn[k], a.rdispls[k] = rd[k];
        rtot += rcn[k];
    }
    if ((sendCount && !sendBuf) || (rtot && !recvBuf)) return HCCL_E_PTR;
    return launch_collective(&a, comm, stream);
}

/* Point to point: the peer must make the matching call (HcclRecv / HcclSend) on the same
 * communicator with the same count and type, in the same order (hccl.h; a send with no receive
 * runs into HCCL_EXEC_TIMEOUT, as on a device). */
API HcclResult HcclSend(void *sendBuf, uint64_t count, int dataType, uint32_t destRank, HcclComm comm,
                        aclrtStream stream) {
    if (!BUFS_OK(count, sendBuf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_SEND, .send = (uintptr_t)sendBuf, .count = count,
                              .dtype = dataType, .root = destRank};
    return launch_collective(&a, comm, stream);
}

API HcclResult HcclRecv(void *recvBuf, uint64_t count, int dataType, uint32_t srcRank, HcclComm comm,
                        aclrtStream stream) {
    if (!BUFS_OK(count, recvBuf)) return HCCL_E_PTR;
    struct ops_hccl_args a = {.kind = OPS_COLL_RECV, .recv = (uintptr_t)recvBuf, .count = count,
                              .dtype = dataType, .root = srcRank};
    return launch_collective(&a, comm, stream);
}

/* The counts and displacements are host arrays of rankSize uint64_t elements (hccl.h: "Integer
 * array, where entry i specifies..."; torch_npu passes std::vector<uint64_t>). HCCL requires the
 * send and receive types to agree. */
API HcclResult HcclAlltoAllV(const void *sendBuf, const void *sendCounts, const void *sdispls, int sendType,
                             const void *recvBuf, const void *recvCounts, const void *rdispls, int recvType,
                             HcclComm comm, aclrtStream stream) {
    if (!sendCounts || !sdispls || !recvCounts || !rdispls) return HCCL_E_PTR;
    if (sendType != recvType) return HCCL_E_PARA;
    uint32_t n = 0;
    HcclResult rc = HcclGetRankSize(comm, &n);
    if (rc != HCCL_SUCCESS) return rc;
    struct ops_hccl_args a = {.kind = OPS_COLL_ALLTOALLV, .send = (uintptr_t)sendBuf, .recv = (uintptr_t)recvBuf,
                              .dtype = sendType};
    const uint64_t *sc = sendCounts, *sd = sdispls, *rcn = recvCounts, *rd = rdispls;
    uint64_t stot = 0, rtot = 0;
    for (uint32_t k = 0; k < n; k++) {
        a.sendcounts[k] = sc[k], a.sdispls[k] = sd[k], a.recvcounts[k] = rcn[k], a.rdispls[k] = rd[k];
        stot += sc[k], rtot += rcn[k];
    }
    if ((stot && !sendBuf) || (rtot && !recvBuf)) return HCCL_E_PTR;
    return launch_collective(&a, comm, stream);
}

API HcclResult HcclAlltoAll(const void *sendBuf, uint64_t sendCount, int sendType, const void *recvBuf,
                            uint64_t recvCount, int recvType, HcclComm comm, aclrtStream stream) {
    if (sendType != recvType) return HCCL_E_PARA;
    uint32_t n = 0;
    HcclResult rc = HcclGetRankSize(comm, &n);
    if (rc != HCCL_SUCCESS) return rc;
    uint64_t sc[HCCL_MAX_RANKS], sd[HCCL_MAX_RANKS], rcn[HCCL_MAX_RANKS], rd[HCCL_MAX_RANKS];
    for (uint32_t k = 0; k < n; k++) sc[k] = sendCount, sd[k] = k * sendCount, rcn[k] = recvCount, rd[k] = k * recvCount;
    return HcclAlltoAllV(sendBuf, sc, sd, sendType, recvBuf, rcn, rd, recvType, comm, stream);
}

/* Every rank's stream reaches the barrier before any passes it. */
API HcclResult HcclBarrier(HcclComm comm, aclrtStream stream) {
    struct ops_hccl_args a = {.kind = OPS_COLL_BARRIER, .dtype = HCCL_DATA_TYPE_INT8};
    return launch_collective(&a, comm, stream);
}

/* The communicator's struct is kept (marked destroyed): a kernel that ran its last collective
 * may still be waking HcclCommDestroy through its state when the latter returns. A few dozen bytes
 * per communicator. */
API HcclResult HcclCommDestroy(HcclComm comm) {
    if (!comm) return HCCL_E_PTR;
    pthread_mutex_lock(&g_mu);
    struct comm *c = find_comm(comm);
    if (c) c->destroyed = 1;
    pthread_mutex_unlock(&g_mu);
    if (!c) return HCCL_E_PARA;
    /* torch_npu has no other abort than this call (HCCLComm::destroyHcclComm, also from
     * ProcessGroupHCCL's abort when a peer is gone): a collective still waiting for its peers gives
     * up (its stream gets the error) instead of holding the destroy for HCCL_EXEC_TIMEOUT. Those
     * still queued read the window: wait for them (HCCL_EXEC_TIMEOUT at most). */
    atomic_store((_Atomic uint32_t *)&c->state.abort, 1);
    _Atomic uint32_t *inflight = (_Atomic uint32_t *)&c->state.inflight;
    double deadline = now_s() + env_positive("HCCL_EXEC_TIMEOUT", 1836.0);
    uint32_t v;
    while ((v = atomic_load(inflight)) != 0 && now_s() < deadline) {
        struct timespec ts = {0, 50000000L};
        syscall(SYS_futex, (uint32_t *)inflight, FUTEX_WAIT, v, &ts, NULL, 0);
    }
    if (atomic_load(inflight) != 0) return HCCL_E_TIMEOUT; /* leak the window rather than pull it away */
    pthread_mutex_lock(&g_mu);
    if (c->window) munmap(c->window, c->window_bytes);
    c->window = NULL;
    pthread_mutex_unlock(&g_mu);
    return HCCL_SUCCESS;
}
