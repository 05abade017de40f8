/* Internal interface of the simulated CANN runtime: error codes and the functions libruntime.so
 * exports to the ACL front-ends (acl.c). Not a public header of the fake CANN tree. */
#ifndef NPUSIM_H
#define NPUSIM_H
#include <stddef.h>
#include <stdint.h>

#ifndef NPUSIM_CANN_VERSION
#define NPUSIM_CANN_VERSION "9.1.0" /* the 9.0 tree is built with -DNPUSIM_CANN_VERSION="9.0.0" */
#endif

#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_DEV_SETUP_ERROR 507033
#define ACL_ERROR_RT_DRV_INTERNAL_ERROR 507899
#define ACL_ERROR_SNAPSHOT_LOCK_TIMEOUT 507905
#define ACL_ERROR_SNAPSHOT_LOCK_FAILED 507906
#define ACL_ERROR_SNAPSHOT_UNLOCK_FAILED 507907
#define ACL_ERROR_SNAPSHOT_BACKUP_FAILED 507908
#define ACL_ERROR_SNAPSHOT_RESTORE_FAILED 507909
#define ACL_ERROR_SNAPSHOT_CALLBACK_FAILED 507912
#define ACL_ERROR_SNAPSHOT_REGISTER_CALLBACK_FAILED 507913

enum {
    NPUSIM_STAGE_LOCK_PRE = 0,
    NPUSIM_STAGE_BACKUP_PRE = 1,
    NPUSIM_STAGE_BACKUP_POST = 2,
    NPUSIM_STAGE_RESTORE_PRE = 3,
    NPUSIM_STAGE_RESTORE_POST = 4,
    NPUSIM_STAGE_UNLOCK_POST = 5,
};

typedef uint32_t (*npusim_callback)(int32_t device_id, void *args);

#define NPUSIM_API __attribute__((visibility("default")))

NPUSIM_API int32_t npusim_rt_init(const char *config);
NPUSIM_API int32_t npusim_rt_finalize(void);
NPUSIM_API int32_t npusim_rt_set_device(int32_t dev);
NPUSIM_API int32_t npusim_rt_reset_device(int32_t dev);
NPUSIM_API int32_t npusim_rt_get_device(int32_t *dev);
NPUSIM_API int32_t npusim_rt_malloc(void **ptr, size_t size, int policy);
NPUSIM_API int32_t npusim_rt_free(void *ptr);
NPUSIM_API int32_t npusim_rt_memcpy(void *dst, size_t dest_max, const void *src, size_t count, int kind);
NPUSIM_API int32_t npusim_rt_synchronize_device(void);
NPUSIM_API int32_t npusim_rt_get_current_context(void **ctx);
NPUSIM_API int32_t npusim_rt_set_current_context(void *ctx);
NPUSIM_API int32_t npusim_rt_get_version_str(char *pkg, char *out);
NPUSIM_API int npusim_rt_get_open_devices(int32_t *ids, int max);
NPUSIM_API int32_t npusim_rt_callback_register(int stage, npusim_callback cb, void *args);
NPUSIM_API int32_t npusim_rt_callback_unregister(int stage, npusim_callback cb);
NPUSIM_API int32_t npusim_rt_lock(int pid, void *reserve);
NPUSIM_API int32_t npusim_rt_backup(int pid, void *args);
NPUSIM_API int32_t npusim_rt_restore(int pid, void *args);
NPUSIM_API int32_t npusim_rt_unlock(int pid, void *reserve);
NPUSIM_API int rtSnapShotProcessGetState(int *state);

#endif
