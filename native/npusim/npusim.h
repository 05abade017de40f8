/* Internal header of the simulated CANN runtime: error codes (include/external/acl/error_codes/
 * rt_error_codes.h and acl_base.h of the runtime repository), snapshot stages and the callback type.
 * The functions between the layers are the real rt* and hal* names (runtime.c, hal.c, hal.h). Not a
 * public header of the fake CANN tree. */
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

typedef int32_t rtError_t;

#define ACL_ERROR_RT_STREAM_SUBSCRIBE 107011
#define ACL_ERROR_RT_THREAD_SUBSCRIBE 107012
#define ACL_ERROR_RT_REPORT_TIMEOUT 507012
#define ACL_ERROR_RT_STREAM_NOT_COMPLETE 507004
#define ACL_ERROR_RT_EVENT_NOT_COMPLETE 507006
#define ACL_ERROR_RT_AICORE_EXCEPTION 507015
#define ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046

#define NPUSIM_API __attribute__((visibility("default")))
#define RT_API NPUSIM_API

#endif
