/* The simulated driver's user-space API (libascend_hal.so): the subset of the real driver header
 * ascend_hal.h (driver repository, pkg_inc/ascend_hal_base.h and the svm/vmm headers) that the
 * simulated runtime calls, with the real names and prototypes. The runtime (runtime.c) reaches
 * these through the dynamic linker, as libruntime.so reaches the real libascend_hal.so, so a tool
 * interposing at the driver layer meets them. Not a public header of the fake CANN tree. */
#ifndef NPUSIM_HAL_H
#define NPUSIM_HAL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef int drvError_t; /* enum tagDrvError in ascend_hal_error.h: an int on the ABI */
typedef unsigned long long UINT64;
typedef UINT64 DVdeviceptr;
typedef int drvFeature_t;

/* The driver's error numbers the simulation answers (values of enum tagDrvError). */
#define DRV_ERROR_NONE 0
#define DRV_ERROR_NO_DEVICE 1
#define DRV_ERROR_INVALID_DEVICE 2
#define DRV_ERROR_INVALID_VALUE 3
#define DRV_ERROR_INVALID_HANDLE 4
#define DRV_ERROR_OUT_OF_MEMORY 6
#define DRV_ERROR_INNER_ERR 7
#define DRV_ERROR_PARA_ERROR 8
#define DRV_ERROR_SERVER_BUSY 28
#define DRV_ERROR_OPER_NOT_PERMITTED 46
#define DRV_ERROR_NOT_SUPPORT 0xfffe

/* halMemAlloc's flag (ascend_hal.h): bits 0-9 the device id (MEM_DEVID_MASK), bits 10-13 the
 * virtual memory type (MEM_VIRT_BIT; MEM_DEV_VAL 1: device memory). */
#define MEM_DEVID_WIDTH 10
#define MEM_DEVID_MASK ((1ull << MEM_DEVID_WIDTH) - 1)
#define MEM_VIRT_BIT 10
#define MEM_DEV_VAL 0x1ull
#define MEM_DEV (MEM_DEV_VAL << MEM_VIRT_BIT)

/* halSupportFeature's feature of the driver-backed snapshot flow (drvFeature_t
 * FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT; its number here is the simulator's). */
#define NPUSIM_FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT 64

/* halProcResBackupInfo.reserve[0] bit 0: the runtime's driver-backed flow (args != NULL): the
 * driver keeps the process's device memory (tag SNAPSHOT_REQUIRED_BACKUP, the default tag). */
#define NPUSIM_BACKUP_DEVICE_MEM 1ull

typedef struct {
    uint64_t reserve[8];
} halProcResBackupInfo;
typedef struct {
    uint64_t reserve[8];
} halProcResRestoreInfo;
typedef struct {
    uint64_t reserve[8];
} halDevOpenIn;
typedef struct {
    uint64_t reserve[8];
} halDevOpenOut;
typedef struct {
    uint32_t close_type;
    uint32_t rsv;
    uint64_t reserve[7];
} halDevCloseIn;

struct drv_mem_prop {
    uint32_t side; /* enum drv_mem_side */
    uint32_t devid;
    uint32_t module_id;
    uint32_t pg_type;  /* enum drv_mem_pg_type */
    uint32_t mem_type; /* enum drv_mem_type */
    uint64_t reserve;
};
typedef struct drv_mem_handle drv_mem_handle_t;

/* halMemGetInfo(type MEM_INFO_TYPE_PHY_INFO): the head of struct MemPhyInfo. */
#define NPUSIM_MEM_INFO_TYPE_PHY_INFO 1
struct MemPhyInfo {
    unsigned long long total;
    unsigned long long free;
    unsigned long long huge_total;
    unsigned long long huge_free;
};

#define HAL_API __attribute__((visibility("default")))

HAL_API drvError_t halDeviceOpen(uint32_t devid, halDevOpenIn *in, halDevOpenOut *out);
HAL_API drvError_t halDeviceClose(uint32_t devid, halDevCloseIn *in);
HAL_API drvError_t halMemAlloc(void **pp, unsigned long long size, unsigned long long flag);
#ifndef NPUSIM_STRICT_EXPORTS
/* The simulated node's own (hal.c): an allocation that bypasses halMemAlloc (fault "untracked"),
 * the node's faults, and the runtime's word that its snapshot lock is held. The strict tree
 * exports driver names only, so it lacks them and the two faults that need them. */
HAL_API drvError_t npusimHalMemAllocHuge(void **pp, unsigned long long size, unsigned long long flag);
HAL_API unsigned long long npusimHalNodeFaults(void);
HAL_API void npusimHalSnapshotLocked(int locked);
#endif
HAL_API drvError_t halMemFree(void *pp);
HAL_API drvError_t drvMemcpy(DVdeviceptr dst, size_t destMax, DVdeviceptr src, size_t ByteCount);
HAL_API drvError_t drvMemsetD8(DVdeviceptr dst, size_t destMax, uint8_t value, size_t num);
HAL_API drvError_t drvMemAddressTranslate(DVdeviceptr vptr, UINT64 *pptr);
HAL_API drvError_t drvGetDevNum(uint32_t *num_dev);
HAL_API drvError_t halMemGetInfo(unsigned int device, unsigned int type, void *info);
HAL_API drvError_t halMemGetAllocationGranularity(const struct drv_mem_prop *prop, int option, size_t *granularity);
HAL_API drvError_t halMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr, uint64_t flag);
HAL_API drvError_t halMemAddressFree(void *ptr);
HAL_API drvError_t halMemCreate(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop,
                                uint64_t flag);
HAL_API drvError_t halMemRelease(drv_mem_handle_t *handle);
HAL_API drvError_t halMemMap(void *ptr, size_t size, size_t offset, drv_mem_handle_t *handle, uint64_t flag);
HAL_API drvError_t halMemUnmap(void *ptr);
HAL_API drvError_t halProcessResBackup(halProcResBackupInfo *info);
HAL_API drvError_t halProcessResRestore(halProcResRestoreInfo *info);
HAL_API bool halSupportFeature(uint32_t devId, drvFeature_t type);
HAL_API drvError_t halGetAPIVersion(int *halAPIVersion);

#endif
