/* npusnap_plugin.so: a CRIU plugin that drives the npusnap agent inside each dumped task, so that
 * container engines (podman, CRI-O, the kubelet's checkpoint API, through runc and CRIU) and a
 * plain `criu dump` snapshot an NPU process's device state without any npusnap command.
 *
 * Dump:    init(DUMP)            interrupt-only mode (runc's cgroup is thawed for the plugin)
 *          PAUSE_DEVICES(pid)    task still running: find its agent (also through the container's
 *                                mount and pid namespaces), lock (owner criu-plugin/<criu pid>) and
 *                                back up, read the replies to EOF and close: nothing is left on
 *                                the socket while the tasks are frozen. Inventory entry once.
 *          CHECKPOINT_DEVICES    nothing to do (the backup is taken while the task could answer)
 *          fini(DUMP, ret)       ok: npusnap-plugin.json (tokens, processes, sha256 of every
 *                                image file) in the images directory. Always: a detached helper
 *                                rolls back every task this run locked once CRIU has let it go
 *                                (failed dump, --leave-running, a post-dump script's veto); a
 *                                task that CRIU killed after a good dump needs nothing.
 * Restore: init(RESTORE)         only when the inventory says the image needs this plugin; reads
 *                                npusnap-plugin.json.
 *          RESUME_DEVICES_LATE   records which restored task is which dumped one (the task is
 *                                stopped by CRIU: its agent cannot answer yet)
 *          fini(RESTORE, 0)      restore + unlock through each agent (the tasks run again; any
 *                                device call they make waits for the unlock).
 *
 * A job across containers (pods): when the dumped tree's root has NPUSNAP_JOB_COORDINATOR=HOST:PORT
 * and NPUSNAP_JOB_MEMBER=N in its environment, the plugin joins that coordinator (`npusnap k8s
 * checkpoint`, npusnap_cli/pipelines/netcoord.py's protocol, member N as its node; joined at the first
 * PAUSE_DEVICES, before anything is locked, or the dump fails there) and holds two
 * barriers: "locked" at the first CHECKPOINT_DEVICES (every task of this container locked, backed up
 * and frozen; no container's memory is dumped before every container got there) and "saved" in
 * fini(DUMP) after the images are written (no container is let go before every one is saved). A
 * failure anywhere, here or in another member, aborts every member: the dump fails at "locked" (CRIU
 * lets the tasks run, the helper unlocks them); after "saved" the coordinator discards the archives.
 *
 * A task without an agent, or one whose lock is held by someone else (`npusnap dump`/`freeze`
 * drive it themselves), is not ours: -ENOTSUP, so another device plugin can claim the hook.
 * Log lines start with "npusnap-plugin: " and name the npusnap exit code a failure maps to.
 */
#define _GNU_SOURCE
#include "agent_int.h"
#include "npusnap/timeutil.h"
#include "agentrecord.h"
#include "sha256.h"

#pragma GCC visibility push(default)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <criu-plugin.h>
#pragma GCC diagnostic pop
#pragma GCC visibility pop
#include <dirent.h>
#include <dlfcn.h>
#include <linux/openat2.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Exported by the criu binary (criu/include/image.h, seize.h, log.h). */
extern int add_inventory_plugin(const char *name);
extern bool check_and_remove_inventory_plugin(const char *name, size_t n);
extern void set_compel_interrupt_only_mode(void);
extern bool alarm_timeouted(void); /* CRIU's freeze timeout (--timeout) ran out */
extern void print_on_level(unsigned int loglevel, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

/* Names, formats, exit codes and protocol constants: npusnap/contract.h (native/contract/npusnap.toml,
 * the same spec npusnap_cli/contract.py is generated from). */
#define PLUGIN_NAME NPUSNAP_PLUGIN_NAME
#define PREFIX "npusnap-plugin: "
#define STATE_FILE NPUSNAP_PLUGIN_STATE_FILE
#define STATE_FORMAT NPUSNAP_PLUGIN_STATE_FORMAT
#define LOG_ERR 1
#define LOG_WRN 2
#define LOG_INF 3

/* npusnap's exit codes (the contract's, docs/exit-codes.md): a failure is logged with the code
 * `npusnap dump/restore` would have exited with. */
#define EX_TARGET NPUSNAP_EXIT_TARGET
#define EX_AGENT NPUSNAP_EXIT_AGENT
#define EX_DEVICE NPUSNAP_EXIT_DEVICE
#define EX_IMAGE NPUSNAP_EXIT_IMAGE
#define EX_STATE_UNKNOWN NPUSNAP_EXIT_STATE_UNKNOWN
/* "exit 7 (device: a CANN snapshot call failed)"; one buffer per thread, used at once. */
static const char *exit_meaning(int code) {
    static __thread char buf[160];
    const char *summary = npusnap_exit_summary(code);
    if (!summary || code == NPUSNAP_EXIT_OK) {
        code = NPUSNAP_EXIT_INTERNAL;
        summary = npusnap_exit_summary(code);
    }
    snprintf(buf, sizeof buf, "exit %d (%s)", code, summary);
    return buf;
}

#define LOGI(...) print_on_level(LOG_INF, PREFIX __VA_ARGS__)
#define LOGW(...) print_on_level(LOG_WRN, PREFIX __VA_ARGS__)
#define FAIL(code, fmt, ...) \
    print_on_level(LOG_ERR, PREFIX "FAILED, npusnap %s: " fmt "\n", exit_meaning(code), ##__VA_ARGS__)

#define MAX_TASKS 1024
#define TOKEN_LEN NPUSNAP_PROTOCOL_TOKEN_HEX_CHARS

typedef struct task {
    int pid;   /* host pid (CRIU's view) */
    int nspid; /* pid in its own namespace: the agent's socket is named after it */
    char sock[256]; /* the socket path inside the task's mount namespace */
    char token[TOKEN_LEN + 1];
    int restored; /* restore: RESUME_DEVICES_LATE saw it */
    int newpid;   /* restore: host pid of the restored task */
    int pidfd;    /* dump's rollback helper: this very task, not a later one with its pid */
} task;

static struct {
    int stage;
    int disabled;
    int inventory_added;
    int ntasks;
    task tasks[MAX_TASKS];
    /* Processes left to CRIU at PAUSE_DEVICES because they never opened a device, though
     * their agent could not be asked; CHECKPOINT_DEVICES checks again once they are frozen. */
    int nidle;
    int idle[MAX_TASKS][2]; /* pid, ns pid */
    double lease_s;
    int require_agent;
    char device_memory[16]; /* "" (the agent's default) or one of the contract's device-memory modes */
    char log_path[256];
    int criu_pid;
    double job_barrier_s; /* how long a job barrier may wait for the other members */
} P;

/* The job coordinator of this dump (see the top of the file); fd -1 until joined. */
static struct {
    int checked;   /* the root's environment was read */
    int member;    /* NPUSNAP_JOB_MEMBER; -1: not a job member */
    char addr[256];
    int fd;
    int locked;    /* passed the "locked" barrier */
    int aborted;   /* an abort was sent or received: no later barrier */
    char buf[4096];
    size_t len;
} J = {.member = -1, .fd = -1};

static double env_double(const char *name, double dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    double d = strtod(v, &end);
    return (*end || d <= 0) ? dflt : d;
}

static const char *config_path(void) {
    const char *p = getenv("NPUSNAP_PLUGIN_CONFIG");
    return (p && *p) ? p : "/etc/npusnap/criu-plugin.conf";
}

/* /etc/npusnap/criu-plugin.conf (NPUSNAP_PLUGIN_CONFIG): KEY=VALUE lines, '#' comments. A file
 * because container engines scrub the environment they hand to runc and CRIU. The environment
 * (NPUSNAP_PLUGIN_LEASE_S, NPUSNAP_PLUGIN_REQUIRE_AGENT, NPUSNAP_PLUGIN_LOG) wins where set. */
static void load_config(void) {
    P.lease_s = 60.0;
    P.require_agent = 0;
    P.job_barrier_s = 600.0;
    snprintf(P.log_path, sizeof P.log_path, "/var/log/npusnap/criu-plugin.log");
    FILE *f = fopen(config_path(), "re");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f)) {
            char *k = line;
            while (*k == ' ' || *k == '\t') k++;
            if (*k == '#' || *k == '\n' || !*k) continue;
            char *eq = strchr(k, '=');
            if (!eq) continue;
            *eq = 0;
            char *v = eq + 1;
            v[strcspn(v, "\r\n")] = 0;
            char *kend = eq;
            while (kend > k && (kend[-1] == ' ' || kend[-1] == '\t')) *--kend = 0;
            while (*v == ' ' || *v == '\t') v++;
            if (!strcmp(k, "lease_s") && atof(v) > 0) P.lease_s = atof(v);
            else if (!strcmp(k, "require_agent")) P.require_agent = atoi(v) != 0;
            else if (!strcmp(k, "log")) snprintf(P.log_path, sizeof P.log_path, "%s", v);
            else if (!strcmp(k, "job_barrier_s") && atof(v) > 0) P.job_barrier_s = atof(v);
            else if (!strcmp(k, "device_memory") && npusnap_devmem_mode_valid(v))
                snprintf(P.device_memory, sizeof P.device_memory, "%s", v);
            else
                LOGW("%s: unknown key or value %s=%s (known: lease_s, require_agent, log, job_barrier_s, "
                     "device_memory=one of " NPUSNAP_DEVMEM_MODES_TEXT ")\n", config_path(), k, v);
        }
        fclose(f);
    }
    P.lease_s = env_double("NPUSNAP_PLUGIN_LEASE_S", P.lease_s);
    const char *ra = getenv("NPUSNAP_PLUGIN_REQUIRE_AGENT");
    if (ra && *ra) P.require_agent = atoi(ra) != 0;
    const char *lg = getenv("NPUSNAP_PLUGIN_LOG");
    if (lg && *lg) snprintf(P.log_path, sizeof P.log_path, "%s", lg);
}

/* ---- small helpers ----------------------------------------------------------------------- */

static int read_file(const char *path, char *buf, size_t len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t got = 0;
    while (got + 1 < len) {
        ssize_t n = read(fd, buf + got, len - 1 - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    buf[got] = 0;
    return (int)got;
}

/* The innermost pid of a host pid (last field of NSpid), or -1. */
static int ns_pid(int pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    if (read_file(path, buf, sizeof buf) < 0) return -1;
    char *l = strstr(buf, "\nNSpid:");
    if (!l) return pid;
    l += 7;
    char *end = strchr(l, '\n');
    if (end) *end = 0;
    int last = -1;
    for (char *tok = strtok(l, " \t"); tok; tok = strtok(NULL, " \t")) last = atoi(tok);
    return last;
}

static int status_field(int pid, const char *field) {
    char path[64], buf[4096], key[64];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    if (read_file(path, buf, sizeof buf) < 0) return -1;
    snprintf(key, sizeof key, "\n%s:", field);
    char *l = strstr(buf, key);
    return l ? atoi(l + strlen(key)) : -1;
}

/* 'R', 'S', 'Z', 't', ... of a pid; 0 if it is gone. */
static char proc_state(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (read_file(path, buf, sizeof buf) <= 0) return 0;
    char *rp = strrchr(buf, ')');
    return (rp && rp[1] == ' ') ? rp[2] : 0;
}

/* Does the task have a CANN runtime library mapped? (Then it needs an agent to be dumped.) */
static int maps_cann(int pid, char *lib, size_t liblen) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/maps", pid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    char line[4096];
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        char *slash = strrchr(line, '/');
        if (!slash) continue;
        if (!strncmp(slash, "/libacl_rt.so", 13) || !strncmp(slash, "/libascendcl.so", 15) ||
            !strncmp(slash, "/libruntime.so", 14)) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            char *p = strchr(line, '/');
            snprintf(lib, liblen, "%s", p ? p : slash);
            found = 1;
            break;
        }
    }
    fclose(f);
    return found;
}

/* The agent's listening socket for a task, as bound inside its mount namespace: a listening
 * AF_UNIX path ".../npusnap*<dir>/<nspid>.sock" (or in the target's NPUSNAP_RUNTIME_DIR) in the
 * task's network namespace (/proc/PID/net/unix). Returns the number of candidates written (at most max). */
/* The target's NPUSNAP_RUNTIME_DIR (an agent started with it binds its socket there), or "". */
static void target_runtime_dir(int pid, char *out, size_t len) {
    char path[64];
    static char env[1 << 16];
    out[0] = 0;
    snprintf(path, sizeof path, "/proc/%d/environ", pid);
    int n = read_file(path, env, sizeof env);
    for (int i = 0; i < n; i += (int)strlen(env + i) + 1) {
        size_t kl = strlen(NPUSNAP_AGENT_SOCKET_ENV_DIR);
        if (!strncmp(env + i, NPUSNAP_AGENT_SOCKET_ENV_DIR, kl) && env[i + kl] == '=') {
            snprintf(out, len, "%s", env + i + kl + 1);
            size_t l = strlen(out);
            while (l > 1 && out[l - 1] == '/') out[--l] = 0;
        }
    }
}

/* Whether the directory `dir` (len bytes, in the task's mount namespace) may hold the task's agent
 * socket: it belongs to the task's user or to root. Any user can listen as ".../npusnap-x/<pid>.sock"
 * in a directory of their own: such a socket is never the task's agent, and taking it for one
 * would fail the checkpoint of a task that has none (the paths.py may_serve rule). */
static int dir_may_serve(int pid, const char *dir, size_t len) {
    char path[600], proc[64];
    struct stat dst, pst;
    snprintf(path, sizeof path, "/proc/%d/root%.*s", pid, (int)len, dir);
    snprintf(proc, sizeof proc, "/proc/%d", pid);
    if (stat(path, &dst) != 0 || stat(proc, &pst) != 0) return 0;
    return dst.st_uid == 0 || dst.st_uid == pst.st_uid;
}

static int agent_sockets(int pid, int nspid, char out[][256], int max) {
    char path[64], want[32], rtdir[256];
    target_runtime_dir(pid, rtdir, sizeof rtdir);
    snprintf(path, sizeof path, "/proc/%d/net/unix", pid);
    snprintf(want, sizeof want, "/" NPUSNAP_AGENT_SOCKET_NAME, nspid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    char line[1024];
    int n = 0;
    if (!fgets(line, sizeof line, f)) { /* header */
        fclose(f);
        return 0;
    }
    while (n < max && fgets(line, sizeof line, f)) {
        char num[32], sp[256] = "";
        unsigned long refc, proto, flags, type, st, ino;
        if (sscanf(line, "%31s %lx %lx %lx %lx %lx %lu %255s", num, &refc, &proto, &flags, &type, &st, &ino, sp) < 8)
            continue;
        if (sp[0] != '/' || !(flags & 0x10000)) continue;
        size_t l = strlen(sp), wl = strlen(want);
        if (l <= wl || strcmp(sp + l - wl, want)) continue;
        /* the parent directory's name starts with "npusnap" (the contract's agent socket rules) */
        char *dir_end = sp + l - wl;
        char *dir_start = dir_end;
        while (dir_start > sp && dir_start[-1] != '/') dir_start--;
        int in_rtdir = rtdir[0] && (size_t)(dir_end - sp) == strlen(rtdir) && !strncmp(sp, rtdir, strlen(rtdir));
        if (strncmp(dir_start, NPUSNAP_AGENT_SOCKET_DIR_PREFIX, strlen(NPUSNAP_AGENT_SOCKET_DIR_PREFIX)) && !in_rtdir)
            continue;
        if (!dir_may_serve(pid, sp, (size_t)(dir_end - sp))) continue;
        snprintf(out[n++], 256, "%s", sp);
    }
    fclose(f);
    return n;
}

/* ---- one connection to an agent ---------------------------------------------------------- */
typedef struct conn {
    int fd;
    int pid;
    long long next_id;
    char buf[MAX_LINE + 2];
    size_t len;
} conn;

/* Connect to the agent of host pid `pid` listening at `sock` (a path in its mount namespace):
 * through /proc/PID/root, via an O_PATH fd of the directory so the address stays short. The peer
 * must be `pid` itself (SO_PEERCRED, translated into our pid namespace). */
static int agent_connect(conn *c, int pid, const char *sock, char *err, size_t errlen) {
    c->fd = -1;
    c->pid = pid;
    c->next_id = 1;
    c->len = 0;
    char rootpath[64], dirpath[512];
    const char *slash = strrchr(sock, '/');
    snprintf(rootpath, sizeof rootpath, "/proc/%d/root", pid);
    snprintf(dirpath, sizeof dirpath, "%.*s", (int)(slash - sock), sock);
    if (!dirpath[0]) snprintf(dirpath, sizeof dirpath, "/");
    int rootfd = open(rootpath, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", rootpath, strerror(errno));
        return -1;
    }
    /* Resolve the directory inside the task's root: a symlink in the container cannot lead us
     * to a path of the host (the peer check below would refuse it anyway). */
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = O_PATH | O_DIRECTORY | O_CLOEXEC;
    how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
    int dfd = (int)syscall(SYS_openat2, rootfd, dirpath, &how, sizeof how);
    int oerr = errno;
    close(rootfd);
    if (dfd < 0) {
        snprintf(err, errlen, "cannot open %s in the root of pid %d: %s", dirpath, pid, strerror(oerr));
        return -1;
    }
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "/proc/self/fd/%d%s", dfd, slash);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        close(dfd);
        return -1;
    }
    int rc = connect(fd, (struct sockaddr *)&addr, sizeof addr);
    int saved = errno;
    close(dfd);
    if (rc < 0) {
        snprintf(err, errlen, "cannot connect to %s (in the namespaces of pid %d): %s", sock, pid, strerror(saved));
        close(fd);
        return -1;
    }
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0 || cred.pid != pid) {
        snprintf(err, errlen, "refusing %s: it is served by pid %d, not by pid %d", sock, (int)cred.pid, pid);
        close(fd);
        return -1;
    }
    c->fd = fd;
    return 0;
}

/* Read one line within timeout_s. 0 ok (NUL-terminated in c->buf, length *len), -1 error/EOF. */
static int read_line(conn *c, double timeout_s, size_t *len, char *err, size_t errlen) {
    double deadline = now_s() + timeout_s;
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->len);
        if (nl) {
            *len = (size_t)(nl - c->buf);
            return 0;
        }
        if (c->len > MAX_LINE) {
            snprintf(err, errlen, "the agent's answer exceeds %d bytes", MAX_LINE);
            return -1;
        }
        double left = deadline - now_s();
        if (left <= 0) {
            snprintf(err, errlen, "no answer from the agent of pid %d within %.0fs", c->pid, timeout_s);
            return -1;
        }
        if (P.stage == CR_PLUGIN_STAGE__DUMP && alarm_timeouted()) {
            snprintf(err, errlen,
                     "CRIU's freeze timeout ran out while the agent of pid %d was answering (a large device "
                     "backup? raise it: `timeout 600` in the CRIU config file, or criu --timeout)",
                     c->pid);
            return -1;
        }
        struct pollfd p = {c->fd, POLLIN, 0};
        int rc = poll(&p, 1, (int)(left * 1000) + 1);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) continue;
        ssize_t n = recv(c->fd, c->buf + c->len, MAX_LINE + 1 - c->len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            snprintf(err, errlen, "the agent of pid %d closed the connection%s%s", c->pid, n < 0 ? ": " : "",
                     n < 0 ? strerror(errno) : "");
            return -1;
        }
        c->len += (size_t)n;
    }
}

/* A decoded answer (client.c): ok, body (result or error), and the error's type, name and message. */
typedef proto_reply reply;

static void reply_free(reply *r) { proto_reply_free(r); }

/* Send one request (args: a JSON object text, built with sbuf) and read its answer, both through the
 * agent's own codec (client.c, proto.c). -1: not sent, transport failure or a malformed answer (err). */
static int agent_request(conn *c, const char *op, const char *args, double timeout_s, reply *r, char *err,
                   size_t errlen) {
    memset(r, 0, sizeof *r);
    long long id = c->next_id++;
    sbuf line;
    sb_init(&line);
    op_error e;
    err_init(&e);
    if (proto_request_line(&line, id, op, args, &e) < 0) {
        snprintf(err, errlen, "not sending %s to the agent of pid %d: %s: %s", op, c->pid, e.name, e.message);
        err_free(&e);
        sb_free(&line);
        return -1;
    }
    err_free(&e);
    ssize_t sent = send(c->fd, line.p, line.len, MSG_NOSIGNAL);
    int serr = errno, whole = sent == (ssize_t)line.len;
    sb_free(&line);
    if (!whole) {
        snprintf(err, errlen, "cannot send %s to the agent of pid %d: %s", op, c->pid,
                 sent < 0 ? strerror(serr) : "short write");
        errno = sent < 0 ? serr : EPIPE; /* EPIPE: the agent refused us at accept (BUSY: one client at a time) */
        return -1;
    }
    size_t len;
    if (read_line(c, timeout_s, &len, err, errlen) < 0) return -1;
    char derr[256];
    int rc = proto_decode_response(c->buf, len, r, derr, sizeof derr);
    memmove(c->buf, c->buf + len + 1, c->len - len - 1);
    c->len -= len + 1;
    if (rc < 0) {
        snprintf(err, errlen, "the agent of pid %d answered %s with a malformed line: %s", c->pid, op, derr);
        return -1;
    }
    /* id 0 with an error: the agent refused the connection at accept (core.c refuse()), before
     * reading any request: an answer to this request all the same (BUSY is retried). */
    if (r->id != id && !(r->id == 0 && !r->ok)) {
        snprintf(err, errlen, "the agent of pid %d answered request %lld with the id %lld", c->pid, id, r->id);
        reply_free(r);
        return -1;
    }
    return 0;
}

/* {"token": t} (rollback, restore, unlock), with the lease for backup when lease_s > 0. */
static void token_args(sbuf *b, const char *token, double lease_s) {
    sb_raw(b, "{");
    if (lease_s > 0) {
        sb_key(b, "lease_s");
        sb_num(b, lease_s);
    }
    sb_key(b, "token");
    sb_str(b, token);
    sb_raw(b, "}");
}

/* Say goodbye: shut our side, read to EOF (the agent closes), close. Bounded. */
static void agent_close(conn *c) {
    if (c->fd < 0) return;
    shutdown(c->fd, SHUT_WR);
    double deadline = now_s() + 5.0;
    char tmp[512];
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0) {
            LOGW("the agent of pid %d did not close its end within 5s\n", c->pid);
            break;
        }
        struct pollfd p = {c->fd, POLLIN, 0};
        int rc = poll(&p, 1, (int)(left * 1000) + 1);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) continue;
        ssize_t n = recv(c->fd, tmp, sizeof tmp, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
    }
    close(c->fd);
    c->fd = -1;
}

static int error_exit_code(const reply *r) {
    return (!strcmp(r->type, NPUSNAP_ERRTYPE_ACL) || !strcmp(r->type, NPUSNAP_ERRTYPE_STATE)) ? EX_DEVICE : EX_AGENT;
}

static int find_and_connect(int pid, int nspid, char *sock, size_t socklen, conn *c, char *err, size_t errlen) {
    char cands[8][256];
    /* An agent names its socket after its pid as its /proc shows it: the namespace pid in a
     * container with a /proc of its own, the host pid under `npusnap run --pid-ns` (host /proc).
     * A socket of another process by either name fails agent_connect's SO_PEERCRED check. */
    int n = agent_sockets(pid, pid, cands, 8);
    if (nspid != pid) n += agent_sockets(pid, nspid, cands + n, 8 - n);
    if (n == 0) {
        snprintf(err, errlen, "no listening npusnap agent socket named %d.sock in the namespaces of pid %d", nspid,
                 pid);
        return 1; /* no agent */
    }
    for (int i = 0; i < n; i++) {
        if (agent_connect(c, pid, cands[i], err, errlen) == 0) {
            snprintf(sock, socklen, "%s", cands[i]);
            return 0;
        }
    }
    return -1;
}

/* ---- dump -------------------------------------------------------------------------------- */
static task *task_of(int pid) {
    for (int i = 0; i < P.ntasks; i++)
        if (P.tasks[i].pid == pid) return &P.tasks[i];
    return NULL;
}

static void rollback_one(conn *c, const task *t) {
    char err[512];
    sbuf args;
    sb_init(&args);
    token_args(&args, t->token, 0);
    reply r;
    int rc = agent_request(c, "rollback", args.p, 120, &r, err, sizeof err);
    sb_free(&args);
    if (rc < 0) {
        FAIL(EX_STATE_UNKNOWN, "rollback of pid %d: %s; its lease (%.0fs) rolls it back, or run `npusnap thaw %d`",
             t->pid, err, P.lease_s, t->pid);
        return;
    }
    if (!r.ok)
        FAIL(EX_STATE_UNKNOWN, "rollback of pid %d: %s: %s; its lease rolls it back, or run `npusnap thaw %d`",
             t->pid, r.name, r.message, t->pid);
    else
        LOGI("pid %d rolled back (unlocked)\n", t->pid);
    reply_free(&r);
}

/* ---- the job coordinator (a job across containers; see the top of the file) ------------------ */
/* NPUSNAP_JOB_COORDINATOR / NPUSNAP_JOB_MEMBER from the dumped root's environment: the pod spec
 * sets them, since container engines hand CRIU no environment of the job's own. */
static void job_read_env(int pid) {
    J.checked = 1;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/environ", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    static char env[1 << 16];
    size_t n = 0;
    ssize_t r;
    while (n < sizeof env - 1 && (r = read(fd, env + n, sizeof env - 1 - n)) > 0) n += (size_t)r;
    close(fd);
    env[n] = 0;
    const char *coord = NULL, *member = NULL;
    for (size_t i = 0; i < n; i += strlen(env + i) + 1) {
        if (!strncmp(env + i, "NPUSNAP_JOB_COORDINATOR=", 24)) coord = env + i + 24;
        else if (!strncmp(env + i, "NPUSNAP_JOB_MEMBER=", 19)) member = env + i + 19;
    }
    if (!coord || !*coord) return;
    snprintf(J.addr, sizeof J.addr, "%s", coord);
    char *end = NULL;
    long m = member ? strtol(member, &end, 10) : -1;
    J.member = (member && *member && end && !*end && m >= 0 && m < 1000000) ? (int)m : -2;
}

static int job_send(const char *line) {
    size_t len = strlen(line), off = 0;
    while (off < len) {
        ssize_t n = send(J.fd, line + off, len - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        off += (size_t)n;
    }
    return 0;
}

/* Connect to HOST:PORT ([V6]:PORT) and say which member this is; retried for 5 s (the
 * coordinator listens before it asks the runtimes to checkpoint). */
static int job_connect(char *err, size_t errlen) {
    char host[256];
    snprintf(host, sizeof host, "%s", J.addr);
    char *colon = strrchr(host, ':');
    if (!colon || !colon[1]) {
        snprintf(err, errlen, "NPUSNAP_JOB_COORDINATOR=%s is not HOST:PORT", J.addr);
        return -1;
    }
    *colon = 0;
    const char *port = colon + 1, *h = host;
    if (host[0] == '[' && colon[-1] == ']') {
        colon[-1] = 0;
        h = host + 1;
    }
    double deadline = now_s() + 5;
    for (;;) {
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
        int grc = getaddrinfo(h, port, &hints, &res);
        int e = 0;
        if (grc == 0) {
            for (struct addrinfo *a = res; a; a = a->ai_next) {
                int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
                if (fd < 0) continue;
                struct timeval tv = {5, 0}; /* bounds connect() too */
                setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
                if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
                    J.fd = fd;
                    break;
                }
                e = errno;
                close(fd);
            }
            freeaddrinfo(res);
        }
        if (J.fd >= 0) break;
        if (now_s() > deadline) {
            snprintf(err, errlen, "cannot reach the job coordinator at %s: %s", J.addr,
                     grc ? gai_strerror(grc) : strerror(e));
            return -1;
        }
        usleep(200 * 1000);
    }
    int one = 1;
    setsockopt(J.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char hello[64];
    snprintf(hello, sizeof hello, "{\"node\":%d}\n", J.member);
    if (job_send(hello) < 0) {
        snprintf(err, errlen, "the job coordinator at %s closed the connection", J.addr);
        return -1;
    }
    return 0;
}

/* The coordinator's next message (one JSON object a line), within timeout_s. */
static int job_recv(double timeout_s, jval *out, char *err, size_t errlen) {
    double deadline = now_s() + timeout_s;
    for (;;) {
        char *nl = memchr(J.buf, '\n', J.len);
        if (nl) {
            size_t len = (size_t)(nl - J.buf);
            int rc = json_parse(J.buf, len, out, err, errlen);
            memmove(J.buf, nl + 1, J.len - len - 1);
            J.len -= len + 1;
            return rc < 0 || out->t != J_OBJ ? -1 : 0;
        }
        double left = deadline - now_s();
        if (left <= 0 || J.len >= sizeof J.buf) {
            snprintf(err, errlen, "no word from the job coordinator at %s within %.0fs", J.addr, timeout_s);
            return -1;
        }
        struct pollfd p = {J.fd, POLLIN, 0};
        int rc = poll(&p, 1, (int)(left * 1000) + 1);
        if (rc <= 0) continue;
        ssize_t n = recv(J.fd, J.buf + J.len, sizeof J.buf - J.len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            snprintf(err, errlen, "the job coordinator at %s closed the connection", J.addr);
            return -1;
        }
        J.len += (size_t)n;
    }
}

/* Arrive at `phase` and wait until every member did (0), or an abort (-1, reason in err). */
static int job_sync(const char *phase, char *err, size_t errlen) {
    if (J.aborted) {
        snprintf(err, errlen, "the job was aborted");
        return -1;
    }
    if (J.fd < 0 && job_connect(err, errlen) < 0) {
        J.aborted = 1;
        return -1;
    }
    char line[128];
    snprintf(line, sizeof line, "{\"arrive\":\"%s\"}\n", phase);
    if (job_send(line) < 0) {
        snprintf(err, errlen, "the job coordinator at %s closed the connection", J.addr);
        J.aborted = 1;
        return -1;
    }
    jval v;
    if (job_recv(P.job_barrier_s + 10, &v, err, errlen) < 0) {
        J.aborted = 1;
        return -1;
    }
    const jval *go = json_get(&v, "go"), *abort_ = json_get(&v, "abort");
    int ok = go && go->t == J_STR && !strcmp(go->s, phase);
    if (!ok)
        snprintf(err, errlen, "the job was aborted: %s",
                 abort_ && abort_->t == J_STR ? abort_->s : "the coordinator is out of step");
    json_free(&v);
    if (!ok) J.aborted = 1;
    return ok ? 0 : -1;
}

/* Tell every other member to roll back (this one failed before it reached a barrier). */
static void job_abort(const char *reason) {
    if (J.member < 0 || J.aborted) return;
    J.aborted = 1;
    char err[256];
    if (J.fd < 0 && job_connect(err, sizeof err) < 0) {
        LOGW("could not tell the job coordinator that member %d failed: %s\n", J.member, err);
        return;
    }
    sbuf b;
    sb_init(&b);
    sb_raw(&b, "{");
    sb_key(&b, "abort");
    char msg[256];
    snprintf(msg, sizeof msg, "member %d (%s): %s", J.member, J.addr, reason);
    sb_str(&b, msg);
    sb_raw(&b, "}\n");
    if (!b.oom) job_send(b.p);
    sb_free(&b);
}

/* A process whose agent cannot be asked (stopped, or a copy made without fork handlers) and
 * that never opened a device has nothing to lock: CRIU dumps it as any other, and
 * checkpoint_devices checks again once it is frozen. 1 when it is left to CRIU. */
static int leave_idle(int pid, int nspid, const char *why) {
    if (P.nidle >= MAX_TASKS || !npusnap_never_opened_a_device(pid, nspid)) return 0;
    P.idle[P.nidle][0] = pid;
    P.idle[P.nidle][1] = nspid;
    P.nidle++;
    LOGI("pid %d %s and never opened an NPU device (its agent's record, /proc): the plugin leaves it to CRIU\n",
         pid, why);
    return 1;
}

static int pause_devices(int pid) {
    if (P.disabled || P.stage != CR_PLUGIN_STAGE__DUMP) return -ENOTSUP;
    if (!J.checked) {
        job_read_env(pid); /* the first call is for the dumped tree's root */
        if (J.member == -2) {
            FAIL(EX_TARGET, "pid %d has NPUSNAP_JOB_COORDINATOR=%s but no valid NPUSNAP_JOB_MEMBER (a number) in "
                            "its environment: set both in the pod spec", pid, J.addr);
            return -1;
        }
        if (J.member >= 0) {
            /* Join now, while nothing is locked or frozen: a coordinator that is not there fails
             * this checkpoint before it touches the job. */
            char err[512];
            if (job_connect(err, sizeof err) < 0) {
                J.aborted = 1;
                FAIL(EX_TARGET, "pid %d is member %d of a job (NPUSNAP_JOB_COORDINATOR=%s): %s; a job member is "
                                "checkpointed with its job: `npusnap k8s checkpoint --listen %s`", pid, J.member,
                     J.addr, err, J.addr);
                return -1;
            }
            LOGI("member %d of the job coordinated at %s\n", J.member, J.addr);
        }
    }
    if (task_of(pid)) return 0;
    int nspid = ns_pid(pid);
    if (nspid < 0) return -ENOTSUP; /* gone: CRIU sees it too */
    char pst = proc_state(pid);
    if (pst == 'T' || pst == 't') {
        char cands[1][256];
        if (pst == 'T' && leave_idle(pid, nspid, "is stopped")) return -ENOTSUP;
        if (agent_sockets(pid, nspid, cands, 1) > 0) {
            FAIL(EX_TARGET, "pid %d is stopped (SIGSTOP, Ctrl-Z or a debugger): its agent cannot lock or back up "
                            "the device; continue it (kill -CONT %d) and checkpoint again", pid, pid);
            return -1;
        }
    }
    char sock[256], err[512];
    conn c;
    int rc = -1;
    double deadline = now_s() + 2.0;
    reply r;
    sbuf args;
    for (;;) {
        rc = find_and_connect(pid, nspid, sock, sizeof sock, &c, err, sizeof err);
        if (rc == 1) {
            char lib[512];
            if (leave_idle(pid, nspid, "has no agent of its own")) return -ENOTSUP;
            if (maps_cann(pid, lib, sizeof lib)) {
                if (P.require_agent) {
                    FAIL(EX_TARGET,
                         "pid %d (pid %d in its namespace) has the CANN runtime loaded (%s) but no npusnap agent: "
                         "its device state would be lost; start it under `npusnap run` or with "
                         "LD_PRELOAD=libnpusnap_agent.so NPUSNAP_AGENT=1 (require_agent=1 in %s)",
                         pid, nspid, lib, config_path());
                    return -1;
                }
                LOGW("pid %d (pid %d in its namespace) has the CANN runtime loaded (%s) but no npusnap agent: the "
                     "plugin does not touch it, its device state is up to the application or another plugin "
                     "(set require_agent=1 in %s to refuse such dumps)\n",
                     pid, nspid, lib, config_path());
                return -ENOTSUP;
            }
            LOGI("pid %d has no agent and no CANN runtime: not ours\n", pid);
            return -ENOTSUP;
        }
        if (rc < 0) {
            FAIL(EX_AGENT, "pid %d: %s", pid, err);
            return -1;
        }
        sb_init(&args);
        sb_raw(&args, "{");
        sb_key(&args, "lease_s");
        sb_num(&args, P.lease_s);
        if (P.device_memory[0]) {
            sb_key(&args, "device_memory");
            sb_str(&args, P.device_memory);
        }
        sb_key(&args, "owner");
        sb_raw(&args, "{");
        sb_key(&args, "command");
        sb_str(&args, NPUSNAP_PLUGIN_OWNER_COMMAND);
        sb_key(&args, "pid");
        sb_printf(&args, "%d", (int)getpid());
        sb_raw(&args, "}}");
        int sent = agent_request(&c, "lock", args.p, 90, &r, err, sizeof err);
        int e = errno;
        sb_free(&args);
        if (sent < 0) {
            agent_close(&c);
            if ((e == EPIPE || e == ECONNRESET) && now_s() < deadline) {
                /* Refused at accept: another client (npusnap renewing its lease, `npusnap
                 * status`) is talking to the agent for a moment. Retried like a BUSY reply. */
                usleep(100 * 1000);
                continue;
            }
            FAIL(EX_AGENT, "lock of pid %d: %s", pid, err);
            return -1;
        }
        if (!r.ok && !strcmp(r.name, NPUSNAP_ERR_BUSY) && now_s() < deadline) {
            reply_free(&r);
            agent_close(&c);
            usleep(100 * 1000);
            continue;
        }
        break;
    }
    if (!r.ok) {
        if (!strcmp(r.name, NPUSNAP_ERR_NO_ACL_RUNTIME)) {
            LOGI("pid %d has an agent but no CANN runtime: not ours\n", pid);
            reply_free(&r);
            agent_close(&c);
            return -ENOTSUP;
        }
        if (!strcmp(r.name, NPUSNAP_ERR_ALREADY_LOCKED)) {
            const jval *owner = r.body ? json_get(r.body, "owner") : NULL;
            const jval *cmd = owner ? json_get(owner, "command") : NULL;
            int ours = cmd && cmd->t == J_STR && !strcmp(cmd->s, NPUSNAP_PLUGIN_OWNER_COMMAND);
            if (!ours) {
                /* `npusnap dump` or `freeze` holds the lock and drives the device state itself. */
                LOGI("pid %d: %s; that command drives its device state, the plugin leaves it alone\n", pid,
                     r.message);
                reply_free(&r);
                agent_close(&c);
                return -ENOTSUP;
            }
        }
        int code = error_exit_code(&r);
        FAIL(code, "lock of pid %d: %s: %s", pid, r.name, r.message);
        reply_free(&r);
        agent_close(&c);
        return -1;
    }
    task *t = &P.tasks[P.ntasks];
    memset(t, 0, sizeof *t);
    t->pid = pid;
    t->nspid = nspid;
    snprintf(t->sock, sizeof t->sock, "%s", sock);
    const jval *tok = r.body ? json_get(r.body, "token") : NULL;
    if (!tok || tok->t != J_STR || strlen(tok->s) != TOKEN_LEN) {
        FAIL(EX_AGENT, "lock of pid %d: the agent's answer carries no token (an agent older than the lock-owner "
                       "protocol?)", pid);
        reply_free(&r);
        if (agent_request(&c, "rollback", "{\"force\":true}", 120, &r, err, sizeof err) == 0) reply_free(&r);
        agent_close(&c);
        return -1;
    }
    snprintf(t->token, sizeof t->token, "%s", tok->s);
    reply_free(&r);
    if (P.ntasks >= MAX_TASKS) {
        FAIL(EX_TARGET, "more than %d NPU processes in one dump", MAX_TASKS);
        rollback_one(&c, t);
        agent_close(&c);
        return -1;
    }
    P.ntasks++; /* from here on fini rolls it back if the dump does not go through */
    sb_init(&args);
    token_args(&args, t->token, P.lease_s);
    int sent = agent_request(&c, "backup", args.p, 900, &r, err, sizeof err);
    sb_free(&args);
    if (sent < 0) {
        FAIL(EX_AGENT, "backup of pid %d: %s", pid, err);
        agent_close(&c);
        return -1;
    }
    if (!r.ok) {
        FAIL(error_exit_code(&r), "backup of pid %d: %s: %s", pid, r.name, r.message);
        reply_free(&r);
        rollback_one(&c, t);
        P.ntasks--;
        agent_close(&c);
        return -1;
    }
    reply_free(&r);
    agent_close(&c); /* nothing may stay on the socket while the task is frozen */
    if (!P.inventory_added) {
        if (add_inventory_plugin(PLUGIN_NAME)) {
            FAIL(EX_IMAGE, "cannot record %s in the image inventory", PLUGIN_NAME);
            return -1;
        }
        P.inventory_added = 1;
    }
    LOGI("pid %d (pid %d in its namespace, agent %s): locked and backed up, lease %gs\n", pid, nspid, sock,
         P.lease_s);
    return 0;
}

static int checkpoint_devices(int pid) {
    if (P.disabled || P.stage != CR_PLUGIN_STAGE__DUMP) return -ENOTSUP;
    if (J.member >= 0 && !J.locked) {
        /* The first call: every task of this tree is locked, backed up and frozen. */
        char err[512];
        double t0 = now_s();
        if (job_sync("locked", err, sizeof err) < 0) {
            FAIL(EX_DEVICE, "job member %d: %s; this container is rolled back", J.member, err);
            return -1;
        }
        J.locked = 1;
        LOGI("job member %d: every member locked (waited %.3fs)\n", J.member, now_s() - t0);
    }
    for (int i = 0; i < P.nidle; i++) {
        if (P.idle[i][0] != pid) continue;
        if (!npusnap_never_opened_a_device(pid, P.idle[i][1])) {
            FAIL(EX_TARGET, "pid %d opened an NPU device while the checkpoint ran (it was stopped, or had no agent of "
                            "its own, and had opened none when it began); checkpoint again", pid);
            return -1;
        }
        return -ENOTSUP;
    }
    if (!task_of(pid)) return -ENOTSUP;
    return 0; /* backed up at PAUSE_DEVICES, while the agent could still answer */
}

/* SHA-256: nettle's when CRIU has it loaded (CRIU links gnutls, which brings nettle and its
 * SHA-NI/assembly code, several times faster), else the plugin's own (sha256.c). The images are
 * hashed while the tasks are still frozen, so speed matters for --leave-running. */
typedef struct {
    void (*init)(void *);
    void (*update)(void *, size_t, const uint8_t *);
    void (*digest)(void *, size_t, uint8_t *);
} nettle_sha;

static const char *hasher_name(nettle_sha *n) {
    n->init = (void (*)(void *))dlsym(RTLD_DEFAULT, "nettle_sha256_init");
    n->update = (void (*)(void *, size_t, const uint8_t *))dlsym(RTLD_DEFAULT, "nettle_sha256_update");
    n->digest = (void (*)(void *, size_t, uint8_t *))dlsym(RTLD_DEFAULT, "nettle_sha256_digest");
    if (n->init && n->update && n->digest) return "nettle";
    memset(n, 0, sizeof *n);
    return "built-in";
}

/* sha256 of every regular file of the images directory, as a JSON array (files[]). */
static int hash_images(int dirfd, sbuf *out) {
    int dfd = dup(dirfd);
    if (dfd < 0) return -1;
    lseek(dfd, 0, SEEK_SET);
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return -1;
    }
    rewinddir(d);
    static char buf[1 << 20];
    int first = 1, rc = 0;
    nettle_sha nt;
    const char *impl = hasher_name(&nt);
    double t0 = now_s();
    long long total = 0;
    sb_raw(out, "[");
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        /* CRIU's logs and stats change after this point (restore writes its own) */
        if (de->d_name[0] == '.' || !strncmp(de->d_name, STATE_FILE, strlen(STATE_FILE)) ||
            (nl > 4 && !strcmp(de->d_name + nl - 4, ".log")) || !strncmp(de->d_name, "stats-", 6))
            continue;
        int fd = openat(dirfd, de->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        struct stat st;
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
            close(fd);
            continue;
        }
        sha256_ctx h;
        _Alignas(16) unsigned char nctx[512]; /* struct sha256_ctx of nettle: 112 bytes */
        if (nt.init) nt.init(nctx);
        else sha256_init(&h);
        ssize_t n;
        long long size = 0;
        while ((n = read(fd, buf, sizeof buf)) > 0) {
            if (nt.init) nt.update(nctx, (size_t)n, (const uint8_t *)buf);
            else sha256_update(&h, buf, (size_t)n);
            size += n;
        }
        close(fd);
        if (n < 0) {
            rc = -1;
            continue;
        }
        total += size;
        char hex[65];
        if (nt.init) {
            uint8_t d[32];
            nt.digest(nctx, 32, d);
            for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
        } else {
            sha256_hex(&h, hex);
        }
        sb_raw(out, first ? "{" : ",{");
        first = 0;
        sb_key(out, "path");
        sb_str(out, de->d_name);
        sb_key(out, "size");
        sb_printf(out, "%lld", size);
        sb_key(out, "sha256");
        sb_str(out, hex);
        sb_raw(out, "}");
    }
    sb_raw(out, "]");
    closedir(d);
    LOGI("sha256 (%s) of %lld bytes of images in %.3fs\n", impl, total, now_s() - t0);
    return rc;
}

static void iso_now(char *buf, size_t len) {
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static int write_state_file(void) {
    int dirfd = criu_get_image_dir();
    sbuf s;
    sb_init(&s);
    char when[32], host[256] = "";
    iso_now(when, sizeof when);
    gethostname(host, sizeof host - 1);
    sb_raw(&s, "{");
    sb_key(&s, "format");
    sb_printf(&s, "%d", STATE_FORMAT);
    sb_key(&s, "kind");
    sb_str(&s, NPUSNAP_PLUGIN_STATE_KIND);
    sb_key(&s, "plugin");
    sb_str(&s, PLUGIN_NAME);
    sb_key(&s, "created");
    sb_str(&s, when);
    sb_key(&s, "hostname");
    sb_str(&s, host);
    sb_key(&s, "criu_pid");
    sb_printf(&s, "%d", (int)getpid());
    sb_key(&s, "lease_s");
    sb_num(&s, P.lease_s);
    if (J.member >= 0) {
        sb_key(&s, "job");
        sb_raw(&s, "{");
        sb_key(&s, "member");
        sb_printf(&s, "%d", J.member);
        sb_key(&s, "coordinator");
        sb_str(&s, J.addr);
        sb_raw(&s, "}");
    }
    sb_key(&s, "processes");
    sb_raw(&s, "[");
    for (int i = 0; i < P.ntasks; i++) {
        task *t = &P.tasks[i];
        sb_raw(&s, i ? ",{" : "{");
        sb_key(&s, "pid");
        sb_printf(&s, "%d", t->pid);
        sb_key(&s, "ns_pid");
        sb_printf(&s, "%d", t->nspid);
        sb_key(&s, "agent_socket");
        sb_str(&s, t->sock);
        sb_key(&s, "lock_token");
        sb_str(&s, t->token);
        sb_raw(&s, "}");
    }
    sb_raw(&s, "]");
    sb_key(&s, "files");
    int hrc = hash_images(dirfd, &s);
    sb_raw(&s, "}\n");
    if (s.oom || hrc < 0) {
        sb_free(&s);
        FAIL(EX_IMAGE, "cannot checksum the image files");
        return -1;
    }
    int fd = openat(dirfd, STATE_FILE ".tmp", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    int ok = fd >= 0 && write(fd, s.p, s.len) == (ssize_t)s.len && fsync(fd) == 0;
    if (fd >= 0) close(fd);
    ok = ok && renameat(dirfd, STATE_FILE ".tmp", dirfd, STATE_FILE) == 0;
    sb_free(&s);
    if (!ok) {
        FAIL(EX_IMAGE, "cannot write %s in the images directory: %s", STATE_FILE, strerror(errno));
        return -1;
    }
    LOGI("wrote %s (%d NPU processes, tokens and image checksums)\n", STATE_FILE, P.ntasks);
    return 0;
}

static FILE *helper_log(void) {
    if (!strcmp(P.log_path, "/var/log/npusnap/criu-plugin.log")) mkdir("/var/log/npusnap", 0700);
    FILE *f = fopen(P.log_path, "ae");
    if (f) setvbuf(f, NULL, _IOLBF, 0);
    return f;
}

static void hlog(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void hlog(FILE *f, const char *fmt, ...) {
    if (!f) return;
    char when[32];
    iso_now(when, sizeof when);
    fprintf(f, "%s [%d] " PREFIX, when, (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
}

/* The detached helper: once CRIU lets a task go (it is no longer traced), roll it back. A task
 * that CRIU killed after a good dump is gone: nothing to do. Bounded by the lease (+30 s). */
/* Whether the dumped task has exited. A restore from the image (criu restore keeps pids) can
 * bring back a task with the same pid, namespace pid, socket and lock token within the helper's
 * polling interval; only the pidfd taken while CRIU still held the task tells them apart. */
static int task_gone(const task *t) {
    if (t->pidfd < 0) return 0;
    struct pollfd p = {t->pidfd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
}

static void helper_main(void) {
    P.stage = -1; /* CRIU's dump (and its freeze timeout) is over for this process */
    FILE *lf = helper_log();
    hlog(lf, "helper for %d task(s) of criu pid %d", P.ntasks, P.criu_pid);
    double deadline = now_s() + P.lease_s + 30;
    int left = P.ntasks;
    int done[MAX_TASKS] = {0};
    while (left && now_s() < deadline) {
        for (int i = 0; i < P.ntasks; i++) {
            if (done[i]) continue;
            task *t = &P.tasks[i];
            if (t->pidfd == -2) {
                hlog(lf, "pid %d: no pidfd, not touched; its agent's lease rolls it back if it runs on", t->pid);
                done[i] = 1;
                left--;
                continue;
            }
            char st = proc_state(t->pid);
            if (task_gone(t) || st == 0 || st == 'Z' || st == 'X' || ns_pid(t->pid) != t->nspid) {
                hlog(lf, "pid %d exited (a dump that was not --leave-running ends the task): nothing to unlock",
                     t->pid);
                done[i] = 1;
                left--;
                continue;
            }
            if (status_field(t->pid, "TracerPid") != 0 || st == 't' || st == 'T') continue; /* CRIU holds it */
            conn c;
            char err[512];
            if (agent_connect(&c, t->pid, t->sock, err, sizeof err) < 0) {
                hlog(lf, "pid %d: %s (retrying)", t->pid, err);
                continue;
            }
            if (task_gone(t)) {
                /* It died while we connected: the peer (same pid) can only be a task CRIU restored
                 * from this very image, which holds the same token. Not ours to roll back. */
                close(c.fd);
                continue;
            }
            sbuf args;
            sb_init(&args);
            token_args(&args, t->token, 0);
            reply r;
            int rc = agent_request(&c, "rollback", args.p, 10, &r, err, sizeof err);
            sb_free(&args);
            if (rc < 0) {
                hlog(lf, "pid %d: rollback: %s (retrying)", t->pid, err);
                close(c.fd);
                continue;
            }
            if (!r.ok && !strcmp(r.name, NPUSNAP_ERR_BUSY)) {
                /* The agent still serves another connection: the dumping CRIU's own (closed only as
                 * CRIU ends), or a status. It serves one at a time: ask again. */
                reply_free(&r);
                agent_close(&c);
                continue;
            }
            if (r.ok)
                hlog(lf, "pid %d rolled back: running, unlocked", t->pid);
            else if (!strcmp(r.name, NPUSNAP_ERR_NOT_OWNER) || !strcmp(r.type, NPUSNAP_ERRTYPE_STATE))
                hlog(lf, "pid %d: nothing to roll back: %s: %s", t->pid, r.name, r.message);
            else
                hlog(lf, "FAILED, npusnap %s: rollback of pid %d: %s: %s; its lease rolls it back, or run `npusnap "
                         "thaw %d`", exit_meaning(EX_STATE_UNKNOWN), t->pid, r.name, r.message, t->pid);
            reply_free(&r);
            agent_close(&c);
            done[i] = 1;
            left--;
        }
        if (left) usleep(50 * 1000);
    }
    for (int i = 0; i < P.ntasks; i++)
        if (!done[i])
            hlog(lf, "FAILED, npusnap %s: pid %d was not released by CRIU within %.0fs; its lease rolls it back, or "
                     "run `npusnap thaw %d`", exit_meaning(EX_STATE_UNKNOWN), P.tasks[i].pid, P.lease_s + 30,
                 P.tasks[i].pid);
    if (lf) fclose(lf);
}

static void spawn_rollback_helper(void) {
    P.criu_pid = (int)getpid();
    /* CRIU still holds every task here (killed or resumed only after fini), so each pid is still
     * the task we locked. */
    for (int i = 0; i < P.ntasks; i++) {
        P.tasks[i].pidfd = (int)syscall(SYS_pidfd_open, P.tasks[i].pid, 0);
        if (P.tasks[i].pidfd < 0) {
            FAIL(EX_STATE_UNKNOWN, "pidfd_open(%d): %s; the helper cannot tell it from a restored task with its pid, "
                                   "so it leaves it to the agent's lease (%.0fs)", P.tasks[i].pid, strerror(errno),
                 P.lease_s);
            P.tasks[i].pidfd = -2; /* the helper leaves it alone */
        }
    }
    pid_t child = fork();
    if (child < 0) {
        FAIL(EX_STATE_UNKNOWN, "cannot fork the rollback helper: %s; the agents' leases (%.0fs) roll back",
             strerror(errno), P.lease_s);
        return;
    }
    if (child == 0) {
        setsid();
        if (fork() != 0) _exit(0);
        /* Keep nothing of CRIU's: runc waits for EOF on CRIU's RPC socket. */
        int devnull = open("/dev/null", O_RDWR);
        if (devnull >= 0) {
            dup2(devnull, 0);
            dup2(devnull, 1);
            dup2(devnull, 2);
        }
        /* Close everything of CRIU's but the pidfds: the gaps between them, in fd order. */
        unsigned from = 3;
        for (;;) {
            unsigned next = ~0U;
            for (int i = 0; i < P.ntasks; i++)
                if (P.tasks[i].pidfd >= (int)from && (unsigned)P.tasks[i].pidfd < next) next = (unsigned)P.tasks[i].pidfd;
            if (next > from) syscall(SYS_close_range, from, next == ~0U ? ~0U : next - 1, 0);
            if (next == ~0U) break;
            from = next + 1;
        }
        signal(SIGPIPE, SIG_IGN);
        helper_main();
        _exit(0);
    }
    int st;
    while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
    }
    for (int i = 0; i < P.ntasks; i++)
        if (P.tasks[i].pidfd >= 0) close(P.tasks[i].pidfd);
    LOGI("a detached helper rolls back the %d locked task(s) if CRIU lets them run (failed dump, --leave-running); "
         "log: %s\n", P.ntasks, P.log_path);
}

/* ---- restore ----------------------------------------------------------------------------- */
static int load_state_file(void) {
    int dirfd = criu_get_image_dir();
    int fd = openat(dirfd, STATE_FILE, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        FAIL(EX_IMAGE, "the image needs %s but has no %s: %s (was it copied without it?)", PLUGIN_NAME, STATE_FILE,
             strerror(errno));
        return -1;
    }
    sbuf s;
    sb_init(&s);
    char buf[8192];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) sb_rawn(&s, buf, (size_t)n);
    close(fd);
    jval v;
    char err[128];
    if (s.oom || json_parse(s.p ? s.p : "", s.len, &v, err, sizeof err) < 0 || v.t != J_OBJ) {
        FAIL(EX_IMAGE, "%s is not valid JSON: %s", STATE_FILE, err);
        sb_free(&s);
        return -1;
    }
    sb_free(&s);
    const jval *fmt = json_get(&v, "format");
    const jval *procs = json_get(&v, "processes");
    const jval *lease = json_get(&v, "lease_s");
    if (!fmt || fmt->t != J_NUM || (int)fmt->num != STATE_FORMAT || !procs || procs->t != J_ARR) {
        FAIL(EX_IMAGE, "%s has an unknown format (this plugin reads format %d)", STATE_FILE, STATE_FORMAT);
        json_free(&v);
        return -1;
    }
    if (lease && lease->t == J_NUM) P.lease_s = lease->num;
    /* A job member's checkpoint: its restore joins the same coordinator (the "restored" barrier). */
    const jval *job = json_get(&v, "job");
    const jval *member = job && job->t == J_OBJ ? json_get(job, "member") : NULL;
    const jval *coord = job && job->t == J_OBJ ? json_get(job, "coordinator") : NULL;
    if (member && member->t == J_NUM && coord && coord->t == J_STR) {
        J.member = (int)member->num;
        snprintf(J.addr, sizeof J.addr, "%s", coord->s);
    }
    P.ntasks = 0;
    for (size_t i = 0; i < procs->n && P.ntasks < MAX_TASKS; i++) {
        const jval *p = &procs->items[i];
        const jval *pid = json_get(p, "pid"), *nspid = json_get(p, "ns_pid"), *sock = json_get(p, "agent_socket"),
                   *tok = json_get(p, "lock_token");
        if (!pid || pid->t != J_NUM || !nspid || nspid->t != J_NUM || !sock || sock->t != J_STR || !tok ||
            tok->t != J_STR) {
            FAIL(EX_IMAGE, "%s: processes[%zu] lacks pid/ns_pid/agent_socket/lock_token", STATE_FILE, i);
            json_free(&v);
            return -1;
        }
        task *t = &P.tasks[P.ntasks++];
        memset(t, 0, sizeof *t);
        t->pid = (int)pid->num;
        t->nspid = (int)nspid->num;
        snprintf(t->sock, sizeof t->sock, "%s", sock->s);
        snprintf(t->token, sizeof t->token, "%s", tok->s);
    }
    json_free(&v);
    LOGI("%s: %d NPU process(es) to restore\n", STATE_FILE, P.ntasks);
    return 0;
}

static int resume_devices_late(int pid) {
    if (P.disabled || P.stage != CR_PLUGIN_STAGE__RESTORE) return -ENOTSUP;
    int nspid = ns_pid(pid);
    for (int i = 0; i < P.ntasks; i++) {
        task *t = &P.tasks[i];
        if (t->nspid == nspid && !t->restored) {
            t->restored = 1;
            t->newpid = pid;
            LOGI("restored pid %d is dumped pid %d (pid %d in its namespace): restore + unlock once it runs\n", pid,
                 t->pid, nspid);
            return 0;
        }
    }
    return -ENOTSUP;
}

static void restore_one(task *t) {
    conn c;
    char err[512];
    int pid = t->newpid;
    if (agent_connect(&c, pid, t->sock, err, sizeof err) < 0) {
        FAIL(EX_AGENT, "restore of pid %d: %s; the agent's lease (%.0fs) restores and unlocks it by itself", pid, err,
             P.lease_s);
        return;
    }
    sbuf args;
    sb_init(&args);
    token_args(&args, t->token, 0);
    const char *ops[] = {"restore", "unlock"};
    for (int i = 0; i < 2; i++) {
        reply r;
        if (agent_request(&c, ops[i], args.p, 900, &r, err, sizeof err) < 0) {
            sb_free(&args);
            FAIL(EX_AGENT, "%s of pid %d: %s; the agent's lease restores and unlocks it by itself", ops[i], pid, err);
            agent_close(&c);
            return;
        }
        if (!r.ok) {
            FAIL(error_exit_code(&r), "%s of pid %d: %s: %s; run `npusnap status %d`, then `npusnap thaw %d`", ops[i],
                 pid, r.name, r.message, pid, pid);
            reply_free(&r);
            sb_free(&args);
            agent_close(&c);
            return;
        }
        reply_free(&r);
    }
    sb_free(&args);
    agent_close(&c);
    LOGI("pid %d: device state restored, unlocked\n", pid);
}

/* ---- init / fini ------------------------------------------------------------------------- */
static int plugin_init(int stage) {
    memset(&P, 0, sizeof P);
    memset(&J, 0, sizeof J);
    J.member = -1;
    J.fd = -1;
    P.stage = stage;
    load_config();
    if (stage == CR_PLUGIN_STAGE__PRE_DUMP) {
        P.disabled = 1; /* pre-dump never freezes device state */
        return 0;
    }
    if (stage == CR_PLUGIN_STAGE__RESTORE) {
        if (!check_and_remove_inventory_plugin(PLUGIN_NAME, strlen(PLUGIN_NAME))) {
            P.disabled = 1; /* not an image this plugin took part in */
            return 0;
        }
        return load_state_file() < 0 ? -1 : 0;
    }
    /* Dump: talk to the agents before CRIU stops the tasks, also under runc (which asks CRIU to
     * freeze the container's cgroup): CRIU thaws it and interrupts the tasks one by one. */
    set_compel_interrupt_only_mode();
    LOGI("loaded (dump), lease %gs, require_agent %d, config %s\n", P.lease_s, P.require_agent, config_path());
    return 0;
}

static void plugin_fini(int stage, int ret) {
    if (P.disabled) return;
    if (stage == CR_PLUGIN_STAGE__DUMP) {
        int saved = ret == 0;
        if (saved && P.ntasks > 0 && write_state_file() < 0) {
            FAIL(EX_IMAGE, "the checkpoint has no %s: it cannot be restored with its device state", STATE_FILE);
            saved = 0;
        }
        if (J.member >= 0) {
            char err[512];
            if (!saved) {
                job_abort(ret ? "its dump failed (CRIU's log says why)" : "its state file could not be written");
            } else if (job_sync("saved", err, sizeof err) < 0) {
                /* CRIU's outcome is decided before fini: the coordinator discards this checkpoint. */
                FAIL(EX_DEVICE, "job member %d: saved, but %s: `npusnap k8s checkpoint` discards this "
                                "checkpoint", J.member, err);
            } else {
                LOGI("job member %d: every member saved\n", J.member);
            }
            if (J.fd >= 0) close(J.fd);
            J.fd = -1;
        }
        if (P.ntasks == 0) return;
        spawn_rollback_helper();
    } else if (stage == CR_PLUGIN_STAGE__RESTORE) {
        if (ret != 0) { /* CRIU removed the restored tasks */
            if (J.member >= 0) job_abort("its restore failed (CRIU's log says why)");
            if (J.fd >= 0) close(J.fd);
            return;
        }
        if (J.member >= 0) {
            /* Every member's tasks are back (locked: their device calls wait) before any member's
             * device state is restored and unlocked: the job is released together. */
            char err[512];
            if (job_connect(err, sizeof err) < 0) {
                LOGW("job member %d: %s: restored on its own, without the job's barrier\n", J.member, err);
            } else if (job_sync("restored", err, sizeof err) < 0) {
                FAIL(EX_DEVICE, "job member %d: %s; its NPU processes stay locked: their agents' leases (%.0fs) "
                                "restore and unlock them, or `npusnap thaw PID`", J.member, err, P.lease_s);
                close(J.fd);
                J.fd = -1;
                return;
            } else {
                LOGI("job member %d: every member restored\n", J.member);
            }
            if (J.fd >= 0) close(J.fd);
            J.fd = -1;
        }
        for (int i = 0; i < P.ntasks; i++) {
            if (!P.tasks[i].restored) {
                FAIL(EX_IMAGE, "dumped pid %d (pid %d in its namespace) was not among the restored tasks",
                     P.tasks[i].pid, P.tasks[i].nspid);
                continue;
            }
            restore_one(&P.tasks[i]);
        }
    }
}

CR_PLUGIN_REGISTER(PLUGIN_NAME, plugin_init, plugin_fini)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__PAUSE_DEVICES, pause_devices)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__CHECKPOINT_DEVICES, checkpoint_devices)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, resume_devices_late)
