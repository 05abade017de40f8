/* One connection to a task's agent: found through the task's own mount and pid namespaces, the
 * peer checked, one request at a time through the agent's own codec. */
#define _GNU_SOURCE
#include "plugin.h"

/* ---- one connection to an agent ---------------------------------------------------------- */

/* Connect to the agent of host pid `pid` listening at `sock` (a path in its mount namespace):
 * through /proc/PID/root, via an O_PATH fd of the directory so the address stays short. The peer
 * must be `pid` itself (SO_PEERCRED, translated into our pid namespace). */
int agent_connect(conn *c, int pid, const char *sock, char *err, size_t errlen) {
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


/* Send one request (args: a JSON object text, built with sbuf) and read its answer, both through the
 * agent's own codec (client.c, proto.c). -1: not sent, transport failure or a malformed answer (err). */
int agent_request(conn *c, const char *op, const char *args, double timeout_s, reply *r, char *err,
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
void token_args(sbuf *b, const char *token, double lease_s) {
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
void agent_close(conn *c) {
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

int error_exit_code(const reply *r) {
    return (!strcmp(r->type, NPUSNAP_ERRTYPE_ACL) || !strcmp(r->type, NPUSNAP_ERRTYPE_STATE)) ? EX_DEVICE : EX_AGENT;
}

int find_and_connect(int pid, int nspid, char *sock, size_t socklen, conn *c, char *err, size_t errlen) {
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
