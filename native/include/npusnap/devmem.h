/* npusnap's own copy of a job's device memory across a snapshot.
 *
 * Why: in CANN's released (legacy) snapshot flow, Restore brings back every allocation's
 * *address* but not its *contents* (see docs/device-memory.md). npusnap therefore learns the
 * live device allocations of the process it runs in (by interposing the allocation calls),
 * copies them to host memory before Lock (while device copies are still allowed), lets CRIU
 * save that host memory with the rest of the process, and writes the bytes back to the same
 * device addresses after Restore and Unlock -- before any thread of the job may issue device
 * work again. A gate of npusnap's own holds the job's device calls for that whole window
 * (runtime Lock alone does not cover it: its gate opens at Unlock).
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

/* Before Lock: close the gate (new device calls of the job wait; calls already in flight are
 * waited for, at most timeout_ms), then copy every tracked allocation to host memory.
 * Returns 0, or -errno with a message in err (the gate is open again on failure). */
int npusnap_devmem_save(int timeout_ms, char *err, size_t errlen);

/* The same, but the copies go into fd (a file of the image that npusnap's dump opened and
 * passed to the agent) instead of host memory: CRIU then dumps (and restores) that much less
 * process memory, and the bytes are written once. *written gets the file's size. */
int npusnap_devmem_save_fd(int fd, int timeout_ms, uint64_t *written, char *err, size_t errlen);

/* After Restore and Unlock: write the copies saved by npusnap_devmem_save_fd back from fd
 * (the same file, checked against the allocation table first). The gate stays closed. */
int npusnap_devmem_reload_fd(int fd, char *err, size_t errlen);

/* After Restore and Unlock: write the host copies back to the same device addresses.
 * The gate stays closed. Returns 0, or -errno with a message in err. */
int npusnap_devmem_reload(char *err, size_t errlen);

/* Drop the host copies and open the gate (after reload, on rollback, or with --leave-running). */
void npusnap_devmem_finish(void);

void npusnap_devmem_get_info(npusnap_devmem_info *out);

/* Explicit registration, for buffers npusnap cannot see being allocated (attach, custom
 * allocators) and for buffers that need no copy (scratch, a KV cache to be recomputed). */
int npusnap_devmem_register(void *dev_ptr, size_t size);
int npusnap_devmem_exclude(void *dev_ptr, size_t size);

/* Added: how many allocations came from npusnap_devmem_register. */
uint64_t npusnap_devmem_registered_count(void);

/* Added: the device ids the job opened (interposed aclrtSetDevice, not yet reset); writes at
 * most max of them into ids and returns how many there are. */
int npusnap_devmem_devices(int32_t *ids, int max);

#ifdef __cplusplus
}
#endif
#endif
