/* libascend_hal.so of the simulated NPU: the driver's user-space API (hal.h).
 *
 * It owns the device connection (a unix socket to the daemon, npusnap_sim/daemon.py: the
 * stand-in for /dev/davinci_manager) and the process's device memory table: plain allocations
 * (halMemAlloc), physical allocations (halMemCreate), reserved virtual ranges (halMemAddressReserve)
 * and the mappings of physical memory into them (halMemMap). Every byte of device memory is a memfd
 * of the daemon; this library maps it and copies (drvMemcpy), as the real driver maps device memory
 * through its SVM module.
 *
 * The driver has no notion of the runtime's snapshot lock: the gate (GLOBAL_STATE_WAIT_IF_LOCKED)
 * lives only in the runtime's API layer (runtime src/runtime/api/api_c*.cc, 17 files; the macro in
 * src/runtime/core/inc/common/global_state_manager.hpp), and the runtime's own driver wrapper that
 * calls drvMemcpy (src/runtime/driver/npu_driver_mem.cc) has none. So drvMemcpy works while the
 * process is LOCKED. Only halProcessResBackup changes what this library does: it drops every
 * mapping of device memory (none may reach a CRIU image, as a real device mapping is VM_IO and not
 * dumped), and until the devices are opened again (Restore or Unlock) copies map for their own
 * duration only.
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

#include "hal.h"
#include "npusim_wire.h"
#include "private_guard.h"
#include "npusnap/timeutil.h"

#define MAX_DEV 64
#define PACE_CHUNK ((uint64_t)1 << 20) /* a paced copy sleeps after each MiB */
#define VMM_GRAN ((uint64_t)2 << 20)   /* the driver's VMM granularity (2 MiB pages) */
/* Reserved virtual ranges live above every device's daemon address range (wire.ADDR_BASE +
 * 64 x ADDR_SPAN), so that a reserved address is never a plain allocation's. Per process. */
#define VMM_BASE ((uint64_t)0x6000 << 32)

enum { R_ALLOC = 0, R_PHYS = 1, R_RESV = 2 };

struct vmap { /* a mapping of physical memory into a reserved range */
    uint64_t va, size, off;
    struct drv_mem_handle *h;
};

struct region {
    int kind;
    int32_t dev;
    uint64_t addr, size; /* R_ALLOC, R_PHYS: the daemon's address; R_RESV: the reserved range */
    char *map;           /* host view while kept (R_ALLOC: memfd mapping; R_RESV: the range) */
    char *was_map;       /* where Backup dropped the kept view: Restore puts it back there */
    void *backup;        /* bytes kept by halProcessResBackup (R_ALLOC, R_PHYS), or NULL */
    struct vmap *maps;   /* R_RESV */
    size_t nmaps, mapcap;
    struct drv_mem_handle *h; /* R_PHYS: its handle */
};

struct drv_mem_handle {
    uint64_t magic;
    struct region *r;
};
#define HANDLE_MAGIC 0x6e7075736d68616eull

/* g_mu guards the table and flags; g_io guards the daemon socket. Lock order: g_io before g_mu. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_io = PTHREAD_MUTEX_INITIALIZER;
static int g_fd = -1;
static int g_open[MAX_DEV];
static struct region **g_regs;
static size_t g_nregs, g_regcap;
static int g_backed_up;       /* between halProcessResBackup and the next device open */
static int g_keep_backup;     /* the last Backup kept the bytes (driver flow or --keep-contents) */
static int g_have_backup;     /* a Backup since the last Restore: the driver refuses Restore without */
static uint64_t g_vmm_next = VMM_BASE;
static double g_link_mbps;    /* the daemon's --bandwidth-mbps, from its last MAP answer */
static double g_file_mbps = -1.0;
static double g_file_read_at = -10.0;
static int g_copying; /* copies in flight that may use kept mappings (g_mu) */
/* The node's faults (NPUSIM_CONFIG_FAULT_* of the daemon's configuration word, read when a device
 * opens), and whether the runtime holds its snapshot lock (npusimHalSnapshotLocked): see
 * docs/simulator.md, "Faults of the node". Both under g_mu. */
static uint64_t g_faults;
static int g_rt_locked;
#ifdef NPUSIM_STRICT_EXPORTS /* "dropcopy" and "untracked" need the runtime's word (hal.h) */
#define FAULT_MASK (NPUSIM_CONFIG_FAULT_MAPNAME | NPUSIM_CONFIG_FAULT_MOVEVMM)
#else
#define FAULT_MASK (NPUSIM_CONFIG_FAULT_MAPNAME | NPUSIM_CONFIG_FAULT_DROPCOPY | NPUSIM_CONFIG_FAULT_MOVEVMM | \
                    NPUSIM_CONFIG_FAULT_UNTRACKED)
#endif
static struct deferred_unmap {
    void *p;
    size_t n;
} *g_deferred;
static size_t g_ndeferred, g_deferred_cap;

/* ---------------------------------------------------------------- helpers */

static uint64_t daemon_config(void);

/* NPUSIM_COPY_MBPS (a per-process fault: a slow link) from the environment, else from
 * NPUSIM_FAULT_FILE, read again at most every 200 ms so that a test can switch it in a running
 * process. */
static double copy_mbps(void) {
    const char *v = getenv("NPUSIM_COPY_MBPS");
    if (v && *v) return atof(v);
    double t = now_s();
    pthread_mutex_lock(&g_mu);
    int stale = t - g_file_read_at > 0.2;
    if (stale) g_file_read_at = t;
    double mbps = g_file_mbps;
    pthread_mutex_unlock(&g_mu);
    if (!stale) return mbps;
    mbps = -1.0;
    const char *path = getenv("NPUSIM_FAULT_FILE");
    FILE *fp = (path && *path) ? fopen(path, "re") : NULL;
    if (fp) {
        char line[256];
        while (fgets(line, sizeof line, fp))
            if (!strncmp(line, "NPUSIM_COPY_MBPS=", 17)) mbps = atof(line + 17);
        fclose(fp);
    }
    pthread_mutex_lock(&g_mu);
    g_file_mbps = mbps;
    pthread_mutex_unlock(&g_mu);
    return mbps;
}

static const char *socket_path(char *buf, size_t len) {
    const char *env = getenv(NPUSIM_SOCKET_ENV);
    if (env && *env) return env;
    uid_t uid = geteuid();
    if (uid == 0) return NPUSIM_SOCKET_ROOT_PATH;
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (xdg && *xdg && stat(xdg, &st) == 0 && S_ISDIR(st.st_mode) && strcmp(xdg, "/tmp") != 0)
        snprintf(buf, len, "%s/" NPUSIM_SOCKET_XDG_SUBDIR "/" NPUSIM_SOCKET_NAME, xdg);
    else
        snprintf(buf, len, NPUSIM_SOCKET_TMP_DIR "/" NPUSIM_SOCKET_NAME, (unsigned)uid);
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

/* One request/response: the daemon status (0 or -errno), or -EPIPE if the connection broke. */
static int io_rpc(uint32_t op, int32_t dev, uint64_t a, uint64_t b, uint64_t n, void *in, size_t inlen,
                  uint64_t *value) {
    if (g_fd < 0) return -ENOTCONN;
    struct npusim_req req = {op, dev, a, b, n};
    struct npusim_resp resp;
    if (write_all(g_fd, &req, sizeof req) != 0 || read_all(g_fd, &resp, sizeof resp) != 0) {
        io_disconnect();
        return -EPIPE;
    }
    if (resp.payload_len) {
        if (!in) { /* protocol error: never leave stray bytes */
            io_disconnect();
            return -EPROTO;
        }
        /* More than the caller takes: read the rest away (dropping the connection would release
         * the process's devices) and say so. */
        uint64_t take = resp.payload_len < inlen ? resp.payload_len : inlen;
        if (read_all(g_fd, in, take) != 0) {
            io_disconnect();
            return -EPIPE;
        }
        for (uint64_t left = resp.payload_len - take; left > 0;) {
            char sink[4096];
            size_t c = left < sizeof sink ? (size_t)left : sizeof sink;
            if (read_all(g_fd, sink, c) != 0) {
                io_disconnect();
                return -EPIPE;
            }
            left -= c;
        }
        if (take < inlen) ((char *)in)[take] = '\0';
        if (take < resp.payload_len) return -EOVERFLOW;
    }
    if (value) *value = resp.value;
    return resp.status;
}

/* NPUSIM_OP_MAP: the memfd holding [addr, addr+n) of the caller's allocation (SCM_RIGHTS) and the
 * allocation's extent. Returns 0 or -errno. */
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
    if (!bad && resp.status == 0 && (fd < 0 || resp.payload_len != sizeof *m)) bad = 1;
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

static drvError_t status_to_drv(int st) {
    switch (st) {
    case 0: return DRV_ERROR_NONE;
    case -ENOMEM: return DRV_ERROR_OUT_OF_MEMORY;
    case -EBUSY: return DRV_ERROR_SERVER_BUSY;
    case -ENODEV: return DRV_ERROR_INVALID_DEVICE;
    case -EINVAL:
    case -EPERM:
    case -EEXIST: return DRV_ERROR_INVALID_VALUE;
    default: return DRV_ERROR_INNER_ERR; /* daemon gone or protocol broken */
    }
}

/* ---------------------------------------------------------------- the table (g_mu held) */

static int add_region(struct region *r) {
    if (g_nregs == g_regcap) {
        size_t cap = g_regcap ? g_regcap * 2 : 64;
        struct region **p = realloc(g_regs, cap * sizeof *p);
        if (!p) return -1;
        g_regs = p;
        g_regcap = cap;
    }
    g_regs[g_nregs++] = r;
    return 0;
}

static void defer_unmap(void *p, size_t n) {
    if (g_ndeferred == g_deferred_cap) {
        size_t cap = g_deferred_cap ? 2 * g_deferred_cap : 16;
        struct deferred_unmap *d = realloc(g_deferred, cap * sizeof *d);
        if (!d) return; /* no memory to remember it: leak the mapping rather than pull it from a copy */
        g_deferred = d;
        g_deferred_cap = cap;
    }
    g_deferred[g_ndeferred++] = (struct deferred_unmap){p, n};
}

/* Drop a region's host view; while a copy of another thread may use it, later. */
static void unmap_region(struct region *r) {
    if (!r->map) return;
    if (g_copying) defer_unmap(r->map, r->size);
    else munmap(r->map, r->size);
    r->map = NULL;
}

static void flush_deferred_unmaps(void) {
    for (size_t i = 0; i < g_ndeferred; i++) munmap(g_deferred[i].p, g_deferred[i].n);
    g_ndeferred = 0;
}

static void free_region(struct region *r) {
    unmap_region(r);
    free(r->backup);
    free(r->maps);
    if (r->h) r->h->magic = 0, free(r->h);
    free(r);
}

static void remove_region_at(size_t i) {
    free_region(g_regs[i]);
    g_regs[i] = g_regs[--g_nregs];
}

static struct region *find_kind(uint64_t addr, int kind) {
    for (size_t i = 0; i < g_nregs; i++)
        if (g_regs[i]->kind == kind && g_regs[i]->addr == addr) return g_regs[i];
    return NULL;
}

/* The addressable region (a plain allocation or a reserved range) holding [addr, addr+n). */
static struct region *find_range(uint64_t addr, uint64_t n) {
    for (size_t i = 0; i < g_nregs; i++) {
        struct region *r = g_regs[i];
        if (r->kind == R_PHYS) continue;
        if (addr >= r->addr && n <= r->size && addr - r->addr <= r->size - n) return r;
    }
    return NULL;
}

/* Whether [addr, addr+n) of a reserved range is backed by mappings throughout. */
static int resv_covered(const struct region *r, uint64_t addr, uint64_t n) {
    uint64_t covered = 0;
    for (size_t i = 0; i < r->nmaps; i++) {
        const struct vmap *m = &r->maps[i];
        uint64_t lo = m->va > addr ? m->va : addr;
        uint64_t hi = m->va + m->size < addr + n ? m->va + m->size : addr + n;
        if (hi > lo) covered += hi - lo;
    }
    return covered == n;
}

/* ---------------------------------------------------------------- host views (g_io held) */

/* Map `size` bytes at `off` of the memfd of the daemon allocation at `daddr` (of `dsize` bytes) to
 * `at` (MAP_FIXED when at != NULL). Returns the mapping or MAP_FAILED (`*st` the status). */
static char *map_daemon(uint64_t daddr, uint64_t dsize, uint64_t off, uint64_t size, void *at, int populate,
                        int *st) {
    struct npusim_map info;
    int fd = -1;
    *st = io_map_fd(daddr, dsize, &info, &fd);
    if (*st != 0) return MAP_FAILED;
    g_link_mbps = info.link_mbps;
    if (info.base != daddr || info.size != dsize) { /* the daemon's view of it is not ours */
        close(fd);
        *st = -EPROTO;
        return MAP_FAILED;
    }
    int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0) | (at ? MAP_FIXED : 0);
    void *v = mmap(at, size, PROT_READ | PROT_WRITE, flags, fd, (off_t)off);
    close(fd);
    if (v == MAP_FAILED) {
        *st = -ENOMEM;
        return MAP_FAILED;
    }
    /* As a device mapping: not inherited by a fork, not in a core dump. */
    madvise(v, size, MADV_DONTFORK);
    madvise(v, size, MADV_DONTDUMP);
    return v;
}

/* A host view of a whole region (g_io held): a mapping of its memfd, or for a reserved range an
 * inaccessible reservation with each mapped piece of physical memory placed at its offset. At
 * `at` when not NULL and free there (-EEXIST when it is not), anywhere otherwise. */
static int build_view(struct region *r, int populate, char *at, char **out) {
    int st = 0;
    char *v = NULL;
    if (at) { /* claim the range first, never over a mapping of someone else's */
        v = mmap(at, r->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (v != at) {
            if (v != MAP_FAILED) munmap(v, r->size); /* a kernel without MAP_FIXED_NOREPLACE */
            return -EEXIST;
        }
    }
    if (r->kind == R_ALLOC) {
        char *m = map_daemon(r->addr, r->size, 0, r->size, v, populate, &st);
        if (m == MAP_FAILED) {
            if (v) munmap(v, r->size);
            return st;
        }
        *out = m;
        return 0;
    }
    if (!v) v = mmap(NULL, r->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (v == MAP_FAILED) return -ENOMEM;
    madvise(v, r->size, MADV_DONTFORK);
    madvise(v, r->size, MADV_DONTDUMP);
    for (size_t i = 0; i < r->nmaps && st == 0; i++) {
        struct vmap *m = &r->maps[i];
        if (map_daemon(m->h->r->addr, m->h->r->size, m->off, m->size, v + (m->va - r->addr), 0, &st) == MAP_FAILED)
            break;
    }
    if (st != 0) {
        munmap(v, r->size);
        return st;
    }
    *out = v;
    return 0;
}

/* Page tables for [p, p + n) a copy is about to write, in one call (Linux 5.14+). */
static void populate_write(char *p, uint64_t n) {
#ifdef MADV_POPULATE_WRITE
    if (n < ((uint64_t)1 << 20)) return;
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)p & ~(pg - 1), hi = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
    madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
#else
    (void)p, (void)n;
#endif
}

/* The host address of device address `addr` for n bytes (g_io held). Kept mappings are reused and
 * kept; after halProcessResBackup the view is made for this copy only (`*tbase`/`*tlen` to unmap).
 * Returns 0, -EINVAL (not device memory, or a hole of a reserved range), or a daemon status. */
static int dev_ptr(uint64_t addr, uint64_t n, int write, char **p, char **tbase, size_t *tlen) {
    *tbase = NULL;
    pthread_mutex_lock(&g_mu);
    struct region *r = find_range(addr, n);
    int ok = r && (r->kind != R_RESV || resv_covered(r, addr, n));
    char *m = ok ? r->map : NULL;
    int keep = !g_backed_up;
    pthread_mutex_unlock(&g_mu);
    if (!ok) return -EINVAL;
    if (!m) {
        int st = build_view(r, n >= r->size / 2, NULL, &m);
        if (st != 0) return st;
        if (keep) {
            pthread_mutex_lock(&g_mu);
            r->map = m; /* every change of the table holds g_io too: r is still there */
            pthread_mutex_unlock(&g_mu);
        } else {
            *tbase = m;
            *tlen = r->size;
        }
    }
    if (write) populate_write(m + (addr - r->addr), n);
    *p = m + (addr - r->addr);
    return 0;
}

static int is_device(uint64_t addr) {
    pthread_mutex_lock(&g_mu);
    struct region *r = find_range(addr, 1);
    pthread_mutex_unlock(&g_mu);
    return r != NULL;
}

static double pace_mbps(void) {
    double a = copy_mbps(), b = g_link_mbps;
    if (a > 0 && b > 0) return a < b ? a : b;
    return a > 0 ? a : (b > 0 ? b : 0.0);
}

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

/* A copy or fill with device memory on one side or both; `src` NULL fills with `value`. g_io is
 * held while mapping and let go while the bytes move at memory speed, so that copies of several
 * threads (and the engine's) run at once; a paced copy keeps it (the modelled link is shared). */
static drvError_t transfer(uint64_t dst, uint64_t src, uint64_t n, int fill, uint8_t value) {
    int ddev = is_device(dst), sdev = !fill && is_device(src);
    if (!ddev && !sdev) return DRV_ERROR_INVALID_VALUE; /* host to host is not the driver's */
    char *dp = (char *)(uintptr_t)dst, *sp = (char *)(uintptr_t)src;
    char *b1 = NULL, *b2 = NULL;
    size_t l1 = 0, l2 = 0;
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    g_copying++;
    pthread_mutex_unlock(&g_mu);
    int st = 0;
    if (ddev) st = dev_ptr(dst, n, 1, &dp, &b1, &l1);
    if (st == 0 && sdev) st = dev_ptr(src, n, 0, &sp, &b2, &l2);
    double mbps = fill ? 0.0 : pace_mbps();
    /* The fault "dropcopy": a copy from the device to the host while the runtime is locked moves
     * only its first half and reports success, as a driver whose DMA engine is stopped with the
     * runtime's task schedulers would when it returns before the transfer drained. The copy's
     * tail in host memory keeps what it held before. */
    uint64_t moved = n;
    pthread_mutex_lock(&g_mu);
    if ((g_faults & NPUSIM_CONFIG_FAULT_DROPCOPY) && g_rt_locked && sdev && !ddev && n >= 8192)
        moved = (n / 2) & ~(uint64_t)4095;
    pthread_mutex_unlock(&g_mu);
    int unlocked = mbps <= 0;
    if (unlocked) pthread_mutex_unlock(&g_io);
    if (st == 0) {
        if (fill) memset(dp, value, n);
        else paced_move(dp, sp, moved, mbps);
    }
    if (b1) munmap(b1, l1);
    if (b2) munmap(b2, l2);
    if (unlocked) pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    if (--g_copying == 0) flush_deferred_unmaps();
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
    return st == -EINVAL ? DRV_ERROR_INVALID_VALUE : status_to_drv(st);
}

/* ---------------------------------------------------------------- devices */

drvError_t halDeviceOpen(uint32_t devid, halDevOpenIn *in, halDevOpenOut *out) {
    (void)in, (void)out;
    if (devid >= MAX_DEV) return DRV_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_io);
    drvError_t rc;
    if (io_connect() != 0) rc = DRV_ERROR_NO_DEVICE;
    else rc = status_to_drv(io_rpc(NPUSIM_OP_CLAIM, (int32_t)devid, 0, 0, 0, NULL, 0, NULL));
    uint64_t faults = rc == DRV_ERROR_NONE ? daemon_config() & FAULT_MASK : 0;
    pthread_mutex_lock(&g_mu);
    if (rc == DRV_ERROR_NONE) {
        g_faults = faults;
        g_open[devid] = 1;
        g_backed_up = 0; /* the device is open again: mappings may be kept */
    }
    int any = 0;
    for (int d = 0; d < MAX_DEV; d++) any |= g_open[d];
    pthread_mutex_unlock(&g_mu);
    if (!any) io_disconnect();
    pthread_mutex_unlock(&g_io);
    return rc;
}

/* Closing a device releases what the process holds on it (the daemon frees it). */
drvError_t halDeviceClose(uint32_t devid, halDevCloseIn *in) {
    (void)in;
    if (devid >= MAX_DEV) return DRV_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_io);
    int st = io_rpc(NPUSIM_OP_RELEASE, (int32_t)devid, 0, 0, 0, NULL, 0, NULL);
    pthread_mutex_lock(&g_mu);
    /* Mappings of its physical memory in reserved ranges go first, then its memory. */
    for (size_t i = 0; i < g_nregs; i++) {
        struct region *r = g_regs[i];
        if (r->kind != R_RESV) continue;
        size_t k = 0;
        for (size_t j = 0; j < r->nmaps; j++)
            if (r->maps[j].h->r->dev != (int32_t)devid) r->maps[k++] = r->maps[j];
        if (k != r->nmaps) unmap_region(r);
        r->nmaps = k;
    }
    for (size_t i = 0; i < g_nregs;) {
        if (g_regs[i]->dev == (int32_t)devid && g_regs[i]->kind != R_RESV) remove_region_at(i);
        else i++;
    }
    g_open[devid] = 0;
    int any = 0;
    for (int d = 0; d < MAX_DEV; d++) any |= g_open[d];
    pthread_mutex_unlock(&g_mu);
    if (!any) io_disconnect();
    pthread_mutex_unlock(&g_io);
    return st == 0 || st == -ENOTCONN ? DRV_ERROR_NONE : status_to_drv(st);
}

/* ---------------------------------------------------------------- plain device memory */

static drvError_t daemon_alloc(int32_t dev, uint64_t size, int kind, struct region **out) {
    struct region *r = calloc(1, sizeof *r);
    if (!r) return DRV_ERROR_OUT_OF_MEMORY;
    uint64_t addr = 0;
    pthread_mutex_lock(&g_io);
    drvError_t rc = status_to_drv(io_rpc(NPUSIM_OP_ALLOC, dev, 0, 0, size, NULL, 0, &addr));
    if (rc == DRV_ERROR_NONE) {
        *r = (struct region){.kind = kind, .dev = dev, .addr = addr, .size = size};
        pthread_mutex_lock(&g_mu);
        if (add_region(r) != 0) rc = DRV_ERROR_OUT_OF_MEMORY;
        pthread_mutex_unlock(&g_mu);
        if (rc != DRV_ERROR_NONE) io_rpc(NPUSIM_OP_FREE, dev, addr, 0, 0, NULL, 0, NULL);
    }
    pthread_mutex_unlock(&g_io);
    if (rc != DRV_ERROR_NONE) free(r);
    else *out = r;
    return rc;
}

/* halMemAlloc's work, also reached by npusimHalMemAllocHuge without passing the exported name. */
static drvError_t plain_alloc(void **pp, unsigned long long size, unsigned long long flag) {
    if (!pp || size == 0) return DRV_ERROR_INVALID_VALUE;
    int32_t dev = (int32_t)(flag & MEM_DEVID_MASK);
    if (dev >= MAX_DEV) return DRV_ERROR_INVALID_DEVICE;
    struct region *r;
    drvError_t rc = daemon_alloc(dev, size, R_ALLOC, &r);
    if (rc == DRV_ERROR_NONE) *pp = (void *)(uintptr_t)r->addr;
    return rc;
}

drvError_t halMemAlloc(void **pp, unsigned long long size, unsigned long long flag) {
    return plain_alloc(pp, size, flag);
}

#ifndef NPUSIM_STRICT_EXPORTS
/* The simulator's stand-in for a driver entry point that allocates device memory without going
 * through halMemAlloc (older drivers' huge-page allocators, a newer driver's allocation call): the
 * runtime uses it only on a node with the fault "untracked" (npusimHalNodeFaults), for
 * ACL_MEM_MALLOC_HUGE_ONLY. The memory is the same as halMemAlloc's and halMemFree frees it; what
 * differs is that an interposer of halMemAlloc never sees it. */
drvError_t npusimHalMemAllocHuge(void **pp, unsigned long long size, unsigned long long flag) {
    NPUSIM_PRIVATE();
    return plain_alloc(pp, size, flag);
}

/* The node's faults, as the daemon's configuration word had them when a device was opened. */
unsigned long long npusimHalNodeFaults(void) {
    NPUSIM_PRIVATE();
    pthread_mutex_lock(&g_mu);
    uint64_t f = g_faults;
    pthread_mutex_unlock(&g_mu);
    return f;
}

/* The runtime says when its snapshot lock is held (LOCKED or BACKED_UP) and when not: a real
 * driver learns it as the runtime stops and starts its task schedulers. Only the fault
 * "dropcopy" looks at it. */
void npusimHalSnapshotLocked(int locked) {
    NPUSIM_PRIVATE();
    pthread_mutex_lock(&g_mu);
    g_rt_locked = locked;
    pthread_mutex_unlock(&g_mu);
}
#endif

static drvError_t daemon_free(uint64_t addr, int kind) {
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    struct region *r = find_kind(addr, kind);
    int32_t dev = r ? r->dev : -1;
    pthread_mutex_unlock(&g_mu);
    drvError_t rc = DRV_ERROR_INVALID_VALUE;
    if (r) {
        rc = status_to_drv(io_rpc(NPUSIM_OP_FREE, dev, addr, 0, 0, NULL, 0, NULL));
        if (rc == DRV_ERROR_NONE) {
            pthread_mutex_lock(&g_mu);
            for (size_t i = 0; i < g_nregs; i++)
                if (g_regs[i] == r) {
                    remove_region_at(i);
                    break;
                }
            pthread_mutex_unlock(&g_mu);
        }
    }
    pthread_mutex_unlock(&g_io);
    return rc;
}

drvError_t halMemFree(void *pp) {
    if (!pp) return DRV_ERROR_INVALID_VALUE;
    return daemon_free((uint64_t)(uintptr_t)pp, R_ALLOC);
}

/* Either side may be device memory (the SVM address space holds both); host to host is refused. */
drvError_t drvMemcpy(DVdeviceptr dst, size_t destMax, DVdeviceptr src, size_t ByteCount) {
    if (!dst || !src || ByteCount > destMax) return DRV_ERROR_INVALID_VALUE;
    if (ByteCount == 0) return DRV_ERROR_NONE;
    return transfer(dst, src, ByteCount, 0, 0);
}

drvError_t drvMemsetD8(DVdeviceptr dst, size_t destMax, uint8_t value, size_t num) {
    if (!dst || num > destMax) return DRV_ERROR_INVALID_VALUE;
    if (num == 0) return DRV_ERROR_NONE;
    if (!is_device(dst)) return DRV_ERROR_INVALID_VALUE;
    return transfer(dst, 0, num, 1, value);
}

/* The address behind device address `vptr` as the device's cores reach it. In the simulation the
 * cores are threads of this process, so it is a host address in the region's view (kept until the
 * region is freed, unmapped, or Backup drops the views); refused after halProcessResBackup. */
drvError_t drvMemAddressTranslate(DVdeviceptr vptr, UINT64 *pptr) {
    if (!pptr) return DRV_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    int backed = g_backed_up;
    pthread_mutex_unlock(&g_mu);
    if (backed) return DRV_ERROR_OPER_NOT_PERMITTED;
    pthread_mutex_lock(&g_io);
    char *p, *tb;
    size_t tl;
    int st = dev_ptr(vptr, 1, 0, &p, &tb, &tl);
    pthread_mutex_unlock(&g_io);
    if (st != 0) return st == -EINVAL ? DRV_ERROR_INVALID_VALUE : status_to_drv(st);
    *pptr = (UINT64)(uintptr_t)p;
    return DRV_ERROR_NONE;
}

/* The device behind logical id ``logical`` in a status answer's "caller_devices", or -1. */
static long caller_device(const char *buf, unsigned logical) {
    const char *key = "\"caller_devices\": [";
    const char *p = strstr(buf, key);
    if (!p) return -1;
    p += strlen(key);
    for (unsigned i = 0; *p && *p != ']'; i++) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) return -1;
        if (i == logical) return v;
        p = end;
        while (*p == ',' || *p == ' ') p++;
    }
    return -1;
}

/* Device memory totals from the daemon's status (its JSON: "id": N, "capacity": C, "used": U) of
 * the device that logical id ``device`` reaches for this process. */
drvError_t halMemGetInfo(unsigned int device, unsigned int type, void *info) {
    if (!info || type != NPUSIM_MEM_INFO_TYPE_PHY_INFO || device >= MAX_DEV) return DRV_ERROR_INVALID_VALUE;
    static char buf[1 << 16];
    pthread_mutex_lock(&g_io);
    int st = io_rpc(NPUSIM_OP_STATUS, -1, 0, 0, 0, buf, sizeof buf - 1, NULL);
    drvError_t rc = status_to_drv(st);
    unsigned long long cap = 0, used = 0;
    if (rc == DRV_ERROR_NONE) {
        char key[48];
        long phys = caller_device(buf, device);
        snprintf(key, sizeof key, "{\"id\": %ld, \"capacity\": ", phys);
        const char *p = phys >= 0 ? strstr(buf, key) : NULL;
        if (!p || sscanf(p + strlen(key), "%llu, \"used\": %llu", &cap, &used) != 2) rc = DRV_ERROR_INVALID_DEVICE;
    }
    pthread_mutex_unlock(&g_io);
    if (rc == DRV_ERROR_NONE) {
        struct MemPhyInfo *m = info;
        m->total = cap;
        m->free = cap > used ? cap - used : 0;
        m->huge_total = m->total;
        m->huge_free = m->free;
    }
    return rc;
}

/* The number of devices this process sees: those of its container (the device nodes its mount
 * namespace holds, numbered from 0 in physical order; driver src/sdk_driver/pbl/uda/uda_access.c,
 * devdrv_manager_get_devnum -> uda_get_cur_ns_dev_num), which the daemon answers as
 * "caller_devices". */
drvError_t drvGetDevNum(uint32_t *num_dev) {
    if (!num_dev) return DRV_ERROR_INVALID_VALUE;
    static char buf[1 << 16];
    pthread_mutex_lock(&g_io);
    int had = g_fd >= 0;
    drvError_t rc = io_connect() == 0 ? DRV_ERROR_NONE : DRV_ERROR_NO_DEVICE;
    if (rc == DRV_ERROR_NONE) rc = status_to_drv(io_rpc(NPUSIM_OP_STATUS, -1, 0, 0, 0, buf, sizeof buf - 1, NULL));
    uint32_t n = 0;
    const char *p = rc == DRV_ERROR_NONE ? strstr(buf, "\"caller_devices\": [") : NULL;
    if (p) {
        p += strlen("\"caller_devices\": [");
        for (; *p && *p != ']'; p++)
            if (*p >= '0' && *p <= '9' && (p[1] < '0' || p[1] > '9')) n++;
    } else if (rc == DRV_ERROR_NONE) {
        rc = DRV_ERROR_NO_DEVICE;
    }
    pthread_mutex_lock(&g_mu);
    int any = 0;
    for (int d = 0; d < MAX_DEV; d++) any |= g_open[d];
    pthread_mutex_unlock(&g_mu);
    if (!had && !any) io_disconnect(); /* a query opens no device */
    pthread_mutex_unlock(&g_io);
    if (rc == DRV_ERROR_NONE) *num_dev = n;
    return rc;
}

/* ---------------------------------------------------------------- VMM (svm/v3 api/master/svm_vmm.c) */

/* The VMM granularity: 2 MiB for normal and huge pages (svm_vmm.c, VMM_ALLOC_GRANULARITY_2M);
 * option MEM_ALLOC_GRANULARITY_MINIMUM 0 or RECOMMENDED 1. */
drvError_t halMemGetAllocationGranularity(const struct drv_mem_prop *prop, int option, size_t *granularity) {
    if (!prop || !granularity || option < 0 || option > 1 || prop->pg_type > 1) return DRV_ERROR_INVALID_VALUE;
    *granularity = VMM_GRAN;
    return DRV_ERROR_NONE;
}

/* The driver (cann/driver src/ascend_hal/svm/v3/api/master/svm_vmm.c, halMemAddressReserve and
 * vmm_address_reserve_para_check) checks only ptr, size != 0 and the page type in the flag's low byte
 * (normal 0, huge 1, giant 2); it does not refuse a size that is no multiple of the granularity but
 * asks its VA allocator for the range at the page type's alignment (vmm_get_va_align: 2 MiB, 1 GiB
 * from 1 GiB up), so a small reserve, such as torch_npu's 512-byte probe of expandable segments
 * with flags=1, takes whole granules. */
drvError_t halMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr, uint64_t flag) {
    if (!ptr || size == 0 || (flag & 0xFF) > 2 || size > UINT64_MAX - VMM_GRAN) return DRV_ERROR_INVALID_VALUE;
    size = (size + VMM_GRAN - 1) & ~(VMM_GRAN - 1);
    uint64_t align = alignment > VMM_GRAN ? alignment : VMM_GRAN;
    if (size >= ((uint64_t)1 << 30) && align < ((uint64_t)1 << 30)) align = (uint64_t)1 << 30;
    if (align & (align - 1)) return DRV_ERROR_INVALID_VALUE;
    struct region *r = calloc(1, sizeof *r);
    if (!r) return DRV_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    uint64_t want = (uint64_t)(uintptr_t)addr, at = 0;
    if (want && want % align == 0 && want >= VMM_BASE) {
        at = want; /* the address asked for, when free */
        for (size_t i = 0; i < g_nregs && at; i++)
            if (g_regs[i]->kind == R_RESV && want < g_regs[i]->addr + g_regs[i]->size && g_regs[i]->addr < want + size)
                at = 0;
    }
    if (!at) {
        at = (g_vmm_next + align - 1) & ~(align - 1);
        g_vmm_next = at + size;
    } else if (at + size > g_vmm_next) {
        g_vmm_next = at + size;
    }
    *r = (struct region){.kind = R_RESV, .dev = -1, .addr = at, .size = size};
    drvError_t rc = add_region(r) == 0 ? DRV_ERROR_NONE : DRV_ERROR_OUT_OF_MEMORY;
    pthread_mutex_unlock(&g_mu);
    if (rc != DRV_ERROR_NONE) free(r);
    else *ptr = (void *)(uintptr_t)at;
    return rc;
}

drvError_t halMemAddressFree(void *ptr) {
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    drvError_t rc = DRV_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < g_nregs; i++) {
        struct region *r = g_regs[i];
        if (r->kind == R_RESV && r->addr == (uint64_t)(uintptr_t)ptr) {
            /* still mapped: the driver refuses (unmap first) */
            rc = r->nmaps ? DRV_ERROR_OPER_NOT_PERMITTED : DRV_ERROR_NONE;
            if (rc == DRV_ERROR_NONE) remove_region_at(i);
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
    return rc;
}

drvError_t halMemCreate(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop, uint64_t flag) {
    (void)flag;
    if (!handle || !prop || size == 0 || size % VMM_GRAN || prop->devid >= MAX_DEV) return DRV_ERROR_INVALID_VALUE;
    struct drv_mem_handle *h = calloc(1, sizeof *h);
    if (!h) return DRV_ERROR_OUT_OF_MEMORY;
    struct region *r;
    drvError_t rc = daemon_alloc((int32_t)prop->devid, size, R_PHYS, &r);
    if (rc != DRV_ERROR_NONE) {
        free(h);
        return rc;
    }
    pthread_mutex_lock(&g_mu);
    h->magic = HANDLE_MAGIC;
    h->r = r;
    r->h = h;
    pthread_mutex_unlock(&g_mu);
    *handle = h;
    return DRV_ERROR_NONE;
}

static int handle_ok(const struct drv_mem_handle *h) {
    if (!h) return 0;
    for (size_t i = 0; i < g_nregs; i++)
        if (g_regs[i]->kind == R_PHYS && g_regs[i]->h == h) return 1;
    return 0;
}

drvError_t halMemRelease(drv_mem_handle_t *handle) {
    pthread_mutex_lock(&g_mu);
    int ok = handle_ok(handle);
    int mapped = 0;
    for (size_t i = 0; ok && i < g_nregs; i++)
        for (size_t j = 0; g_regs[i]->kind == R_RESV && j < g_regs[i]->nmaps; j++)
            if (g_regs[i]->maps[j].h == handle) mapped = 1;
    uint64_t addr = ok ? handle->r->addr : 0;
    pthread_mutex_unlock(&g_mu);
    if (!ok) return DRV_ERROR_INVALID_HANDLE;
    if (mapped) return DRV_ERROR_OPER_NOT_PERMITTED; /* unmap before release */
    return daemon_free(addr, R_PHYS);
}

drvError_t halMemMap(void *ptr, size_t size, size_t offset, drv_mem_handle_t *handle, uint64_t flag) {
    (void)flag;
    uint64_t va = (uint64_t)(uintptr_t)ptr;
    if (!ptr || size == 0 || size % VMM_GRAN || va % VMM_GRAN || offset % VMM_GRAN) return DRV_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    drvError_t rc = DRV_ERROR_NONE;
    struct region *r = NULL;
    for (size_t i = 0; i < g_nregs && !r; i++)
        if (g_regs[i]->kind == R_RESV && va >= g_regs[i]->addr && size <= g_regs[i]->size &&
            va - g_regs[i]->addr <= g_regs[i]->size - size)
            r = g_regs[i];
    if (!handle_ok(handle)) rc = DRV_ERROR_INVALID_HANDLE;
    else if (!r || offset > handle->r->size || size > handle->r->size - offset) rc = DRV_ERROR_INVALID_VALUE;
    for (size_t j = 0; rc == DRV_ERROR_NONE && j < r->nmaps; j++)
        if (va < r->maps[j].va + r->maps[j].size && r->maps[j].va < va + size) rc = DRV_ERROR_INVALID_VALUE;
    if (rc == DRV_ERROR_NONE && r->nmaps == r->mapcap) {
        size_t cap = r->mapcap ? r->mapcap * 2 : 8;
        struct vmap *m = realloc(r->maps, cap * sizeof *m);
        if (!m) rc = DRV_ERROR_OUT_OF_MEMORY;
        else r->maps = m, r->mapcap = cap;
    }
    char *view = NULL;
    uint64_t paddr = 0, psize = 0;
    if (rc == DRV_ERROR_NONE) {
        r->maps[r->nmaps++] = (struct vmap){va, size, offset, handle};
        view = r->map;
        paddr = handle->r->addr;
        psize = handle->r->size;
    }
    pthread_mutex_unlock(&g_mu);
    if (rc == DRV_ERROR_NONE && view) {
        /* The range has a kept view: place the new piece in it now. */
        int st;
        if (map_daemon(paddr, psize, offset, size, view + (va - r->addr), 0, &st) == MAP_FAILED) {
            pthread_mutex_lock(&g_mu);
            r->nmaps--;
            pthread_mutex_unlock(&g_mu);
            rc = status_to_drv(st);
        }
    }
    pthread_mutex_unlock(&g_io);
    return rc;
}

drvError_t halMemUnmap(void *ptr) {
    uint64_t va = (uint64_t)(uintptr_t)ptr;
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    drvError_t rc = DRV_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < g_nregs && rc != DRV_ERROR_NONE; i++) {
        struct region *r = g_regs[i];
        if (r->kind != R_RESV) continue;
        for (size_t j = 0; j < r->nmaps; j++)
            if (r->maps[j].va == va) {
                if (r->map) {
                    /* The piece becomes a hole again at once (MAP_FIXED replaces it): unmapping
                     * memory that a copy or kernel is still using is the caller's error, as on
                     * the device; the memfd's pages stay the daemon's. */
                    mmap(r->map + (va - r->addr), r->maps[j].size, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
                }
                r->maps[j] = r->maps[--r->nmaps];
                rc = DRV_ERROR_NONE;
                break;
            }
    }
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
    return rc;
}

/* ---------------------------------------------------------------- process snapshot */

static int region_rw(struct region *r, void *host, int write) {
    int st;
    char *v = map_daemon(r->addr, r->size, 0, r->size, NULL, 1, &st);
    if (v == MAP_FAILED) return st;
    double mbps = pace_mbps();
    if (write) paced_move(v, host, r->size, mbps);
    else paced_move(host, v, r->size, mbps);
    munmap(v, r->size);
    return 0;
}

static uint64_t daemon_config(void) {
    uint64_t cfg = 0;
    if (io_rpc(NPUSIM_OP_CONFIG, -1, 0, 0, 0, NULL, 0, &cfg) != 0) cfg = 0;
    return cfg;
}

/* The configuration word over a working connection (g_io held): a connection that broke (the
 * daemon restarted under a CRIU-restored process) is made again once. -1 if none can be made. */
static int64_t daemon_config_connected(void) {
    for (int attempt = 0; attempt < 2; attempt++) {
        if (io_connect() != 0) return -1;
        uint64_t cfg = 0;
        int st = io_rpc(NPUSIM_OP_CONFIG, -1, 0, 0, 0, NULL, 0, &cfg);
        if (st == 0) return (int64_t)cfg;
        if (st != -EPIPE && st != -EPROTO) return -1;
    }
    return -1;
}

/* The driver's part of Backup: no mapping of device memory stays (a CRIU dump follows); with the
 * driver-backed flow (NPUSIM_BACKUP_DEVICE_MEM) or a --keep-contents daemon, the bytes of every
 * allocation are kept in host memory for halProcessResRestore. Repeatable: the last one wins. */
drvError_t halProcessResBackup(halProcResBackupInfo *info) {
    if (!info) return DRV_ERROR_PARA_ERROR;
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    g_backed_up = 1;
    g_have_backup = 1;
    for (size_t i = 0; i < g_nregs; i++) {
        if (g_regs[i]->map) g_regs[i]->was_map = g_regs[i]->map;
        unmap_region(g_regs[i]);
        free(g_regs[i]->backup);
        g_regs[i]->backup = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    uint64_t cfg = daemon_config();
    int keep = (cfg & NPUSIM_CONFIG_KEEP_CONTENTS) || (info->reserve[0] & NPUSIM_BACKUP_DEVICE_MEM);
    drvError_t rc = DRV_ERROR_NONE;
    for (size_t i = 0; keep && i < g_nregs && rc == DRV_ERROR_NONE; i++) {
        struct region *r = g_regs[i]; /* g_io held: the table does not change */
        if (r->kind == R_RESV) continue;
        r->backup = malloc(r->size);
        if (!r->backup || region_rw(r, r->backup, 0) != 0) rc = DRV_ERROR_INNER_ERR;
    }
    pthread_mutex_lock(&g_mu);
    if (rc != DRV_ERROR_NONE)
        for (size_t i = 0; i < g_nregs; i++) free(g_regs[i]->backup), g_regs[i]->backup = NULL;
    g_keep_backup = keep && rc == DRV_ERROR_NONE;
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
    return rc;
}

/* The driver's part of Restore: every open device claimed with no other live process on it (the
 * real Restore needs the device free), and every allocation back at its device address: with the
 * bytes kept by Backup, else filled with the poison pattern (the legacy flow keeps addresses, not
 * contents). Without a previous Backup the driver refuses. */
drvError_t halProcessResRestore(halProcResRestoreInfo *info) {
    if (!info) return DRV_ERROR_PARA_ERROR;
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
    int backed = g_have_backup, keep = g_keep_backup;
    int32_t ids[MAX_DEV];
    int nd = 0;
    for (int d = 0; d < MAX_DEV; d++)
        if (g_open[d]) ids[nd++] = d;
    pthread_mutex_unlock(&g_mu);
    drvError_t rc = backed ? DRV_ERROR_NONE : DRV_ERROR_OPER_NOT_PERMITTED;
    if (rc == DRV_ERROR_NONE && io_connect() != 0) rc = DRV_ERROR_NO_DEVICE;
    for (int d = 0; d < nd && rc == DRV_ERROR_NONE; d++)
        rc = status_to_drv(io_rpc(NPUSIM_OP_CLAIM, ids[d], 0, NPUSIM_CLAIM_EXCLUSIVE, 0, NULL, 0, NULL));
    for (size_t i = 0; i < g_nregs && rc == DRV_ERROR_NONE; i++) {
        struct region *r = g_regs[i];
        if (r->kind == R_RESV) continue;
        if (!keep) {
            rc = status_to_drv(io_rpc(NPUSIM_OP_ALLOC_AT, r->dev, r->addr, NPUSIM_ALLOC_POISON, r->size, NULL, 0, NULL));
        } else if (!r->backup) {
            rc = DRV_ERROR_INNER_ERR;
        } else {
            rc = status_to_drv(io_rpc(NPUSIM_OP_ALLOC_AT, r->dev, r->addr, 0, r->size, NULL, 0, NULL));
            if (rc == DRV_ERROR_NONE && region_rw(r, r->backup, 1) != 0) rc = DRV_ERROR_INNER_ERR;
        }
    }
    /* The fault "movevmm": every reserved range comes back at a new address, with its mappings
     * moved along, as a driver that takes the address of a reservation as a hint at Restore (as
     * aclrtReserveMemAddress does with expectPtr) and finds it taken would give it. The program's
     * pointers into the old range then reach nothing. */
    pthread_mutex_lock(&g_mu);
    int move = rc == DRV_ERROR_NONE && (g_faults & NPUSIM_CONFIG_FAULT_MOVEVMM);
    for (size_t i = 0; move && i < g_nregs; i++) {
        struct region *r = g_regs[i];
        if (r->kind != R_RESV) continue;
        uint64_t at = (g_vmm_next + VMM_GRAN - 1) & ~(VMM_GRAN - 1);
        g_vmm_next = at + r->size;
        for (size_t k = 0; k < r->nmaps; k++) r->maps[k].va = r->maps[k].va - r->addr + at;
        r->addr = at;
        r->was_map = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    /* Device memory comes back at its device addresses, and the process's views of it at the
     * host addresses they had: as mappings of a real device do, and as a program (or CRIU's own
     * tests, comparing /proc/self/maps across a restore) may expect. Where another mapping took
     * the place meanwhile, the view is made anywhere at its first use, as before. */
    for (size_t i = 0; i < g_nregs && rc == DRV_ERROR_NONE; i++) {
        struct region *r = g_regs[i];
        char *m = NULL;
        if (r->was_map && !r->map && build_view(r, 0, r->was_map, &m) == 0) {
            pthread_mutex_lock(&g_mu);
            r->map = m;
            pthread_mutex_unlock(&g_mu);
        }
        r->was_map = NULL;
    }
    pthread_mutex_lock(&g_mu);
    if (rc == DRV_ERROR_NONE) {
        g_backed_up = 0;
        g_have_backup = 0;
        for (size_t i = 0; i < g_nregs; i++) free(g_regs[i]->backup), g_regs[i]->backup = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
    return rc;
}

bool halSupportFeature(uint32_t devId, drvFeature_t type) {
    (void)devId;
    if (type != NPUSIM_FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT) return false;
    pthread_mutex_lock(&g_io);
    int64_t cfg = daemon_config_connected();
    pthread_mutex_unlock(&g_io);
    return cfg >= 0 && (cfg & NPUSIM_CONFIG_DRIVER_SNAPSHOT) != 0;
}

/* The driver's version (the daemon's --driver-version): what the driver-backed flow records at
 * Backup and compares at Restore. */
drvError_t halGetAPIVersion(int *halAPIVersion) {
    if (!halAPIVersion) return DRV_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_io);
    int64_t cfg = daemon_config_connected();
    pthread_mutex_unlock(&g_io);
    if (cfg < 0) return DRV_ERROR_NO_DEVICE;
    *halAPIVersion = (int)((uint64_t)cfg >> 16);
    return DRV_ERROR_NONE;
}

/* ---------------------------------------------------------------- fork */

static void atfork_prepare(void) {
    pthread_mutex_lock(&g_io);
    pthread_mutex_lock(&g_mu);
}

static void atfork_parent(void) {
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
}

/* A forked child owns no device (as with the real driver, which does not survive fork): it must not
 * talk over the parent's connection or believe it holds the parent's memory. Its views of device
 * memory are MADV_DONTFORK: not there. The connection's descriptor stays open in it, unused, as the
 * driver's /dev/davinci* descriptors do in a forked child: fork copies the descriptor table, and the
 * driver's user library keeps the pid that opened a descriptor beside it and opens a new one in
 * another process rather than closing the inherited one (CANN driver,
 * src/ascend_hal/dpa/dp_proc_mng/dp_proc_mng.c: g_dp_proc_mng_fd, g_dp_proc_mng_pid). Closing it
 * would free a number the program may expect to stay taken (CRIU's tty00 test opens a pty slave on
 * the number of the master it just closed). */
static void atfork_child(void) {
    g_fd = -1;
    for (size_t i = 0; i < g_nregs; i++) {
        g_regs[i]->map = NULL;
        free(g_regs[i]->backup);
        free(g_regs[i]->maps);
        if (g_regs[i]->h) g_regs[i]->h->magic = 0;
        free(g_regs[i]);
    }
    g_nregs = 0;
    g_ndeferred = 0;
    g_copying = 0;
    memset(g_open, 0, sizeof g_open);
    g_backed_up = 0;
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_io);
}

__attribute__((constructor)) static void hal_init(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}
