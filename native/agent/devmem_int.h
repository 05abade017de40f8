/* What the files of the agent's device-memory keeper share (libnpusnap_agent.so, internal).
 *
 * devmem.c        the tables (allocations, reservations, VMM chunks, devices, contexts), the
 *                 agent record, fork handling, write tracking, queries;
 * devmem_hooks.c  the wrappers of the driver's allocation calls, of the runtime's device and
 *                 context calls, and dlsym();
 * devmem_save.c   the copy after Lock (drain, save to memory or to a file) and the reload after
 *                 Restore;
 * devmem_cc.c     the concurrent copy of `dump --leave-running` and the writers' gate.
 *
 * One lock, g_mu, guards the tables; npusnap/devmem.h is the interface the rest of the agent uses.
 */
#ifndef NPUSNAP_DEVMEM_INT_H
#define NPUSNAP_DEVMEM_INT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NPUSNAP_CONTRACT_CANN_NAMES /* ACL_SUCCESS, ...: no CANN header is included */
#include "npusnap/devmem.h"
#include "npusnap/quietthread.h"
#include "npusnap/timeutil.h"
#include "realsym.h"

void agent_log(const char *fmt, ...) __attribute__((format(printf, 1, 2))); /* log.c */
void *npusnap_hccl_wrapper_for(const char *name, void *p); /* hccl.c */
void *npusnap_writes_wrapper_for(void *handle, const char *name, void *p, dlsym_fn ds); /* writes_ops.c */
/* the writers' side (writes.c calls them too) */
void npusnap_devmem_before_write(uintptr_t p, size_t n);
void npusnap_devmem_mark(uintptr_t p, size_t n);
void npusnap_devmem_write_close(void);

typedef int32_t aclError;
typedef int drvError_t; /* enum tagDrvError (driver ascend_hal_error.h): an int on the ABI */
typedef unsigned long long DVdeviceptr;
typedef struct drv_mem_handle drv_mem_handle_t;
struct drv_mem_prop { /* ascend_hal.h: the head is what npusnap reads */
    uint32_t side;
    uint32_t devid;
    uint32_t module_id;
    uint32_t pg_type;
    uint32_t mem_type;
    uint64_t reserve;
};
#define DRV_ERROR_NOT_SUPPORT 0xfffe
/* halMemAlloc's flag carries the device id in its low bits (MEM_DEVICE_ID of ascend_hal.h). */
#define HAL_FLAG_DEVID_MASK 0x3FFull

typedef drvError_t (*memcpy_fn_t)(DVdeviceptr, size_t, DVdeviceptr, size_t);

/* ---- the real functions (devmem.c) ------------------------------------------------------ */
enum {
    /* wrapped: the driver's allocation calls (tracked), its copy (counted) */
    F_HAL_ALLOC, F_HAL_FREE, F_HAL_RESERVE, F_HAL_ADDR_FREE, F_HAL_CREATE, F_HAL_RELEASE, F_HAL_MAP,
    F_HAL_UNMAP, F_DRV_MEMCPY,
    /* wrapped: the runtime calls that tell which context a device uses (followed, never held) */
    F_SET_DEVICE, F_RESET_DEVICE, F_RESET_DEVICE_FORCE, F_FINALIZE, F_CREATE_CTX, F_SET_CTX, F_DESTROY_CTX,
    N_WRAPPED,
    /* not wrapped, used by save/reload (queries, context selection, synchronize) */
    F_GET_DEVICE = N_WRAPPED, F_GET_CTX, F_SYNC_DEVICE, F_SYNC_DEVICE_TIMEOUT,
    N_FUNCS
};

extern const char *const NAMES[N_FUNCS];
extern void *volatile g_real[N_FUNCS];
void *dm_real(int i); /* the real function i, or NULL */
drvError_t dm_missing(int i); /* logs that function i is missing; its layer's "not supported" */

#define API __attribute__((visibility("default")))
API drvError_t halMemAlloc(void **, unsigned long long, unsigned long long);
API drvError_t halMemFree(void *);
API drvError_t halMemAddressReserve(void **, size_t, size_t, void *, uint64_t);
API drvError_t halMemAddressFree(void *);
API drvError_t halMemCreate(drv_mem_handle_t **, size_t, const struct drv_mem_prop *, uint64_t);
API drvError_t halMemRelease(drv_mem_handle_t *);
API drvError_t halMemMap(void *, size_t, size_t, drv_mem_handle_t *, uint64_t);
API drvError_t halMemUnmap(void *);
API drvError_t drvMemcpy(DVdeviceptr, size_t, DVdeviceptr, size_t);
API aclError aclrtSetDevice(int32_t);
API aclError aclrtResetDevice(int32_t);
API aclError aclrtResetDeviceForce(int32_t);
API aclError aclFinalize(void);
API aclError aclrtCreateContext(void **, int32_t);
API aclError aclrtSetCurrentContext(void *);
API aclError aclrtDestroyContext(void *);

/* ---- the tables (devmem.c; g_mu held unless said) ------------------------------------------ */
enum { K_ALLOC = 0, K_VMM = 1, K_REGISTERED = 2 };

/* What is copied: a halMemAlloc allocation, a mapped VMM range (its contents are those of the
 * physical chunk behind it), or a range the application registered. */
struct alloc {
    uintptr_t ptr;
    size_t size;
    int32_t dev;
    int kind;
    int excluded;
    void *copy;  /* host copy (npusnap_devmem_save) */
    int in_file; /* copied into the file of npusnap_devmem_save_fd instead */
    /* Write tracking (writes.c): the epoch the allocation was made in, whether the job got it
     * through aclrtMalloc* / aclrtMapMem (else it is the runtime's own and always written), and
     * per piece the epoch of the last write the agent was told of (NULL: none yet). */
    uint32_t born;
    int app;
    uint32_t *gen;
};

struct range {
    uintptr_t start;
    size_t size;
};

struct handle {
    drv_mem_handle_t *h;
    size_t size;
    int32_t dev;
};

#define PIECE ((size_t)NPUSNAP_DEVMEM_PIECE_BYTES)
#define LINEAGE 16
#define MAX_DEVS 1024
struct dm_lineage {
    uint64_t id;
    uint32_t epoch;
};

extern pthread_mutex_t g_mu;
extern pthread_cond_t g_cv;
extern struct alloc *g_allocs;
extern size_t g_n, g_cap;
extern struct range *g_excl;
extern size_t g_nexcl, g_excl_cap;
extern struct range *g_reserved;
extern size_t g_nres, g_res_cap;
extern struct handle *g_handles;
extern size_t g_nh, g_h_cap;
extern int g_copies_inflight;
extern uint32_t g_epoch, g_all_gen;
extern char g_untracked[128];
extern uint64_t g_marks_all;
extern char g_all_why[96];
extern struct dm_lineage g_lineage[LINEAGE];
extern int g_nlineage;
extern uint64_t g_since_id;
extern int g_check_all;
extern unsigned char *g_unchanged;
extern size_t g_npieces;
extern int g_since_used;
extern uint64_t g_save_id;
extern uint32_t g_save_epoch;
extern int g_saved;
extern int g_interposed;
extern unsigned g_devs[MAX_DEVS];
extern pthread_mutex_t g_life;
extern void *g_dev_ctx[MAX_DEVS];
extern __thread int t_agent;

void dm_device_opened(void);
void dm_record_opened(void);
void dm_seterr(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int dm_in_excluded(uintptr_t p, size_t n);
struct alloc *dm_find(uintptr_t p);
void dm_drop_at(size_t i);
int dm_grow(void **arr, size_t *cap, size_t n, size_t elem);
int32_t dm_user_dev(int32_t drv);
int dm_add(uintptr_t p, size_t n, int32_t dev, int kind);
void dm_untrack(uintptr_t p);
size_t dm_pieces_of(const struct alloc *a);
uint32_t dm_piece_gen(const struct alloc *a, size_t j);
void dm_note_oom(int rc);

void dm_remember_ctx(int32_t dev, int set_device);
void dm_current_place(int32_t *dev);
int dm_interposed(void); /* preloaded: the program's own lookups find the wrappers */
void dm_free_copies_locked(void);
int dm_pwrite_full(int fd, const char *p, size_t n, off_t off);

/* ---- devmem_cc.c --------------------------------------------------------------------------- */
/* The writers' gate: the lock's hold on the job's writers (npusnap_devmem_hold_writers). */
extern __thread int t_entered;
extern int g_entry_closed, g_writers_inside;
extern pthread_mutex_t g_emu;
extern pthread_cond_t g_ecv;
void cc_note_whole_at_cut(int planning);
int cc_plan_add(const struct alloc *a, off_t file_off, const unsigned char *unchanged);
void dm_write_open(int gated);

#endif
