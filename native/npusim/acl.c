/* The ACL front-end of the simulated NPU, built twice: as libacl_rt.so (CANN 9.1+) and as
 * libascendcl.so (older name, same exports). Every function checks its arguments as the real ACL
 * layer does (runtime src/acl/aclrt_impl/, one .cpp per area) and calls the real rt* function of libruntime.so
 * (rt.h) through the dynamic linker, so that both front-ends share the one runtime state of the
 * process. Names and prototypes are those of include/external/acl/acl_rt.h. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "errmsg.h"
#include "private_guard.h"
#include "rt.h"

typedef int32_t aclError;
#define ACL_API NPUSIM_API

/* Every failing front-end call leaves a text for aclGetRecentErrMsg, as the real front-end reports
 * each failure to the error manager (src/acl/aclrt_impl: ACL_LOG_ERROR + ReportInputError/
 * ReportInnerError at every failing check). */
static aclError acl_rc(const char *func, aclError rc) {
    if (rc != ACL_SUCCESS) npusim_report(rc, "EE9999", func, "%s failed", func);
    return rc;
}

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
    if (__atomic_exchange_n(&g_initialized, 1, __ATOMIC_SEQ_CST)) return acl_rc(__func__, ACL_ERROR_REPEAT_INITIALIZE);
    return ACL_SUCCESS;
}

/* Finalize leaves the devices alone, as CANN's does (acl's aclFinalizeInternal: profiling, dump,
 * the finalize callbacks, the default device's setting; no device reset): a device the process
 * set and did not reset is released when the process exits (aclrtResetDevice's reference). A
 * thread of the job that sets its device while another finalizes still finds its context. */
ACL_API aclError aclFinalize(void) {
    aclError rc = __atomic_exchange_n(&g_initialized, 0, __ATOMIC_SEQ_CST) ? ACL_SUCCESS : ACL_ERROR_UNINITIALIZE;
    return acl_rc(__func__, rc);
}

ACL_API aclError aclsysGetVersionStr(char *pkgName, char *versionStr) {
    if (!pkgName || !versionStr) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    snprintf(versionStr, 128, "%s", NPUSIM_CANN_VERSION);
    return ACL_SUCCESS;
}

/* The simulated chip: NPUSIM_SOC_VERSION (default Ascend910B1, an Atlas A2). */
ACL_API const char *aclrtGetSocName(void) {
    const char *v = getenv("NPUSIM_SOC_VERSION");
    return v && *v ? v : "Ascend910B1";
}

/* ---- devices, contexts */
ACL_API aclError aclrtSetDevice(int32_t deviceId) { return acl_rc(__func__, rtSetDevice(deviceId)); }
ACL_API aclError aclrtResetDevice(int32_t deviceId) { return acl_rc(__func__, rtDeviceReset(deviceId)); }
ACL_API aclError aclrtResetDeviceForce(int32_t deviceId) { return acl_rc(__func__, rtDeviceResetForce(deviceId)); }
/* Before any SetDevice: 107002, reported quietly (no message): torch_npu asks first on purpose and
 * then sets device 0, and a stale message would be prepended to the next real failure's text. */
ACL_API aclError aclrtGetDevice(int32_t *deviceId) {
    aclError rc = rtGetDevice(deviceId);
    return rc == ACL_ERROR_RT_CONTEXT_NULL ? rc : acl_rc(__func__, rc);
}
ACL_API aclError aclrtGetDeviceCount(uint32_t *count) {
    if (!count) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    int32_t n = 0;
    aclError rc = rtGetDeviceCount(&n);
    if (rc == ACL_SUCCESS) *count = (uint32_t)n;
    return acl_rc(__func__, rc);
}
ACL_API aclError aclrtGetCurrentContext(void **context) { return acl_rc(__func__, rtCtxGetCurrent(context)); }
ACL_API aclError aclrtSetCurrentContext(void *context) { return acl_rc(__func__, rtCtxSetCurrent(context)); }
ACL_API aclError aclrtSynchronizeDevice(void) { return acl_rc(__func__, rtDeviceSynchronize()); }
ACL_API aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout) {
    return acl_rc(__func__, rtDeviceSynchronizeWithTimeout(timeout));
}

/* ---- memory */
ACL_API aclError aclrtMalloc(void **devPtr, size_t size, int policy) {
    return acl_rc(__func__, rtMalloc(devPtr, size, (uint32_t)policy, 0));
}
ACL_API aclError aclrtMallocAlign32(void **devPtr, size_t size, int policy) {
    if (size > SIZE_MAX - 31) return acl_rc(__func__, ACL_ERROR_RT_PARAM_INVALID);
    return acl_rc(__func__, rtMalloc(devPtr, (size + 31) & ~(size_t)31, (uint32_t)policy, 0));
}
ACL_API aclError aclrtMallocCached(void **devPtr, size_t size, int policy) {
    return acl_rc(__func__, rtMallocCached(devPtr, size, (uint32_t)policy, 0));
}
ACL_API aclError aclrtFree(void *devPtr) { return acl_rc(__func__, rtFree(devPtr)); }
ACL_API aclError aclrtMallocHost(void **hostPtr, size_t size) {
    return acl_rc(__func__, rtMallocHost(hostPtr, size, 0));
}
ACL_API aclError aclrtFreeHost(void *hostPtr) { return acl_rc(__func__, rtFreeHost(hostPtr)); }
ACL_API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    return acl_rc(__func__, rtMemcpy(dst, destMax, src, count, (uint32_t)kind));
}
ACL_API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, int kind,
                                  void *stream) {
    return acl_rc(__func__, rtMemcpyAsync(dst, destMax, src, count, (uint32_t)kind, stream));
}
ACL_API aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    return acl_rc(__func__, rtMemset(devPtr, maxCount, (uint32_t)value, count));
}
ACL_API aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, void *stream) {
    return acl_rc(__func__, rtMemsetAsync(devPtr, maxCount, (uint32_t)value, count, stream));
}
ACL_API aclError aclrtGetMemInfo(int attr, size_t *free, size_t *total) {
    return acl_rc(__func__, rtMemGetInfoEx((uint32_t)attr, free, total));
}

/* ---- VMM */
ACL_API aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                        uint64_t flags) {
    return acl_rc(__func__, rtReserveMemAddress(virPtr, size, alignment, expectPtr, flags));
}
ACL_API aclError aclrtReleaseMemAddress(void *virPtr) { return acl_rc(__func__, rtReleaseMemAddress(virPtr)); }
/* memory.cpp: aclrtPhysicalMemProp -> rtDrvMemProp_t (device side; HUGE attrs: huge pages). */
static struct drv_mem_prop drv_prop(const aclrtPhysicalMemProp *prop) {
    struct drv_mem_prop p = {.side = 1, .devid = prop->location.id, .module_id = 0,
                             .pg_type = (prop->memAttr == 2 || prop->memAttr == 4) ? 1u : 0u,
                             .mem_type = 0, .reserve = 0};
    return p;
}
ACL_API aclError aclrtMallocPhysical(void **handle, size_t size, const aclrtPhysicalMemProp *prop, uint64_t flags) {
    if (!prop) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    struct drv_mem_prop p = drv_prop(prop);
    return acl_rc(__func__, rtMallocPhysical(handle, size, &p, flags));
}
ACL_API aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int option, size_t *granularity) {
    if (!prop || !granularity) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    struct drv_mem_prop p = drv_prop(prop);
    return acl_rc(__func__, rtMemGetAllocationGranularity(&p, (uint32_t)option, granularity));
}
ACL_API aclError aclrtFreePhysical(void *handle) { return acl_rc(__func__, rtFreePhysical(handle)); }
ACL_API aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, void *handle, uint64_t flags) {
    return acl_rc(__func__, rtMapMem(virPtr, size, offset, handle, flags));
}
ACL_API aclError aclrtUnmapMem(void *virPtr) { return acl_rc(__func__, rtUnmapMem(virPtr)); }

/* ---- streams, events */
ACL_API aclError aclrtCreateStream(void **stream) { return acl_rc(__func__, rtStreamCreate(stream, 0)); }
ACL_API aclError aclrtCreateStreamWithConfig(void **stream, uint32_t priority, uint32_t flag) {
    return acl_rc(__func__, rtStreamCreateWithFlags(stream, (int32_t)priority, flag));
}
ACL_API aclError aclrtDestroyStream(void *stream) { return acl_rc(__func__, rtStreamDestroy(stream)); }
ACL_API aclError aclrtDestroyStreamForce(void *stream) { return acl_rc(__func__, rtStreamDestroyForce(stream)); }
ACL_API aclError aclrtSynchronizeStream(void *stream) { return acl_rc(__func__, rtStreamSynchronize(stream)); }
ACL_API aclError aclrtSynchronizeStreamWithTimeout(void *stream, int32_t timeout) {
    return acl_rc(__func__, rtStreamSynchronizeWithTimeout(stream, timeout));
}
/* aclrtStreamStatus: ACL_STREAM_STATUS_COMPLETE 0, ACL_STREAM_STATUS_NOT_READY 1. */
ACL_API aclError aclrtStreamQuery(void *stream, int *status) {
    if (!status) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    aclError rc = rtStreamQuery(stream);
    if (rc == ACL_SUCCESS) *status = 0;
    else if (rc == ACL_ERROR_RT_STREAM_NOT_COMPLETE) *status = 1, rc = ACL_SUCCESS;
    return acl_rc(__func__, rc);
}
ACL_API aclError aclrtCreateEvent(void **event) { return acl_rc(__func__, rtEventCreate(event)); }
ACL_API aclError aclrtCreateEventWithFlag(void **event, uint32_t flag) {
    return acl_rc(__func__, rtEventCreateWithFlag(event, flag));
}
ACL_API aclError aclrtCreateEventExWithFlag(void **event, uint32_t flag) {
    return acl_rc(__func__, rtEventCreateExWithFlag(event, flag));
}
ACL_API aclError aclrtRecordEvent(void *event, void *stream) { return acl_rc(__func__, rtEventRecord(event, stream)); }
ACL_API aclError aclrtResetEvent(void *event, void *stream) { return acl_rc(__func__, rtEventReset(event, stream)); }
ACL_API aclError aclrtStreamWaitEvent(void *stream, void *event) {
    return acl_rc(__func__, rtStreamWaitEvent(stream, event));
}
ACL_API aclError aclrtSynchronizeEvent(void *event) { return acl_rc(__func__, rtEventSynchronize(event)); }
/* aclrtEventRecordedStatus: NOT_READY 0, COMPLETE 1. */
ACL_API aclError aclrtQueryEventStatus(void *event, int *status) {
    if (!status) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    uint32_t s = 0;
    aclError rc = rtEventQueryStatus(event, &s);
    if (rc == ACL_SUCCESS) *status = (int)s;
    return acl_rc(__func__, rc);
}
ACL_API aclError aclrtEventElapsedTime(float *ms, void *startEvent, void *endEvent) {
    return acl_rc(__func__, rtEventElapsedTime(ms, startEvent, endEvent));
}
ACL_API aclError aclrtDestroyEvent(void *event) { return acl_rc(__func__, rtEventDestroy(event)); }
ACL_API aclError aclrtSubscribeReport(uint64_t threadId, void *stream) {
    return acl_rc(__func__, rtSubscribeReport(threadId, stream));
}
ACL_API aclError aclrtUnSubscribeReport(uint64_t threadId, void *stream) {
    return acl_rc(__func__, rtUnSubscribeReport(threadId, stream));
}
ACL_API aclError aclrtProcessReport(int32_t timeout) { return acl_rc(__func__, rtProcessReport(timeout)); }
/* blockType: ACL_CALLBACK_NO_BLOCK 0, ACL_CALLBACK_BLOCK 1. */
ACL_API aclError aclrtLaunchCallback(void (*fn)(void *), void *userData, int blockType, void *stream) {
    return acl_rc(__func__, rtCallbackLaunch(fn, userData, stream, blockType == 1));
}

/* ---- kernels (the binary format: npusim_kernel.h) */
ACL_API aclError aclrtBinaryLoadFromFile(const char *binPath, void *options, void **binHandle) {
    (void)options;
    if (!binPath || !binHandle) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, rtsBinaryLoadFromFile(binPath, NULL, binHandle));
}
ACL_API aclError aclrtBinaryGetFunction(void *binHandle, const char *kernelName, void **funcHandle) {
    if (!binHandle || !kernelName || !funcHandle) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, rtsFuncGetByName(binHandle, kernelName, funcHandle));
}
ACL_API aclError aclrtBinaryUnLoad(void *binHandle) { return acl_rc(__func__, rtBinaryUnLoad(binHandle)); }
ACL_API aclError aclrtLaunchKernel(void *funcHandle, uint32_t numBlocks, const void *argsData, size_t argsSize,
                                   void *stream) {
    if (!funcHandle || argsSize > UINT32_MAX) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    aclError rc = rtsLaunchKernelWithHostArgs(funcHandle, numBlocks, stream, NULL, (void *)argsData,
                                              (uint32_t)argsSize, NULL, 0);
    return acl_rc(__func__, rc);
}

/* ---- snapshot (src/acl/aclrt_impl/snapshot.cpp: the pid/args checks, then the rt function) */
#ifdef NPUSIM_ABI_ZERO_ARG
/* CANN 8.5.x / 9.0.x declare the snapshot functions without arguments. */
ACL_API aclError aclrtSnapShotProcessLock(void) { return acl_rc(__func__, rtSnapShotProcessLock()); }
ACL_API aclError aclrtSnapShotProcessBackup(void) { return acl_rc(__func__, rtSnapShotProcessBackup()); }
ACL_API aclError aclrtSnapShotProcessRestore(void) { return acl_rc(__func__, rtSnapShotProcessRestore()); }
ACL_API aclError aclrtSnapShotProcessUnlock(void) { return acl_rc(__func__, rtSnapShotProcessUnlock()); }
#else
/* CANN 9.1.0-beta.3 and later: (pid, args), pid the caller's own, reserve NULL. */
ACL_API aclError aclrtSnapShotProcessLock(int pid, void *reserve) {
    if (pid != getpid() || reserve) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, rtSnapShotProcessLock());
}
ACL_API aclError aclrtSnapShotProcessUnlock(int pid, void *reserve) {
    if (pid != getpid() || reserve) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, rtSnapShotProcessUnlock());
}
#ifdef NPUSIM_DRIVER_FLOW
/* Newer builds: an args struct {uint32_t flags; char reserved[60];}, flags 0 (required device
 * memory) or 1 (also optional); args != NULL selects the driver-backed flow. */
struct snap_args {
    uint32_t flags;
    char reserved[60];
};
ACL_API aclError aclrtSnapShotProcessBackup(int pid, void *args) {
    if (pid != getpid() || (args && ((const struct snap_args *)args)->flags > 1))
        return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, args ? rtSnapShotProcessBackupWithArgs(args) : rtSnapShotProcessBackup());
}
ACL_API aclError aclrtSnapShotProcessRestore(int pid, void *args) {
    if (pid != getpid() || (args && ((const struct snap_args *)args)->flags > 1))
        return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, args ? rtSnapShotProcessRestoreWithArgs(args) : rtSnapShotProcessRestore());
}
#else
/* 9.1.x: args must be NULL. */
ACL_API aclError aclrtSnapShotProcessBackup(int pid, void *args) {
    if (pid != getpid() || args) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, rtSnapShotProcessBackup());
}
ACL_API aclError aclrtSnapShotProcessRestore(int pid, void *args) {
    if (pid != getpid() || args) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return acl_rc(__func__, rtSnapShotProcessRestore());
}
#endif
#endif
ACL_API aclError aclrtSnapShotCallbackRegister(int stage, npusim_callback cb, void *args) {
    return acl_rc(__func__, rtSnapShotCallbackRegister(stage, cb, args));
}
ACL_API aclError aclrtSnapShotCallbackUnregister(int stage, npusim_callback cb) {
    return acl_rc(__func__, rtSnapShotCallbackUnregister(stage, cb));
}

/* ---- what torch_npu's initialisation and its error paths call (read in Ascend/pytorch,
 * torch_npu/csrc/core/npu/interface/AclInterface.cpp and sys_ctrl/npu_sys_ctrl.cpp) */

/* aclrtFloatOverflowMode: SATURATION 0, INF_NAN 1 (device.cpp aclrtSetDeviceSatModeImpl). The
 * simulated device computes IEEE floats, i.e. INF_NAN; saturation is not simulated, so asking for
 * it fails instead of being ignored. */
static int g_sat_mode = 1;
ACL_API aclError aclrtSetDeviceSatMode(int mode) {
    if (mode != 0 && mode != 1) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    if (mode == 0) {
        npusim_report(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "EE1005", __func__,
                      "aclrtSetDeviceSatMode: saturation mode is not simulated (the device computes INF/NaN)");
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    __atomic_store_n(&g_sat_mode, mode, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}
ACL_API aclError aclrtGetDeviceSatMode(int *mode) {
    if (!mode) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    *mode = __atomic_load_n(&g_sat_mode, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}

/* aclSysParamOpt: DETERMINISTIC 0, ENABLE_DEBUG_KERNEL 1, STRONG_CONSISTENCY 2, KERNEL_EARLY_START 3
 * (acl_base.h). The process-wide values default to 0 and are always readable (runtime
 * src/runtime/api/api_c.cc rtGetSysParamOpt: sysParamOpt_[opt], no "not set" error); the context's
 * values (aclrtCtxSetSysParamOpt) are kept apart, per process here as torch_npu sets the same
 * value on every device's context. The simulated kernels always reduce in one fixed order, so
 * deterministic mode needs no change of behaviour. */
#define SYS_OPT_COUNT 4
static int64_t g_sys_opt[SYS_OPT_COUNT], g_ctx_opt[SYS_OPT_COUNT];
static int sys_opt_ok(int opt, int ctx) { return opt >= 0 && opt < (ctx ? 3 : SYS_OPT_COUNT); }
ACL_API aclError aclrtSetSysParamOpt(int opt, int64_t value) {
    if (!sys_opt_ok(opt, 0)) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    __atomic_store_n(&g_sys_opt[opt], value, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}
ACL_API aclError aclrtGetSysParamOpt(int opt, int64_t *value) {
    if (!value || !sys_opt_ok(opt, 0)) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    *value = __atomic_load_n(&g_sys_opt[opt], __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}
ACL_API aclError aclrtCtxSetSysParamOpt(int opt, int64_t value) {
    if (!sys_opt_ok(opt, 1)) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    int32_t d;
    if (rtGetDevice(&d) != ACL_SUCCESS) return acl_rc(__func__, ACL_ERROR_RT_CONTEXT_NULL);
    __atomic_store_n(&g_ctx_opt[opt], value, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}
ACL_API aclError aclrtCtxGetSysParamOpt(int opt, int64_t *value) {
    if (!value || !sys_opt_ok(opt, 1)) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    int32_t d;
    if (rtGetDevice(&d) != ACL_SUCCESS) return acl_rc(__func__, ACL_ERROR_RT_CONTEXT_NULL);
    *value = __atomic_load_n(&g_ctx_opt[opt], __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}

/* Operator timeouts (aclrtSetOpExecuteTimeOut: seconds, 0 = the default; V2: microseconds, with the
 * value in effect written back; aclrtSetOpWaitTimeout: seconds an event wait may take). The
 * simulated kernels finish or fail on their own: the values are kept and answered, never used. */
static uint64_t g_op_exec_timeout_us, g_op_wait_timeout_s;
ACL_API aclError aclrtSetOpExecuteTimeOut(uint32_t timeout) {
    __atomic_store_n(&g_op_exec_timeout_us, (uint64_t)timeout * 1000000u, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}
ACL_API aclError aclrtSetOpExecuteTimeOutV2(uint64_t timeout, uint64_t *actualTimeout) {
    if (!actualTimeout) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    __atomic_store_n(&g_op_exec_timeout_us, timeout, __ATOMIC_SEQ_CST);
    *actualTimeout = timeout;
    return ACL_SUCCESS;
}
ACL_API aclError aclrtGetOpExecuteTimeOut(uint32_t *timeoutMs) {
    if (!timeoutMs) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    *timeoutMs = (uint32_t)(__atomic_load_n(&g_op_exec_timeout_us, __ATOMIC_SEQ_CST) / 1000u);
    return ACL_SUCCESS;
}
ACL_API aclError aclrtSetOpWaitTimeout(uint32_t timeout) {
    __atomic_store_n(&g_op_wait_timeout_s, timeout, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}

/* aclmdlRICaptureGetInfo (model_ri.cpp): whether the stream is capturing into a model. The
 * simulator has no graph capture: never capturing (ACL_MODEL_RI_CAPTURE_STATUS_NONE 0, no model).
 * torch_npu calls it before each operator and from both allocators. */
ACL_API aclError aclmdlRICaptureGetInfo(void *stream, int *status, void **modelRI) {
    (void)stream;
    if (!status || !modelRI) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    *status = 0;
    *modelRI = NULL;
    return ACL_SUCCESS;
}

/* aclCannAttr: INF_NAN 0, BF16 1, JIT_COMPILE 2 (acl_base.h; acl.cpp aclGetCannAttributeImpl via
 * CannInfoUtils::GetAttribute: 1 when the SoC supports it). The simulated device computes IEEE
 * INF/NaN; it has no bfloat16 kernels and no operator compiler. */
ACL_API aclError aclGetCannAttribute(int attr, int32_t *value) {
    if (!value || attr < 0 || attr > 2) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    *value = attr == 0 ? 1 : 0;
    return ACL_SUCCESS;
}

/* Stream modes: the overflow switch (0/1) and the failure mode (ACL_CONTINUE_ON_FAILURE 0,
 * ACL_STOP_ON_FAILURE 1). A simulated stream stops at its first failed task either way (runtime.c);
 * the arguments are checked as stream.cpp checks them. */
ACL_API aclError aclrtSetStreamOverflowSwitch(void *stream, uint32_t flag) {
    (void)stream;
    if (flag > 1) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return ACL_SUCCESS;
}
ACL_API aclError aclrtSetStreamFailureMode(void *stream, uint64_t mode) {
    if (!stream || mode > 1) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return ACL_SUCCESS;
}

/* aclrtLastErrLevel: ACL_RT_THREAD_LEVEL 0 only (context.cpp). Peek leaves the code, Get clears it. */
ACL_API aclError aclrtPeekAtLastError(int level) {
    if (level != 0) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    return npusim_last_code;
}
ACL_API aclError aclrtGetLastError(int level) {
    if (level != 0) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    aclError rc = npusim_last_code;
    npusim_last_code = ACL_SUCCESS;
    return rc;
}

/* aclsysGetCANNVersion (acl.cpp): aclCANNPackageName CANN 0 .. DRIVER 7; the version split in
 * parts (acl_base.h aclCANNPackageVersion: char[128] version, four char[64] parts, char[128]). */
typedef struct {
    char version[128];
    char majorVersion[64];
    char minorVersion[64];
    char releaseVersion[64];
    char patchVersion[64];
    char reserved[128];
} aclCANNPackageVersion;
ACL_API aclError aclsysGetCANNVersion(int name, aclCANNPackageVersion *version) {
    if (!version || name < 0 || name > 7) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    memset(version, 0, sizeof *version);
    snprintf(version->version, sizeof version->version, "%s", NPUSIM_CANN_VERSION);
    unsigned maj = 0, min = 0, rel = 0;
    sscanf(NPUSIM_CANN_VERSION, "%u.%u.%u", &maj, &min, &rel);
    snprintf(version->majorVersion, sizeof version->majorVersion, "%u", maj);
    snprintf(version->minorVersion, sizeof version->minorVersion, "%u", min);
    snprintf(version->releaseVersion, sizeof version->releaseVersion, "%u", rel);
    return ACL_SUCCESS;
}

/* aclDeviceInfo: AI_CORE_NUM 0, VECTOR_CORE_NUM 1, L2_SIZE 2 (acl.cpp aclGetDeviceCapabilityImpl:
 * the device id is checked against the count, then the SoC's platform values). The values are
 * those of an Atlas A2 (Ascend910B1: 24 AI cores, 48 vector cores, 192 MiB L2). */
ACL_API aclError aclGetDeviceCapability(uint32_t deviceId, int info, int64_t *value) {
    int32_t n = 0;
    if (!value) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    aclError rc = rtGetDeviceCount(&n);
    if (rc != ACL_SUCCESS) return acl_rc(__func__, rc);
    if (deviceId >= (uint32_t)n || info < 0 || info > 2) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    static const int64_t caps[3] = {24, 48, (int64_t)192 << 20};
    *value = caps[info];
    return ACL_SUCCESS;
}

/* aclAppLog (log.cpp): the application's line in the CANN log. The simulator keeps no log files;
 * ASCEND_SLOG_PRINT_TO_STDOUT=1 prints it, as it does with a real install. aclLogLevel: DEBUG 0,
 * INFO 1, WARNING 2, ERROR 3; ASCEND_GLOBAL_LOG_LEVEL (default 3) filters. */
ACL_API void aclAppLog(int level, const char *func, const char *file, uint32_t line, const char *fmt, ...) {
    const char *out = getenv("ASCEND_SLOG_PRINT_TO_STDOUT");
    const char *lv = getenv("ASCEND_GLOBAL_LOG_LEVEL");
    if (!fmt || !out || strcmp(out, "1") != 0 || level < (lv && *lv ? atoi(lv) : 3)) return;
    static const char *names[] = {"DEBUG", "INFO", "WARNING", "ERROR"};
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    printf("[%s] APP(%d):%s:%u %s: %s\n", level >= 0 && level <= 3 ? names[level] : "?", (int)getpid(),
           file ? file : "", line, func ? func : "", text);
    fflush(stdout);
}

/* aclDataBuffer (data_buffer.cpp): a host object naming device memory, {data, length}. */
typedef struct {
    void *data;
    uint64_t length;
} aclDataBuffer;
ACL_API aclDataBuffer *aclCreateDataBuffer(void *data, size_t size) {
    aclDataBuffer *b = malloc(sizeof *b);
    if (!b) {
        npusim_report(ACL_ERROR_RT_MEMORY_ALLOCATION, "EE9999", __func__, "aclCreateDataBuffer: out of host memory");
        return NULL;
    }
    b->data = data;
    b->length = size;
    return b;
}
ACL_API aclError aclDestroyDataBuffer(const aclDataBuffer *dataBuffer) {
    if (!dataBuffer) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    free((void *)dataBuffer);
    return ACL_SUCCESS;
}
ACL_API void *aclGetDataBufferAddr(const aclDataBuffer *dataBuffer) { return dataBuffer ? dataBuffer->data : NULL; }
ACL_API size_t aclGetDataBufferSizeV2(const aclDataBuffer *dataBuffer) {
    return dataBuffer ? (size_t)dataBuffer->length : 0;
}

/* Peer access (memory.cpp aclrtDeviceCanAccessPeer): both ids must be devices, and differ. The
 * simulated devices copy to each other only through the host, so the answer is no; torch_npu then
 * never enables it (aclrtDeviceEnablePeerAccess is a deliberate failure, failures.toml). */
ACL_API aclError aclrtDeviceCanAccessPeer(int32_t *canAccessPeer, int32_t deviceId, int32_t peerDeviceId) {
    int32_t n = 0;
    if (!canAccessPeer) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    aclError rc = rtGetDeviceCount(&n);
    if (rc != ACL_SUCCESS) return acl_rc(__func__, rc);
    if (deviceId < 0 || peerDeviceId < 0 || deviceId >= n || peerDeviceId >= n || deviceId == peerDeviceId)
        return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    *canAccessPeer = 0;
    return ACL_SUCCESS;
}

/* aclrtDeviceGetBareTgid (memory.cpp): the process's tgid as the driver knows it (outside any pid
 * namespace), for IPC handles. The simulated driver is this host's: the tgid of the process. */
ACL_API aclError aclrtDeviceGetBareTgid(int32_t *pid) {
    if (!pid) return acl_rc(__func__, ACL_ERROR_INVALID_PARAM);
    *pid = (int32_t)getpid();
    return ACL_SUCCESS;
}

#define NPUSIM_FAILURES_ACL
#include "failures.inc"

#ifndef NPUSIM_STRICT_EXPORTS
/* Not an ACL function: lets the npusnap agent report which devices this process has open. Absent
 * from the strict tree (.build/cann-strict), which exports real names only. */
ACL_API int npusimGetOpenDevices(int32_t *ids, int max) {
    NPUSIM_PRIVATE();
    return npusimRuntimeOpenDevices(ids, max);
}
#endif
