/* npusnap's own copy of a job's device memory across a snapshot.
 *
 * Why: in CANN's released (legacy) snapshot flow, Restore brings back every allocation's
 * *address* but not its *contents* (see docs/device-memory.md). npusnap therefore tracks the live
 * device allocations of the process it runs in at the driver layer (halMemAlloc and the VMM calls
 * of libascend_hal.so), and, while the runtime is LOCKED (its own lock holds every launch, copy and
 * allocation of every thread), drains the devices with a bounded synchronize and copies the memory
 * with the driver's drvMemcpy, which that lock does not gate; after Restore, still LOCKED, it writes
 * the bytes back the same way, and only then does the agent Unlock.
 *
 * This header is the only interface between the device-memory part and the rest of the native
 * agent (the control-socket core calls these at the matching protocol steps). All functions
 * are thread-safe and never take the Python GIL.
 */
#ifndef NPUSNAP_DEVMEM_H
#define NPUSNAP_DEVMEM_H

#include <stddef.h>
#include <stdint.h>

#include "contract.h"

#ifdef __cplusplus
extern "C" {
#endif

/* npusnap_devmem_info, the struct npusnap_devmem_get_info() fills: in contract.h (generated from
 * native/contract/npusnap.toml, which also gives npusnap_cli/agent/devmem.py its layout). */

/* After the runtime's Lock: synchronize every device that holds tracked memory (its context
 * selected; at most timeout_ms each), wait (at most timeout_ms) for the job's driver copies in
 * flight, synchronize again, then copy every tracked allocation to host memory with drvMemcpy.
 * Returns 0, or -errno with a message in err (-ETIMEDOUT: a kernel or collective still runs). */
int npusnap_devmem_save(int timeout_ms, char *err, size_t errlen);

/* After the runtime's Lock, without a copy (modes app/discard, the driver-backed flow): the same
 * bounded drain of every device the job opened, so that Backup's own synchronize (which has no
 * timeout) finds nothing queued. 0, or -errno with err set. */
int npusnap_devmem_drain(int timeout_ms, char *err, size_t errlen);

/* Before the runtime's Lock: hold the job's calls that write device memory at their entry (the
 * agent's wrappers of copies, memsets, launches, operators and collectives) and wait, at most
 * timeout_ms, until none is inside one; returns how many still are (0: none past the runtime's
 * entry check can write after Lock). npusnap_devmem_release_writers lets the held ones go on
 * (into the runtime, whose gate then holds them); call it after Lock, whatever Lock answered. */
int npusnap_devmem_hold_writers(int timeout_ms);
void npusnap_devmem_release_writers(void);
/* Seconds the last drain (drain, or the drain of a save) waited for the job's queued work: the
 * job's own computing, which the lock lets finish, reported apart from the time it is held. */
double npusnap_devmem_last_drain_s(void);

/* The same, but the copies go into fd (a file of the image that npusnap's dump opened and
 * passed to the agent) instead of host memory: CRIU then dumps (and restores) that much less
 * process memory, and the bytes are written once. *written gets the file's size. */
int npusnap_devmem_save_fd(int fd, int timeout_ms, uint64_t *written, char *err, size_t errlen);

/* After the runtime's Restore, before Unlock: write the copies saved by npusnap_devmem_save_fd
 * back from fd (the same file, checked against the allocation table first) with drvMemcpy. */
int npusnap_devmem_reload_fd(int fd, char *err, size_t errlen);

/* After the runtime's Restore, before Unlock: write the host copies back to the same device
 * addresses. Returns 0, or -errno with a message in err. */
int npusnap_devmem_reload(char *err, size_t errlen);

/* Drop the copies (after reload, on rollback, or with --leave-running). */
void npusnap_devmem_finish(void);

void npusnap_devmem_get_info(npusnap_devmem_info *out);

/* Write tracking (native/agent/writes.c): the next file save copies only the pieces written
 * since the save `since_id` of this process's history (0: everything); `check_all` copies
 * everything all the same but still reports which pieces it could have left out. */
void npusnap_devmem_save_since(uint64_t since_id, int check_all);

#define NPUSNAP_DEVMEM_LINEAGE 16
typedef struct npusnap_devmem_tracking_info {
    uint32_t epoch;
    uint64_t app_bytes;        /* of the tracked bytes, the job's own (aclrtMalloc*, aclrtMapMem, registered) */
    uint64_t marks_all;        /* calls whose writes the agent could not tell: everything written */
    char all_why[96];          /* the last such call */
    char untracked[128];       /* a writer looked up that cannot be followed ("": none) */
    int nlineage;              /* this process's last saves, oldest first */
    uint64_t lineage_ids[NPUSNAP_DEVMEM_LINEAGE];
    uint32_t lineage_epochs[NPUSNAP_DEVMEM_LINEAGE];
    uint64_t save_id;          /* the last save */
    uint32_t save_epoch;
    int since_used;            /* it was incremental */
    const unsigned char *unchanged; /* its pieces in file order: 1 where left out (or could be) */
    size_t npieces;
} npusnap_devmem_tracking_info;
void npusnap_devmem_tracking(npusnap_devmem_tracking_info *out);

/* The concurrent copy of a --leave-running dump: the next file save only plans the job's
 * allocations (1; 2: and copies them as well, a reference for a test); copy_start (before
 * Unlock) copies them into fd while the job runs, a piece the job is about to write first;
 * copy_wait waits for it (stats: pieces left, copied first for a write, copied in the
 * background); copy_cancel drops it. */
void npusnap_devmem_plan_next(int on);
int npusnap_devmem_copy_start(int fd, char *err, size_t errlen);
int npusnap_devmem_copy_wait(int timeout_ms, uint64_t stats[3], char *err, size_t errlen);
void npusnap_devmem_copy_cancel(void);

/* Explicit registration, for buffers npusnap cannot see being allocated (attach, custom
 * allocators) and for buffers that need no copy (scratch, a KV cache to be recomputed). */
int npusnap_devmem_register(void *dev_ptr, size_t size);
int npusnap_devmem_exclude(void *dev_ptr, size_t size);

/* How many allocations came from npusnap_devmem_register (the agent's status reports it). */
uint64_t npusnap_devmem_registered_count(void);

/* The device ids the job opened (aclrtSetDevice / its contexts followed, not yet reset); writes
 * at most max of them into ids and returns how many there are. */
int npusnap_devmem_devices(int32_t *ids, int max);

#ifdef __cplusplus
}
#endif
#endif
