/* A C program on the (simulated) NPU for the "any program" tests: no Python anywhere.
 *
 * It keeps a buffer in device memory and every step copies it to the host, updates it
 * deterministically, copies it back and prints "step N checksum C" (the same sequence as the
 * Python workload of tests/integration/agentlib.py), so a dump/restore that loses device memory
 * or a step shows in the output.
 *
 *   npu_stepper [--steps N] [--interval-ms MS] [--device D]   (steps 0 = forever)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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

int main(int argc, char **argv) {
    long steps = 0, interval_ms = 20;
    int device = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--interval-ms")) interval_ms = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--device")) device = atoi(argv[i + 1]);
    }
    check(aclInit(NULL), "aclInit");
    check(aclrtSetDevice(device), "aclrtSetDevice");
    void *dev = NULL;
    check(aclrtMalloc(&dev, N, 0), "aclrtMalloc");
    uint8_t host[N];
    memset(host, 0, sizeof host);
    check(aclrtMemcpy(dev, N, host, N, H2D), "H2D");
    char line[128];
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
    return 0;
}
