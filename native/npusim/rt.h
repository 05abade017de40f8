/* The rt* functions of the simulated libruntime.so (runtime.c), as the ACL front-ends (acl.c) call
 * them through the dynamic linker. Names and argument order are the real ones (runtime repository:
 * include/ and pkg_inc/ prototypes, src/runtime/api/api_c*.cc); handle types are void * and enum
 * types uint32_t on the same ABI. Not a public header of the fake CANN tree. */
#ifndef NPUSIM_RT_H
#define NPUSIM_RT_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "hal.h"
#include "npusim.h"

RT_API rtError_t rtSetDevice(int32_t devId);
RT_API rtError_t rtDeviceReset(int32_t devId);
RT_API rtError_t rtDeviceResetForce(int32_t devId);
RT_API rtError_t rtGetDevice(int32_t *devId);
RT_API rtError_t rtGetDeviceCount(int32_t *cnt);
RT_API rtError_t rtDeviceSynchronizeWithTimeout(int32_t timeout);
RT_API rtError_t rtDeviceSynchronize(void);
RT_API rtError_t rtCtxGetCurrent(void **currentCtx);
RT_API rtError_t rtCtxSetCurrent(void *currentCtx);
RT_API rtError_t rtMalloc(void **devPtr, uint64_t size, uint32_t type, uint16_t moduleId);
RT_API rtError_t rtMallocCached(void **devPtr, uint64_t size, uint32_t type, uint16_t moduleId);
RT_API rtError_t rtFree(void *devPtr);
RT_API rtError_t rtMallocHost(void **hostPtr, uint64_t size, uint16_t moduleId);
RT_API rtError_t rtFreeHost(void *hostPtr);
RT_API rtError_t rtMemcpy(void *dst, uint64_t destMax, const void *src, uint64_t cnt, uint32_t kind);
RT_API rtError_t rtMemcpyAsync(void *dst, uint64_t destMax, const void *src, uint64_t cnt, uint32_t kind, void *stm);
RT_API rtError_t rtMemset(void *devPtr, uint64_t destMax, uint32_t val, uint64_t cnt);
RT_API rtError_t rtMemsetAsync(void *ptr, uint64_t destMax, uint32_t val, uint64_t cnt, void *stm);
RT_API rtError_t rtMemGetInfoEx(uint32_t memInfoType, size_t *freeSize, size_t *totalSize);
RT_API rtError_t rtReserveMemAddress(void **devPtr, size_t size, size_t alignment, void *devAddr, uint64_t flags);
RT_API rtError_t rtReleaseMemAddress(void *devPtr);
RT_API rtError_t rtMallocPhysical(void **handle, size_t size, const struct drv_mem_prop *prop, uint64_t flags);
RT_API rtError_t rtFreePhysical(void *handle);
RT_API rtError_t rtMemGetAllocationGranularity(const struct drv_mem_prop *prop, uint32_t option, size_t *granularity);
RT_API rtError_t rtMapMem(void *devPtr, size_t size, size_t offset, void *handle, uint64_t flags);
RT_API rtError_t rtUnmapMem(void *devPtr);
RT_API rtError_t rtStreamCreateWithFlags(void **stm, int32_t priority, uint32_t flags);
RT_API rtError_t rtStreamCreate(void **stm, int32_t priority);
RT_API rtError_t rtStreamDestroy(void *stm);
RT_API rtError_t rtStreamDestroyForce(void *stm);
RT_API rtError_t rtStreamSynchronizeWithTimeout(void *stm, int32_t timeout);
RT_API rtError_t rtStreamSynchronize(void *stm);
RT_API rtError_t rtStreamQuery(void *stm);
RT_API rtError_t rtEventCreateWithFlag(void **evt, uint32_t flag);
RT_API rtError_t rtEventCreate(void **evt);
RT_API rtError_t rtEventCreateExWithFlag(void **evt, uint32_t flag);
RT_API rtError_t rtEventRecord(void *evt, void *stm);
RT_API rtError_t rtEventReset(void *evt, void *stm);
RT_API rtError_t rtStreamWaitEvent(void *stm, void *evt);
RT_API rtError_t rtEventSynchronize(void *evt);
RT_API rtError_t rtEventQueryStatus(void *evt, uint32_t *status);
RT_API rtError_t rtEventElapsedTime(float *timeInterval, void *startEvent, void *endEvent);
RT_API rtError_t rtEventDestroy(void *evt);
RT_API rtError_t rtSubscribeReport(uint64_t threadId, void *stm);
RT_API rtError_t rtUnSubscribeReport(uint64_t threadId, void *stm);
RT_API rtError_t rtProcessReport(int32_t timeout);
RT_API rtError_t rtCallbackLaunch(void (*callBackFunc)(void *), void *fnData, void *stm, bool isBlock);
RT_API rtError_t rtsBinaryLoadFromFile(const char *binPath, const void *optionalCfg, void **handle);
RT_API rtError_t rtBinaryUnLoad(void *binHandle);
RT_API rtError_t rtsFuncGetByName(const void *binHandle, const char *kernelName, void **funcHandle);
RT_API rtError_t rtsLaunchKernelWithHostArgs(void *funcHandle, uint32_t numBlocks, void *stm, void *cfg,
                                             void *hostArgs, uint32_t argsSize, void *placeHolderArray,
                                             uint32_t placeHolderNum);
RT_API rtError_t rtSnapShotCallbackRegister(int stage, npusim_callback callback, void *args);
RT_API rtError_t rtSnapShotCallbackUnregister(int stage, npusim_callback callback);
RT_API rtError_t rtSnapShotProcessLock(void);
RT_API rtError_t rtSnapShotProcessBackup(void);
RT_API rtError_t rtSnapShotProcessRestore(void);
RT_API rtError_t rtSnapShotProcessBackupWithArgs(const void *args);
RT_API rtError_t rtSnapShotProcessRestoreWithArgs(const void *args);
RT_API rtError_t rtSnapShotProcessUnlock(void);
RT_API rtError_t rtSnapShotProcessGetState(int *state);
#ifndef NPUSIM_STRICT_EXPORTS
RT_API int npusimRuntimeOpenDevices(int32_t *ids, int max);
#endif

#endif
