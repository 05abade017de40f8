/* An LD_PRELOAD interposer for the torch_npu allocator tests: logs each VMM and allocation call
 * torch_npu makes (one line per call to $VMM_TRACE_FILE) and forwards it to the simulated ACL
 * library. With LD_PRELOAD set, torch_npu's FunctionLoader looks names up with
 * dlsym(RTLD_DEFAULT) first (core/npu/register/FunctionLoader.cpp), so these definitions win for
 * the names it looks up as well as for its link-time imports. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void trace(const char *fmt, unsigned long long a, unsigned long long b, int rc) {
    const char *path = getenv("VMM_TRACE_FILE");
    if (!path) return;
    pthread_mutex_lock(&mu);
    FILE *f = fopen(path, "a");
    if (f) {
        fprintf(f, fmt, a, b);
        fprintf(f, " rc=%d\n", rc);
        fclose(f);
    }
    pthread_mutex_unlock(&mu);
}

/* The ACL library torch_npu linked: not in the global scope (Python loads torch_npu RTLD_LOCAL),
 * so RTLD_NEXT would not find it; its handle does. */
static void *acl(void) {
    static void *h;
    if (!h) h = dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen("libascendcl.so", RTLD_LAZY);
    return h;
}

#define NEXT(fn)                                                                                   \
    static __typeof__(fn) *real;                                                                   \
    if (!real) real = (__typeof__(fn) *)dlsym(acl(), #fn)

int aclrtReserveMemAddress(void **p, size_t size, size_t alignment, void *expect, uint64_t flags) {
    NEXT(aclrtReserveMemAddress);
    int rc = real(p, size, alignment, expect, flags);
    trace("reserve size=%llu flags=%llu", size, flags, rc);
    return rc;
}
int aclrtReleaseMemAddress(void *p) {
    NEXT(aclrtReleaseMemAddress);
    int rc = real(p);
    trace("release %llu%llu", 0, 0, rc);
    return rc;
}
int aclrtMallocPhysical(void **h, size_t size, const void *prop, uint64_t flags) {
    NEXT(aclrtMallocPhysical);
    int rc = real(h, size, prop, flags);
    trace("physical size=%llu flags=%llu", size, flags, rc);
    return rc;
}
int aclrtFreePhysical(void *h) {
    NEXT(aclrtFreePhysical);
    int rc = real(h);
    trace("free_physical %llu%llu", 0, 0, rc);
    return rc;
}
int aclrtMapMem(void *p, size_t size, size_t offset, void *h, uint64_t flags) {
    NEXT(aclrtMapMem);
    int rc = real(p, size, offset, h, flags);
    trace("map size=%llu offset=%llu", size, offset, rc);
    return rc;
}
int aclrtUnmapMem(void *p) {
    NEXT(aclrtUnmapMem);
    int rc = real(p);
    trace("unmap %llu%llu", 0, 0, rc);
    return rc;
}
int aclrtMallocAlign32(void **p, size_t size, int policy) {
    NEXT(aclrtMallocAlign32);
    int rc = real(p, size, policy);
    trace("malloc_align32 size=%llu policy=%llu", size, (unsigned long long)policy, rc);
    return rc;
}
int aclrtMalloc(void **p, size_t size, int policy) {
    NEXT(aclrtMalloc);
    int rc = real(p, size, policy);
    trace("malloc size=%llu policy=%llu", size, (unsigned long long)policy, rc);
    return rc;
}
int aclrtGetMemInfo(int attr, size_t *free_, size_t *total) {
    NEXT(aclrtGetMemInfo);
    int rc = real(attr, free_, total);
    trace("meminfo attr=%llu total=%llu", (unsigned long long)attr, rc == 0 ? *total : 0, rc);
    return rc;
}
