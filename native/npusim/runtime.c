/* libruntime.so of the simulated NPU: the one runtime state of a process.
 *
 * Both ACL front-ends (libacl_rt.so and libascendcl.so) forward here, so a process that loads both
 * still has a single state machine, device table and daemon connection, as with real CANN where
 * both sit on top of libruntime.so. Semantics follow shared/npusim-spec.md and
 * shared/cann-snapshot-api.md; device memory lives in the daemon (npusnap_cli/sim/daemon.py).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "npusim.h"
#include "npusim_wire.h"

#define MAX_DEV 64
#define NSTAGES 6
#define PACE_CHUNK ((uint64_t)1 << 20) /* a paced copy sleeps after each MiB */

enum { ST_RUNNING = 0, ST_LOCKED = 1, ST_BACKED_UP = 2 };

struct alloc {
    uint64_t addr;
    uint64_t size;
    int32_t dev;
    void *backup; /* host copy made by Backup, NULL otherwise */
    char *map;    /* this process's mapping of the allocation's memfd while RUNNING, or NULL */
};

struct cb {
    npusim_callback fn;
    void *args;
};

struct faults {
    int lock_timeout, backup, restore, unlock;
    int backup_code;   /* NPUSIM_FAULT_BACKUP_CODE: Backup returns this underlying error */
    long lock_wait_ms; /* NPUSIM_LOCK_WAIT_MS: how long Lock polls background threads (-1: 60 s) */
    long backup_hang_ms;
    double copy_mbps;
};

/* g_mu guards the state machine, the device/allocation tables and the in-flight counter.
 * g_io guards the daemon socket. Lock order: g_io before g_mu; never take g_io holding g_mu. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv; /* CLOCK_MONOTONIC, set up in the constructor */
static pthread_mutex_t g_io = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_snap = PTHREAD_MUTEX_INITIALIZER; /* one snapshot call at a time */
static pthread_mutex_t g_cbmu = PTHREAD_MUTEX_INITIALIZER;

static int g_state = ST_RUNNING;
static int g_inflight;
static int g_initialized;
static int g_open[MAX_DEV];
static int g_default_dev = -1;
static __thread int t_dev = -1;
static int g_fd = -1;
static struct alloc *g_allocs;
static size_t g_nallocs, g_allocs_cap;
static struct cb *g_cbs[NSTAGES];
static int g_ncb[NSTAGES], g_cbcap[NSTAGES];
static int g_keep_contents; /* the daemon's --keep-contents, read by the last Backup */
static int g_restore_contents; /* the Restore in progress writes the backed-up bytes back */
/* The driver-backed flow (NPUSIM_DRIVER_FLOW builds): whether the last Backup used it, and the
 * runtime and driver versions it recorded (Restore refuses when they differ). */
static int g_driver_backup;
static uint64_t g_backup_driver_version;
static double g_file_copy_mbps = -1.0; /* NPUSIM_COPY_MBPS from the fault file, last read */
static double g_link_mbps;              /* the daemon's --bandwidth-mbps, from its last MAP answer */
/* Copies in flight that may use kept mappings (g_mu): Lock leaves those to the last one to drop,
 * and a freed allocation's mapping is unmapped only when none is in flight (g_deferred). */
static int g_copying;
static struct deferred_unmap {
    void *p;
    size_t n;
} *g_deferred;
static size_t g_ndeferred, g_deferred_cap;

/* ---------------------------------------------------------------- helpers */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void apply_fault(struct faults *f, const char *key, const char *val) {
    if (!strcmp(key, "NPUSIM_FAULT_LOCK_TIMEOUT")) f->lock_timeout = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_BACKUP")) f->backup = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_RESTORE")) f->restore = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_UNLOCK")) f->unlock = atoi(val) != 0;
    else if (!strcmp(key, "NPUSIM_FAULT_BACKUP_CODE")) f->backup_code = atoi(val);
    else if (!strcmp(key, "NPUSIM_LOCK_WAIT_MS")) f->lock_wait_ms = atol(val);
    else if (!strcmp(key, "NPUSIM_BACKUP_HANG_MS")) f->backup_hang_ms = atol(val);
    else if (!strcmp(key, "NPUSIM_COPY_MBPS")) f->copy_mbps = atof(val);
}

/* Faults come from the environment and from NPUSIM_FAULT_FILE (KEY=VALUE lines), re-read on every
 * snapshot call so that a test can switch them in a process that is already running. */
static void read_faults(struct faults *f) {
    static const char *keys[] = {"NPUSIM_FAULT_LOCK_TIMEOUT", "NPUSIM_FAULT_BACKUP", "NPUSIM_FAULT_RESTORE",
                                 "NPUSIM_FAULT_UNLOCK", "NPUSIM_BACKUP_HANG_MS", "NPUSIM_COPY_MBPS",
                                 "NPUSIM_FAULT_BACKUP_CODE", "NPUSIM_LOCK_WAIT_MS"};
    memset(f, 0, sizeof *f);
    f->lock_wait_ms = -1;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const char *v = getenv(keys[i]);
        if (v && *v) apply_fault(f, keys[i], v);
    }
    double file_mbps = -1.0;
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
            if (!strcmp(key, "NPUSIM_COPY_MBPS")) file_mbps = atof(val);
        }
        fclose(fp);
    }
    g_file_copy_mbps = file_mbps;
}

static double copy_mbps(void) {
    const char *v = getenv("NPUSIM_COPY_MBPS");
    if (v && *v) return atof(v);
    return g_file_copy_mbps;
}

static const char *socket_path(char *buf, size_t len) {
    const char *env = getenv("NPUSIM_SOCKET");
    if (env && *env) return env;
    uid_t uid = geteuid();
    if (uid == 0) return "/run/npusim/npusim.sock";
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (xdg && *xdg && stat(xdg, &st) == 0 && S_ISDIR(st.st_mode) && strcmp(xdg, "/tmp") != 0)
        snprintf(buf, len, "%s/npusim/npusim.sock", xdg);
    else
        snprintf(buf, len, "/tmp/npusim-%u/npusim.sock", (unsigned)uid);
    return buf;
}

/* ---------------------------------------------------------------- daemon connection (g_io held) */

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static void io_disconnect(void) {
    if (g_fd >= 0) close(g_fd);
    g_fd = -1;
}

static int io_connect(void) {
    if (g_fd >= 0) return 0;
    char buf[256];
    const char *path = socket_path(buf, sizeof buf);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof sa.sun_path) return -1;
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    g_fd = fd;
    return 0;
}

/* One request/response. Returns the daemon status (0 or -errno), or -EPIPE if the connection
 * broke (which also drops it). `out` is sent after the header; `in` receives the payload. */
static int io_rpc(uint32_t op, int32_t dev, uint64_t a, uint64_t b, uint64_t n, const void *out,
                  size_t outlen, void *in, size_t inlen, uint64_t *value) {
    if (g_fd < 0) return -ENOTCONN;
    struct npusim_req req = {op, dev, a, b, n};
    struct npusim_resp resp;
    if (write_all(g_fd, &req, sizeof req) != 0 || (outlen && write_all(g_fd, out, outlen) != 0) ||
        read_all(g_fd, &resp, sizeof resp) != 0) {
        io_disconnect();
        return -EPIPE;
    }
    if (resp.payload_len) {
        if (resp.payload_len != inlen || !in) { /* protocol error: never leave stray bytes */
            io_disconnect();
            return -EPROTO;
        }
        if (read_all(g_fd, in, inlen) != 0) {
            io_disconnect();
            return -EPIPE;
        }
    }
    if (value) *value = resp.value;
    return resp.status;
}

/* NPUSIM_OP_MAP: the memfd of the caller's allocation holding [addr, addr+n), received as
 * SCM_RIGHTS on the answer's header, and the allocation's extent. Returns 0 or -errno. */
static int io_map_fd(uint64_t addr, uint64_t n, struct npusim_map *m, int *fdout) {
    if (g_fd < 0) return -ENOTCONN;
    struct npusim_req req = {NPUSIM_OP_MAP, -1, addr, 0, n};
    struct npusim_resp resp;
    if (write_all(g_fd, &req, sizeof req) != 0) {
        io_disconnect();
        return -EPIPE;
    }
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct iovec iov = {&resp, sizeof resp};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t r;
    do r = recvmsg(g_fd, &msg, MSG_CMSG_CLOEXEC);
    while (r < 0 && errno == EINTR);
    int fd = -1;
    for (struct cmsghdr *c = r > 0 ? CMSG_FIRSTHDR(&msg) : NULL; c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(&fd, CMSG_DATA(c), sizeof fd);
    int bad = r <= 0 || (msg.msg_flags & MSG_CTRUNC) ||
              ((size_t)r < sizeof resp && read_all(g_fd, (char *)&resp + r, sizeof resp - (size_t)r) != 0);
    if (!bad && resp.payload_len && (resp.payload_len != sizeof *m || read_all(g_fd, m, sizeof *m) != 0)) bad = 1;
    if (!bad && resp.status == 0 && (fd < 0 || resp.payload_len != sizeof *m)) bad = 1; /* no fd: protocol error */
    if (bad) {
        if (fd >= 0) close(fd);
        io_disconnect();
        return r <= 0 ? -EPIPE : -EPROTO;
    }
    if (resp.status != 0) {
        if (fd >= 0) close(fd);
        return resp.status;
    }
    *fdout = fd;
    return 0;
}

/* The allocation holding [addr, addr+n) (g_mu held), or NULL. Its pointer is valid until g_mu is
 * released; callers keep g_io, which every change of a mapping also holds. */
static struct alloc *find_range(uint64_t addr, uint64_t n) {
    for (size_t i = 0; i < g_nallocs; i++)
        if (addr >= g_allocs[i].addr && n <= g_allocs[i].size && addr - g_allocs[i].addr <= g_allocs[i].size - n)
            return &g_allocs[i];
    return NULL;
}

static void unmap_alloc(struct alloc *a) {
    if (a->map && g_copying) {
        /* A copy of another thread may be using it (copies run without g_io): later. */
        if (g_ndeferred == g_deferred_cap) {
            size_t cap = g_deferred_cap ? 2 * g_deferred_cap : 16;
            struct deferred_unmap *d = realloc(g_deferred, cap * sizeof *d);
            if (d) {
                g_deferred = d;
                g_deferred_cap = cap;
            }
        }
        if (g_ndeferred < g_deferred_cap) {
            g_deferred[g_ndeferred++] = (struct deferred_unmap){a->map, a->size};
            a->map = NULL;
            return;
        }
        /* No memory to remember it: leak the mapping rather than pull it from under a copy. */
        a->map = NULL;
        return;
    }
    if (a->map) munmap(a->map, a->size);
    a->map = NULL;
}

/* The last copy in flight ended (g_mu held): unmap what was freed meanwhile. */
static void flush_deferred_unmaps_locked(void) {
    for (size_t i = 0; i < g_ndeferred; i++) munmap(g_deferred[i].p, g_deferred[i].n);
    g_ndeferred = 0;
}

/* Page tables for [p, p + n) of a mapping that a copy is about to write, in one call (Linux
 * 5.14+; older kernels fault page by page as before). Reads are left to fault: populating them
 * measured no faster (a 1 GiB copy out 0.68 against 0.64 s here). */
static void populate(char *p, uint64_t n, int write) {
#ifdef MADV_POPULATE_WRITE
    if (!write || n < ((uint64_t)1 << 20)) return; /* a small copy: a few faults cost less */
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)p & ~(pg - 1), hi = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
    madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
#else
    (void)p, (void)n, (void)write;
#endif
}

/* Device memory as seen by this process: a pointer to addr in a mapping of the allocation's memfd
 * (g_io held). While RUNNING the mapping is kept for the next copies (`*transient` = 0); in any
 * other state (Backup, Restore) it is made for this copy only (`*transient` = 1: the caller
 * unmaps `*base` of `*len` bytes), so that a mapping of device memory never reaches a CRIU image:
 * Lock drops the kept ones (drop_mappings_locked), as a real device mapping is not dumped either.
 * Mapped MAP_POPULATE when the copy covers at least half the allocation, else the range a copy
 * writes alone is populated (populate): one batch of page-table work instead of a fault per
 * page, which matters for npusnap's reload in 64 MiB pieces (0.58-0.67 s for 1 GiB before, 0.34-
 * 0.45 s after, reload and Unlock). MADV_DONTFORK|MADV_DONTDUMP as a device mapping is. */
static int dev_ptr(uint64_t addr, uint64_t n, int write, char **p, char **base, size_t *len, int *transient) {
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_range(addr, n);
    int keep = g_state == ST_RUNNING;
    char *m = a ? a->map : NULL;
    uint64_t abase = a ? a->addr : 0, asize = a ? a->size : 0;
    pthread_mutex_unlock(&g_mu);
    if (!a) return -EINVAL;
    if (!m) {
        struct npusim_map info;
        int fd = -1;
        int st = io_map_fd(addr, n, &info, &fd);
        if (st != 0) return st;
        g_link_mbps = info.link_mbps;
        int same = info.base == abase && info.size == asize; /* the daemon's view of it is ours */
        int whole = n >= info.size / 2;
        int flags = MAP_SHARED | (whole ? MAP_POPULATE : 0);
        void *v = same ? mmap(NULL, info.size, PROT_READ | PROT_WRITE, flags, fd, 0) : MAP_FAILED;
        close(fd);
        if (v == MAP_FAILED) return same ? -ENOMEM : -EPROTO;
        madvise(v, info.size, MADV_DONTFORK);
        madvise(v, info.size, MADV_DONTDUMP);
        m = v;
        if (!whole) populate(m + (addr - abase), n, write);
        *transient = !keep;
        *base = m;
        *len = info.size;
        if (keep) {
            pthread_mutex_lock(&g_mu);
            a = find_range(addr, n);
            if (a && a->addr == abase && !a->map) a->map = m;
            else *transient = 1; /* the table changed meanwhile: do not keep it */
            pthread_mutex_unlock(&g_mu);
        }
    } else {
        *transient = 0;
        populate(m + (addr - abase), n, write); /* a kept mapping: the range may be new to it */
    }
    *p = m + (addr - abase);
    return 0;
}

/* Lock: no kept mapping survives (g_mu held, no copy in flight). */
static void drop_mappings_locked(void) {
    for (size_t i = 0; i < g_nallocs; i++) unmap_alloc(&g_allocs[i]);
}

/* The pace of a copy in MB/s, or 0 for memory speed: the slower of NPUSIM_COPY_MBPS (a per-process
 * fault) and the daemon's --bandwidth-mbps (the link every process shares). */
static double pace_mbps(void) {
    double a = copy_mbps(), b = g_link_mbps;
    if (a > 0 && b > 0) return a < b ? a : b;
    return a > 0 ? a : (b > 0 ? b : 0.0);
}

/* memmove that sleeps to a pace of `mbps` MB/s after each MiB when mbps > 0. */
static void paced_move(char *dst, const char *src, uint64_t n, double mbps) {
    if (mbps <= 0) {
        memmove(dst, src, n);
        return;
    }
    double t0 = now_s();
    for (uint64_t done = 0; done < n;) {
        uint64_t c = n - done < PACE_CHUNK ? n - done : PACE_CHUNK;
        memmove(dst + done, src + done, c);
        done += c;
        sleep_s((double)done / (mbps * 1e6) - (now_s() - t0));
    }
}

/* A copy with device memory on one side or both (g_io held): kind 1 host to device, 2 device to
 * host, 3 device to device. Returns 0 or -errno. With `release_io`, g_io is let go while the
 * bytes move at memory speed (and taken again before returning), so that copies of several
 * threads run at once, as on a device with several copy engines; the daemon connection is only
 * needed to map. Freed allocations' mappings wait for the copies in flight (unmap_alloc). */
static int io_transfer_kind(int kind, uint64_t dst, uint64_t src, uint64_t n, int release_io) {
    char *dp = (char *)(uintptr_t)dst, *sp = (char *)(uintptr_t)src;
    char *b1 = NULL, *b2 = NULL;
    size_t l1 = 0, l2 = 0;
    int t1 = 0, t2 = 0, st = 0;
    pthread_mutex_lock(&g_mu);
    g_copying++;
    pthread_mutex_unlock(&g_mu);
    if (kind == 1 || kind == 3) st = dev_ptr(dst, n, 1, &dp, &b1, &l1, &t1);
    if (st == 0 && (kind == 2 || kind == 3)) st = dev_ptr(src, n, 0, &sp, &b2, &l2, &t2);
    double mbps = pace_mbps();
    /* A paced copy keeps g_io: the modelled link is shared, one copy at a time. */
    int unlocked = release_io && mbps <= 0;
    if (unlocked) pthread_mutex_unlock(&g_io);
    if (st == 0) paced_move(dp, sp, n, mbps);
    if (t1) munmap(b1, l1);
    if (t2) munmap(b2, l2);
    if (unlocked) pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    if (--g_copying == 0) {
        if (g_state != ST_RUNNING) drop_mappings_locked(); /* Lock came while copies ran */
        flush_deferred_unmaps_locked();
    }
    pthread_mutex_unlock(&g_mu);
    return st;
}

/* Device<->host copies (Backup and Restore use them too), paced as io_transfer_kind. */
static int io_transfer(int write, uint64_t addr, void *host, uint64_t n) {
    return write ? io_transfer_kind(1, addr, (uint64_t)(uintptr_t)host, n, 0)
                 : io_transfer_kind(2, (uint64_t)(uintptr_t)host, addr, n, 0);
}

static int32_t status_to_acl(int st) {
    switch (st) {
    case 0: return ACL_SUCCESS;
    case -ENOMEM: return ACL_ERROR_RT_MEMORY_ALLOCATION;
    case -EBUSY: return ACL_ERROR_RT_DEV_SETUP_ERROR;
    case -ENODEV:
    case -EINVAL:
    case -EPERM:
    case -EEXIST: return ACL_ERROR_RT_PARAM_INVALID;
    default: return ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* daemon gone or protocol broken */
    }
}

/* ---------------------------------------------------------------- tables (g_mu held) */

static struct alloc *find_exact(uint64_t addr) {
    for (size_t i = 0; i < g_nallocs; i++)
        if (g_allocs[i].addr == addr) return &g_allocs[i];
    return NULL;
}

static int range_ok(uint64_t addr, uint64_t n) {
    for (size_t i = 0; i < g_nallocs; i++)
        if (addr >= g_allocs[i].addr && n <= g_allocs[i].size && addr - g_allocs[i].addr <= g_allocs[i].size - n)
            return 1;
    return 0;
}

static int add_alloc(uint64_t addr, uint64_t size, int32_t dev) {
    if (g_nallocs == g_allocs_cap) {
        size_t cap = g_allocs_cap ? g_allocs_cap * 2 : 64;
        struct alloc *p = realloc(g_allocs, cap * sizeof *p);
        if (!p) return -1;
        g_allocs = p;
        g_allocs_cap = cap;
    }
    g_allocs[g_nallocs++] = (struct alloc){addr, size, dev, NULL, NULL};
    return 0;
}

static void remove_alloc(struct alloc *a) {
    free(a->backup);
    unmap_alloc(a);
    *a = g_allocs[--g_nallocs];
}

static void free_backups(void) {
    for (size_t i = 0; i < g_nallocs; i++) {
        free(g_allocs[i].backup);
        g_allocs[i].backup = NULL;
    }
}

static int open_devices(int32_t *ids, int max) {
    int n = 0;
    for (int d = 0; d < MAX_DEV; d++)
        if (g_open[d]) {
            if (n < max) ids[n] = d;
            n++;
        }
    return n;
}

/* ---------------------------------------------------------------- locking of device calls */

/* Every call that changes device resources goes through enter/leave: it waits while the process
 * is LOCKED or BACKED_UP, and Lock waits for the in-flight ones to drain. */
static void enter(void) {
    pthread_mutex_lock(&g_mu);
    while (g_state != ST_RUNNING) pthread_cond_wait(&g_cv, &g_mu);
    g_inflight++;
    pthread_mutex_unlock(&g_mu);
}

static void leave(void) {
    pthread_mutex_lock(&g_mu);
    g_inflight--;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

static int current_device(void) {
    pthread_mutex_lock(&g_mu);
    int d = (t_dev >= 0 && g_open[t_dev]) ? t_dev : g_default_dev;
    pthread_mutex_unlock(&g_mu);
    return d;
}

/* ---------------------------------------------------------------- lifecycle */

static void atfork_prepare(void) {
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
}

static void atfork_parent(void) {
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
}

/* A forked child owns no device (as with real CANN, which does not survive fork): it must not
 * talk over the parent's daemon connection or believe it holds the parent's memory. */
static void atfork_child(void) {
    if (g_fd >= 0) close(g_fd);
    g_fd = -1;
    for (size_t i = 0; i < g_nallocs; i++) free(g_allocs[i].backup);
    g_nallocs = 0;
    memset(g_open, 0, sizeof g_open);
    g_default_dev = -1;
    t_dev = -1;
    g_state = ST_RUNNING;
    g_inflight = 0;
    g_initialized = 0;
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
}

__attribute__((constructor)) static void rt_init(void) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* A process that exits while locked is force-unlocked (CANN does this with an exit hook), so that
 * threads still blocked in device calls are released and host copies are dropped. */
__attribute__((destructor)) static void rt_fini(void) {
    pthread_mutex_lock(&g_mu);
    if (g_state != ST_RUNNING) {
        fprintf(stderr, "npusim: process %d exiting while %s: force-unlocked\n", (int)getpid(),
                g_state == ST_LOCKED ? "LOCKED" : "BACKED_UP");
        g_state = ST_RUNNING;
        free_backups();
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

/* ---------------------------------------------------------------- ACL implementation */

int32_t npusim_rt_init(const char *config) {
    (void)config;
    pthread_mutex_lock(&g_mu);
    int32_t rc = g_initialized ? ACL_ERROR_REPEAT_INITIALIZE : ACL_SUCCESS;
    g_initialized = 1;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static int32_t reset_device_locked_io(int32_t dev) {
    /* g_io held by caller */
    int st = io_rpc(NPUSIM_OP_RELEASE, dev, 0, 0, 0, NULL, 0, NULL, 0, NULL);
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_nallocs;) {
        if (g_allocs[i].dev == dev) remove_alloc(&g_allocs[i]);
        else i++;
    }
    g_open[dev] = 0;
    if (t_dev == dev) t_dev = -1;
    if (g_default_dev == dev) {
        g_default_dev = -1;
        for (int d = 0; d < MAX_DEV; d++)
            if (g_open[d]) {
                g_default_dev = d;
                break;
            }
    }
    int any = g_default_dev >= 0;
    pthread_mutex_unlock(&g_mu);
    if (!any) io_disconnect();
    return st == 0 || st == -ENOTCONN ? ACL_SUCCESS : status_to_acl(st);
}

int32_t npusim_rt_finalize(void) {
    enter();
    pthread_mutex_lock(&g_io);
    for (int d = 0; d < MAX_DEV; d++) {
        pthread_mutex_lock(&g_mu);
        int open = g_open[d];
        pthread_mutex_unlock(&g_mu);
        if (open) reset_device_locked_io(d);
    }
    io_disconnect();
    pthread_mutex_unlock(&g_io);
    pthread_mutex_lock(&g_mu);
    int32_t rc = g_initialized ? ACL_SUCCESS : ACL_ERROR_UNINITIALIZE;
    g_initialized = 0;
    pthread_mutex_unlock(&g_mu);
    leave();
    return rc;
}

int32_t npusim_rt_set_device(int32_t dev) {
    if (dev < 0 || dev >= MAX_DEV) return ACL_ERROR_RT_PARAM_INVALID;
    enter();
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_io);
    if (io_connect() != 0) {
        rc = ACL_ERROR_RT_DRV_INTERNAL_ERROR;
    } else {
        int st = io_rpc(NPUSIM_OP_CLAIM, dev, 0, 0, 0, NULL, 0, NULL, 0, NULL);
        rc = status_to_acl(st);
    }
    if (rc == ACL_SUCCESS) {
        pthread_mutex_lock(&g_mu);
        g_open[dev] = 1;
        t_dev = dev;
        if (g_default_dev < 0) g_default_dev = dev;
        pthread_mutex_unlock(&g_mu);
    } else {
        pthread_mutex_lock(&g_mu);
        int any = g_default_dev >= 0;
        pthread_mutex_unlock(&g_mu);
        if (!any) io_disconnect();
    }
    pthread_mutex_unlock(&g_io);
    leave();
    return rc;
}

int32_t npusim_rt_reset_device(int32_t dev) {
    if (dev < 0 || dev >= MAX_DEV) return ACL_ERROR_RT_PARAM_INVALID;
    enter();
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    int open = g_open[dev];
    pthread_mutex_unlock(&g_mu);
    int32_t rc = open ? reset_device_locked_io(dev) : ACL_SUCCESS;
    pthread_mutex_unlock(&g_io);
    leave();
    return rc;
}

int32_t npusim_rt_get_device(int32_t *dev) {
    if (!dev) return ACL_ERROR_RT_PARAM_INVALID;
    int d = current_device();
    if (d < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    *dev = d;
    return ACL_SUCCESS;
}

int32_t npusim_rt_malloc(void **ptr, size_t size, int policy) {
    (void)policy;
    if (!ptr || size == 0) return ACL_ERROR_RT_PARAM_INVALID;
    enter();
    int32_t rc;
    int dev = current_device();
    if (dev < 0) {
        rc = ACL_ERROR_UNINITIALIZE;
    } else {
        uint64_t addr = 0;
        pthread_mutex_lock(&g_io);
        int st = io_rpc(NPUSIM_OP_ALLOC, dev, 0, 0, size, NULL, 0, NULL, 0, &addr);
        rc = status_to_acl(st);
        if (rc == ACL_SUCCESS) {
            pthread_mutex_lock(&g_mu);
            if (add_alloc(addr, size, dev) != 0) rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
            pthread_mutex_unlock(&g_mu);
            if (rc != ACL_SUCCESS) io_rpc(NPUSIM_OP_FREE, dev, addr, 0, 0, NULL, 0, NULL, 0, NULL);
            else *ptr = (void *)(uintptr_t)addr;
        }
        pthread_mutex_unlock(&g_io);
    }
    leave();
    return rc;
}

int32_t npusim_rt_free(void *ptr) {
    if (!ptr) return ACL_ERROR_RT_PARAM_INVALID;
    enter();
    int32_t rc;
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    struct alloc *a = find_exact((uint64_t)(uintptr_t)ptr);
    int32_t dev = a ? a->dev : -1;
    pthread_mutex_unlock(&g_mu);
    if (!a) {
        rc = ACL_ERROR_RT_PARAM_INVALID;
    } else {
        rc = status_to_acl(io_rpc(NPUSIM_OP_FREE, dev, (uint64_t)(uintptr_t)ptr, 0, 0, NULL, 0, NULL, 0, NULL));
        if (rc == ACL_SUCCESS) {
            pthread_mutex_lock(&g_mu);
            a = find_exact((uint64_t)(uintptr_t)ptr);
            if (a) remove_alloc(a);
            pthread_mutex_unlock(&g_mu);
        }
    }
    pthread_mutex_unlock(&g_io);
    leave();
    return rc;
}

int32_t npusim_rt_memcpy(void *dst, size_t dest_max, const void *src, size_t count, int kind) {
    if (!dst || !src || count > dest_max || kind < 0 || kind > 3) return ACL_ERROR_RT_PARAM_INVALID;
    enter();
    int32_t rc = ACL_SUCCESS;
    uint64_t d = (uint64_t)(uintptr_t)dst, s = (uint64_t)(uintptr_t)src;
    if (count == 0) {
        rc = ACL_SUCCESS;
    } else if (kind == 0) {
        memmove(dst, src, count);
    } else {
        pthread_mutex_lock(&g_io);
        pthread_mutex_lock(&g_mu);
        int connected = g_fd >= 0 && g_default_dev >= 0;
        int ok = (kind != 1 || range_ok(d, count)) && (kind != 2 || range_ok(s, count)) &&
                 (kind != 3 || (range_ok(d, count) && range_ok(s, count)));
        pthread_mutex_unlock(&g_mu);
        if (!connected) rc = ACL_ERROR_UNINITIALIZE;
        else if (!ok) rc = ACL_ERROR_RT_PARAM_INVALID;
        else if (kind == 1) rc = status_to_acl(io_transfer_kind(1, d, (uint64_t)(uintptr_t)src, count, 1));
        else if (kind == 2) rc = status_to_acl(io_transfer_kind(2, (uint64_t)(uintptr_t)dst, s, count, 1));
        else rc = status_to_acl(io_transfer_kind(3, d, s, count, 1));
        pthread_mutex_unlock(&g_io);
    }
    leave();
    return rc;
}

/* Contexts: one per device (the default context aclrtSetDevice creates), identified by an opaque
 * non-NULL handle. Enough for code that saves and selects contexts, as npusnap's agent does. */
#define CTX_BASE ((uintptr_t)0x7c000000)

int32_t npusim_rt_get_current_context(void **ctx) {
    if (!ctx) return ACL_ERROR_RT_PARAM_INVALID;
    int d = current_device();
    if (d < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    *ctx = (void *)(CTX_BASE + (uintptr_t)d);
    return ACL_SUCCESS;
}

int32_t npusim_rt_set_current_context(void *ctx) {
    uintptr_t v = (uintptr_t)ctx;
    if (v < CTX_BASE || v >= CTX_BASE + MAX_DEV) return ACL_ERROR_RT_PARAM_INVALID;
    int d = (int)(v - CTX_BASE);
    pthread_mutex_lock(&g_mu);
    int ok = g_open[d];
    if (ok) t_dev = d;
    pthread_mutex_unlock(&g_mu);
    return ok ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
}

int32_t npusim_rt_synchronize_device(void) {
    /* Copies are synchronous in the simulator: nothing is ever queued, so nothing to wait for. */
    return current_device() < 0 ? ACL_ERROR_UNINITIALIZE : ACL_SUCCESS;
}

int32_t npusim_rt_get_version_str(char *pkg, char *out) {
    if (!pkg || !out) return ACL_ERROR_INVALID_PARAM;
    snprintf(out, 128, "%s", NPUSIM_CANN_VERSION);
    return ACL_SUCCESS;
}

int npusim_rt_get_open_devices(int32_t *ids, int max) {
    if (!ids || max < 0) return -1;
    pthread_mutex_lock(&g_mu);
    int n = open_devices(ids, max);
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* ---------------------------------------------------------------- callbacks */

/* Per stage, a growing list (no fixed limit, as in CANN). g_cbmu guards it and is held while the
 * callbacks run, as the runtime holds its callback mutex. */
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

int32_t npusim_rt_callback_register(int stage, npusim_callback cb, void *args) {
    if (stage < 0 || stage >= NSTAGES || !cb) return ACL_ERROR_RT_PARAM_INVALID;
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_cbmu);
    for (int i = 0; i < g_ncb[stage]; i++)
        if (g_cbs[stage][i].fn == cb) rc = ACL_ERROR_SNAPSHOT_REGISTER_CALLBACK_FAILED;
    if (rc == ACL_SUCCESS) rc = cb_add(stage, cb, args);
    pthread_mutex_unlock(&g_cbmu);
    return rc;
}

int32_t npusim_rt_callback_unregister(int stage, npusim_callback cb) {
    if (stage < 0 || stage >= NSTAGES || !cb) return ACL_ERROR_RT_PARAM_INVALID;
    int32_t rc = ACL_ERROR_RT_PARAM_INVALID;
    pthread_mutex_lock(&g_cbmu);
    for (int i = 0; i < g_ncb[stage]; i++)
        if (g_cbs[stage][i].fn == cb) {
            memmove(&g_cbs[stage][i], &g_cbs[stage][i + 1], (size_t)(g_ncb[stage] - i - 1) * sizeof(struct cb));
            g_ncb[stage]--;
            rc = ACL_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&g_cbmu);
    return rc;
}

/* Runs a stage's callbacks once per open device (device by device), holding the callback mutex;
 * the first non-zero result aborts. Called without g_mu, so callbacks may query the runtime. */
static int32_t run_callbacks(int stage) {
    int32_t ids[MAX_DEV];
    pthread_mutex_lock(&g_mu);
    int nd = open_devices(ids, MAX_DEV);
    pthread_mutex_unlock(&g_mu);
    int32_t rc = ACL_SUCCESS;
    pthread_mutex_lock(&g_cbmu);
    for (int d = 0; d < nd && rc == ACL_SUCCESS; d++)
        for (int i = 0; i < g_ncb[stage] && rc == ACL_SUCCESS; i++)
            if (g_cbs[stage][i].fn(ids[d], g_cbs[stage][i].args) != 0) rc = ACL_ERROR_SNAPSHOT_CALLBACK_FAILED;
    pthread_mutex_unlock(&g_cbmu);
    return rc;
}

/* ---------------------------------------------------------------- snapshot */

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
}

/* A "chip" without snapshot support (NPUSIM_NO_SNAPSHOT=1): every snapshot call and GetState
 * answer 207000, as CANN does on hardware other than Atlas A2/A3 and Ascend 950PR. */
static int no_snapshot(void) {
    const char *v = getenv("NPUSIM_NO_SNAPSHOT");
    return v && *v && atoi(v) != 0;
}

/* The snapshot functions' argument check: 9.1+ wants the caller's own pid and NULL args; the
 * zero-argument builds (8.5/9.0, NPUSIM_ABI_ZERO_ARG) take no arguments and so check nothing. */
#ifdef NPUSIM_ABI_ZERO_ARG
#define BAD_ARGS(pid, p) ((void)(pid), (void)(p), 0)
#define BAD_SNAP_ARGS(pid, p) ((void)(pid), (void)(p), 0)
#elif defined(NPUSIM_DRIVER_FLOW)
/* Newer builds: Backup/Restore take an args struct whose flag is 0 (required device memory) or 1
 * (also optional memory); args != NULL selects the driver-backed flow. */
struct snap_args {
    uint32_t flags;
    char reserved[60];
};
#define BAD_ARGS(pid, p) ((pid) != getpid() || (p))
#define BAD_SNAP_ARGS(pid, p) ((pid) != getpid() || ((p) && ((const struct snap_args *)(p))->flags > 1))
#else
#define BAD_ARGS(pid, p) ((pid) != getpid() || (p))
#define BAD_SNAP_ARGS(pid, p) BAD_ARGS(pid, p) /* 9.1.x: args must be NULL */
#endif

#ifdef NPUSIM_DRIVER_FLOW
#define DRIVER_FLOW(args) ((args) != NULL)
#else
#define DRIVER_FLOW(args) ((void)(args), 0)
#endif

/* The daemon's configuration word (NPUSIM_CONFIG_* bits, driver version above bit 16), or 0. */
static uint64_t daemon_config(void) {
    uint64_t cfg = 0;
    if (io_rpc(NPUSIM_OP_CONFIG, -1, 0, 0, 0, NULL, 0, NULL, 0, &cfg) != 0) cfg = 0;
    return cfg;
}

/* Lock: LOCK_PRE callbacks first (before the state check, as in CANN: they run even when Lock
 * then fails), then RUNNING is required, then the runtime's registered background threads must
 * park (NPUSIM_FAULT_LOCK_TIMEOUT: one never does; after the wait, 507905 and back to RUNNING).
 * Calls already in flight on other threads are neither waited for nor a reason to fail; calls
 * made from now on wait in enter(). */
int32_t npusim_rt_lock(int pid, void *reserve) {
    if (BAD_ARGS(pid, reserve)) return ACL_ERROR_INVALID_PARAM;
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = run_callbacks(NPUSIM_STAGE_LOCK_PRE);
    if (rc == ACL_SUCCESS && get_state() != ST_RUNNING) rc = ACL_ERROR_SNAPSHOT_LOCK_FAILED;
    if (rc == ACL_SUCCESS) {
        set_state(ST_LOCKED);
        /* From here on copies map device memory for their own duration only; the mappings kept
         * while RUNNING go now, or when the copy in flight that uses them ends (not waited for). */
        pthread_mutex_lock(&g_mu);
        if (!g_copying) drop_mappings_locked();
        pthread_mutex_unlock(&g_mu);
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

/* Backup: state check, BACKUP_PRE, then the runtime state (the allocation table; with a
 * --keep-contents daemon also every allocation's bytes), BACKUP_POST -- before the state becomes
 * BACKED_UP, as in CANN. The device connection stays open, as the real runtime keeps
 * /dev/davinci_manager open and mapped: CRIU needs a plugin for it (npusim_plugin.so, as Huawei's
 * npu_plugin.so for the device files), which records it at dump and reconnects at restore. An
 * underlying error
 * (NPUSIM_FAULT_BACKUP_CODE, e.g. 207000 for an AICPU model) is passed through as it is. */
int32_t npusim_rt_backup(int pid, void *args) {
    if (BAD_SNAP_ARGS(pid, args)) return ACL_ERROR_INVALID_PARAM;
    int driver = DRIVER_FLOW(args);
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = ACL_SUCCESS;
    if (get_state() != ST_LOCKED || f.backup) rc = ACL_ERROR_SNAPSHOT_BACKUP_FAILED;
    else if (f.backup_code) rc = f.backup_code;
    if (rc == ACL_SUCCESS && driver) {
        /* The driver feature FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT: without it, "not
         * supported", and no fallback to the legacy flow. */
        pthread_mutex_lock(&g_io);
        uint64_t cfg = daemon_config();
        pthread_mutex_unlock(&g_io);
        if (!(cfg & NPUSIM_CONFIG_DRIVER_SNAPSHOT)) rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    if (rc == ACL_SUCCESS) rc = run_callbacks(NPUSIM_STAGE_BACKUP_PRE);
    if (rc == ACL_SUCCESS) {
        if (f.backup_hang_ms > 0) sleep_s((double)f.backup_hang_ms / 1000.0);
        /* g_io waits for a device call still in flight (CANN synchronizes every stream). */
        pthread_mutex_lock(&g_io);
        pthread_mutex_lock(&g_mu);
        free_backups(); /* a repeated Backup replaces the previous one */
        drop_mappings_locked(); /* Lock dropped them already; no device mapping reaches the dump */
        size_t n = g_nallocs;
        pthread_mutex_unlock(&g_mu);
        /* CANN's legacy Backup saves runtime state, not what the application allocated: Restore
         * gives the allocations back at the same addresses with other contents. Only a daemon
         * started with --keep-contents (a model of a future driver) keeps the bytes. */
        uint64_t cfg = daemon_config();
        g_keep_contents = (cfg & NPUSIM_CONFIG_KEEP_CONTENTS) != 0;
        /* Driver flow: the driver backs up the process's device memory by tag. Every allocation
         * here carries the default tag, SNAPSHOT_REQUIRED, so both flags copy all of it. */
        g_driver_backup = driver;
        g_backup_driver_version = cfg >> 16;
        if (!g_keep_contents && !driver) n = 0;
        for (size_t i = 0; i < n && rc == ACL_SUCCESS; i++) {
            struct alloc *a = &g_allocs[i];
            a->backup = malloc(a->size);
            if (!a->backup) rc = ACL_ERROR_SNAPSHOT_BACKUP_FAILED;
            else if (io_transfer(0, a->addr, a->backup, a->size) != 0) rc = ACL_ERROR_SNAPSHOT_BACKUP_FAILED;
        }
        if (rc != ACL_SUCCESS) {
            pthread_mutex_lock(&g_mu);
            free_backups();
            pthread_mutex_unlock(&g_mu);
        }
        pthread_mutex_unlock(&g_io);
        if (rc == ACL_SUCCESS) {
            rc = run_callbacks(NPUSIM_STAGE_BACKUP_POST);
            if (rc == ACL_SUCCESS) set_state(ST_BACKED_UP); /* else stays LOCKED */
        }
    }
    pthread_mutex_unlock(&g_snap);
    return rc;
}

/* Claim every open device over the device connection; for Restore also recreate and refill
 * allocations. In a CRIU-restored process the connection is a new one (npusim_plugin.so made it
 * at restore, at the same fd), so the daemon sees the restored process as the claimant; a process
 * without one (its connection broke) connects first. */
static int32_t reattach(int recreate, int32_t fail_code) {
    int32_t ids[MAX_DEV];
    pthread_mutex_lock(&g_mu);
    int nd = open_devices(ids, MAX_DEV);
    size_t n = g_nallocs;
    pthread_mutex_unlock(&g_mu);
    if (nd == 0) return ACL_SUCCESS;
    pthread_mutex_lock(&g_io);
    int32_t rc = ACL_SUCCESS;
    if (io_connect() != 0) rc = fail_code;
    for (int d = 0; d < nd && rc == ACL_SUCCESS; d++)
        if (io_rpc(NPUSIM_OP_CLAIM, ids[d], 0, recreate ? NPUSIM_CLAIM_EXCLUSIVE : 0, 0, NULL, 0, NULL, 0, NULL) != 0)
            rc = fail_code; /* Restore needs the device free of other processes; Unlock does not */
    for (size_t i = 0; i < n && rc == ACL_SUCCESS; i++) {
        struct alloc *a = &g_allocs[i];
        if (!recreate) {
            /* Unlock from BACKED_UP without Restore is a pure state change in CANN: the original
             * keeps its memory. (A CRIU-restored copy that skips Restore runs on nothing; the
             * npusnap agent refuses that Unlock itself.) */
            break;
        } else if (!g_restore_contents) {
            /* Same address, new pages: the daemon fills them with the poison pattern. */
            if (io_rpc(NPUSIM_OP_ALLOC_AT, a->dev, a->addr, NPUSIM_ALLOC_POISON, a->size, NULL, 0, NULL, 0, NULL) != 0)
                rc = fail_code;
        } else if (!a->backup ||
                   io_rpc(NPUSIM_OP_ALLOC_AT, a->dev, a->addr, 0, a->size, NULL, 0, NULL, 0, NULL) != 0 ||
                   io_transfer(1, a->addr, a->backup, a->size) != 0) {
            rc = fail_code;
        }
    }
    /* A refused claim keeps the connection: closing it would make the daemon release what this
     * process holds (io_rpc drops a connection that actually broke). */
    pthread_mutex_unlock(&g_io);
    return rc;
}

/* Restore: RESTORE_PRE, re-open every device exclusively (507909 while another live process has
 * it open), every allocation back at its address (poisoned unless --keep-contents), then
 * RESTORE_POST -- before the state becomes LOCKED, as in CANN. */
int32_t npusim_rt_restore(int pid, void *args) {
    if (BAD_SNAP_ARGS(pid, args)) return ACL_ERROR_INVALID_PARAM;
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    int driver = DRIVER_FLOW(args);
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = ACL_SUCCESS;
    if (get_state() != ST_BACKED_UP || f.restore) rc = ACL_ERROR_SNAPSHOT_RESTORE_FAILED;
    else if (driver && !g_driver_backup) rc = ACL_ERROR_SNAPSHOT_RESTORE_FAILED; /* nothing to restore */
    else if (driver) {
        /* The versions recorded at Backup must be the running ones. */
        pthread_mutex_lock(&g_io);
        int connected = io_connect() == 0;
        uint64_t cfg = connected ? daemon_config() : 0;
        pthread_mutex_unlock(&g_io);
        if (!connected || !(cfg & NPUSIM_CONFIG_DRIVER_SNAPSHOT) || (cfg >> 16) != g_backup_driver_version)
            rc = ACL_ERROR_SNAPSHOT_RESTORE_FAILED;
    }
    g_restore_contents = g_keep_contents || (driver && g_driver_backup);
    if (rc == ACL_SUCCESS) rc = run_callbacks(NPUSIM_STAGE_RESTORE_PRE);
    if (rc == ACL_SUCCESS) rc = reattach(1, ACL_ERROR_SNAPSHOT_RESTORE_FAILED);
    if (rc == ACL_SUCCESS) {
        pthread_mutex_lock(&g_mu);
        free_backups();
        pthread_mutex_unlock(&g_mu);
        rc = run_callbacks(NPUSIM_STAGE_RESTORE_POST);
        if (rc == ACL_SUCCESS) set_state(ST_LOCKED);
    }
    pthread_mutex_unlock(&g_snap);
    return rc;
}

/* Unlock from LOCKED or BACKED_UP (the latter without Restore is a pure state change: the
 * original keeps running after a dump); UNLOCK_POST runs after the state is RUNNING. */
int32_t npusim_rt_unlock(int pid, void *reserve) {
    if (BAD_ARGS(pid, reserve)) return ACL_ERROR_INVALID_PARAM;
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    pthread_mutex_lock(&g_snap);
    struct faults f;
    read_faults(&f);
    int32_t rc = ACL_SUCCESS;
    int st = get_state();
    if ((st != ST_LOCKED && st != ST_BACKED_UP) || f.unlock) rc = ACL_ERROR_SNAPSHOT_UNLOCK_FAILED;
    else if (st == ST_BACKED_UP) rc = reattach(0, ACL_ERROR_SNAPSHOT_UNLOCK_FAILED);
    if (rc == ACL_SUCCESS) {
        pthread_mutex_lock(&g_mu);
        free_backups();
        g_state = ST_RUNNING;
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
        rc = run_callbacks(NPUSIM_STAGE_UNLOCK_POST);
    }
    pthread_mutex_unlock(&g_snap);
    return rc;
}

__attribute__((visibility("default"))) int rtSnapShotProcessGetState(int *state) {
    if (!state) return ACL_ERROR_RT_PARAM_INVALID;
    if (no_snapshot()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    *state = get_state();
    return 0;
}
