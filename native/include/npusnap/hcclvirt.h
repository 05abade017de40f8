/* The HCCL part of the agent (native/agent/hccl.c): communicators that survive a snapshot.
 *
 * A real communicator does not survive a Restore (HCCL's RESTORE_POST callback marks it invalid;
 * its links are gone). The agent stands between the application and libhccl for every name that
 * takes a communicator: the handle the application holds stays the same, the communicator behind
 * it is rebuilt after a Restore through HCCL's public calls (HcclGetRootInfo on the rank that was
 * the root, HcclCommInitRootInfo[Config] on every rank with the rank, size and configuration the
 * application used), and calls on it wait meanwhile. docs/distributed.md, "HCCL communicators".
 *
 * The ops (native/agent/ops.c) call these; every function is safe without any communicator. */
#ifndef NPUSNAP_HCCLVIRT_H
#define NPUSNAP_HCCLVIRT_H

#include <stddef.h>
#include <stdint.h>

#define NPUSNAP_HCCL_KEY_HEX 32        /* a communicator's key: a hash of its first root info */
#define NPUSNAP_HCCL_ROOT_BYTES 4108   /* sizeof(HcclRootInfo), hccl_types.h */

struct npusnap_hccl_comm_info {
    char key[NPUSNAP_HCCL_KEY_HEX + 1];
    uint32_t rank, nranks;
    const char *state; /* "live", "stale" (restored, not rebuilt yet), "failed" */
    uint64_t collectives; /* launched through this process's handle since it was made */
};

/* Before Lock: new device-side HCCL calls (collectives, point to point) wait in the agent; returns
 * once no thread is inside one (0) or after timeout_s (-1: one still is; the Lock goes on). */
int npusnap_hccl_hold(double timeout_s);
/* The process runs again: the calls held by npusnap_hccl_hold go on (those on a communicator
 * that awaits its rebuild wait for that). */
void npusnap_hccl_release(void);
/* A Restore succeeded: every communicator is invalid; its calls wait for npusnap_hccl_rebuild. */
void npusnap_hccl_restored(void);
/* Up to max communicators into out; the number the process has. */
size_t npusnap_hccl_comms(struct npusnap_hccl_comm_info *out, size_t max);
/* On the process that holds rank 0 of communicator `key`: new root info, hex-encoded into
 * root_hex (2 * NPUSNAP_HCCL_ROOT_BYTES + 1 bytes). 0, or an HCCL/errno code with err set. */
int npusnap_hccl_new_root(const char *key, char *root_hex, char *err, size_t errlen);
/* Every rank of `key`, at the same time: the communicator behind the application's handle made
 * anew from root_hex (blocks until every rank joined, HCCL_CONNECT_TIMEOUT). 0, or a code with
 * err set (the communicator is then failed: its calls answer HCCL_E_UNAVAIL). An empty root_hex
 * gives the communicator up at once (failed): the restore cannot rebuild it (ranks elsewhere). */
int npusnap_hccl_rebuild(const char *key, const char *root_hex, char *err, size_t errlen);

#endif
