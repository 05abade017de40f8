/* The ACL front-end of the simulated NPU, built twice: as libacl_rt.so (CANN 9.1+) and as
 * libascendcl.so (older name, same exports). Every function forwards to libruntime.so, which holds
 * the single runtime state of the process. Names and prototypes are the real CANN ones. */
#include "npusim.h"

typedef int32_t aclError;

NPUSIM_API aclError aclInit(const char *configPath) { return npusim_rt_init(configPath); }
NPUSIM_API aclError aclFinalize(void) { return npusim_rt_finalize(); }
NPUSIM_API aclError aclrtSetDevice(int32_t deviceId) { return npusim_rt_set_device(deviceId); }
NPUSIM_API aclError aclrtResetDevice(int32_t deviceId) { return npusim_rt_reset_device(deviceId); }
NPUSIM_API aclError aclrtGetDevice(int32_t *deviceId) { return npusim_rt_get_device(deviceId); }
NPUSIM_API aclError aclrtMalloc(void **devPtr, size_t size, int policy) {
    return npusim_rt_malloc(devPtr, size, policy);
}
NPUSIM_API aclError aclrtFree(void *devPtr) { return npusim_rt_free(devPtr); }
NPUSIM_API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    return npusim_rt_memcpy(dst, destMax, src, count, kind);
}
NPUSIM_API aclError aclrtGetCurrentContext(void **context) { return npusim_rt_get_current_context(context); }
NPUSIM_API aclError aclrtSetCurrentContext(void *context) { return npusim_rt_set_current_context(context); }
NPUSIM_API aclError aclrtSynchronizeDevice(void) { return npusim_rt_synchronize_device(); }
NPUSIM_API aclError aclsysGetVersionStr(char *pkgName, char *versionStr) {
    return npusim_rt_get_version_str(pkgName, versionStr);
}

#ifdef NPUSIM_ABI_ZERO_ARG
/* CANN 8.5.x / 9.0.x declare the snapshot functions without arguments. */
NPUSIM_API aclError aclrtSnapShotProcessLock(void) { return npusim_rt_lock(0, NULL); }
NPUSIM_API aclError aclrtSnapShotProcessBackup(void) { return npusim_rt_backup(0, NULL); }
NPUSIM_API aclError aclrtSnapShotProcessRestore(void) { return npusim_rt_restore(0, NULL); }
NPUSIM_API aclError aclrtSnapShotProcessUnlock(void) { return npusim_rt_unlock(0, NULL); }
#else
/* CANN 9.1.0-beta.3 and later: (pid, args), pid the caller's own, args NULL on 9.1.x. */
NPUSIM_API aclError aclrtSnapShotProcessLock(int pid, void *reserve) { return npusim_rt_lock(pid, reserve); }
NPUSIM_API aclError aclrtSnapShotProcessBackup(int pid, void *args) { return npusim_rt_backup(pid, args); }
NPUSIM_API aclError aclrtSnapShotProcessRestore(int pid, void *args) { return npusim_rt_restore(pid, args); }
NPUSIM_API aclError aclrtSnapShotProcessUnlock(int pid, void *reserve) { return npusim_rt_unlock(pid, reserve); }
#endif
NPUSIM_API aclError aclrtSnapShotCallbackRegister(int stage, npusim_callback cb, void *args) {
    return npusim_rt_callback_register(stage, cb, args);
}
NPUSIM_API aclError aclrtSnapShotCallbackUnregister(int stage, npusim_callback cb) {
    return npusim_rt_callback_unregister(stage, cb);
}

/* Not an ACL function: lets the npusnap agent report which devices this process has open. */
NPUSIM_API int npusimGetOpenDevices(int32_t *ids, int max) { return npusim_rt_get_open_devices(ids, max); }
