/* The ACL front-end of the simulated NPU, built twice: as libacl_rt.so (CANN 9.1+) and as
 * libascendcl.so (older name, same exports). Every function checks its arguments as the real ACL
 * layer does (runtime src/acl/aclrt_impl/, one .cpp per area) and calls the real rt* function of libruntime.so
 * (rt.h) through the dynamic linker, so that both front-ends share the one runtime state of the
 * process. Names and prototypes are those of include/external/acl/acl_rt.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rt.h"

typedef int32_t aclError;
#define ACL_API NPUSIM_API

/* aclrtPhysicalMemProp (acl_rt.h): handleType, allocationType, memAttr, location {id, type}. */
typedef struct {
    uint32_t id;
    uint32_t type;
} aclrtMemLocation;
typedef struct {
    uint32_t handleType;
    uint32_t allocationType;
    uint32_t memAttr; /* aclrtMemAttr: ACL_HBM_MEM_HUGE 4, ACL_HBM_MEM_NORMAL 5, ... */
    aclrtMemLocation location;
    uint64_t reserve;
} aclrtPhysicalMemProp;

/* aclInit's state is the front-end's own, as the real one (src/acl/aclrt_impl/acl.cpp). */
static int g_initialized;

ACL_API aclError aclInit(const char *configPath) {
    (void)configPath;
    if (__atomic_exchange_n(&g_initialized, 1, __ATOMIC_SEQ_CST)) return ACL_ERROR_REPEAT_INITIALIZE;
    return ACL_SUCCESS;
}

/* Finalize resets every device the process opened. */
ACL_API aclError aclFinalize(void) {
    for (int32_t d = 0; d < 64; d++) rtDeviceReset(d);
    return __atomic_exchange_n(&g_initialized, 0, __ATOMIC_SEQ_CST) ? ACL_SUCCESS : ACL_ERROR_UNINITIALIZE;
}

ACL_API aclError aclsysGetVersionStr(char *pkgName, char *versionStr) {
    if (!pkgName || !versionStr) return ACL_ERROR_INVALID_PARAM;
    snprintf(versionStr, 128, "%s", NPUSIM_CANN_VERSION);
    return ACL_SUCCESS;
}

/* The simulated chip: NPUSIM_SOC_VERSION (default Ascend910B1, an Atlas A2). */
ACL_API const char *aclrtGetSocName(void) {
    const char *v = getenv("NPUSIM_SOC_VERSION");
    return v && *v ? v : "Ascend910B1";
}

/* ---- devices, contexts */
ACL_API aclError aclrtSetDevice(int32_t deviceId) { return rtSetDevice(deviceId); }
ACL_API aclError aclrtResetDevice(int32_t deviceId) { return rtDeviceReset(deviceId); }
ACL_API aclError aclrtGetDevice(int32_t *deviceId) { return rtGetDevice(deviceId); }
ACL_API aclError aclrtGetDeviceCount(uint32_t *count) {
    if (!count) return ACL_ERROR_INVALID_PARAM;
    int32_t n = 0;
    aclError rc = rtGetDeviceCount(&n);
    if (rc == ACL_SUCCESS) *count = (uint32_t)n;
    return rc;
}
ACL_API aclError aclrtGetCurrentContext(void **context) { return rtCtxGetCurrent(context); }
ACL_API aclError aclrtSetCurrentContext(void *context) { return rtCtxSetCurrent(context); }
ACL_API aclError aclrtSynchronizeDevice(void) { return rtDeviceSynchronize(); }
ACL_API aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout) { return rtDeviceSynchronizeWithTimeout(timeout); }

/* ---- memory */
ACL_API aclError aclrtMalloc(void **devPtr, size_t size, int policy) {
    return rtMalloc(devPtr, size, (uint32_t)policy, 0);
}
ACL_API aclError aclrtMallocAlign32(void **devPtr, size_t size, int policy) {
    if (size > SIZE_MAX - 31) return ACL_ERROR_RT_PARAM_INVALID;
    return rtMalloc(devPtr, (size + 31) & ~(size_t)31, (uint32_t)policy, 0);
}
ACL_API aclError aclrtMallocCached(void **devPtr, size_t size, int policy) {
    return rtMallocCached(devPtr, size, (uint32_t)policy, 0);
}
ACL_API aclError aclrtFree(void *devPtr) { return rtFree(devPtr); }
ACL_API aclError aclrtMallocHost(void **hostPtr, size_t size) { return rtMallocHost(hostPtr, size, 0); }
ACL_API aclError aclrtFreeHost(void *hostPtr) { return rtFreeHost(hostPtr); }
ACL_API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    return rtMemcpy(dst, destMax, src, count, (uint32_t)kind);
}
ACL_API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, int kind,
                                  void *stream) {
    return rtMemcpyAsync(dst, destMax, src, count, (uint32_t)kind, stream);
}
ACL_API aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    return rtMemset(devPtr, maxCount, (uint32_t)value, count);
}
ACL_API aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, void *stream) {
    return rtMemsetAsync(devPtr, maxCount, (uint32_t)value, count, stream);
}
ACL_API aclError aclrtGetMemInfo(int attr, size_t *free, size_t *total) {
    return rtMemGetInfoEx((uint32_t)attr, free, total);
}

/* ---- VMM */
ACL_API aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                        uint64_t flags) {
    return rtReserveMemAddress(virPtr, size, alignment, expectPtr, flags);
}
ACL_API aclError aclrtReleaseMemAddress(void *virPtr) { return rtReleaseMemAddress(virPtr); }
/* memory.cpp: aclrtPhysicalMemProp -> rtDrvMemProp_t (device side; HUGE attrs: huge pages). */
static struct drv_mem_prop drv_prop(const aclrtPhysicalMemProp *prop) {
    struct drv_mem_prop p = {.side = 1, .devid = prop->location.id, .module_id = 0,
                             .pg_type = (prop->memAttr == 2 || prop->memAttr == 4) ? 1u : 0u,
                             .mem_type = 0, .reserve = 0};
    return p;
}
ACL_API aclError aclrtMallocPhysical(void **handle, size_t size, const aclrtPhysicalMemProp *prop, uint64_t flags) {
    if (!prop) return ACL_ERROR_INVALID_PARAM;
    struct drv_mem_prop p = drv_prop(prop);
    return rtMallocPhysical(handle, size, &p, flags);
}
ACL_API aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int option, size_t *granularity) {
    if (!prop || !granularity) return ACL_ERROR_INVALID_PARAM;
    struct drv_mem_prop p = drv_prop(prop);
    return rtMemGetAllocationGranularity(&p, (uint32_t)option, granularity);
}
ACL_API aclError aclrtFreePhysical(void *handle) { return rtFreePhysical(handle); }
ACL_API aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, void *handle, uint64_t flags) {
    return rtMapMem(virPtr, size, offset, handle, flags);
}
ACL_API aclError aclrtUnmapMem(void *virPtr) { return rtUnmapMem(virPtr); }

/* ---- streams, events */
ACL_API aclError aclrtCreateStream(void **stream) { return rtStreamCreate(stream, 0); }
ACL_API aclError aclrtCreateStreamWithConfig(void **stream, uint32_t priority, uint32_t flag) {
    return rtStreamCreateWithFlags(stream, (int32_t)priority, flag);
}
ACL_API aclError aclrtDestroyStream(void *stream) { return rtStreamDestroy(stream); }
ACL_API aclError aclrtDestroyStreamForce(void *stream) { return rtStreamDestroyForce(stream); }
ACL_API aclError aclrtSynchronizeStream(void *stream) { return rtStreamSynchronize(stream); }
ACL_API aclError aclrtSynchronizeStreamWithTimeout(void *stream, int32_t timeout) {
    return rtStreamSynchronizeWithTimeout(stream, timeout);
}
/* aclrtStreamStatus: ACL_STREAM_STATUS_COMPLETE 0, ACL_STREAM_STATUS_NOT_READY 1. */
ACL_API aclError aclrtStreamQuery(void *stream, int *status) {
    if (!status) return ACL_ERROR_INVALID_PARAM;
    aclError rc = rtStreamQuery(stream);
    if (rc == ACL_SUCCESS) *status = 0;
    else if (rc == ACL_ERROR_RT_STREAM_NOT_COMPLETE) *status = 1, rc = ACL_SUCCESS;
    return rc;
}
ACL_API aclError aclrtCreateEvent(void **event) { return rtEventCreate(event); }
ACL_API aclError aclrtCreateEventWithFlag(void **event, uint32_t flag) { return rtEventCreateWithFlag(event, flag); }
ACL_API aclError aclrtCreateEventExWithFlag(void **event, uint32_t flag) {
    return rtEventCreateExWithFlag(event, flag);
}
ACL_API aclError aclrtRecordEvent(void *event, void *stream) { return rtEventRecord(event, stream); }
ACL_API aclError aclrtResetEvent(void *event, void *stream) { return rtEventReset(event, stream); }
ACL_API aclError aclrtStreamWaitEvent(void *stream, void *event) { return rtStreamWaitEvent(stream, event); }
ACL_API aclError aclrtSynchronizeEvent(void *event) { return rtEventSynchronize(event); }
/* aclrtEventRecordedStatus: NOT_READY 0, COMPLETE 1. */
ACL_API aclError aclrtQueryEventStatus(void *event, int *status) {
    if (!status) return ACL_ERROR_INVALID_PARAM;
    uint32_t s = 0;
    aclError rc = rtEventQueryStatus(event, &s);
    if (rc == ACL_SUCCESS) *status = (int)s;
    return rc;
}
ACL_API aclError aclrtEventElapsedTime(float *ms, void *startEvent, void *endEvent) {
    return rtEventElapsedTime(ms, startEvent, endEvent);
}
ACL_API aclError aclrtDestroyEvent(void *event) { return rtEventDestroy(event); }
ACL_API aclError aclrtSubscribeReport(uint64_t threadId, void *stream) { return rtSubscribeReport(threadId, stream); }
ACL_API aclError aclrtUnSubscribeReport(uint64_t threadId, void *stream) {
    return rtUnSubscribeReport(threadId, stream);
}
ACL_API aclError aclrtProcessReport(int32_t timeout) { return rtProcessReport(timeout); }
/* blockType: ACL_CALLBACK_NO_BLOCK 0, ACL_CALLBACK_BLOCK 1. */
ACL_API aclError aclrtLaunchCallback(void (*fn)(void *), void *userData, int blockType, void *stream) {
    return rtCallbackLaunch(fn, userData, stream, blockType == 1);
}

/* ---- kernels (the binary format: npusim_kernel.h) */
ACL_API aclError aclrtBinaryLoadFromFile(const char *binPath, void *options, void **binHandle) {
    (void)options;
    if (!binPath || !binHandle) return ACL_ERROR_INVALID_PARAM;
    return rtsBinaryLoadFromFile(binPath, NULL, binHandle);
}
ACL_API aclError aclrtBinaryGetFunction(void *binHandle, const char *kernelName, void **funcHandle) {
    if (!binHandle || !kernelName || !funcHandle) return ACL_ERROR_INVALID_PARAM;
    return rtsFuncGetByName(binHandle, kernelName, funcHandle);
}
ACL_API aclError aclrtBinaryUnLoad(void *binHandle) { return rtBinaryUnLoad(binHandle); }
ACL_API aclError aclrtLaunchKernel(void *funcHandle, uint32_t numBlocks, const void *argsData, size_t argsSize,
                                   void *stream) {
    if (!funcHandle || argsSize > UINT32_MAX) return ACL_ERROR_INVALID_PARAM;
    return rtsLaunchKernelWithHostArgs(funcHandle, numBlocks, stream, NULL, (void *)argsData, (uint32_t)argsSize,
                                       NULL, 0);
}

/* ---- snapshot (src/acl/aclrt_impl/snapshot.cpp: the pid/args checks, then the rt function) */
#ifdef NPUSIM_ABI_ZERO_ARG
/* CANN 8.5.x / 9.0.x declare the snapshot functions without arguments. */
ACL_API aclError aclrtSnapShotProcessLock(void) { return rtSnapShotProcessLock(); }
ACL_API aclError aclrtSnapShotProcessBackup(void) { return rtSnapShotProcessBackup(); }
ACL_API aclError aclrtSnapShotProcessRestore(void) { return rtSnapShotProcessRestore(); }
ACL_API aclError aclrtSnapShotProcessUnlock(void) { return rtSnapShotProcessUnlock(); }
#else
/* CANN 9.1.0-beta.3 and later: (pid, args), pid the caller's own, reserve NULL. */
ACL_API aclError aclrtSnapShotProcessLock(int pid, void *reserve) {
    if (pid != getpid() || reserve) return ACL_ERROR_INVALID_PARAM;
    return rtSnapShotProcessLock();
}
ACL_API aclError aclrtSnapShotProcessUnlock(int pid, void *reserve) {
    if (pid != getpid() || reserve) return ACL_ERROR_INVALID_PARAM;
    return rtSnapShotProcessUnlock();
}
#ifdef NPUSIM_DRIVER_FLOW
/* Newer builds: an args struct {uint32_t flags; char reserved[60];}, flags 0 (required device
 * memory) or 1 (also optional); args != NULL selects the driver-backed flow. */
struct snap_args {
    uint32_t flags;
    char reserved[60];
};
ACL_API aclError aclrtSnapShotProcessBackup(int pid, void *args) {
    if (pid != getpid() || (args && ((const struct snap_args *)args)->flags > 1)) return ACL_ERROR_INVALID_PARAM;
    return args ? rtSnapShotProcessBackupWithArgs(args) : rtSnapShotProcessBackup();
}
ACL_API aclError aclrtSnapShotProcessRestore(int pid, void *args) {
    if (pid != getpid() || (args && ((const struct snap_args *)args)->flags > 1)) return ACL_ERROR_INVALID_PARAM;
    return args ? rtSnapShotProcessRestoreWithArgs(args) : rtSnapShotProcessRestore();
}
#else
/* 9.1.x: args must be NULL. */
ACL_API aclError aclrtSnapShotProcessBackup(int pid, void *args) {
    if (pid != getpid() || args) return ACL_ERROR_INVALID_PARAM;
    return rtSnapShotProcessBackup();
}
ACL_API aclError aclrtSnapShotProcessRestore(int pid, void *args) {
    if (pid != getpid() || args) return ACL_ERROR_INVALID_PARAM;
    return rtSnapShotProcessRestore();
}
#endif
#endif
ACL_API aclError aclrtSnapShotCallbackRegister(int stage, npusim_callback cb, void *args) {
    return rtSnapShotCallbackRegister(stage, cb, args);
}
ACL_API aclError aclrtSnapShotCallbackUnregister(int stage, npusim_callback cb) {
    return rtSnapShotCallbackUnregister(stage, cb);
}

#ifndef NPUSIM_STRICT_EXPORTS
/* Not an ACL function: lets the npusnap agent report which devices this process has open. Absent
 * from the strict tree (.build/cann-strict), which exports real names only. */
ACL_API int npusimGetOpenDevices(int32_t *ids, int max) { return npusimRuntimeOpenDevices(ids, max); }
#endif
