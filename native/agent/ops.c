/* The agent's state logic: the protocol operations, lock ownership, the lease, CRIU-restore
 * detection and the device-memory steps around them.
 *
 * Everything here runs on the agent thread only (requests and ticks are serialised by its
 * loop), so no lock guards this state. No function here takes the GIL: Python hooks are run
 * through hooks_run(), which waits for them with a deadline.
 *
 * Lock ownership is the contract of docs/internals.md ("Lock ownership"). A lease counts the
 * target's run time: a gap between ticks longer than FREEZE_GAP means the whole process was
 * stopped (CRIU, SIGSTOP) and counts as one tick; time spent inside an operation is not silence.
 */
#include "agent_int.h"

#include <npusnap/devmem.h>
#include <npusnap/hcclvirt.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The device-memory part (devmem.c) is optional: called only when linked in. */
#pragma weak npusnap_devmem_save
#pragma weak npusnap_devmem_save_fd
#pragma weak npusnap_devmem_reload_fd
#pragma weak npusnap_devmem_reload
#pragma weak npusnap_devmem_finish
#pragma weak npusnap_devmem_get_info
#pragma weak npusnap_devmem_registered_count
#pragma weak npusnap_devmem_devices
#pragma weak npusnap_devmem_drain
#pragma weak npusnap_devmem_hold_writers
#pragma weak npusnap_devmem_release_writers
#pragma weak npusnap_devmem_last_drain_s
#pragma weak npusnap_devmem_save_since
#pragma weak npusnap_devmem_tracking
#pragma weak npusnap_devmem_plan_next
#pragma weak npusnap_devmem_copy_start
#pragma weak npusnap_devmem_copy_wait
#pragma weak npusnap_devmem_copy_cancel

/* 1: a `lock` that names no owner records none, and then needs no token (the CLI of this branch
 * does not send owners yet). 0: every lock has an owner, "unknown" with the client's pid when it
 * names none (docs/internals.md). Set to 0 once the CLI sends owners and tokens everywhere. */
#ifndef ALLOW_UNOWNED_LOCK
#define ALLOW_UNOWNED_LOCK 0
#endif

#define TICK 0.1
#define FREEZE_GAP 1.0
#define DEVMEM_SAVE_TIMEOUT_MS 10000
static int drain_ms = DEVMEM_SAVE_TIMEOUT_MS; /* of the current lock (its drain_timeout_s) */
#define N_EVENTS 20

static acl_rt rt;
static int rt_found;
static long long start_ticks;
static int restored;        /* CRIU restored this process at least once */
static int restore_pending; /* restored while BACKED_UP and no Restore since */
static int device_restored; /* Restore ran since the save: device memory must be reloaded before Unlock */
static int no_device;       /* this lock found no open device (a launcher): nothing was left locked */

static struct {
    int active;
    double duration, remaining, last, expired_duration;
    char voided[256];
    int frozen_gaps;
} lease;

static struct {
    int set;
    char command[128];
    long long pid;
    char since[32];
    char token[33];
} owner;

static struct {
    char mode[16];      /* "preserve" | "app" | "discard" of the current lock, "" when unlocked */
    int saved;          /* npusnap_devmem_save succeeded and finish has not run */
    char flow[8];       /* "driver" (args != NULL: the runtime and driver keep device memory),
                         * "driver?" (to be tried at Backup), "legacy" (args == NULL), "" */
    char fallback[160]; /* why the driver-backed flow was not used, "" when it was not tried */
    int save_fd;        /* lock's device-memory file (the copies go there, not to host memory) */
    int reload_fd;      /* restore's device-memory file (the copies come back from there) */
    unsigned long long file_bytes; /* what the save wrote into save_fd */
    char file_path[4096]; /* that file's name once the image is published (lock) or as the
                           * restore opened it: a reload without a descriptor (a lease's
                           * rollback after an interrupted restore) opens it by name */
} devmem = {.save_fd = -1, .reload_fd = -1};

/* npusnap's own LOCK_PRE callback (CANN 9.0+): the runtime calls it once per open device inside
 * Lock, which is the real-API way to learn the device ids (the driver holds no /dev/davinciN
 * open). Registered once per process; kept across fork (the runtime's registration is copied
 * into the child with the rest of its memory), so ops_init does not reset it. The runtime may
 * also call it from an application thread that calls Lock itself, hence the mutex. */
#define MAX_CB_DEVICES 64
static struct {
    int tried;
    char state[200]; /* "registered" or "not registered: why" */
    pthread_mutex_t mu;
    int32_t seen[MAX_CB_DEVICES]; /* during the current Lock */
    int n_seen;
    int32_t known[MAX_CB_DEVICES]; /* from the last Lock that reported any */
    int n_known;
} cb = {.mu = PTHREAD_MUTEX_INITIALIZER};

static char events[N_EVENTS][400];
static int n_events;

/* ---- small helpers ----------------------------------------------------------------------- */
static long long read_start_ticks(void) {
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "re");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    p += 2;
    /* fields after the comm: state is field 3; starttime is field 22 -> the 20th from here */
    for (int i = 0; i < 19 && p; i++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    return p ? strtoll(p, NULL, 10) : -1;
}

static double boot_time(void) {
    FILE *f = fopen("/proc/stat", "re");
    if (!f) return -1;
    char line[256];
    double bt = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "btime ", 6) == 0) {
            bt = strtod(line + 6, NULL);
            break;
        }
    }
    fclose(f);
    return bt;
}

void ops_event(const char *fmt, ...) {
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    agent_log("%s", msg);
    char stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
    if (n_events == N_EVENTS) {
        memmove(events[0], events[1], sizeof events[0] * (N_EVENTS - 1));
        n_events--;
    }
    snprintf(events[n_events++], sizeof events[0], "%s %s", stamp, msg);
}

/* The Python hooks of a stage (hooks.c); one that timed out is also an event `status` shows. */
static int run_hooks(const char *stage, sbuf *ran, op_error *e) {
    int rc = hooks_run(stage, ran, e);
    if (rc < 0 && strcmp(e->name, NPUSNAP_ERR_HOOK_TIMEOUT) == 0) ops_event("%s", e->message);
    return rc;
}

void ops_init(void) {
    memset(&lease, 0, sizeof lease);
    memset(&owner, 0, sizeof owner);
    memset(&devmem, 0, sizeof devmem);
    devmem.save_fd = devmem.reload_fd = -1; /* none yet (0 would be stdin) */
    n_events = 0;
    rt_found = 0;
    restored = restore_pending = device_restored = no_device = 0;
    start_ticks = read_start_ticks();
    lease.last = now_s();
}

static acl_rt *runtime(void) {
    if (!rt_found) rt_found = acl_find(&rt) == 0;
    return rt_found ? &rt : NULL;
}

static int state_now(void) {
    acl_rt *r = runtime();
    if (!r) return ST_UNKNOWN;
    int code;
    return acl_state(r, &code);
}

static void sb_state(sbuf *b, int st) {
    const char *name = state_name(st);
    if (name) sb_str(b, name);
    else sb_raw(b, "null");
}

/* ---- lease ------------------------------------------------------------------------------- */
static void lease_grant(double seconds) {
    lease.active = 1;
    lease.duration = lease.remaining = seconds;
    lease.voided[0] = 0;
    lease.last = now_s();
}

static void lease_release(void) {
    lease.active = 0;
    lease.duration = lease.remaining = 0;
}

static void lease_skip_gap(void) { lease.last = now_s(); }

static void lease_json(sbuf *b) {
    sb_raw(b, "{");
    sb_key(b, "active");
    sb_raw(b, lease.active ? "true" : "false");
    sb_key(b, "lease_s");
    if (lease.active) sb_num(b, lease.duration);
    else sb_raw(b, "null");
    sb_key(b, "remaining_s");
    if (lease.active) sb_num(b, (double)(long long)((lease.remaining > 0 ? lease.remaining : 0) * 1000 + 0.5) / 1000);
    else sb_raw(b, "null");
    sb_key(b, "voided_reason");
    sb_str(b, lease.voided[0] ? lease.voided : NULL);
    sb_key(b, "frozen_gaps");
    sb_printf(b, "%d", lease.frozen_gaps);
    sb_raw(b, "}");
}

/* ---- ownership --------------------------------------------------------------------------- */
static void owner_json(sbuf *b) {
    if (!owner.set) {
        sb_raw(b, "null");
        return;
    }
    sb_raw(b, "{");
    sb_key(b, "command");
    sb_str(b, owner.command);
    sb_key(b, "pid");
    sb_printf(b, "%lld", owner.pid);
    sb_key(b, "since");
    sb_str(b, owner.since);
    sb_raw(b, "}");
}

/* "`npusnap dump` (pid 42) since 2026-...Z", as the Python agent words it. */
static void owner_text(char *out, size_t len) {
    snprintf(out, len, "`npusnap %s` (pid %lld) since %s", owner.command, owner.pid, owner.since);
}

static void owner_error(op_error *e, const char *name, const char *message) {
    err_set(e, NPUSNAP_ERRTYPE_STATE, name, 0, "%s", message);
    sb_raw(&e->extra, ",\"owner\":");
    owner_json(&e->extra);
}

/* The host pid, which /proc/self names (`npusnap run --pid-ns` keeps the host's /proc), read
 * without opening a file. */
static long host_pid_now(void) {
    char buf[32];
    ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
    if (n <= 0) return -1;
    buf[n] = 0;
    return strtol(buf, NULL, 10);
}

/* The pid a message asks the user to act on: the host's. getpid() is 1 for init of a
 * `--pid-ns` job, which on the host names another process entirely. */
static int user_pid(void) {
    long v = host_pid_now();
    return v > 0 ? (int)v : (int)getpid();
}

/* 0 if the request may act on the lock; -1 with NOT_OWNER in e otherwise. */
static int check_owner(const char *op, const jval *args, int allow_force, op_error *e) {
    if (!owner.set) return 0;
    char who[256], msg[400];
    owner_text(who, sizeof who);
    const jval *force = json_get(args, "force");
    if (allow_force && force && force->t == J_BOOL && force->b) {
        ops_event("%s forced over the lock of %s", op, who);
        return 0;
    }
    const jval *tok = json_get(args, "token");
    if (tok && tok->t == J_STR && tok->slen == 32) {
        unsigned char diff = 0; /* constant time: the comparison must not leak the token */
        for (int i = 0; i < 32; i++) diff |= (unsigned char)(tok->s[i] ^ owner.token[i]);
        if (!diff) return 0;
    }
    snprintf(msg, sizeof msg, "pid %d is locked by %s; only its owner may %s it", user_pid(), who, op);
    owner_error(e, NPUSNAP_ERR_NOT_OWNER, msg);
    return -1;
}

static int new_token(char out[33]) {
    unsigned char raw[16];
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        got += (size_t)n;
    }
    for (int i = 0; i < 16; i++) snprintf(out + 2 * i, 3, "%02x", raw[i]);
    return 0;
}

static void clear_owner(void) { memset(&owner, 0, sizeof owner); }

/* ---- device memory ----------------------------------------------------------------------- */

/* ,"tracking":{...}: what the agent knows of the job's writes (writes.c), its last saves, and
 * after a file save which of its pieces were left out ("unchanged": a hex bitmap, piece i in bit
 * i % 8 of byte i / 8, pieces in file order). */
static void tracking_json(sbuf *b) {
    npusnap_devmem_tracking_info t;
    npusnap_devmem_tracking(&t);
    sb_raw(b, ",\"tracking\":{");
    sb_printf(b, "\"epoch\":%u,\"app_bytes\":%llu,\"marks_all\":%llu", t.epoch, (unsigned long long)t.app_bytes,
              (unsigned long long)t.marks_all);
    sb_key(b, "all_why");
    sb_str(b, t.all_why[0] ? t.all_why : NULL);
    sb_key(b, "untracked");
    sb_str(b, t.untracked[0] ? t.untracked : NULL);
    sb_raw(b, ",\"lineage\":[");
    for (int i = 0; i < t.nlineage; i++)
        sb_printf(b, "%s[\"%016llx\",%u]", i ? "," : "", (unsigned long long)t.lineage_ids[i], t.lineage_epochs[i]);
    sb_raw(b, "]");
    if (t.save_id && devmem.file_bytes && t.unchanged) {
        sb_printf(b, ",\"save\":{\"id\":\"%016llx\",\"epoch\":%u,\"since_used\":%s,\"pieces\":%zu,\"unchanged\":\"",
                  (unsigned long long)t.save_id, t.save_epoch, t.since_used ? "true" : "false", t.npieces);
        for (size_t i = 0; i < t.npieces; i += 8) {
            unsigned v = 0;
            for (size_t k = 0; k < 8 && i + k < t.npieces; k++) v |= (unsigned)(t.unchanged[i + k] ? 1 : 0) << k;
            sb_printf(b, "%02x", v);
        }
        sb_raw(b, "\"}");
    }
    sb_raw(b, "}");
}

static void devmem_json(sbuf *b) {
    sb_raw(b, "{");
    sb_key(b, "available");
    sb_raw(b, npusnap_devmem_get_info ? "true" : "false");
    sb_key(b, "mode");
    sb_str(b, devmem.mode[0] ? devmem.mode : NULL);
    sb_key(b, "saved");
    sb_raw(b, devmem.saved ? "true" : "false");
    sb_key(b, "flow");
    sb_str(b, devmem.flow[0] ? devmem.flow : NULL);
    if (devmem.file_bytes) {
        sb_key(b, "file_bytes"); /* the copies are in the dump's device-memory file */
        sb_printf(b, "%llu", devmem.file_bytes);
    }
    if (devmem.fallback[0]) {
        sb_key(b, "fallback");
        sb_str(b, devmem.fallback);
    }
    if (npusnap_devmem_registered_count) {
        sb_key(b, "registered");
        sb_printf(b, "%llu", (unsigned long long)npusnap_devmem_registered_count());
    }
    if (npusnap_devmem_devices) {
        int32_t ids[MAX_CB_DEVICES];
        int n = npusnap_devmem_devices(ids, MAX_CB_DEVICES);
        if (n > MAX_CB_DEVICES) n = MAX_CB_DEVICES;
        sb_key(b, "devices");
        sb_raw(b, "[");
        for (int i = 0; i < n; i++) sb_printf(b, i ? ",%d" : "%d", ids[i]);
        sb_raw(b, "]");
    }
    if (npusnap_devmem_get_info) {
        npusnap_devmem_info info;
        memset(&info, 0, sizeof info);
        npusnap_devmem_get_info(&info);
        sb_printf(b,
                  ",\"allocations\":%llu,\"bytes\":%llu,\"saved_bytes\":%llu,\"excluded_bytes\":%llu,"
                  "\"vmm_bytes\":%llu,\"reserved_bytes\":%llu,\"interposed\":%s,\"gate_closed\":%s",
                  (unsigned long long)info.allocations, (unsigned long long)info.bytes,
                  (unsigned long long)info.saved_bytes, (unsigned long long)info.excluded_bytes,
                  (unsigned long long)info.vmm_bytes, (unsigned long long)info.reserved_bytes,
                  info.interposed ? "true" : "false", info.gate_closed ? "true" : "false");
    }
    if (npusnap_devmem_tracking) tracking_json(b);
    sb_raw(b, "}");
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static void devmem_finish(void) {
    if (devmem.saved && npusnap_devmem_finish) npusnap_devmem_finish();
    devmem.saved = 0;
    devmem.mode[0] = 0;
    devmem.file_bytes = 0;
    devmem.file_path[0] = 0;
    close_fd(&devmem.save_fd);
    close_fd(&devmem.reload_fd);
}

/* The device-memory file sent with a lock (where the copies go) or a restore (where they come
 * back from): args "device_memory_file": its name, and its descriptor with the line. Kept
 * (dup) until devmem_finish. */
static int take_devmem_file(const request *r, int *slot, op_error *e) {
    const jval *f = json_get(r->args, "device_memory_file");
    if (!f || f->t != J_STR) return 0;
    if (r->fd < 0) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0,
                "device_memory_file names a file but no file descriptor came with the request (SCM_RIGHTS)");
        return -1;
    }
    if (!npusnap_devmem_save_fd || !npusnap_devmem_reload_fd) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_UNAVAILABLE, 0,
                "this agent has no device-memory part: it cannot use a device-memory file");
        return -1;
    }
    close_fd(slot);
    *slot = fcntl(r->fd, F_DUPFD_CLOEXEC, agent_fd_floor());
    if (*slot < 0) *slot = fcntl(r->fd, F_DUPFD_CLOEXEC, 3);
    if (*slot < 0) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, errno, "cannot keep the device-memory file: %s",
                strerror(errno));
        return -1;
    }
    snprintf(devmem.file_path, sizeof devmem.file_path, "%s", f->s);
    return 0;
}

/* The stream an index of chunks lists (image-format.md, "Device-memory chunks": JSON, "pieces":
 * [[digest, size], ...] in stream order, each piece the file chunks/<digest> beside the index),
 * put together in a memory file; its descriptor, or -1 with err set. The digests are not checked
 * here: this is the reload of a rollback without the restore's descriptor, which reads the
 * image's own file as it is, like the single-file layout. */
static int assemble_index(int idx, char *err, size_t errlen) {
    struct stat st;
    if (fstat(idx, &st) != 0 || st.st_size <= 0 || st.st_size > (64 << 20)) {
        snprintf(err, errlen, "%s: not a device-memory index of a sane size", devmem.file_path);
        return -1;
    }
    char *buf = malloc((size_t)st.st_size);
    jval root;
    memset(&root, 0, sizeof root);
    int out = -1, ok = 0;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", devmem.file_path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    if (!buf || pread(idx, buf, (size_t)st.st_size, 0) != st.st_size) {
        snprintf(err, errlen, "cannot read %s", devmem.file_path);
    } else if (json_parse(buf, (size_t)st.st_size, &root, err, errlen) != 0) {
        /* err says why */
    } else {
        const jval *pieces = json_get(&root, "pieces");
        const jval *fmt = json_get(&root, "format");
        if (!pieces || pieces->t != J_ARR || !fmt || fmt->t != J_STR || strcmp(fmt->s, "npusnap-devmem-chunks") != 0) {
            snprintf(err, errlen, "%s is not a device-memory index", devmem.file_path);
        } else if ((out = agent_fd_high(memfd_create("npusnap-devmem", MFD_CLOEXEC))) < 0) {
            snprintf(err, errlen, "memfd_create: %s", strerror(errno));
        } else {
            ok = 1;
            off_t off = 0;
            for (size_t i = 0; ok && i < pieces->n; i++) {
                const jval *p = &pieces->items[i];
                if (p->t != J_ARR || p->n != 2 || p->items[0].t != J_STR || !p->items[1].is_int ||
                    p->items[1].i < 0 || strchr(p->items[0].s, '/')) {
                    snprintf(err, errlen, "%s: piece %zu is not [digest, size]", devmem.file_path, i);
                    ok = 0;
                    break;
                }
                char path[4200];
                snprintf(path, sizeof path, "%s/chunks/%s", dir, p->items[0].s);
                int c = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
                if (c < 0) {
                    snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
                    ok = 0;
                    break;
                }
                long long n = p->items[1].i;
                off_t from = 0;
                while (ok && n > 0) {
                    char part[1 << 16];
                    ssize_t r = pread(c, part, n < (long long)sizeof part ? (size_t)n : sizeof part, from);
                    ssize_t w = r > 0 ? pwrite(out, part, (size_t)r, off) : -1;
                    if (r <= 0 || w != r) {
                        snprintf(err, errlen, "cannot copy %s: %s", path, r < 0 || w < 0 ? strerror(errno) : "it is short");
                        ok = 0;
                    } else {
                        n -= r;
                        from += r;
                        off += r;
                    }
                }
                close(c);
            }
        }
    }
    json_free(&root);
    free(buf);
    if (!ok && out >= 0) {
        close(out);
        out = -1;
    }
    return out;
}

/* The reload's file: the restore's descriptor, else (the restore was interrupted before it sent
 * one, and a lease or `thaw` rolls back) the file by the name recorded at lock or restore. -1
 * with err set when there is none. */
static int reload_file(char *err, size_t errlen) {
    if (devmem.reload_fd >= 0) return devmem.reload_fd;
    if (!devmem.file_path[0]) {
        snprintf(err, errlen, "the copies are in the image's device-memory file and no file was named");
        return -1;
    }
    int fd = agent_fd_high(open(devmem.file_path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (fd < 0) {
        snprintf(err, errlen, "no descriptor of the image's device-memory file came with the restore, and %s "
                 "cannot be opened: %s (restore the image again, or copy it back there)",
                 devmem.file_path, strerror(errno));
        return -1;
    }
    char first = 0;
    if (pread(fd, &first, 1, 0) == 1 && first == '{') {
        /* An index of chunks (the image's device memory shared with other images of the job):
         * the stream is put together again from them. */
        int memfd = assemble_index(fd, err, errlen);
        close(fd);
        if (memfd < 0) return -1;
        fd = memfd;
    }
    devmem.reload_fd = fd;
    ops_event("reloading device memory from %s (no descriptor came with the restore)", devmem.file_path);
    return devmem.reload_fd;
}

/* After Restore, before Unlock (the runtime's lock still holds every thread of the job): write the
 * saved device memory back. A failure leaves the process LOCKED -- held, never computing on lost
 * memory -- and a later unlock/rollback/`thaw` tries the reload again before it unlocks. */
static int devmem_reload(sbuf *steps, op_error *e) {
    if (!device_restored || !devmem.saved || !npusnap_devmem_reload) return 0;
    char err[512] = "";
    npusnap_devmem_info info;
    memset(&info, 0, sizeof info);
    if (npusnap_devmem_get_info) npusnap_devmem_get_info(&info);
    int rc;
    if (!info.in_file) {
        rc = npusnap_devmem_reload(err, sizeof err);
    } else {
        int fd = reload_file(err, sizeof err);
        rc = fd < 0 ? -ENOENT : npusnap_devmem_reload_fd(fd, err, sizeof err);
    }
    if (rc != 0) {
        ops_event("device memory reload FAILED, the process stays locked (%d): %s", rc, err);
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_RELOAD_FAILED, rc,
                "the runtime was restored but npusnap could not write the job's device memory back: %s; the "
                "process stays locked (`npusnap thaw %d` tries again)",
                err, user_pid());
        return -1;
    }
    device_restored = 0;
    sb_raw(steps, steps->len ? ",\"reload device memory\"" : "\"reload device memory\"");
    return 0;
}

/* After Unlock: drop the copies (they were reloaded before Unlock, or the device kept the memory). */
static int devmem_after_unlock(sbuf *steps, op_error *e) {
    (void)e;
    int had_copy = devmem.saved;
    devmem_finish();
    device_restored = 0;
    no_device = 0;
    if (had_copy) sb_raw(steps, steps->len ? ",\"drop copies\"" : "\"drop copies\"");
    return 0;
}

/* device_memory of an unlock/rollback result: the report and the steps done after Unlock. */
static void devmem_steps_json(sbuf *b, const sbuf *steps) {
    devmem_json(b);
    if (b->oom || !b->len) return;
    b->len--; /* reopen the object: drop its '}' */
    sb_printf(b, ",\"steps\":[%s]}", steps->p ? steps->p : "");
}

/* Start the bookkeeping of a snapshot in `mode`, in the legacy flow until told otherwise. */
static void devmem_begin(const char *mode) {
    snprintf(devmem.mode, sizeof devmem.mode, "%s", mode);
    devmem.saved = 0;
    snprintf(devmem.flow, sizeof devmem.flow, "legacy");
    devmem.fallback[0] = 0;
    device_restored = 0;
}

static int call(const char *what, op_error *e);
/* How long Lock waits for the threads inside an HCCL launch to leave it (they are not held yet:
 * a launch takes microseconds). */
#define HCCL_HOLD_TIMEOUT_S 2.0

/* Unlock after a failed drain or save (nothing of the job ran meanwhile); a failed Unlock is
 * added to e's message with what to do. */
static void unlock_after_failure(op_error *e) {
    op_error again;
    err_init(&again);
    npusnap_hccl_release();
    if (call("Unlock", &again) < 0) {
        ops_event("unlock after a failed lock step FAILED: %s", again.message);
        size_t n = strlen(e->message);
        snprintf(e->message + n, sizeof e->message - n, " -- and Unlock FAILED: %s; run `npusnap thaw %d`",
                 again.message, user_pid());
    }
    err_free(&again);
}

/* After Lock without a copy of npusnap's: the bounded drain of every device the job opened, so
 * that Backup's synchronize (no timeout in CANN) finds them idle. */
static double drain_s; /* of the current lock: its wait for the job's queued work */

static double last_drain_s(void) { return npusnap_devmem_last_drain_s ? npusnap_devmem_last_drain_s() : 0; }

static int devmem_drain(op_error *e, const char *after) {
    if (!npusnap_devmem_drain) return 0;
    char err[512] = "";
    int rc = npusnap_devmem_drain(drain_ms, err, sizeof err);
    drain_s += last_drain_s();
    if (rc != 0) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_BUSY, rc, "the devices did not finish their queued work: %s; %s", err, after);
        return -1;
    }
    return 0;
}

/* After Lock in preserve mode: drain the devices (bounded) and copy the device memory with the
 * driver's copy, which the runtime's lock does not gate. */
/* Seconds the current lock or backup spent copying device memory: reported apart from the
 * runtime's own Lock and Backup, which are short, so that a dump's phase table does not put a
 * multi-second copy under "lock". */
static double copy_s;

static int devmem_save(op_error *e, const char *nothing_locked) {
    if (!npusnap_devmem_save) return 0;
    char err[512] = "";
    int rc;
    double copy_start = now_s();
    const char *where = devmem.save_fd >= 0 ? "into the image's file" : "to host memory";
    if (devmem.save_fd >= 0) {
        uint64_t written = 0;
        rc = npusnap_devmem_save_fd(devmem.save_fd, drain_ms, &written, err, sizeof err);
        devmem.file_bytes = rc == 0 ? (unsigned long long)written : 0;
        close_fd(&devmem.save_fd); /* written: the dump owns the file now */
    } else {
        rc = npusnap_devmem_save(drain_ms, err, sizeof err);
    }
    /* The save drains first: that wait is the job's own work finishing, not the copy. */
    double drained = last_drain_s();
    drain_s += drained;
    copy_s += now_s() - copy_start - drained;
    if (rc != 0) {
        if (rc == -ETIMEDOUT)
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_BUSY, rc, "the devices did not finish their queued work: %s; %s", err,
                    nothing_locked);
        else
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, rc, "could not copy the device memory %s: %s; %s",
                    where, err, nothing_locked);
        return -1;
    }
    devmem.saved = 1;
    return 0;
}

/* ---- npusnap's LOCK_PRE callback --------------------------------------------------------- */
static uint32_t on_lock_pre(int32_t device_id, void *args) {
    (void)args;
    pthread_mutex_lock(&cb.mu);
    int dup = 0;
    for (int i = 0; i < cb.n_seen; i++) dup |= cb.seen[i] == device_id;
    if (!dup && cb.n_seen < MAX_CB_DEVICES) {
        int i = cb.n_seen++;
        for (; i > 0 && cb.seen[i - 1] > device_id; i--) cb.seen[i] = cb.seen[i - 1]; /* sorted */
        cb.seen[i] = device_id;
    }
    pthread_mutex_unlock(&cb.mu);
    return 0; /* non-zero would abort the Lock */
}

static void ensure_lock_pre_callback(acl_rt *a) {
    if (cb.tried) return;
    cb.tried = 1;
    int code = acl_register_callback(a, STAGE_LOCK_PRE, on_lock_pre);
    if (code == 0) {
        snprintf(cb.state, sizeof cb.state, "registered");
    } else { /* 8.5 has no callbacks: the devices then come from elsewhere */
        snprintf(cb.state, sizeof cb.state, "not registered: aclrtSnapShotCallbackRegister failed: %s (%d)",
                 acl_error_name(code), code);
        agent_log("LOCK_PRE callback %s", cb.state);
    }
}

/* The LOCK_PRE callback is registered and saw at least one device at the last Lock. */
static int cb_devices_known(void) {
    pthread_mutex_lock(&cb.mu);
    int known = strcmp(cb.state, "registered") == 0 && cb.n_known > 0;
    pthread_mutex_unlock(&cb.mu);
    return known;
}

static void ids_json(sbuf *b, const int32_t *ids, int n) {
    sb_raw(b, "[");
    for (int i = 0; i < n; i++) sb_printf(b, i ? ",%d" : "%d", ids[i]);
    sb_raw(b, "]");
}

/* ---- errors ------------------------------------------------------------------------------ */
static void acl_err(op_error *e, const char *what, int code) {
    err_set(e, NPUSNAP_ERRTYPE_ACL, acl_error_name(code), code, "%s failed: %s (%d)", what, acl_error_name(code), code);
}

static int call(const char *what, op_error *e) {
    int code = acl_call(&rt, what);
    if (code != 0) {
        acl_err(e, what, code);
        return -1;
    }
    return 0;
}

/* Restore in the flow of the current snapshot (the driver-backed one wants its args again). */
static int call_restore(op_error *e) {
    int flags = strcmp(devmem.flow, "driver") == 0 ? DRIVER_FLOW_FLAGS : -1;
    int code = acl_call_flags(&rt, "Restore", flags);
    if (code != 0) {
        acl_err(e, "Restore", code);
        return -1;
    }
    restore_pending = 0;
    npusnap_hccl_restored(); /* HCCL's RESTORE_POST made every communicator invalid */
    /* CANN's legacy Restore gives the allocations back at their addresses, not their contents:
     * npusnap writes them back before the Unlock that follows (unlock, rollback), still LOCKED --
     * by then the restore command has checked the device-memory file's checksum. */
    device_restored = 1;
    return 0;
}

/* Backup in the flow chosen at Lock. Where the driver-backed flow turns out not to be supported
 * (207000: the driver lacks the feature; 100000: a build that wants NULL args), the runtime does
 * not fall back, so npusnap does: Unlock, its own copy of the device memory, Lock, legacy Backup. */
static int call_backup(op_error *e) {
    if (strcmp(devmem.flow, "driver?") != 0) {
        int flags = strcmp(devmem.flow, "driver") == 0 ? DRIVER_FLOW_FLAGS : -1;
        int code = acl_call_flags(&rt, "Backup", flags);
        if (code != 0) {
            acl_err(e, "Backup", code);
            return -1;
        }
        return 0;
    }
    int code = acl_call_flags(&rt, "Backup", DRIVER_FLOW_FLAGS);
    if (code == 0) {
        snprintf(devmem.flow, sizeof devmem.flow, "driver");
        return 0;
    }
    if (code != ACL_ERROR_RT_FEATURE_NOT_SUPPORT && code != ACL_ERROR_INVALID_PARAM) {
        acl_err(e, "Backup", code);
        return -1;
    }
    snprintf(devmem.fallback, sizeof devmem.fallback, "driver-backed Backup refused with %d (%s)", code,
             acl_error_name(code));
    snprintf(devmem.flow, sizeof devmem.flow, "legacy");
    ops_event("%s: npusnap keeps the device memory itself (legacy flow)", devmem.fallback);
    /* Still LOCKED: the copy is taken now, then the legacy Backup. A failure leaves the process
     * LOCKED for the caller's rollback, as any failed Backup does. */
    if (devmem_save(e, "the process is still locked") < 0) return -1;
    if (call("Backup", e) < 0) return -1;
    return 0;
}

static int need_runtime(op_error *e) {
    if (runtime()) return 0;
    err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_NO_ACL_RUNTIME, 0,
            "the CANN runtime (libacl_rt.so / libascendcl.so) is not loaded in this process");
    return -1;
}

static void hook_error(op_error *e, const char *rolled_back) {
    /* hooks_run filled name/message and the hook/stage/exception extras */
    size_t n = strlen(e->message);
    snprintf(e->message + n, sizeof e->message - n, "; %s", rolled_back);
}

/* Drive the runtime back to `target` without hooks after a hook failed; steps into `steps`. */
static int move_to(int target, sbuf *steps, op_error *e) {
    int current = state_now();
    if (current == target) return 0;
    if (target == ST_RUNNING || (current == ST_BACKED_UP && target == ST_LOCKED)) {
        if (current == ST_BACKED_UP && restore_pending) {
            if (call_restore(e) < 0) return -1;
            sb_raw(steps, steps->len ? ", restore" : "restore");
        }
        sbuf done;
        sb_init(&done);
        int rr = devmem_reload(&done, e);
        sb_free(&done);
        if (rr < 0 || call("Unlock", e) < 0) return -1;
        sb_raw(steps, steps->len ? ", unlock" : "unlock");
        if (target == ST_RUNNING) {
            sbuf done;
            sb_init(&done);
            int rc = devmem_after_unlock(&done, e);
            sb_free(&done);
            if (rc < 0) return -1;
        }
        current = ST_RUNNING;
    }
    if ((target == ST_LOCKED || target == ST_BACKED_UP) && current == ST_RUNNING) {
        if (call("Lock", e) < 0) return -1;
        sb_raw(steps, steps->len ? ", lock" : "lock");
        current = ST_LOCKED;
    }
    if (target == ST_BACKED_UP && current == ST_LOCKED) {
        if (call_backup(e) < 0) return -1;
        sb_raw(steps, steps->len ? ", backup" : "backup");
    }
    return 0;
}

static void abort_after_hook(op_error *e, int before) {
    char msg[600];
    if (before == ST_UNKNOWN) {
        hook_error(e, "snapshot state unknown, not rolled back");
        return;
    }
    sbuf steps;
    sb_init(&steps);
    op_error again;
    err_init(&again);
    if (move_to(before, &steps, &again) < 0) {
        ops_event("rollback after hook failure FAILED: %s", again.message);
        snprintf(msg, sizeof msg, "rollback to %s FAILED: %s", state_name(before), again.message);
    } else {
        if (before == ST_RUNNING) {
            lease_release();
            clear_owner();
        }
        snprintf(msg, sizeof msg, "rolled back to %s (%s)", state_name(before), steps.p ? steps.p : "no change");
    }
    hook_error(e, msg);
    err_free(&again);
    sb_free(&steps);
}

/* ---- results ----------------------------------------------------------------------------- */
static void state_members(sbuf *b) {
    sb_key(b, "state");
    sb_state(b, state_now());
    sb_key(b, "lease");
    lease_json(b);
    sb_key(b, "owner");
    owner_json(b);
}

static void elapsed_member(sbuf *b, double start) {
    sb_key(b, "elapsed_s");
    sb_num(b, (double)(long long)((now_s() - start) * 1e6 + 0.5) / 1e6);
}

static double arg_lease(const jval *args, int *present) {
    const jval *v = json_get(args, "lease_s");
    *present = v && v->t == J_NUM;
    return *present ? v->num : 0;
}

/* ---- CRIU restore detection, the lease tick ---------------------------------------------- */
static void refresh_restored(void) {
    long long now = read_start_ticks();
    if (now < 0 || start_ticks < 0 || now == start_ticks) return;
    start_ticks = now;
    restored = 1;
    int st = state_now();
    restore_pending = st == ST_UNKNOWN || st == ST_BACKED_UP;
    ops_event("process was restored by CRIU (start time changed)");
    if (lease.active) {
        /* The restore command carries on under the same lease: if it dies before Unlock, the
         * lease restores and unlocks this process by itself. Restart it in full. */
        lease_grant(lease.duration);
        ops_event("lease of %gs restarted for the restored process: it rolls back by itself unless "
                  "the restore command finishes or renews it", lease.duration);
    }
}

static int do_rollback(sbuf *res, op_error *e);


void ops_tick(const agent_endpoint *ep) {
    /* The tick opens no descriptor: one opened every 100 ms would, now and then, take the number a
     * program's own open() expected (the lowest free one), and a dump that froze this thread
     * between fopen and fclose of /proc/self/stat would save that fd as /proc/<host pid>/stat,
     * which a restore in a pid namespace of its own (other host pids) cannot open ("Can't open
     * file proc/N/stat on restore"). A CRIU restore shows without one: it makes a new listening
     * socket (another inode) and, in such a namespace, another host pid (a readlink). Only then
     * is the start time read. */
    static long last_host_pid = -1;
    static unsigned long long last_ino;
    long host_pid = host_pid_now();
    unsigned long long ino = ep->ino;
    int moved = (last_ino && ino && ino != last_ino) || (last_host_pid >= 0 && host_pid >= 0 && host_pid != last_host_pid);
    if (ino) last_ino = ino;
    if (host_pid >= 0) last_host_pid = host_pid;
    if (moved) refresh_restored();
    double now = now_s();
    double delta = now - lease.last;
    if (delta < 0) delta = 0;
    lease.last = now;
    if (!lease.active) return;
    if (delta > FREEZE_GAP) {
        lease.frozen_gaps++;
        delta = delta < TICK ? delta : TICK;
    }
    lease.remaining -= delta;
    if (lease.remaining > 0) return;
    lease.expired_duration = lease.duration;
    lease_release();
    ops_event("lease of %gs expired without renew: rolling back by itself", lease.expired_duration);
    sbuf res;
    sb_init(&res);
    op_error e;
    err_init(&e);
    if (do_rollback(&res, &e) == 0) {
        ops_event("lease rollback done: state %s", state_name(state_now()) ? state_name(state_now()) : "unknown");
    } else {
        /* The command first: an event is cut at its buffer's end, and the message can be long. */
        ops_event("lease rollback FAILED, run `npusnap thaw %d`: %s", user_pid(), e.message);
    }
    err_free(&e);
    sb_free(&res);
    lease_skip_gap();
}

/* ---- operations -------------------------------------------------------------------------- */
static void python_or_null(sbuf *b) { python_info_json(b); }

static int op_hello(const request *r, const agent_endpoint *ep, sbuf *res, op_error *e) {
    (void)r;
    (void)e;
    acl_rt *a = runtime();
    sb_key(res, "agent_version");
    sb_str(res, NPUSNAP_VERSION);
    sb_key(res, "agent");
    sb_str(res, "native");
    sb_key(res, "protocol_version");
    sb_printf(res, "%d", PROTOCOL_VERSION);
    sb_key(res, "pid");
    sb_printf(res, "%d", (int)getpid());
    long long ticks = read_start_ticks();
    sb_key(res, "start_time_ticks");
    sb_printf(res, "%lld", ticks);
    sb_key(res, "log");
    if (agent_log_path()) sb_str(res, agent_log_path());
    else sb_raw(res, "null");
    double bt = boot_time();
    sb_key(res, "started_at");
    if (bt >= 0 && ticks >= 0) sb_num(res, bt + (double)ticks / (double)sysconf(_SC_CLK_TCK));
    else sb_raw(res, "null");
    sb_key(res, "restored");
    sb_raw(res, restored ? "true" : "false");
    sb_key(res, "socket");
    sb_str(res, ep->socket);
    sb_key(res, "python");
    python_or_null(res);
    sb_key(res, "acl");
    sb_raw(res, "{");
    sb_key(res, "loaded");
    sb_raw(res, a ? "true" : "false");
    sb_key(res, "library");
    sb_str(res, a ? a->path : NULL);
    sb_key(res, "cann_version");
    sb_str(res, a && a->version[0] ? a->version : NULL);
    /* The runtime maps the program's device ids through this list, read once at its init and
     * kept in process memory (runtime.cc GetVisibleDevices): a restore must reach the same driver
     * ids, which a restore onto other devices (--device-map) cannot promise. */
    sb_key(res, "visible_devices");
    sb_str(res, getenv("ASCEND_RT_VISIBLE_DEVICES"));
    /* The devices: those the interposed aclrtSetDevice saw, else what the runtime can tell. */
    int32_t ids[MAX_CB_DEVICES];
    int n = 0;
    const char *source = NULL;
    npusnap_devmem_info info;
    memset(&info, 0, sizeof info);
    if (npusnap_devmem_get_info) npusnap_devmem_get_info(&info);
    if (info.interposed && npusnap_devmem_devices) n = npusnap_devmem_devices(ids, MAX_CB_DEVICES);
    if (n > 0) {
        source = "aclrtSetDevice (interposed)";
    } else {
        pthread_mutex_lock(&cb.mu);
        n = cb.n_known;
        memcpy(ids, cb.known, sizeof ids[0] * (size_t)n);
        pthread_mutex_unlock(&cb.mu);
        source = n ? "LOCK_PRE callback" : NULL;
    }
    if (n > MAX_CB_DEVICES) n = MAX_CB_DEVICES;
    sb_key(res, "devices");
    ids_json(res, ids, n < 0 ? 0 : n);
    sb_key(res, "devices_source");
    sb_str(res, source);
    sb_key(res, "callback_devices");
    pthread_mutex_lock(&cb.mu);
    ids_json(res, cb.known, cb.n_known);
    pthread_mutex_unlock(&cb.mu);
    sb_raw(res, "}");
    sb_key(res, "hooks");
    hooks_names_json(res);
    sb_key(res, "owner");
    owner_json(res);
    sb_key(res, "device_memory");
    devmem_json(res);
    return 0;
}

/* "hccl": the communicators the agent stands behind (npusnap/hcclvirt.h). */
static void hccl_json(sbuf *res) {
    struct npusnap_hccl_comm_info comms[64];
    size_t n = npusnap_hccl_comms(comms, 64);
    if (n > 64) n = 64;
    sb_key(res, "hccl");
    sb_raw(res, "[");
    for (size_t i = 0; i < n; i++) {
        sb_raw(res, i ? ",{" : "{");
        sb_printf(res, "\"key\":\"%s\",\"rank\":%u,\"nranks\":%u,\"state\":\"%s\",\"collectives\":%llu", comms[i].key,
                  comms[i].rank, comms[i].nranks, comms[i].state, (unsigned long long)comms[i].collectives);
        sb_raw(res, "}");
    }
    sb_raw(res, "]");
}

static int op_hccl_root(const request *r, sbuf *res, op_error *e) {
    const jval *key = json_get(r->args, "key");
    if (!key || key->t != J_STR) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "hccl_root needs a key");
        return -1;
    }
    char root[2 * NPUSNAP_HCCL_ROOT_BYTES + 1], err[256] = "";
    int rc = npusnap_hccl_new_root(key->s, root, err, sizeof err);
    if (rc != 0) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_HCCL_FAILED, rc, "%s", err);
        return -1;
    }
    sb_key(res, "root");
    sb_str(res, root);
    return 0;
}

static int op_hccl_rebuild(const request *r, sbuf *res, op_error *e) {
    const jval *key = json_get(r->args, "key"), *root = json_get(r->args, "root");
    if (!key || key->t != J_STR || !root || root->t != J_STR) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0, "hccl_rebuild needs a key and a root");
        return -1;
    }
    double start = now_s();
    char err[256] = "";
    int rc = npusnap_hccl_rebuild(key->s, root->s, err, sizeof err);
    if (rc != 0) {
        ops_event("HCCL communicator %s NOT rebuilt: %s", key->s, err);
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_HCCL_FAILED, rc, "%s", err);
        return -1;
    }
    ops_event("HCCL communicator %s rebuilt", key->s);
    elapsed_member(res, start);
    return 0;
}

static int op_status(const request *r, sbuf *res, op_error *e) {
    (void)r;
    (void)e;
    state_members(res);
    sb_key(res, "pid");
    sb_printf(res, "%d", (int)getpid());
    sb_key(res, "acl_loaded");
    sb_raw(res, runtime() ? "true" : "false");
    sb_key(res, "restored");
    sb_raw(res, restored ? "true" : "false");
    sb_key(res, "restore_pending");
    sb_raw(res, restore_pending ? "true" : "false");
    sb_key(res, "device_memory");
    devmem_json(res);
    hccl_json(res);
    sb_key(res, "events");
    sb_raw(res, "[");
    int first = n_events > 10 ? n_events - 10 : 0;
    for (int i = first; i < n_events; i++) {
        if (i > first) sb_raw(res, ",");
        sb_str(res, events[i]);
    }
    sb_raw(res, "]");
    return 0;
}

static int op_lock(const request *r, int peer_pid, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0) return -1;
    int st = state_now();
    if (owner.set || (st != ST_RUNNING && st != ST_UNKNOWN)) {
        char who[256], msg[400];
        if (owner.set) owner_text(who, sizeof who);
        else snprintf(who, sizeof who, "no recorded owner (an external Lock)");
        snprintf(msg, sizeof msg, "pid %d is already locked (%s) by %s", user_pid(),
                 st == ST_UNKNOWN ? "state unknown" : state_name(st), who);
        if (owner.set) {
            owner_error(e, NPUSNAP_ERR_ALREADY_LOCKED, msg);
        } else {
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_ALREADY_LOCKED, 0, "%s", msg);
            sb_raw(&e->extra, ",\"owner\":null");
        }
        return -1;
    }
    const jval *dm = json_get(r->args, "device_memory");
    const char *mode = dm && dm->t == J_STR ? dm->s : NPUSNAP_DEVMEM_MODE_DEFAULT;
    const jval *dt = json_get(r->args, "drain_timeout_s");
    drain_ms = dt && dt->t == J_NUM ? (int)(dt->num * 1000 + 0.5) : DEVMEM_SAVE_TIMEOUT_MS;
    if (drain_ms < 1) drain_ms = 1;
    if (take_devmem_file(r, &devmem.save_fd, e) < 0) return -1;
    if (strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) != 0) close_fd(&devmem.save_fd); /* nothing to save */
    if (npusnap_devmem_save_since) {
        /* An incremental save: only what was written since that save of this process's history. */
        const jval *since = json_get(r->args, "device_memory_since");
        const jval *check = json_get(r->args, "device_memory_check_writes");
        uint64_t id = since && since->t == J_STR ? strtoull(since->s, NULL, 16) : 0;
        npusnap_devmem_save_since(id, check && check->t == J_BOOL && check->b);
    }
    if (npusnap_devmem_plan_next) {
        /* --leave-running: only the cut now; the job's memory is copied after Unlock, while it
         * runs (the unlock brings the file). Checked: a full copy now all the same. */
        const jval *cc = json_get(r->args, "device_memory_concurrent");
        const jval *ck = json_get(r->args, "device_memory_check_concurrent");
        int on = cc && cc->t == J_BOOL && cc->b && devmem.save_fd >= 0;
        npusnap_devmem_plan_next(on ? (ck && ck->t == J_BOOL && ck->b ? 2 : 1) : 0);
    }
    double start = now_s();
    double lock_call_s = 0;
    copy_s = 0;
    drain_s = 0;
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_PRE_LOCK, &ran, e) < 0) {
        close_fd(&devmem.save_fd);
        hook_error(e, "nothing was locked");
        sb_free(&ran);
        return -1;
    }
    devmem_begin(mode);
    ensure_lock_pre_callback(&rt);
    pthread_mutex_lock(&cb.mu);
    cb.n_seen = 0;
    pthread_mutex_unlock(&cb.mu);
    /* No thread inside a collective at Lock: each is wholly before or after the snapshot. */
    if (npusnap_hccl_hold(HCCL_HOLD_TIMEOUT_S) < 0)
        ops_event("an HCCL call was still running %gs after the hold: locking anyway", HCCL_HOLD_TIMEOUT_S);
    /* No writer of the job past the runtime's entry check at Lock either: such a call runs to its
     * end after Lock, into the drain and the copy (npusnap_devmem_hold_writers). */
    int inside = npusnap_devmem_hold_writers ? npusnap_devmem_hold_writers(drain_ms) : 0;
    if (inside > 0) {
        npusnap_devmem_release_writers();
        npusnap_hccl_release();
        close_fd(&devmem.save_fd);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_BUSY, 0,
                "%d call(s) of the job that write device memory were still running after %d ms; "
                "nothing was locked",
                inside, drain_ms);
        return -1;
    }
    double lock_call_start = now_s();
    int locked_rc = call("Lock", e);
    lock_call_s = now_s() - lock_call_start;
    if (npusnap_devmem_release_writers) npusnap_devmem_release_writers();
    if (locked_rc < 0) {
        npusnap_hccl_release();
        close_fd(&devmem.save_fd);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        return -1;
    }
    int32_t seen[MAX_CB_DEVICES];
    pthread_mutex_lock(&cb.mu);
    int n_seen = cb.n_seen;
    memcpy(seen, cb.seen, sizeof seen[0] * (size_t)n_seen);
    cb.n_known = n_seen; /* the devices open now (none: a launcher) */
    memcpy(cb.known, seen, sizeof seen[0] * (size_t)n_seen);
    int cb_ok = strcmp(cb.state, "registered") == 0;
    pthread_mutex_unlock(&cb.mu);
    npusnap_devmem_info pre;
    memset(&pre, 0, sizeof pre);
    if (npusnap_devmem_get_info) npusnap_devmem_get_info(&pre);
    no_device = 0;
    if (cb_ok && n_seen == 0 && pre.allocations == 0) {
        /* The runtime calls LOCK_PRE once per open device: none was called, so this process
         * (a launcher that loaded ACL and never opened a device) has nothing to back up, and
         * Backup would refuse it (107002, no context). It is not left locked: it runs on, and the
         * dump takes it as a plain process. */
        if (call("Unlock", e) < 0) {
            sb_free(&ran);
            return -1;
        }
        no_device = 1;
        npusnap_hccl_release();
        close_fd(&devmem.save_fd);
        ops_event("no device open (no LOCK_PRE callback ran): not locked, nothing to back up");
    } else if ((strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) != 0 || acl_may_have_driver_flow(&rt)) &&
               devmem_drain(e, "the process was unlocked and runs on") < 0) {
        unlock_after_failure(e);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        return -1;
    } else if (strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) == 0 && acl_may_have_driver_flow(&rt)) {
        /* The driver-backed flow keeps device memory itself where the driver has the feature;
         * Backup tells (207000 otherwise), and then npusnap takes its own copy, still locked. */
        snprintf(devmem.flow, sizeof devmem.flow, "driver?");
    } else if (strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) == 0 && devmem_save(e, "the process was unlocked and runs on") < 0) {
        /* Nothing of the job ran while it was locked; Unlock gives it back as it was. */
        unlock_after_failure(e);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        return -1;
    }
    const jval *ow = json_get(r->args, "owner");
    if (ow && ow->t != J_OBJ) ow = NULL; /* null: none named */
    if (ow || !ALLOW_UNOWNED_LOCK) {
        const jval *cmd = ow ? json_get(ow, "command") : NULL;
        const jval *pid = ow ? json_get(ow, "pid") : NULL;
        owner.set = 1;
        snprintf(owner.command, sizeof owner.command, "%s", cmd ? cmd->s : "unknown");
        owner.pid = pid ? pid->i : peer_pid;
        time_t now = time(NULL);
        struct tm tm;
        gmtime_r(&now, &tm);
        strftime(owner.since, sizeof owner.since, "%Y-%m-%dT%H:%M:%SZ", &tm);
        if (new_token(owner.token) < 0) {
            /* No randomness: refuse to pretend there is an owner; undo the lock. */
            int saved_errno = errno;
            clear_owner();
            op_error again;
            err_init(&again);
            call("Unlock", &again);
            err_free(&again);
            devmem_finish();
            npusnap_hccl_release();
            err_set(e, NPUSNAP_ERRTYPE_INTERNAL, NPUSNAP_ERR_NO_RANDOM, saved_errno, "getrandom failed: %s; the lock was undone",
                    strerror(saved_errno));
            sb_free(&ran);
            return -1;
        }
    }
    int present;
    double l = arg_lease(r->args, &present);
    if (present) lease_grant(l);
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "runtime_lock_s");
    sb_num(res, lock_call_s);
    sb_key(res, "device_copy_s");
    sb_num(res, copy_s);
    sb_key(res, "drain_s");
    sb_num(res, drain_s);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_key(res, "token");
    sb_str(res, owner.set ? owner.token : NULL);
    sb_key(res, "device_memory");
    devmem_json(res);
    sb_key(res, "callback_devices");
    ids_json(res, seen, n_seen);
    sb_key(res, "callback");
    sb_str(res, cb.state);
    sb_key(res, "no_device");
    sb_raw(res, no_device ? "true" : "false");
    sb_free(&ran);
    return 0;
}

static int op_backup(const request *r, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0 || check_owner("backup", r->args, 0, e) < 0) return -1;
    int before = state_now();
    double start = now_s();
    copy_s = 0;
    drain_s = 0;
    int rc = no_device ? 0 : call_backup(e);
    if (rc < 0 && e->code == ACL_ERROR_RT_CONTEXT_NULL && !cb_devices_known()) {
        /* No active context (a launcher on a runtime without callbacks, so Lock could not tell):
         * nothing to back up. Unlock, and the dump takes it as a plain process. */
        op_error again;
        err_init(&again);
        if (call("Unlock", &again) == 0) {
            err_free(e);
            err_init(e);
            no_device = 1;
            rc = 0;
            ops_event("Backup found no active context (ACL_ERROR_RT_CONTEXT_NULL): no device open, unlocked");
        }
        err_free(&again);
    }
    /* Unused when the driver-backed flow kept the memory: nothing of the image being written
     * may stay open in the process that CRIU saves. */
    close_fd(&devmem.save_fd);
    if (rc < 0) return -1;
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_POST_BACKUP, &ran, e) < 0) {
        abort_after_hook(e, before);
        sb_free(&ran);
        return -1;
    }
    int present;
    double l = arg_lease(r->args, &present);
    if (present) lease_grant(l);
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "device_copy_s");
    sb_num(res, copy_s);
    sb_key(res, "drain_s");
    sb_num(res, drain_s);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_key(res, "device_memory");
    devmem_json(res);
    sb_free(&ran);
    return 0;
}

static int op_renew(const request *r, sbuf *res, op_error *e) {
    if (check_owner("renew", r->args, 0, e) < 0) return -1;
    if (!lease.active) {
        if (lease.voided[0]) err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_NO_LEASE, 0, "%s", lease.voided);
        else
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_NO_LEASE, 0,
                    "no lease is active (it expired, was released, or was never granted)");
        return -1;
    }
    int present;
    double l = arg_lease(r->args, &present);
    lease_grant(present ? l : lease.duration);
    state_members(res);
    return 0;
}

static int op_release(const request *r, sbuf *res, op_error *e) {
    if (check_owner("release", r->args, 0, e) < 0) return -1;
    lease_release();
    state_members(res);
    return 0;
}

static int op_restore(const request *r, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0 || check_owner("restore", r->args, 0, e) < 0) return -1;
    if (npusnap_devmem_copy_cancel) npusnap_devmem_copy_cancel(); /* the dump's plan, not this copy's */
    if (take_devmem_file(r, &devmem.reload_fd, e) < 0) return -1;
    int before = state_now();
    double start = now_s();
    if (!no_device && call_restore(e) < 0) return -1;
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_POST_RESTORE, &ran, e) < 0) {
        abort_after_hook(e, before);
        sb_free(&ran);
        return -1;
    }
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_free(&ran);
    return 0;
}

static int op_unlock(const request *r, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0 || check_owner("unlock", r->args, 1, e) < 0) return -1;
    int before = state_now();
    if (restore_pending && before == ST_BACKED_UP) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_RESTORE_REQUIRED, 0,
                "this process was restored by CRIU and its device state is still backed up: run "
                "`restore` before `unlock`");
        return -1;
    }
    double start = now_s();
    sbuf steps;
    sb_init(&steps);
    const jval *f = json_get(r->args, "device_memory_file");
    if (npusnap_devmem_copy_start) {
        /* A concurrent copy (lock planned it): started before Unlock, so that the job's first
         * writes already find it; without its file the plan is dropped. */
        char err[512] = "";
        if (f && f->t == J_STR && r->fd >= 0) {
            if (npusnap_devmem_copy_start(r->fd, err, sizeof err) < 0) {
                err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, EIO, "%s; still locked", err);
                sb_free(&steps);
                return -1;
            }
            sb_raw(&steps, "\"concurrent copy started\"");
        } else {
            npusnap_devmem_copy_cancel();
        }
    }
    if ((!no_device && devmem_reload(&steps, e) < 0) || (!no_device && call("Unlock", e) < 0)) {
        if (npusnap_devmem_copy_cancel) npusnap_devmem_copy_cancel();
        sb_free(&steps);
        return -1;
    }
    npusnap_hccl_release();
    devmem_after_unlock(&steps, e);
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_POST_UNLOCK, &ran, e) < 0) {
        abort_after_hook(e, before);
        sb_free(&ran);
        sb_free(&steps);
        return -1;
    }
    lease_release();
    clear_owner();
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_key(res, "warnings");
    sb_raw(res, "[]");
    sb_key(res, "device_memory");
    devmem_steps_json(res, &steps);
    sb_free(&ran);
    sb_free(&steps);
    return 0;
}

/* Back to RUNNING from any state. From BACKED_UP, Unlock directly (the device memory is still
 * there) unless this process was CRIU-restored, where Restore must come first. */
static int do_rollback(sbuf *res, op_error *e) {
    if (need_runtime(e) < 0) return -1;
    if (npusnap_devmem_copy_cancel) npusnap_devmem_copy_cancel();
    double start = now_s();
    int before = state_now();
    sbuf actions, warnings, steps;
    sb_init(&actions);
    sb_init(&warnings);
    sb_init(&steps);
    if (before == ST_BACKED_UP && restore_pending) {
        if (call_restore(e) < 0) goto fail;
        sb_raw(&actions, "\"restore\"");
    }
    if ((before == ST_LOCKED || before == ST_BACKED_UP) && devmem_reload(&steps, e) < 0) goto fail;
    if (before == ST_LOCKED || before == ST_BACKED_UP || before == ST_UNKNOWN) {
        int code = acl_call(&rt, "Unlock");
        if (code == 0) {
            sb_raw(&actions, actions.len ? ",\"unlock\"" : "\"unlock\"");
        } else if (before != ST_UNKNOWN) {
            acl_err(e, "Unlock", code);
            goto fail;
        } /* state unknown (no GetState): Unlock from RUNNING fails harmlessly */
    }
    npusnap_hccl_release();
    if (devmem_after_unlock(&steps, e) < 0) goto fail;
    lease_release();
    clear_owner();
    if (actions.len) {
        sbuf ran;
        sb_init(&ran);
        op_error he;
        err_init(&he);
        if (run_hooks(NPUSNAP_HOOK_POST_UNLOCK, &ran, &he) < 0) {
            /* Rollback's job is to get the process running; a hook failure is reported. */
            if (warnings.len) sb_raw(&warnings, ",");
            sb_str(&warnings, he.message);
        }
        err_free(&he);
        sb_free(&ran);
    }
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "actions");
    sb_printf(res, "[%s]", actions.p ? actions.p : "");
    sb_key(res, "before");
    sb_state(res, before);
    sb_key(res, "warnings");
    sb_printf(res, "[%s]", warnings.p ? warnings.p : "");
    sb_key(res, "device_memory");
    devmem_steps_json(res, &steps);
    sb_free(&actions);
    sb_free(&warnings);
    sb_free(&steps);
    return 0;
fail:
    sb_free(&actions);
    sb_free(&warnings);
    sb_free(&steps);
    return -1;
}

static int op_rollback(const request *r, sbuf *res, op_error *e) {
    if (check_owner("rollback", r->args, 1, e) < 0) return -1;
    return do_rollback(res, e);
}

/* After a --leave-running dump's unlock: wait (at most timeout_s) for the concurrent copy of the
 * device memory; {"complete": bool, "left", "cow_pieces", "background_pieces"}. */
static int op_copy_wait(const request *r, sbuf *res, op_error *e) {
    if (!npusnap_devmem_copy_wait) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_UNAVAILABLE, 0, "this agent has no device-memory part");
        return -1;
    }
    const jval *t = json_get(r->args, "timeout_s");
    int ms = t && t->t == J_NUM ? (int)(t->num * 1000 + 0.5) : 10000;
    uint64_t stats[3] = {0, 0, 0};
    char err[512] = "";
    int rc = npusnap_devmem_copy_wait(ms, stats, err, sizeof err);
    if (rc != 0 && rc != -ETIMEDOUT) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, rc, "the concurrent copy of the device memory failed: %s", err);
        return -1;
    }
    sb_key(res, "complete");
    sb_raw(res, rc == 0 ? "true" : "false");
    sb_printf(res, ",\"left\":%llu,\"cow_pieces\":%llu,\"background_pieces\":%llu", (unsigned long long)stats[0],
              (unsigned long long)stats[1], (unsigned long long)stats[2]);
    return 0;
}

void ops_handle(const request *r, int peer_pid, const agent_endpoint *ep, sbuf *out) {
    refresh_restored();
    sbuf res;
    sb_init(&res);
    sb_raw(&res, "{"); /* so that sb_key knows the first member; stripped below */
    op_error e;
    err_init(&e);
    int rc;
    const char *op = r->op;
    if (strcmp(op, "hello") == 0) rc = op_hello(r, ep, &res, &e);
    else if (strcmp(op, "status") == 0) rc = op_status(r, &res, &e);
    else if (strcmp(op, "lock") == 0) rc = op_lock(r, peer_pid, &res, &e);
    else if (strcmp(op, "backup") == 0) rc = op_backup(r, &res, &e);
    else if (strcmp(op, "renew") == 0) rc = op_renew(r, &res, &e);
    else if (strcmp(op, "release") == 0) rc = op_release(r, &res, &e);
    else if (strcmp(op, "restore") == 0) rc = op_restore(r, &res, &e);
    else if (strcmp(op, "unlock") == 0) rc = op_unlock(r, &res, &e);
    else if (strcmp(op, "rollback") == 0) rc = op_rollback(r, &res, &e);
    else if (strcmp(op, "hccl_root") == 0) rc = op_hccl_root(r, &res, &e);
    else if (strcmp(op, "hccl_rebuild") == 0) rc = op_hccl_rebuild(r, &res, &e);
    else if (strcmp(op, "copy_wait") == 0) rc = op_copy_wait(r, &res, &e);
    else {
        err_set(&e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_UNKNOWN_OP, 0, "unknown op '%s'", op);
        rc = -1;
    }
    if (rc == 0 && !res.oom) {
        proto_result_line(out, r->id, res.p + 1);
    } else {
        if (rc == 0) err_set(&e, NPUSNAP_ERRTYPE_INTERNAL, NPUSNAP_ERR_OUT_OF_MEMORY, ENOMEM, "agent out of memory in %s", op);
        proto_error_line(out, r->id, &e);
    }
    err_free(&e);
    sb_free(&res);
    lease_skip_gap(); /* time spent in an operation is not silence */
}
