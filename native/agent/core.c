/* libnpusnap_agent.so: the npusnap agent's core, in any process that uses the Ascend runtime.
 *
 * Why native: the snapshot Lock makes the job's next device call wait inside the runtime. If
 * that caller holds a lock the agent needs -- for Python, the GIL, when an extension calls the
 * runtime without releasing it -- an agent written in Python can never run again and the job
 * stays frozen (the lease that should unlock it needs the GIL too). This core has its own
 * pthread and never takes the GIL: the control socket, the protocol, the snapshot calls, the
 * state logic and the lease all run here. Python hooks are the one exception, and the agent
 * thread waits for them only with a deadline (hooks.c).
 *
 * Ways in: the constructor starts the agent when NPUSNAP_AGENT=1 (`npusnap run` preloads this
 * library into any dynamically linked program and sets it); npusnap_agent_start() from an
 * application or from the Python face (npusnap_cli.agent.start()); `npusnap attach` loads it.
 *
 * The control socket follows npusnap_cli/paths.py: a 0700 directory per uid, a 0600 socket
 * named <pid>.sock, SO_PEERCRED check that a client is root or our uid, one client at a time.
 */
#include "agent_int.h"

#include <npusnap/agent.h>
#include <npusnap/quietthread.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define POLL_MS 100
#define SEND_TIMEOUT 5.0
#define PARTIAL_IDLE_S 2.0  /* a client that sent part of a line and then nothing is dropped */

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
/* A forked child under NPUSNAP_AGENT=1 starts its agent when it first opens a device: a copy
 * owns no device (CANN does not survive fork), so until then there is nothing to snapshot, and
 * a thread of ours would change what the program sees (a seccomp filter synchronised over every
 * thread, a fork-and-exit helper kept alive, the threads a test counts). npusnap reads such a
 * child's device record instead (devmem.c). */
static int start_on_device_open;

static struct {
    int started;
    pid_t pid;
    volatile int stopping;
    pthread_t thread;
    int listen_fd, client_fd, client_pid;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    char *inbuf;
    size_t inlen;
    double partial_since; /* when the buffered partial line started (0: none) */
    int pending_fd;       /* sent by the client with the line being read (SCM_RIGHTS), -1: none */
    char last_error[512];
} A = {.listen_fd = -1, .client_fd = -1, .pending_fd = -1};

/* The listening socket, for ops.c (hello; the tick's restore detection). */
static agent_endpoint endpoint(void) {
    agent_endpoint ep = {A.path[0] ? A.path : NULL, 0};
    struct stat st;
    if (A.listen_fd >= 0 && fstat(A.listen_fd, &st) == 0) ep.ino = (unsigned long long)st.st_ino;
    return ep;
}

static int ensure_private_dir(const char *dir, char *err, size_t errlen) {
    if (mkdir(dir, 0700) == 0) {
        /* mkdir's mode is filtered by the umask; the process-wide umask must not be changed
         * (other threads create files right now), so fix the mode of what we created. */
        chmod(dir, 0700);
    } else if (errno != EEXIST) {
        snprintf(err, errlen, "cannot create %s: %s", dir, strerror(errno));
        return -1;
    }
    struct stat st;
    if (lstat(dir, &st) < 0) {
        snprintf(err, errlen, "cannot stat %s: %s", dir, strerror(errno));
        return -1;
    }
    if (S_ISLNK(st.st_mode) || !S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "%s is not a real directory (symlink or file); refusing to use it", dir);
        return -1;
    }
    if (st.st_uid != geteuid()) {
        snprintf(err, errlen, "%s is owned by uid %u, not %u; refusing to use it", dir, (unsigned)st.st_uid,
                 (unsigned)geteuid());
        return -1;
    }
    if ((st.st_mode & 07777) != 0700) {
        snprintf(err, errlen, "%s has mode %o, not 700; refusing to use it (fix: chmod 700 %s)", dir,
                 (unsigned)(st.st_mode & 07777), dir);
        return -1;
    }
    return 0;
}

static int bind_socket(char *err, size_t errlen) {
    char dir[512];
    if (agent_runtime_dir(dir, sizeof dir) < 0) {
        snprintf(err, errlen, "runtime directory path too long");
        return -1;
    }
    if (ensure_private_dir(dir, err, errlen) < 0) return -1;
    char path[600];
    snprintf(path, sizeof path, "%s/" NPUSNAP_AGENT_SOCKET_NAME, dir, agent_socket_pid());
    if (strlen(path) >= sizeof A.path) {
        snprintf(err, errlen, "socket path %s exceeds the %zu-byte AF_UNIX limit", path, sizeof A.path - 1);
        return -1;
    }
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            snprintf(err, errlen, "%s exists and is not a socket; not removing it", path);
            return -1;
        }
        unlink(path); /* named after our own pid: left over from a dead process */
    }
    int fd = agent_fd_high(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return -1;
    }
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, strlen(path) + 1);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || chmod(path, 0600) < 0 || listen(fd, 8) < 0) {
        snprintf(err, errlen, "cannot listen on %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    A.listen_fd = fd;
    snprintf(A.path, sizeof A.path, "%s", path);
    return 0;
}

/* ---- the client connection --------------------------------------------------------------- */
static int send_all(int fd, const char *data, size_t len) {
    double deadline = now_s() + SEND_TIMEOUT;
    while (len) {
        ssize_t n = send(fd, data, len, MSG_NOSIGNAL);
        if (n > 0) {
            data += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            double left = deadline - now_s();
            if (left <= 0) return -1;
            struct pollfd p = {fd, POLLOUT, 0};
            poll(&p, 1, (int)(left * 1000) + 1);
            continue;
        }
        return -1;
    }
    return 0;
}

static void drop_pending_fd(void) {
    if (A.pending_fd >= 0) close(A.pending_fd);
    A.pending_fd = -1;
}

static void drop_client(void) {
    drop_pending_fd();
    if (A.client_fd >= 0) close(A.client_fd);
    A.client_fd = -1;
    A.client_pid = 0;
    A.inlen = 0;
    A.partial_since = 0;
}

static void refuse(int fd, const char *name, const char *message) {
    op_error e;
    err_init(&e);
    err_set(&e, NPUSNAP_ERRTYPE_PROTOCOL, name, 0, "%s", message);
    sbuf out;
    sb_init(&out);
    proto_error_line(&out, 0, &e);
    if (out.p) send_all(fd, out.p, out.len);
    sb_free(&out);
    err_free(&e);
    close(fd);
}

static int client_alive(void) {
    struct pollfd p = {A.client_fd, POLLIN, 0};
    if (poll(&p, 1, 0) > 0) {
        if (p.revents & (POLLHUP | POLLERR)) return 0;
        char c;
        ssize_t n = recv(A.client_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return 0;
    }
    return 1;
}

static void accept_client(void) {
    int fd = agent_fd_high(accept4(A.listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (fd < 0) return;
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
        close(fd);
        return;
    }
    if (cred.uid != geteuid() && cred.uid != 0) {
        agent_log("refused a client with uid %u (pid %d): only uid %u or root may connect", (unsigned)cred.uid,
                  (int)cred.pid, (unsigned)geteuid());
        char msg[128];
        snprintf(msg, sizeof msg, "uid %u may not control this process", (unsigned)cred.uid);
        refuse(fd, NPUSNAP_ERR_PERMISSION_DENIED, msg);
        return;
    }
    if (A.client_fd >= 0 && !client_alive()) drop_client(); /* it hung up; EOF not read yet */
    if (A.client_fd >= 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "another client (pid %d) is connected; one at a time", A.client_pid);
        refuse(fd, NPUSNAP_ERR_BUSY, msg);
        return;
    }
    A.client_fd = fd;
    A.client_pid = cred.pid;
    A.inlen = 0;
    A.partial_since = 0;
}

static void reply(const char *data, size_t len) {
    if (A.client_fd < 0) return;
    if (send_all(A.client_fd, data, len) < 0) {
        agent_log("could not answer client pid %d: %s", A.client_pid, strerror(errno));
        drop_client();
    }
}

static void handle_line(const char *line, size_t len) {
    request r;
    op_error e;
    err_init(&e);
    long long id = 0;
    sbuf out;
    sb_init(&out);
    if (proto_decode(line, len, &r, &e, &id) < 0) {
        proto_error_line(&out, id, &e);
    } else {
        r.fd = A.pending_fd;
        agent_endpoint ep = endpoint();
        ops_handle(&r, A.client_pid, &ep, &out);
        proto_request_free(&r);
    }
    drop_pending_fd(); /* one fd goes with one line */
    if (out.p) reply(out.p, out.len);
    sb_free(&out);
    err_free(&e);
}

static void read_client(void) {
    if (!A.inbuf) {
        A.inbuf = malloc(MAX_LINE + 2);
        if (!A.inbuf) {
            drop_client();
            return;
        }
    }
    size_t room = MAX_LINE + 1 - A.inlen;
    /* A request line may come with one file descriptor (the device-memory file of a dump or
     * restore): SCM_RIGHTS, attached to the line's first byte. Any more are closed. */
    struct iovec iov = {A.inbuf + A.inlen, room};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(4 * sizeof(int))];
    } cm;
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof cm.buf;
    ssize_t n = recvmsg(A.client_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    for (struct cmsghdr *c = n > 0 ? CMSG_FIRSTHDR(&mh) : NULL; c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t k = 0; k < nfd; k++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
            if (A.pending_fd < 0) A.pending_fd = agent_fd_high(fd);
            else close(fd);
        }
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) {
        drop_client();
        return;
    }
    A.inlen += (size_t)n;
    while (A.client_fd >= 0) {
        char *nl = memchr(A.inbuf, '\n', A.inlen);
        if (!nl) {
            if (A.inlen > MAX_LINE) {
                op_error e;
                err_init(&e);
                err_set(&e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_LINE_TOO_LONG, 0, "line exceeds %d bytes", MAX_LINE);
                sbuf out;
                sb_init(&out);
                proto_error_line(&out, 0, &e);
                if (out.p) reply(out.p, out.len);
                sb_free(&out);
                err_free(&e);
                drop_client();
                return;
            }
            A.partial_since = A.inlen ? (A.partial_since ? A.partial_since : now_s()) : 0;
            return;
        }
        size_t linelen = (size_t)(nl - A.inbuf);
        A.partial_since = 0;
        handle_line(A.inbuf, linelen);
        if (A.client_fd < 0) return;
        memmove(A.inbuf, nl + 1, A.inlen - linelen - 1);
        A.inlen -= linelen + 1;
        if (A.inlen) A.partial_since = now_s();
    }
}

static void unlink_bound_name(void);

/* ---- the agent thread -------------------------------------------------------------------- */
/* True once every thread of the program has exited and only this one is left. A process lives
 * while any of its threads does: a main thread that ends with the bare exit system call (not
 * exit_group: a program under SECCOMP_MODE_STRICT may use nothing else, and zdtm's seccomp tests
 * do) leaves the process alive as long as the agent thread is, and whoever waits for it waits for
 * ever. Asked without opening a descriptor (a number the program may expect free): the main
 * thread has exited when /proc/self/exe no longer resolves (the kernel drops an exited thread's
 * memory map, through which the link resolves), and /proc/self/task's link count is 2 plus the
 * threads the kernel still counts -- the exited main thread (a zombie until the last thread
 * leaves) and this one. Without /proc, nothing can be told and the agent stays. */
static int main_outlived; /* a thread of the program was seen alive after the main thread exited */

static int program_gone(void) {
    char buf[64];
    if (readlink("/proc/self/exe", buf, sizeof buf) >= 0 || errno != ENOENT) return 0;
    if (readlink("/proc/self", buf, sizeof buf) < 0) return 0;
    struct stat st;
    if (stat("/proc/self/task", &st) != 0) return 0;
    if (st.st_nlink > 4) main_outlived = 1;
    return st.st_nlink <= 4;
}

/* The main thread's exit code as waitpid would report it (field 52 of /proc/self/stat: the
 * thread-group leader's, kept while it is a zombie); -1 if unknown. */
static int main_exit_code(void) {
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    for (int field = 2; p && field < 52; field++) { /* p is at the end of field `field` */
        p = strchr(p + 1, ' ');
    }
    return p ? atoi(p + 1) : -1;
}

/* The program is gone: leave as its destructors would have had it left (agent_fini), and end
 * the process as the program's last thread did. Since Linux 5.17 the last thread to exit gives
 * the process its wait status (synchronize_group_exit), and without npusnap that was the
 * program's; here it is this one. When the main thread was the program's last (as far as the
 * ticks saw: no other thread of the program alive after it), its exit code is known and is ours
 * to end with: a number (the bare exit system call's argument), or the
 * signal that killed that thread alone (seccomp's SECCOMP_RET_KILL_THREAD: SIGSYS), raised
 * here with its default action as the kernel would have raised it in a last thread. Code 0, or
 * an exit we cannot tell (another thread outlived the main one): this thread simply ends, and
 * glibc runs exit(0) if it is the last thread it knows of, as after the program's pthread_exit. */
static void leave_with_program(void) {
    drop_client();
    unlink_bound_name();
    close(A.listen_fd);
    A.listen_fd = -1;
    A.path[0] = 0;
    int code = main_outlived ? -1 : main_exit_code();
    if (code <= 0) return;
    int sig = code & 0x7f;
    if (sig) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, sig);
        pthread_sigmask(SIG_UNBLOCK, &one, NULL);
        syscall(SYS_tgkill, getpid(), (pid_t)syscall(SYS_gettid), sig);
    }
    syscall(SYS_exit, (code >> 8) & 0xff);
}

static void *agent_main(void *arg) {
    (void)arg;
    while (!A.stopping) {
        if (program_gone()) {
            leave_with_program();
            break;
        }
        agent_endpoint ep = endpoint();
        ops_tick(&ep);
        struct pollfd p[2];
        int n = 0;
        p[n++] = (struct pollfd){A.listen_fd, POLLIN, 0};
        if (A.client_fd >= 0) p[n++] = (struct pollfd){A.client_fd, POLLIN, 0};
        int rc = poll(p, (nfds_t)n, POLL_MS);
        if (rc < 0) {
            if (errno != EINTR) usleep(POLL_MS * 1000);
            continue;
        }
        if (n == 2 && p[1].revents) read_client();
        if (p[0].revents & POLLIN) accept_client();
        if (A.client_fd >= 0 && A.partial_since && now_s() - A.partial_since > PARTIAL_IDLE_S) {
            agent_log("dropped client pid %d: it sent part of a line and nothing for %gs", A.client_pid,
                      PARTIAL_IDLE_S);
            drop_client();
        }
    }
    return NULL;
}

static void after_fork_child(void);

static int start_locked(void) {
    if (A.started && A.pid == getpid()) return 0;
    A.last_error[0] = 0;
    agent_log_setup();
    ops_init();
    if (bind_socket(A.last_error, sizeof A.last_error) < 0) return -1;
    A.pid = getpid();
    A.stopping = 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    int rc = npusnap_quiet_thread_create(&A.thread, &attr, agent_main, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        snprintf(A.last_error, sizeof A.last_error, "pthread_create: %s", strerror(rc));
        close(A.listen_fd);
        A.listen_fd = -1;
        unlink(A.path);
        A.path[0] = 0;
        return -1;
    }
    A.started = 1;
    return 0;
}

/* Start the agent (idempotent per process). Returns the socket path, or NULL with the reason in
 * npusnap_agent_last_error(). Never aborts the process. */
AGENT_API const char *npusnap_agent_start(void) {
    pthread_mutex_lock(&start_mu);
    int rc = start_locked();
    pthread_mutex_unlock(&start_mu);
    if (rc < 0) {
        agent_log("could not start the agent: %s", A.last_error);
        return NULL;
    }
    return A.path;
}

AGENT_API const char *npusnap_agent_last_error(void) { return A.last_error; }

AGENT_API int npusnap_agent_running(void) { return A.started && A.pid == getpid(); }

AGENT_API const char *npusnap_agent_socket_path(void) { return npusnap_agent_running() ? A.path : NULL; }

/* Remove the name our socket is bound to now, not A.path: a replica restored from an image of
 * us (`restore --replicas`) carries our A.path in its memory but listens under a name of its
 * own, and A.path may be ours, still running. */
static void unlink_bound_name(void) {
    struct sockaddr_un addr;
    socklen_t len = sizeof addr;
    memset(&addr, 0, sizeof addr);
    if (A.listen_fd < 0 || getsockname(A.listen_fd, (struct sockaddr *)&addr, &len) < 0 ||
        addr.sun_path[0] != '/')
        return;
    struct stat st;
    if (lstat(addr.sun_path, &st) == 0 && S_ISSOCK(st.st_mode)) unlink(addr.sun_path);
}

/* Stop serving and remove the socket; the snapshot state is left as it is. */
AGENT_API void npusnap_agent_stop(void) {
    pthread_mutex_lock(&start_mu);
    if (A.started && A.pid == getpid()) {
        A.stopping = 1;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 5;
        if (pthread_timedjoin_np(A.thread, NULL, &ts) != 0) {
            agent_log("the agent thread did not stop within 5s (busy in an operation); detaching it");
            pthread_detach(A.thread);
        }
        drop_client();
        unlink_bound_name();
        close(A.listen_fd);
        A.listen_fd = -1;
        A.path[0] = 0;
        A.started = 0;
    }
    pthread_mutex_unlock(&start_mu);
}

/* ---- process life cycle ------------------------------------------------------------------ */
/* In a forked child only the forking thread exists: the parent's agent thread, client and
 * listener are not ours. Close them (the path stays: it is the parent's) and start afresh if
 * the environment asks for an agent in every process. */
static void after_fork_child(void) {
    pthread_mutex_init(&start_mu, NULL);
    hooks_after_fork();
    if (A.client_fd >= 0) close(A.client_fd);
    if (A.listen_fd >= 0) close(A.listen_fd);
    A.client_fd = A.listen_fd = -1;
    A.started = 0;
    A.path[0] = 0;
    A.inlen = 0;
    A.partial_since = 0;
    agent_log_setup(); /* the default file is named after our own pid */
    const char *sw = getenv("NPUSNAP_AGENT");
    if (!sw || strcmp(sw, "1") != 0) return;
    /* Only a preloaded agent sees the child's device calls; one loaded later starts now. */
    if (npusnap_devmem_preloaded())
        __atomic_store_n(&start_on_device_open, 1, __ATOMIC_RELAXED);
    else
        npusnap_agent_start();
}

/* After a device-opening call of the job succeeded (devmem.c calls it). */
static void agent_device_opened(void) {
    if (!__atomic_load_n(&start_on_device_open, __ATOMIC_RELAXED)) return;
    __atomic_store_n(&start_on_device_open, 0, __ATOMIC_RELAXED);
    npusnap_agent_start();
}

/* `npusnap attach` of a native process loads a private copy of this library next to a marker
 * file: the process's environment cannot be changed, so the marker is what switches it on. */
static int attach_marker_present(void) {
    Dl_info info;
    if (!dladdr((void *)attach_marker_present, &info) || !info.dli_fname) return 0;
    char path[600];
    snprintf(path, sizeof path, "%s", info.dli_fname);
    char *slash = strrchr(path, '/');
    if (!slash) return 0;
    snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "npusnap-attach-start");
    return access(path, F_OK) == 0;
}

/* At exit(), remove our socket file: under `npusnap run` every short-lived process of the tree
 * (a shell, a compiler) has an agent, and their names would pile up in the runtime directory.
 * The agent thread is not joined: it may be inside an operation, and exit must not wait. */
__attribute__((destructor)) static void agent_fini(void) {
    if (A.started && A.pid == getpid() && A.path[0]) unlink_bound_name();
}

__attribute__((constructor)) static void agent_init(void) {
    hooks_init();
    npusnap_devmem_on_device_open(agent_device_opened);
    agent_log_setup();
    pthread_atfork(NULL, NULL, after_fork_child);
    const char *sw = getenv("NPUSNAP_AGENT");
    if ((sw && strcmp(sw, "1") == 0) || attach_marker_present()) npusnap_agent_start();
}
