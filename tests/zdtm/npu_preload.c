/* Makes a CRIU zdtm test an NPU process, for tests/zdtm/parity.py.
 *
 * Preloaded into the test (and into make and sh, which it leaves alone: it acts only in the
 * program named by ZDTM_NPU_TEST). A zdtm test daemonizes in test_init(): it forks, and the child,
 * the test from then on, calls setsid() first. There, before the test's own set-up and long before
 * the dump, it opens device 0, allocates 1 MiB of device memory and writes a pattern into it (in
 * the daemon itself: a device context belongs to the process that opened it, not to a fork). When the process exits
 * normally (a zdtm test does, after SIGTERM and its own checks), it reads the memory back and
 * appends one line to ZDTM_NPU_OUT: "npu PID ok", "npu PID bad OFFSET" or "npu PID error CALL RC".
 * The harness looks for the line of the test's daemon: a snapshot that lost or moved device
 * memory shows there even when the test itself passes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int aclError;
aclError aclInit(const char *config);
aclError aclrtSetDevice(int32_t device);
aclError aclrtMalloc(void **dev, size_t size, int policy);
aclError aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t count, int kind);

enum { H2D = 1, D2H = 2 };
#define BYTES (1u << 20)

static void *device_buf;
static int active;

static unsigned char pattern_at(size_t i) { return (unsigned char)((i * 2654435761u) >> 13); }

static void report(const char *line) {
    const char *out = getenv("ZDTM_NPU_OUT");
    if (!out) return;
    int fd = open(out, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) return;
    ssize_t w = write(fd, line, strlen(line));
    (void)w;
    close(fd);
}

static int is_the_test(void) {
    const char *want = getenv("ZDTM_NPU_TEST");
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (!want || n <= 0) return 0;
    exe[n] = 0;
    const char *base = strrchr(exe, '/');
    return strcmp(base ? base + 1 : exe, want) == 0;
}

static void npu_on(void) {
    char line[128];
    unsigned char *host = malloc(BYTES);
    if (!host) return;
    for (size_t i = 0; i < BYTES; i++) host[i] = pattern_at(i);
    const char *dev = getenv("ZDTM_NPU_DEVICE");
    aclError rc;
    const char *call = "aclInit";
    if ((rc = aclInit(NULL)) == 0 && (call = "aclrtSetDevice", rc = aclrtSetDevice(dev ? atoi(dev) : 0)) == 0 &&
        (call = "aclrtMalloc", rc = aclrtMalloc(&device_buf, BYTES, 0)) == 0 &&
        (call = "aclrtMemcpy", rc = aclrtMemcpy(device_buf, BYTES, host, BYTES, H2D)) == 0) {
        active = 1;
    } else {
        snprintf(line, sizeof line, "npu %d error %s %d\n", (int)getpid(), call, rc);
        report(line);
    }
    free(host);
}

pid_t setsid(void) {
    static pid_t (*real_setsid)(void);
    static int done;
    if (!real_setsid) real_setsid = (pid_t(*)(void))dlsym(RTLD_NEXT, "setsid");
    pid_t sid = real_setsid();
    if (sid >= 0 && !done && is_the_test()) {
        done = 1;
        npu_on();
    }
    return sid;
}

__attribute__((destructor)) static void npu_check(void) {
    char line[128];
    if (!active || getpid() != getsid(0)) return; /* the daemon, not a child it forked */
    unsigned char *host = malloc(BYTES);
    if (!host) return;
    aclError rc = aclrtMemcpy(host, BYTES, device_buf, BYTES, D2H);
    if (rc != 0) {
        snprintf(line, sizeof line, "npu %d error aclrtMemcpy %d\n", (int)getpid(), rc);
    } else {
        size_t i = 0;
        while (i < BYTES && host[i] == pattern_at(i)) i++;
        if (i == BYTES)
            snprintf(line, sizeof line, "npu %d ok\n", (int)getpid());
        else
            snprintf(line, sizeof line, "npu %d bad %zu\n", (int)getpid(), i);
    }
    free(host);
    report(line);
}
