/* A C program on the (simulated) NPU for the "any program" tests: no Python anywhere.
 *
 * It keeps a buffer in device memory and every step copies it to the host, updates it
 * deterministically, copies it back and prints "step N checksum C" (the same sequence as the
 * Python workload of tests/integration/agentlib.py), so a dump/restore that loses device memory
 * or a step shows in the output.
 *
 *   npu_stepper [--steps N] [--interval-ms MS] [--device D] [--libs DIR] [--threads T]
 *               [--stopped-child 1]
 *   (steps 0 = forever)
 *
 * --stopped-child 1 forks a child once the device is set up and stops it (SIGSTOP), as a shell
 * stops a job: the child never opens a device (a forked child owns none), prints "child
 * continued" should anyone resume it, and is killed after the last step.
 *
 * --libs DIR dlopens every libjx*.so in DIR and --threads T starts T threads that wait on a
 * condition variable for ever: with npusnap_workloads/jaxsize.py's libraries this is a
 * process the size of a JAX job, for the attach tests and the bench.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int aclError;
aclError aclInit(const char *config);
aclError aclrtSetDevice(int32_t device);
aclError aclrtMalloc(void **dev, size_t size, int policy);
aclError aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t count, int kind);

#define N 256
enum { H2D = 1, D2H = 2 };

static void check(aclError rc, const char *what) {
    if (rc != 0) {
        fprintf(stderr, "%s failed: %d\n", what, rc);
        exit(1);
    }
}

static void say(const char *line) {
    /* one write per line, to a file opened O_APPEND by the test */
    size_t len = strlen(line);
    if (write(1, line, len) != (ssize_t)len) exit(2);
}

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;

static void *idle_worker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&pool_mu);
    for (;;) pthread_cond_wait(&pool_cv, &pool_mu);
    return NULL;
}

static void on_cont(int sig) {
    (void)sig;
    static const char msg[] = "child continued\n";
    if (write(1, msg, sizeof msg - 1) < 0) _exit(3);
}

static pid_t stopped_child(void) {
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        exit(1);
    }
    if (child == 0) {
        signal(SIGCONT, on_cont);
        for (;;) pause();
    }
    int st = 0;
    kill(child, SIGSTOP);
    if (waitpid(child, &st, WUNTRACED) != child || !WIFSTOPPED(st)) {
        fprintf(stderr, "the child did not stop\n");
        exit(1);
    }
    return child;
}

static int load_libs(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) {
        perror(dir);
        exit(1);
    }
    int n = 0;
    struct dirent *e;
    char path[4096];
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (strncmp(e->d_name, "libjx", 5) != 0 || len < 4 || strcmp(e->d_name + len - 3, ".so") != 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (!dlopen(path, RTLD_NOW | RTLD_LOCAL)) {
            fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
            exit(1);
        }
        n++;
    }
    closedir(d);
    return n;
}

int main(int argc, char **argv) {
    long steps = 0, interval_ms = 20;
    int device = 0, threads = 0, libs = 0, with_child = 0;
    const char *libdir = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--interval-ms")) interval_ms = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--device")) device = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--libs")) libdir = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--stopped-child")) with_child = atoi(argv[i + 1]);
    }
    if (libdir) libs = load_libs(libdir);
    for (int t = 0; t < threads; t++) {
        pthread_t th;
        if (pthread_create(&th, NULL, idle_worker, NULL) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            return 1;
        }
    }
    if (libdir || threads) {
        char hello[128];
        snprintf(hello, sizeof hello, "jaxsize libs=%d threads=%d\n", libs, threads);
        say(hello);
    }
    check(aclInit(NULL), "aclInit");
    check(aclrtSetDevice(device), "aclrtSetDevice");
    void *dev = NULL;
    check(aclrtMalloc(&dev, N, 0), "aclrtMalloc");
    uint8_t host[N];
    memset(host, 0, sizeof host);
    check(aclrtMemcpy(dev, N, host, N, H2D), "H2D");
    char line[128];
    pid_t child = with_child ? stopped_child() : 0;
    if (child) {
        snprintf(line, sizeof line, "child stopped %d\n", (int)child);
        say(line);
    }
    snprintf(line, sizeof line, "ready %d\n", (int)getpid());
    say(line);
    for (long step = 0; steps == 0 || step < steps; step++) {
        check(aclrtMemcpy(host, N, dev, N, D2H), "D2H");
        long sum = 0;
        for (int i = 0; i < N; i++) {
            host[i] = (uint8_t)((host[i] * 31 + step + i) % 251);
            sum += host[i];
        }
        check(aclrtMemcpy(dev, N, host, N, H2D), "H2D");
        snprintf(line, sizeof line, "step %ld checksum %ld\n", step, sum);
        say(line);
        if (interval_ms > 0) {
            struct timespec ts = {interval_ms / 1000, (interval_ms % 1000) * 1000000L};
            while (nanosleep(&ts, &ts) != 0) {
            }
        }
    }
    if (child) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
    }
    return 0;
}
