/* What a program can observe of npusnap: run with and without `npusnap run`, it must print the
 * same bytes and end the same way (tests/integration/test_agent_quiet.py).
 *
 *   quiet_probe bare-exit        main thread ends with the bare exit system call (code 7), not
 *                                exit_group
 *   quiet_probe fork-bare-exit   a forked child (no NPU) does that; the parent waits for it
 *   quiet_probe seccomp-strict   a forked child under SECCOMP_MODE_STRICT does (zdtm seccomp_strict)
 *   quiet_probe seccomp-kill     a forked child's main thread is killed by its seccomp filter
 *                                (SECCOMP_RET_KILL_THREAD, zdtm seccomp_filter): the parent sees
 *                                SIGSYS
 *   quiet_probe pthread-exit     main calls pthread_exit, the last thread returns: exit(0) follows
 *   quiet_probe signalfd         NPU streams made first, then SIGUSR1 blocked and read from a
 *                                signalfd (zdtm signalfd00): no thread of the runtime may take it
 *   quiet_probe fds              the lowest free descriptors are the program's, and fixed numbers
 *                                (dup2 to 11, 12 as zdtm pipe00) are free to take
 *   quiet_probe talk N MS [GO]   an NPU job that writes "out i" to stdout and "err i" to stderr
 *                                every MS ms for N steps; with GO, waits for that file to exist
 *                                before step 1 (a dump is taken then)
 *
 * A wait that would hang (a child kept alive) fails with "timeout" instead (alarm).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int aclError;
aclError aclInit(const char *config);
aclError aclrtSetDevice(int32_t device);
aclError aclrtCreateStream(void **stream);
aclError aclrtMalloc(void **dev, size_t size, int policy);
aclError aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t count, int kind);

enum { H2D = 1, D2H = 2 };

static void say(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(int fd, const char *fmt, ...) {
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (write(fd, line, (size_t)n) != n) _exit(2); /* one write per line: the files are O_APPEND */
}

static void check(aclError rc, const char *what) {
    if (rc != 0) {
        say(2, "%s failed: %d\n", what, rc);
        exit(1);
    }
}

static void on_alarm(int sig) {
    (void)sig;
    say(1, "timeout\n");
    _exit(3);
}

static int wait_child(pid_t pid) {
    signal(SIGALRM, on_alarm);
    alarm(20);
    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) return -1;
    }
    alarm(0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void *last_thread(void *arg) {
    (void)arg;
    usleep(100 * 1000);
    say(1, "pthread-exit: the last thread returns\n");
    return NULL;
}

static void device_setup(void) {
    check(aclInit(NULL), "aclInit");
    check(aclrtSetDevice(0), "aclrtSetDevice");
    void *stream;
    check(aclrtCreateStream(&stream), "aclrtCreateStream");
}

static int mode_signalfd(void) {
    device_setup(); /* the runtime's threads exist before the signals are blocked */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGUSR1);
    int fd = signalfd(-1, &mask, SFD_NONBLOCK);
    if (fd < 0) {
        say(1, "signalfd: %s\n", strerror(errno));
        return 1;
    }
    sigaddset(&mask, SIGUSR2);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    struct signalfd_siginfo info;
    kill(getpid(), SIGUSR2);
    if (read(fd, &info, sizeof info) >= 0) {
        say(1, "signalfd: a signal it does not watch came through\n");
        return 1;
    }
    kill(getpid(), SIGUSR1);
    if (read(fd, &info, sizeof info) != (ssize_t)sizeof info || info.ssi_signo != SIGUSR1) {
        say(1, "signalfd: SIGUSR1 did not arrive\n");
        return 1;
    }
    say(1, "signalfd: SIGUSR1 read\n");
    return 0;
}

static int mode_fds(void) {
    int p[2];
    if (pipe(p) < 0) return 1;
    int n = open("/dev/null", O_RDONLY);
    say(1, "fds: pipe %d %d, open %d\n", p[0], p[1], n);
    /* zdtm pipe00: fixed numbers, then the originals closed and the pipe used through them */
    if (dup2(p[1], 11) != 11 || dup2(p[0], 12) != 12) {
        say(1, "fds: dup2: %s\n", strerror(errno));
        return 1;
    }
    close(p[0]);
    close(p[1]);
    if (write(11, "x", 1) != 1) return 1;
    char c;
    if (read(12, &c, 1) != 1 || c != 'x') return 1;
    close(0);
    int zero = open("/dev/null", O_RDONLY);
    say(1, "fds: 11 -> 12 ok, stdin reopened as %d\n", zero);
    return 0;
}

static int mode_talk(int steps, int ms, const char *go) {
    device_setup();
    void *dev;
    uint64_t host = 0;
    check(aclrtMalloc(&dev, sizeof host, 0), "aclrtMalloc");
    check(aclrtMemcpy(dev, sizeof host, &host, sizeof host, H2D), "aclrtMemcpy");
    say(1, "ready\n");
    for (int i = 0; i < steps; i++) {
        if (i == 1 && go) {
            while (access(go, F_OK) != 0) usleep(20 * 1000);
        }
        check(aclrtMemcpy(&host, sizeof host, dev, sizeof host, D2H), "aclrtMemcpy");
        host = host * 31 + (uint64_t)i;
        check(aclrtMemcpy(dev, sizeof host, &host, sizeof host, H2D), "aclrtMemcpy");
        say(1, "out %d %llu\n", i, (unsigned long long)host);
        say(2, "err %d\n", i);
        usleep((useconds_t)ms * 1000);
    }
    say(1, "done\n");
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "bare-exit") == 0) {
        say(1, "bare-exit: main thread leaves\n");
        syscall(SYS_exit, 7);
    }
    if (strcmp(mode, "fork-bare-exit") == 0 || strcmp(mode, "seccomp-strict") == 0) {
        int strict = strcmp(mode, "seccomp-strict") == 0;
        pid_t pid = fork();
        if (pid < 0) return 1;
        if (pid == 0) {
            if (strict && prctl(PR_SET_SECCOMP, SECCOMP_MODE_STRICT) < 0) _exit(1);
            say(1, "%s: child leaves\n", mode); /* write: allowed in strict mode */
            syscall(SYS_exit, 0);               /* exit_group is not */
        }
        say(1, "%s: child exited %d\n", mode, wait_child(pid));
        return 0;
    }
    if (strcmp(mode, "seccomp-kill") == 0) {
        pid_t pid = fork();
        if (pid < 0) return 1;
        if (pid == 0) {
            struct sock_filter f[] = {
                BPF_STMT(BPF_LD + BPF_W + BPF_ABS, offsetof(struct seccomp_data, nr)),
                BPF_JUMP(BPF_JMP + BPF_JEQ + BPF_K, __NR_ptrace, 0, 1),
                BPF_STMT(BPF_RET + BPF_K, SECCOMP_RET_KILL_THREAD),
                BPF_STMT(BPF_RET + BPF_K, SECCOMP_RET_ALLOW),
            };
            struct sock_fprog prog = {sizeof f / sizeof f[0], f};
            if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) < 0)
                _exit(1);
            syscall(__NR_ptrace, PTRACE_TRACEME, 0, 0, 0);
            _exit(1); /* not reached: the filter kills this thread */
        }
        say(1, "seccomp-kill: child status %d\n", wait_child(pid));
        return 0;
    }
    if (strcmp(mode, "pthread-exit") == 0) {
        pthread_t t;
        pthread_create(&t, NULL, last_thread, NULL);
        pthread_exit(NULL);
    }
    if (strcmp(mode, "signalfd") == 0) return mode_signalfd();
    if (strcmp(mode, "fds") == 0) return mode_fds();
    if (strcmp(mode, "environ") == 0) {
        /* What a library that asks whether anything is preloaded learns (torch_npu's
         * FunctionLoader does, and warns). */
        const char *p = getenv("LD_PRELOAD");
        char line[256];
        snprintf(line, sizeof line, "environ: LD_PRELOAD %s\n", p ? p : "(unset)");
        say(1, line);
        return 0;
    }
    if (strcmp(mode, "talk") == 0 && argc >= 4) return mode_talk(atoi(argv[2]), atoi(argv[3]), argc > 4 ? argv[4] : NULL);
    say(2, "usage: quiet_probe bare-exit|fork-bare-exit|seccomp-strict|seccomp-kill|pthread-exit|signalfd|fds|environ|talk N MS [GO]\n");
    return 2;
}
