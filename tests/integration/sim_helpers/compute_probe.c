/* A C program on the simulated NPU's ACL and driver APIs, for tests/integration/test_sim_compute.py.
 * Usage: compute_probe SCENARIO KERNELS.so. It runs one scenario and prints "key value" lines
 * (the test asserts on them); it exits non-zero only when it cannot run (a setup call failed).
 * Prototypes are those of acl_rt.h and ascend_hal.h, declared here as a program would see them. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int aclError;
aclError aclInit(const char *);
aclError aclrtSetDevice(int32_t);
aclError aclrtGetDevice(int32_t *);
aclError aclrtMalloc(void **, size_t, int);
aclError aclrtFree(void *);
aclError aclrtMemcpy(void *, size_t, const void *, size_t, int);
aclError aclrtMemcpyAsync(void *, size_t, const void *, size_t, int, void *);
aclError aclrtMemset(void *, size_t, int32_t, size_t);
aclError aclrtMemsetAsync(void *, size_t, int32_t, size_t, void *);
aclError aclrtGetMemInfo(int, size_t *, size_t *);
aclError aclrtGetDeviceCount(uint32_t *);
aclError aclrtMallocHost(void **, size_t);
aclError aclrtFreeHost(void *);
aclError aclrtLaunchCallback(void (*)(void *), void *, int, void *);
aclError aclrtSubscribeReport(uint64_t, void *);
aclError aclrtUnSubscribeReport(uint64_t, void *);
aclError aclrtProcessReport(int32_t);
aclError aclrtCreateStream(void **);
aclError aclrtCreateStreamWithConfig(void **, uint32_t, uint32_t);
aclError aclrtDestroyStream(void *);
aclError aclrtSynchronizeStream(void *);
aclError aclrtSynchronizeStreamWithTimeout(void *, int32_t);
aclError aclrtSynchronizeDevice(void);
aclError aclrtStreamQuery(void *, int *);
aclError aclrtCreateEvent(void **);
aclError aclrtRecordEvent(void *, void *);
aclError aclrtStreamWaitEvent(void *, void *);
aclError aclrtSynchronizeEvent(void *);
aclError aclrtQueryEventStatus(void *, int *);
aclError aclrtEventElapsedTime(float *, void *, void *);
aclError aclrtDestroyEvent(void *);
aclError aclrtBinaryLoadFromFile(const char *, void *, void **);
aclError aclrtBinaryGetFunction(void *, const char *, void **);
aclError aclrtLaunchKernel(void *, uint32_t, const void *, size_t, void *);
aclError aclrtReserveMemAddress(void **, size_t, size_t, void *, uint64_t);
aclError aclrtReleaseMemAddress(void *);
aclError aclrtMallocPhysical(void **, size_t, const void *, uint64_t);
aclError aclrtFreePhysical(void *);
aclError aclrtMapMem(void *, size_t, size_t, void *, uint64_t);
aclError aclrtUnmapMem(void *);
aclError aclrtMemGetAllocationGranularity(void *, int, size_t *);
aclError aclrtSnapShotProcessLock(int, void *);
aclError aclrtSnapShotProcessUnlock(int, void *);
aclError aclrtSnapShotProcessBackup(int, void *);
aclError aclrtSnapShotProcessRestore(int, void *);
aclError aclrtSnapShotCallbackRegister(int, uint32_t (*)(int32_t, void *), void *);
aclError aclrtSnapShotCallbackUnregister(int, uint32_t (*)(int32_t, void *));
int rtSnapShotProcessGetState(int *);
int drvMemcpy(unsigned long long, size_t, unsigned long long, size_t);

#define MiB (1u << 20)
#define CHECK(x)                                                                                                \
    do {                                                                                                        \
        int rc_ = (x);                                                                                          \
        if (rc_ != 0) {                                                                                         \
            fprintf(stderr, "setup failed: %s = %d\n", #x, rc_);                                                \
            exit(2);                                                                                            \
        }                                                                                                       \
    } while (0)

struct fill_args {
    uint64_t addr, chunk;
    uint32_t chunks, value, delay_ms, pad;
};
struct add_args {
    uint64_t addr, count;
    uint32_t add, pad;
};

static void *g_fill, *g_add, *g_fail;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void load(const char *so) {
    void *bin;
    CHECK(aclrtBinaryLoadFromFile(so, NULL, &bin));
    CHECK(aclrtBinaryGetFunction(bin, "npusim_slow_fill", &g_fill));
    CHECK(aclrtBinaryGetFunction(bin, "npusim_add", &g_add));
    CHECK(aclrtBinaryGetFunction(bin, "npusim_fail", &g_fail));
}

static int launch_fill(void *stream, void *dev, uint64_t chunk, uint32_t chunks, uint32_t value, uint32_t delay) {
    struct fill_args a = {(uint64_t)(uintptr_t)dev, chunk, chunks, value, delay, 0};
    return aclrtLaunchKernel(g_fill, 1, &a, sizeof a, stream);
}

static int launch_add(void *stream, void *dev, uint64_t count, uint32_t add) {
    struct add_args a = {(uint64_t)(uintptr_t)dev, count, add, 0};
    int rc = aclrtLaunchKernel(g_add, 8, &a, sizeof a, stream);
    memset(&a, 0xff, sizeof a); /* the args were copied at launch */
    return rc;
}

/* How many chunks of `chunk` bytes hold `value` in their first and last word. */
static int filled_chunks(const uint32_t *h, uint64_t chunk, int chunks, uint32_t value) {
    int n = 0;
    for (int c = 0; c < chunks; c++)
        n += h[c * chunk / 4] == value && h[(c + 1) * chunk / 4 - 1] == value;
    return n;
}

/* ---- scenarios */

static void async_copy(void) {
    const uint64_t chunk = 256 * 1024;
    const int chunks = 8;
    void *dev, *s;
    uint32_t *h = malloc(chunk * chunks);
    CHECK(aclrtMalloc(&dev, chunk * chunks, 0));
    CHECK(aclrtMemset(dev, chunk * chunks, 0, chunk * chunks));
    CHECK(aclrtCreateStream(&s));
    double t0 = now_ms();
    printf("launch_rc %d\n", launch_fill(s, dev, chunk, chunks, 0xA5A5A5A5u, 100));
    printf("launch_ms %.1f\n", now_ms() - t0);
    /* copies while it runs see its progress: poll until the first chunk shows (5 s at most) */
    int partial = 0, copy_rc = 0;
    for (int i = 0; i < 250 && partial == 0 && copy_rc == 0; i++) {
        copy_rc = aclrtMemcpy(h, chunk * chunks, dev, chunk * chunks, 2);
        partial = filled_chunks(h, chunk, chunks, 0xA5A5A5A5u);
        if (!partial) sleep_ms(20);
    }
    int status = -1;
    printf("query_rc %d\n", aclrtStreamQuery(s, &status));
    printf("query_mid %d\n", status);
    printf("copy_mid_rc %d\n", copy_rc);
    printf("partial_chunks %d\n", partial);
    printf("sync_rc %d\n", aclrtSynchronizeStream(s));
    printf("sync_ms %.1f\n", now_ms() - t0);
    aclrtStreamQuery(s, &status);
    printf("query_end %d\n", status);
    aclrtMemcpy(h, chunk * chunks, dev, chunk * chunks, 2);
    printf("full_chunks %d\n", filled_chunks(h, chunk, chunks, 0xA5A5A5A5u));
    printf("destroy_rc %d\n", aclrtDestroyStream(s));
}

struct cb_seen {
    void *dev;
    uint32_t word; /* the device word when the callback ran */
    int calls;
};

static void host_callback(void *arg) {
    struct cb_seen *c = arg;
    aclrtMemcpy(&c->word, 4, c->dev, 4, 2);
    c->calls++;
}

/* The thread that runs a stream's host callbacks, as CANN wants one: it subscribes, then calls
 * aclrtProcessReport until told to stop. */
struct reporter {
    void *stream;
    volatile int stop;
    int subscribe_rc;
    int ran;
    pthread_t th;
};

static void *reporter_main(void *arg) {
    struct reporter *r = arg;
    __atomic_store_n(&r->subscribe_rc, aclrtSubscribeReport((uint64_t)pthread_self(), r->stream), __ATOMIC_SEQ_CST);
    while (!__atomic_load_n(&r->stop, __ATOMIC_SEQ_CST))
        if (aclrtProcessReport(50) == 0) r->ran++;
    return NULL;
}

static void order(void) {
    const uint64_t n = 1 << 16;
    void *dev, *s;
    uint32_t *h = calloc(n, 4);
    CHECK(aclrtMalloc(&dev, n * 4, 0));
    CHECK(aclrtCreateStreamWithConfig(&s, 0, 0));
    CHECK(aclrtMemsetAsync(dev, n * 4, 0, n * 4, s));
    for (int i = 0; i < 3; i++) CHECK(launch_add(s, dev, n, 1));
    CHECK(aclrtMemcpyAsync(h, n * 4, dev, n * 4, 2, s));
    printf("sync_rc %d\n", aclrtSynchronizeStream(s));
    printf("first %u\nlast %u\n", h[0], h[n - 1]);
    /* the default stream (NULL) and a device synchronize */
    for (int i = 0; i < 2; i++) CHECK(launch_add(NULL, dev, n, 10));
    CHECK(aclrtMemcpyAsync(h, n * 4, dev, n * 4, 2, NULL));
    printf("device_sync_rc %d\n", aclrtSynchronizeDevice());
    printf("default_first %u\ndefault_last %u\n", h[0], h[n - 1]);
    /* host to device async, with the host buffer read when the task runs */
    for (uint64_t i = 0; i < n; i++) h[i] = (uint32_t)i;
    CHECK(aclrtMemcpyAsync(dev, n * 4, h, n * 4, 1, s));
    CHECK(launch_add(s, dev, n, 1));
    CHECK(aclrtSynchronizeStream(s));
    memset(h, 0, n * 4);
    CHECK(aclrtMemcpy(h, n * 4, dev, n * 4, 2));
    printf("h2d_first %u\nh2d_last %u\n", h[0], h[n - 1]);
    /* a host callback: refused on a stream nobody subscribed to; once a thread has, it runs
     * there in stream order, after the kernel before it, and (blocking) before what follows */
    struct cb_seen seen = {dev, 0, 0};
    printf("callback_unsubscribed_rc %d\n", aclrtLaunchCallback(host_callback, &seen, 1, s));
    struct reporter rep = {s, 0, -1, 0, 0};
    pthread_create(&rep.th, NULL, reporter_main, &rep);
    while (__atomic_load_n(&rep.subscribe_rc, __ATOMIC_SEQ_CST) == -1) sleep_ms(5);
    CHECK(launch_add(s, dev, 1, 100));
    printf("callback_rc %d\n", aclrtLaunchCallback(host_callback, &seen, 1, s));
    CHECK(launch_add(s, dev, 1, 1000));
    CHECK(aclrtSynchronizeStream(s));
    __atomic_store_n(&rep.stop, 1, __ATOMIC_SEQ_CST);
    pthread_join(rep.th, NULL);
    printf("subscribe_rc %d\nreports_run %d\n", rep.subscribe_rc, rep.ran);
    printf("callback_calls %d\ncallback_word %u\n", seen.calls, seen.word);
    printf("unsubscribe_rc %d\n", aclrtUnSubscribeReport((uint64_t)rep.th, s));
    printf("report_timeout_rc %d\n", aclrtProcessReport(10));
    uint32_t after = 0;
    CHECK(aclrtMemcpy(&after, 4, dev, 4, 2));
    printf("after_callback_word %u\n", after);
    void *hb = NULL;
    printf("mallochost_rc %d\n", aclrtMallocHost(&hb, 1 << 20));
    CHECK(aclrtMemcpy(hb, 4, dev, 4, 2)); /* 1101: the kernels after the callback ran too */
    printf("hostbuf_word %u\n", *(uint32_t *)hb);
    printf("freehost_rc %d\n", aclrtFreeHost(hb));
    uint32_t ndev = 0;
    printf("devcount_rc %d\n", aclrtGetDeviceCount(&ndev));
    printf("devcount %u\n", ndev);
    size_t fr = 0, tot = 0;
    printf("meminfo_rc %d\n", aclrtGetMemInfo(1, &fr, &tot));
    printf("meminfo_total %zu\nmeminfo_free %zu\n", tot, fr);
}

static void events(void) {
    const uint64_t chunk = 64 * 1024;
    const int chunks = 4;
    void *dev, *other, *s1, *s2, *s3, *e0, *e1, *e2;
    uint32_t *h = malloc(chunk * chunks);
    CHECK(aclrtMalloc(&dev, chunk * chunks, 0));
    CHECK(aclrtMalloc(&other, 4096, 0));
    CHECK(aclrtMemset(dev, chunk * chunks, 0, chunk * chunks));
    CHECK(aclrtCreateStream(&s1));
    CHECK(aclrtCreateStream(&s2));
    CHECK(aclrtCreateStream(&s3));
    CHECK(aclrtCreateEvent(&e0));
    CHECK(aclrtCreateEvent(&e1));
    CHECK(aclrtCreateEvent(&e2));
    CHECK(aclrtRecordEvent(e0, s1));
    CHECK(launch_fill(s1, dev, chunk, chunks, 5, 100));
    CHECK(aclrtRecordEvent(e1, s1));
    CHECK(aclrtStreamWaitEvent(s2, e1));
    CHECK(launch_add(s2, dev, chunk * chunks / 4, 1)); /* must run after the fill */
    CHECK(aclrtRecordEvent(e2, s2));
    /* a third stream runs at once, beside the long kernel */
    double t0 = now_ms();
    CHECK(launch_add(s3, other, 1024, 1));
    printf("s3_sync_rc %d\n", aclrtSynchronizeStream(s3));
    printf("s3_sync_ms %.1f\n", now_ms() - t0);
    int st = -1;
    aclrtQueryEventStatus(e2, &st);
    printf("e2_status_mid %d\n", st);
    printf("event_sync_rc %d\n", aclrtSynchronizeEvent(e2));
    aclrtQueryEventStatus(e2, &st);
    printf("e2_status_end %d\n", st);
    CHECK(aclrtMemcpy(h, chunk * chunks, dev, chunk * chunks, 2));
    printf("first %u\nlast %u\n", h[0], h[chunk * chunks / 4 - 1]);
    float ms = -1;
    printf("elapsed_rc %d\n", aclrtEventElapsedTime(&ms, e0, e1));
    printf("elapsed_ms %.1f\n", ms);
    printf("destroy_rc %d\n", aclrtDestroyEvent(e0) | aclrtDestroyEvent(e1) | aclrtDestroyEvent(e2));
}

struct bg {
    void *stream, *dev;
    volatile int done;
    int rc;
};

static void *bg_launch(void *arg) {
    struct bg *b = arg;
    b->rc = launch_add(b->stream, b->dev, 1024, 100);
    __atomic_store_n(&b->done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void lock(void) {
    const uint64_t chunk = 64 * 1024;
    const int chunks = 4;
    void *dev, *s;
    uint32_t *h = malloc(chunk * chunks);
    CHECK(aclrtMalloc(&dev, chunk * chunks, 0));
    CHECK(aclrtMemset(dev, chunk * chunks, 0, chunk * chunks));
    CHECK(aclrtCreateStream(&s));
    CHECK(launch_fill(s, dev, chunk, chunks, 9, 100));
    printf("lock_rc %d\n", aclrtSnapShotProcessLock(getpid(), NULL));
    int state = -1;
    rtSnapShotProcessGetState(&state);
    printf("state %d\n", state);
    /* another thread's launch waits at the gate */
    struct bg b = {s, dev, 0, -1};
    pthread_t th;
    pthread_create(&th, NULL, bg_launch, &b);
    /* the device keeps running what was queued: synchronize passes and sees it done */
    printf("sync_locked_rc %d\n", aclrtSynchronizeStream(s));
    printf("device_sync_locked_rc %d\n", aclrtSynchronizeDevice());
    int32_t d = -1;
    printf("getdev_locked_rc %d\n", aclrtGetDevice(&d));
    /* the driver has no gate: drvMemcpy reads and writes device memory while LOCKED */
    memset(h, 0, chunk * chunks);
    printf("drv_d2h_locked_rc %d\n", drvMemcpy((uintptr_t)h, chunk * chunks, (uintptr_t)dev, chunk * chunks));
    printf("filled_chunks_locked %d\n", filled_chunks(h, chunk, chunks, 9));
    uint32_t pattern[256];
    for (int i = 0; i < 256; i++) pattern[i] = 0xC0DE0000u + i;
    printf("drv_h2d_locked_rc %d\n", drvMemcpy((uintptr_t)dev, sizeof pattern, (uintptr_t)pattern, sizeof pattern));
    uint32_t back[256] = {0};
    drvMemcpy((uintptr_t)back, sizeof back, (uintptr_t)dev, sizeof back);
    printf("drv_roundtrip_locked %d\n", memcmp(back, pattern, sizeof back) == 0);
    sleep_ms(300);
    printf("bg_done_while_locked %d\n", __atomic_load_n(&b.done, __ATOMIC_SEQ_CST));
    printf("unlock_rc %d\n", aclrtSnapShotProcessUnlock(getpid(), NULL));
    pthread_join(th, NULL);
    printf("bg_rc %d\n", b.rc);
    CHECK(aclrtSynchronizeStream(s));
    CHECK(aclrtMemcpy(back, sizeof back, dev, sizeof back, 2));
    printf("after_unlock_word0 %u\n", back[0]);
}

static void vmm(void) {
    const size_t gran = 2 * MiB;
    void *va, *h1, *h2, *s;
    /* aclrtPhysicalMemProp: handleType, allocationType, memAttr (ACL_HBM_MEM_HUGE), location {0,
     * ACL_MEM_LOCATION_TYPE_DEVICE}, reserve */
    struct {
        uint32_t handle_type, alloc_type, mem_attr, loc_id, loc_type;
        uint64_t reserve;
    } prop = {0, 0, 4, 0, 1, 0};
    CHECK(aclrtCreateStream(&s));
    size_t g = 0;
    printf("granularity_rc %d\n", aclrtMemGetAllocationGranularity(&prop, 1, &g));
    printf("granularity %zu\n", g);
    printf("reserve_rc %d\n", aclrtReserveMemAddress(&va, 4 * gran, 0, NULL, 0));
    printf("va_hex %lx\n", (unsigned long)(uintptr_t)va);
    printf("phys1_rc %d\n", aclrtMallocPhysical(&h1, gran, &prop, 0));
    printf("phys2_rc %d\n", aclrtMallocPhysical(&h2, gran, &prop, 0));
    printf("map1_rc %d\n", aclrtMapMem(va, gran, 0, h1, 0));
    printf("map2_rc %d\n", aclrtMapMem((char *)va + gran, gran, 0, h2, 0));
    printf("map_overlap_rc %d\n", aclrtMapMem(va, gran, 0, h2, 0));
    size_t n = 2 * gran / 4;
    uint32_t *h = malloc(2 * gran);
    for (size_t i = 0; i < n; i++) h[i] = (uint32_t)i;
    printf("h2d_rc %d\n", aclrtMemcpy(va, 2 * gran, h, 2 * gran, 1)); /* spans both pieces */
    CHECK(launch_add(s, va, n, 7));                                  /* so does the kernel */
    printf("kernel_sync_rc %d\n", aclrtSynchronizeStream(s));
    memset(h, 0, 2 * gran);
    printf("d2h_rc %d\n", aclrtMemcpy(h, 2 * gran, va, 2 * gran, 2));
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= h[i] == (uint32_t)i + 7;
    printf("values_ok %d\n", ok);
    /* the driver copies VMM memory while LOCKED too */
    CHECK(aclrtSnapShotProcessLock(getpid(), NULL));
    uint32_t w[2] = {0, 0};
    printf("drv_locked_rc %d\n", drvMemcpy((uintptr_t)w, sizeof w, (uintptr_t)va + gran - 4, sizeof w));
    printf("drv_locked_words %u %u\n", w[0], w[1]);
    CHECK(aclrtSnapShotProcessUnlock(getpid(), NULL));
    printf("release_mapped_rc %d\n", aclrtReleaseMemAddress(va));
    printf("free_mapped_rc %d\n", aclrtFreePhysical(h2));
    printf("unmap2_rc %d\n", aclrtUnmapMem((char *)va + gran));
    /* a kernel over the hole faults; a copy into it is refused */
    CHECK(launch_add(s, va, n, 1));
    printf("hole_kernel_sync_rc %d\n", aclrtSynchronizeStream(s));
    printf("hole_copy_rc %d\n", aclrtMemcpy((char *)va + gran, 16, h, 16, 1));
    CHECK(launch_add(s, va, gran / 4, 1));
    printf("mapped_kernel_sync_rc %d\n", aclrtSynchronizeStream(s));
    printf("unmap1_rc %d\n", aclrtUnmapMem(va));
    printf("free1_rc %d\n", aclrtFreePhysical(h1));
    printf("free2_rc %d\n", aclrtFreePhysical(h2));
    printf("release_rc %d\n", aclrtReleaseMemAddress(va));
}

/* VMM memory across Lock, Backup, Restore, Unlock in the same process: the reserved address and
 * its mapping stay, the physical memory comes back poisoned (Restore keeps addresses, not
 * contents), and copies and kernels work on it again. */
static void vmm_restore(void) {
    const size_t gran = 2 * MiB;
    void *va, *ph, *s;
    struct {
        uint32_t handle_type, alloc_type, mem_attr, loc_id, loc_type;
        uint64_t reserve;
    } prop = {0, 0, 4, 0, 1, 0};
    CHECK(aclrtCreateStream(&s));
    CHECK(aclrtReserveMemAddress(&va, 2 * gran, 0, NULL, 0));
    CHECK(aclrtMallocPhysical(&ph, gran, &prop, 0));
    CHECK(aclrtMapMem((char *)va + gran, gran, 0, ph, 0));
    void *p = (char *)va + gran;
    CHECK(aclrtMemset(p, gran, 0, gran));
    CHECK(launch_add(s, p, 4, 5));
    CHECK(aclrtSynchronizeStream(s));
    uint32_t w = 0;
    CHECK(aclrtMemcpy(&w, 4, p, 4, 2));
    printf("before %u\n", w);
    printf("lock_rc %d\n", aclrtSnapShotProcessLock(getpid(), NULL));
    printf("backup_rc %d\n", aclrtSnapShotProcessBackup(getpid(), NULL));
    printf("restore_rc %d\n", aclrtSnapShotProcessRestore(getpid(), NULL));
    w = 0;
    printf("drv_after_restore_rc %d\n", drvMemcpy((uintptr_t)&w, 4, (uintptr_t)p, 4));
    printf("after_restore %x\n", w);
    printf("unlock_rc %d\n", aclrtSnapShotProcessUnlock(getpid(), NULL));
    CHECK(aclrtMemset(p, gran, 0, gran));
    CHECK(launch_add(s, p, 4, 9));
    printf("kernel_after_rc %d\n", aclrtSynchronizeStream(s));
    CHECK(aclrtMemcpy(&w, 4, p, 4, 2));
    printf("after_kernel %u\n", w);
}

static void fault(void) {
    void *s, *dev;
    CHECK(aclrtCreateStream(&s));
    CHECK(aclrtMalloc(&dev, 4096, 0));
    CHECK(aclrtLaunchKernel(g_fail, 1, NULL, 0, s));
    printf("fault_sync_rc %d\n", aclrtSynchronizeStream(s));
    printf("next_sync_rc %d\n", aclrtSynchronizeStream(s));
    CHECK(launch_add(s, (void *)(uintptr_t)0x1234000, 16, 1)); /* not device memory */
    printf("bad_ptr_sync_rc %d\n", aclrtSynchronizeStream(s));
    CHECK(launch_add(s, dev, 8192, 1)); /* past the allocation's end */
    printf("past_end_sync_rc %d\n", aclrtSynchronizeStream(s));
    CHECK(launch_fill(s, dev, 4096, 1, 1, 2000));
    printf("timeout_rc %d\n", aclrtSynchronizeStreamWithTimeout(s, 100));
    printf("after_timeout_rc %d\n", aclrtSynchronizeStream(s));
}

static char g_order[64];
static uint32_t cb_a(int32_t dev, void *args) {
    (void)args;
    size_t l = strlen(g_order);
    snprintf(g_order + l, sizeof g_order - l, "A%d ", dev);
    return 0;
}
static uint32_t cb_b(int32_t dev, void *args) {
    (void)args;
    size_t l = strlen(g_order);
    snprintf(g_order + l, sizeof g_order - l, "B%d ", dev);
    return 0;
}

static void callbacks(void) {
    CHECK(aclrtSetDevice(1));
    CHECK(aclrtSnapShotCallbackRegister(0, cb_a, NULL));
    CHECK(aclrtSnapShotCallbackRegister(0, cb_b, NULL));
    CHECK(aclrtSnapShotProcessLock(getpid(), NULL));
    printf("order %s\n", g_order);
    CHECK(aclrtSnapShotProcessUnlock(getpid(), NULL));
}

static void nodevice(void) {
    printf("lock_rc %d\n", aclrtSnapShotProcessLock(getpid(), NULL));
    printf("backup_rc %d\n", aclrtSnapShotProcessBackup(getpid(), NULL));
    int st = -1;
    rtSnapShotProcessGetState(&st);
    printf("state %d\n", st);
    printf("unlock_rc %d\n", aclrtSnapShotProcessUnlock(getpid(), NULL));
}

static void nosnap(void) {
    int st = -1;
    printf("register_rc %d\n", aclrtSnapShotCallbackRegister(0, cb_a, NULL));
    printf("unregister_rc %d\n", aclrtSnapShotCallbackUnregister(0, cb_a));
    printf("getstate_rc %d\n", rtSnapShotProcessGetState(&st));
    printf("getstate_null_rc %d\n", rtSnapShotProcessGetState(NULL));
    printf("lock_rc %d\n", aclrtSnapShotProcessLock(getpid(), NULL));
}

static int g_backup_pre, g_restore_pre;
static uint32_t cb_backup_pre(int32_t dev, void *args) {
    (void)dev, (void)args;
    g_backup_pre++;
    return 0;
}
static uint32_t cb_restore_pre(int32_t dev, void *args) {
    (void)dev, (void)args;
    g_restore_pre++;
    return 0;
}

static void driverflow(void) {
    struct {
        uint32_t flags;
        char reserved[60];
    } args = {0, {0}};
    int st = -1;
    CHECK(aclrtSnapShotCallbackRegister(1, cb_backup_pre, NULL));
    CHECK(aclrtSnapShotCallbackRegister(3, cb_restore_pre, NULL));
    CHECK(aclrtSnapShotProcessLock(getpid(), NULL));
    printf("backup_args_rc %d\n", aclrtSnapShotProcessBackup(getpid(), &args));
    printf("backup_pre_calls %d\n", g_backup_pre);
    rtSnapShotProcessGetState(&st);
    printf("state_after_backup_args %d\n", st);
    printf("backup_null_rc %d\n", aclrtSnapShotProcessBackup(getpid(), NULL));
    printf("restore_args_rc %d\n", aclrtSnapShotProcessRestore(getpid(), &args));
    printf("restore_pre_calls %d\n", g_restore_pre);
    rtSnapShotProcessGetState(&st);
    printf("state_after_restore_args %d\n", st);
    printf("restore_null_rc %d\n", aclrtSnapShotProcessRestore(getpid(), NULL));
    printf("unlock_rc %d\n", aclrtSnapShotProcessUnlock(getpid(), NULL));
}

/* A job that computes on a stream step by step (each step adds 1 to a device word and prints it),
 * for the CRIU test: SIGUSR1 locks and backs up, SIGUSR2 restores and unlocks (a thread waiting
 * in sigwait, as an agent's would); results go to the file SNAP_STATUS names. */
static void status(const char *what, int rc) {
    FILE *f = fopen(getenv("SNAP_STATUS"), "a");
    if (f) fprintf(f, "%s %d\n", what, rc), fclose(f);
}

static void *snapshot_thread(void *arg) {
    sigset_t *set = arg;
    for (;;) {
        int sig;
        if (sigwait(set, &sig) != 0) continue;
        if (sig == SIGUSR1) {
            int rc = aclrtSnapShotProcessLock(getpid(), NULL);
            status("lock", rc);
            if (rc == 0) status("backup", aclrtSnapShotProcessBackup(getpid(), NULL));
        } else {
            int rc = aclrtSnapShotProcessRestore(getpid(), NULL);
            status("restore", rc);
            if (rc == 0) status("unlock", aclrtSnapShotProcessUnlock(getpid(), NULL));
        }
    }
    return NULL;
}

static void loop(int steps) {
    void *dev, *s, *ev;
    uint32_t w = 0;
    CHECK(aclrtMalloc(&dev, 4096, 0));
    CHECK(aclrtMemset(dev, 4096, 0, 4096));
    CHECK(aclrtCreateStream(&s));
    CHECK(aclrtCreateEvent(&ev));
    for (int i = 0; i < steps; i++) {
        CHECK(launch_add(s, dev, 1, 1));
        CHECK(aclrtRecordEvent(ev, s));
        CHECK(aclrtMemcpyAsync(&w, 4, dev, 4, 2, s));
        int rc = aclrtSynchronizeStream(s);
        int erc = aclrtSynchronizeEvent(ev);
        printf("step %d %d %d %u\n", i, rc, erc, w);
        sleep_ms(50);
    }
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *sc = argv[1];
    static sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    if (!strcmp(sc, "loop")) {
        /* blocked everywhere (the runtime's engine threads inherit it): only the sigwait thread */
        pthread_sigmask(SIG_BLOCK, &set, NULL);
        pthread_t th;
        pthread_create(&th, NULL, snapshot_thread, &set);
    }
    CHECK(aclInit(NULL));
    if (!strcmp(sc, "nodevice")) nodevice();
    else if (!strcmp(sc, "nosnap")) nosnap();
    else {
        CHECK(aclrtSetDevice(0));
        if (!strcmp(sc, "callbacks")) callbacks();
        else if (!strcmp(sc, "driverflow")) driverflow();
        else {
            load(argv[2]);
            if (!strcmp(sc, "async")) async_copy();
            else if (!strcmp(sc, "order")) order();
            else if (!strcmp(sc, "events")) events();
            else if (!strcmp(sc, "lock")) lock();
            else if (!strcmp(sc, "vmm")) vmm();
            else if (!strcmp(sc, "fault")) fault();
            else if (!strcmp(sc, "vmm_restore")) vmm_restore();
            else if (!strcmp(sc, "loop")) loop(atoi(getenv("SNAP_STEPS")));
            else return 2;
        }
    }
    printf("done 1\n");
    return 0;
}
