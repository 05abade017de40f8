/* The agent's messages and descriptors, and where they go: the log file (never the job's own
 * stderr), descriptors kept above the numbers a program uses, and the runtime directory and pid
 * that name the agent's files (the rules of npusnap_cli/paths.py). */
#include "agent_int.h"

#include <npusnap/agent.h>

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- descriptors ------------------------------------------------------------------------ */
/* The agent's descriptors live high, close-on-exec: a program may rely on open() returning the
 * lowest free number (close(0); open("/dev/null") for stdin) or dup2 onto a number it picked, and
 * a descriptor of ours at a low number would take its place or be clobbered by it. Below the soft
 * RLIMIT_NOFILE (a dup above it fails), capped at 1024 so that a huge limit does not grow the
 * kernel's descriptor table for us, and 32 below it: the agent holds at most four at once. */
int agent_fd_floor(void) {
    struct rlimit rl;
    long cur = 1024;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < 1024)
        cur = (long)rl.rlim_cur;
    return cur >= 128 ? (int)cur - 32 : (int)cur / 2;
}

int agent_fd_high(int fd) {
    if (fd < 0) return fd;
    int hi = fcntl(fd, F_DUPFD_CLOEXEC, agent_fd_floor());
    if (hi < 0) { /* every number above the floor taken: keep it where it is, close-on-exec still */
        fcntl(fd, F_SETFD, FD_CLOEXEC);
        return fd;
    }
    close(fd);
    return hi;
}

/* ---- messages ---------------------------------------------------------------------------- */
/* The agent's lines go to a log file, not to the job's stderr: a job under `npusnap run` must print
 * exactly what it prints without it. The file is named once per process (at start, and again in a
 * forked child), from the environment as it was then: NPUSNAP_AGENT_LOG (set by `npusnap run` for
 * the whole tree: one file per job), else <runtime dir>/<pid>.log. NPUSNAP_AGENT_STDERR=1 also
 * writes each line to stderr, as the agent once did. */
static struct {
    char path[600];
    int to_stderr;
} L;

void agent_log_setup(void) {
    const char *sw = getenv(NPUSNAP_AGENT_STDERR_ENV);
    L.to_stderr = sw && strcmp(sw, "1") == 0;
    const char *env = getenv(NPUSNAP_AGENT_LOG_ENV);
    L.path[0] = 0;
    if (env && env[0] == '/') {
        snprintf(L.path, sizeof L.path, "%s", env);
        return;
    }
    char dir[512];
    if (agent_runtime_dir(dir, sizeof dir) == 0) snprintf(L.path, sizeof L.path, "%s/" NPUSNAP_AGENT_LOG_NAME, dir, agent_socket_pid());
}

const char *agent_log_path(void) { return L.path[0] ? L.path : NULL; }

/* Only into a directory that nobody else can plant a file or a symlink in: a real directory
 * (not a symlink) of ours or root's, writable by no one else (a squatted runtime directory in a
 * shared /tmp would otherwise receive the job's messages). */
static int log_dir_safe(void) {
    char dir[sizeof L.path];
    snprintf(dir, sizeof dir, "%s", L.path);
    char *slash = strrchr(dir, '/');
    if (!slash) return 0;
    if (slash == dir) slash[1] = 0;
    else *slash = 0;
    struct stat st;
    if (lstat(dir, &st) < 0 || !S_ISDIR(st.st_mode)) return 0;
    if (st.st_uid != geteuid() && st.st_uid != 0) return 0;
    return (st.st_mode & 022) == 0;
}

/* One line (with its newline) into the log file: opened, appended with one write, closed. Never
 * kept open: CRIU would dump it with the job and, at restore, refuse a log that has grown since
 * (it checks a regular file's size), or one that is missing on another node. */
static void log_append(const char *line, size_t len) {
    if (!L.path[0] || !log_dir_safe()) return;
    int fd = open(L.path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY, 0600);
    if (fd < 0) return;
    char stamp[40];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ ", &tm);
    char buf[800];
    if (n + len > sizeof buf) len = sizeof buf - n;
    memcpy(buf, stamp, n);
    memcpy(buf + n, line, len);
    ssize_t w = write(fd, buf, n + len); /* one write: lines of several processes never interleave */
    (void)w;
    close(fd);
}

void agent_log(const char *fmt, ...) {
    char msg[700];
    int n = snprintf(msg, sizeof msg, "npusnap-agent: [%d] ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + n, sizeof msg - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(msg);
    msg[len++] = '\n';
    log_append(msg, len);
    if (L.to_stderr) {
        ssize_t w = write(2, msg, len); /* one write: lines of several threads never interleave */
        (void)w;
    }
}

/* For the Python face: one message, logged the same way. */
AGENT_API void npusnap_agent_log(const char *message) {
    if (message) agent_log("%s", message);
}

AGENT_API const char *npusnap_agent_log_file(void) { return agent_log_path(); }

/* ---- paths (the rules of npusnap_cli/paths.py) ------------------------------------------- */
int agent_runtime_dir(char *out, size_t outlen) {
    const char *env = getenv(NPUSNAP_AGENT_SOCKET_ENV_DIR);
    if (env && *env) return snprintf(out, outlen, "%s", env) >= (int)outlen ? -1 : 0;
    uid_t uid = geteuid();
    if (uid == 0) return snprintf(out, outlen, NPUSNAP_AGENT_SOCKET_ROOT_DIR) >= (int)outlen ? -1 : 0;
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (xdg && *xdg && stat(xdg, &st) == 0 && S_ISDIR(st.st_mode) && strcmp(xdg, "/tmp") != 0) {
        return snprintf(out, outlen, "%s/" NPUSNAP_AGENT_SOCKET_XDG_SUBDIR, xdg) >= (int)outlen ? -1 : 0;
    }
    return snprintf(out, outlen, NPUSNAP_AGENT_SOCKET_TMP_DIR, (unsigned)uid) >= (int)outlen ? -1 : 0;
}

/* The pid the socket is named after: our pid as the host's /proc sees it. A job started as init
 * of its own pid namespace (`npusnap run --pid-ns`, which keeps the host's /proc) is pid 1 to
 * getpid(), as every other such job is; /proc/self still reads the host's pid there, which the
 * CLI looks up by. Under a /proc of our own namespace the two agree. */
int agent_socket_pid(void) {
    char buf[32];
    ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
    if (n > 0) {
        buf[n] = 0;
        char *end;
        long v = strtol(buf, &end, 10);
        if (*end == 0 && v > 0) return (int)v;
    }
    return (int)getpid();
}
