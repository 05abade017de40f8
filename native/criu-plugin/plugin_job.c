/* The job coordinator: a dump of one container of a job across containers joins `npusnap k8s
 * checkpoint` and holds its barriers (npusnap_plugin.c's overview). */
#define _GNU_SOURCE
#include "plugin.h"

/* ---- the job coordinator (a job across containers; see the top of the file) ------------------ */
/* NPUSNAP_JOB_COORDINATOR / NPUSNAP_JOB_MEMBER from the dumped root's environment: the pod spec
 * sets them, since container engines hand CRIU no environment of the job's own. */
void job_read_env(int pid) {
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
int job_connect(char *err, size_t errlen) {
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
int job_sync(const char *phase, char *err, size_t errlen) {
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
void job_abort(const char *reason) {
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
