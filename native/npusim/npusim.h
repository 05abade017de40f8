/* Internal header of the simulated CANN runtime: error codes (include/external/acl/error_codes/
 * rt_error_codes.h and acl_base.h of the runtime repository) and snapshot stages, both from the
 * generated native/include/npusnap/contract.h (spec: native/contract/npusnap.toml), and the callback type.
 * The functions between the layers are the real rt* and hal* names (runtime.c, hal.c, hal.h). Not a
 * public header of the fake CANN tree. */
#ifndef NPUSIM_H
#define NPUSIM_H
#include <stddef.h>
#include <stdint.h>

/* CANN's ACL_* names and the snapshot stages come from the generated contract. */
#define NPUSNAP_CONTRACT_CANN_NAMES
#include "npusnap/contract.h"

#ifndef NPUSIM_CANN_VERSION
#define NPUSIM_CANN_VERSION "9.1.0" /* the 9.0 tree is built with -DNPUSIM_CANN_VERSION="9.0.0" */
#endif

#define NPUSIM_STAGE_LOCK_PRE NPUSNAP_STAGE_LOCK_PRE
#define NPUSIM_STAGE_BACKUP_PRE NPUSNAP_STAGE_BACKUP_PRE
#define NPUSIM_STAGE_BACKUP_POST NPUSNAP_STAGE_BACKUP_POST
#define NPUSIM_STAGE_RESTORE_PRE NPUSNAP_STAGE_RESTORE_PRE
#define NPUSIM_STAGE_RESTORE_POST NPUSNAP_STAGE_RESTORE_POST
#define NPUSIM_STAGE_UNLOCK_POST NPUSNAP_STAGE_UNLOCK_POST

typedef uint32_t (*npusim_callback)(int32_t device_id, void *args);

typedef int32_t rtError_t;

#define NPUSIM_API __attribute__((visibility("default")))
#define RT_API NPUSIM_API

#endif
