/* What the files of the agent's state logic share (ops.c, ops_steps.c, ops_base.c): the state,
 * kept by the agent thread alone (requests and ticks are serialised by its loop), and the helpers
 * the operations are built from. The files call downwards only: ops.c (the operations) into
 * ops_steps.c (runtime calls that move the state, the device-memory steps) into ops_base.c
 * (helpers, the lease, lock ownership, the LOCK_PRE callback, results). */
#ifndef NPUSNAP_AGENT_OPS_INT_H
#define NPUSNAP_AGENT_OPS_INT_H

#include "agent_int.h"
#include <npusnap/devmem.h>
#include <npusnap/hcclvirt.h>
#include <pthread.h>
#include <stdint.h>

/* The device-memory part (devmem.c) is optional: called only when linked in. */
#pragma weak npusnap_devmem_save
#pragma weak npusnap_devmem_save_fd
#pragma weak npusnap_devmem_reload_fd
#pragma weak npusnap_devmem_reload
#pragma weak npusnap_devmem_finish
#pragma weak npusnap_devmem_get_info
#pragma weak npusnap_devmem_registered_count
#pragma weak npusnap_devmem_devices
#pragma weak npusnap_devmem_drain
#pragma weak npusnap_devmem_hold_writers
#pragma weak npusnap_devmem_release_writers
#pragma weak npusnap_devmem_last_drain_s
#pragma weak npusnap_devmem_save_since
#pragma weak npusnap_devmem_tracking
#pragma weak npusnap_devmem_plan_next
#pragma weak npusnap_devmem_copy_start
#pragma weak npusnap_devmem_copy_wait
#pragma weak npusnap_devmem_copy_cancel

/* 1: a `lock` that names no owner records none, and then needs no token (the CLI of this branch
 * does not send owners yet). 0: every lock has an owner, "unknown" with the client's pid when it
 * names none (docs/internals.md). Set to 0 once the CLI sends owners and tokens everywhere. */
#ifndef ALLOW_UNOWNED_LOCK
#define ALLOW_UNOWNED_LOCK 0
/* ---- ops_report.c -------------------------------------------------------------------------- */
int op_hello(const request *r, const agent_endpoint *ep, sbuf *res, op_error *e);
int op_status(const request *r, sbuf *res, op_error *e);
int op_hccl_root(const request *r, sbuf *res, op_error *e);
int op_hccl_rebuild(const request *r, sbuf *res, op_error *e);

#endif

#define TICK 0.1
#define FREEZE_GAP 1.0
#define DEVMEM_SAVE_TIMEOUT_MS 10000
#define N_EVENTS 20
/* How long Lock waits for the threads inside an HCCL launch to leave it (they are not held yet:
 * a launch takes microseconds). */
#define HCCL_HOLD_TIMEOUT_S 2.0
extern int drain_ms; /* of the current lock (its drain_timeout_s) */

extern acl_rt rt;
extern int rt_found;
extern long long start_ticks;
extern int restored;        /* CRIU restored this process at least once */
extern int restore_pending; /* restored while BACKED_UP and no Restore since */
extern int device_restored; /* Restore ran since the save: device memory must be reloaded before Unlock */
extern int no_device;       /* this lock found no open device (a launcher): nothing was left locked */

struct ops_lease {
    int active;
    double duration, remaining, last, expired_duration;
    char voided[256];
    int frozen_gaps;
};
extern struct ops_lease lease;

struct ops_owner {
    int set;
    char command[128];
    long long pid;
    char since[32];
    char token[33];
};
extern struct ops_owner owner;

struct ops_devmem {
    char mode[16];      /* "preserve" | "app" | "discard" of the current lock, "" when unlocked */
    int saved;          /* npusnap_devmem_save succeeded and finish has not run */
    char flow[8];       /* "driver" (args != NULL: the runtime and driver keep device memory),
                         * "driver?" (to be tried at Backup), "legacy" (args == NULL), "" */
    char fallback[160]; /* why the driver-backed flow was not used, "" when it was not tried */
    int save_fd;        /* lock's device-memory file (the copies go there, not to host memory) */
    int reload_fd;      /* restore's device-memory file (the copies come back from there) */
    unsigned long long file_bytes; /* what the save wrote into save_fd */
    char file_path[4096]; /* that file's name once the image is published (lock) or as the
                           * restore opened it: a reload without a descriptor (a lease's
                           * rollback after an interrupted restore) opens it by name */
};
extern struct ops_devmem devmem;

/* npusnap's own LOCK_PRE callback (CANN 9.0+): the runtime calls it once per open device inside
 * Lock, which is the real-API way to learn the device ids (the driver holds no /dev/davinciN
 * open). Registered once per process; kept across fork (the runtime's registration is copied
 * into the child with the rest of its memory), so ops_init does not reset it. The runtime may
 * also call it from an application thread that calls Lock itself, hence the mutex. */
#define MAX_CB_DEVICES 64
struct ops_cb {
    int tried;
    char state[200]; /* "registered" or "not registered: why" */
    pthread_mutex_t mu;
    int32_t seen[MAX_CB_DEVICES]; /* during the current Lock */
    int n_seen;
    int32_t known[MAX_CB_DEVICES]; /* from the last Lock that reported any */
    int n_known;
};
extern struct ops_cb cb;

extern char events[N_EVENTS][400];
extern int n_events;

extern double drain_s; /* of the current lock: its wait for the job's queued work */
extern double copy_s;  /* of the current lock: its copy of the device memory */

/* ---- ops_base.c ---------------------------------------------------------------------------- */
long long read_start_ticks(void);
double boot_time(void);
void ops_event(const char *fmt, ...);
int run_hooks(const char *stage, sbuf *ran, op_error *e);
acl_rt *runtime(void);
int state_now(void);
void sb_state(sbuf *b, int st);
void lease_grant(double seconds);
void lease_release(void);
void lease_skip_gap(void);
void owner_json(sbuf *b);
void owner_text(char *out, size_t len);
void owner_error(op_error *e, const char *name, const char *message);
long host_pid_now(void);
int user_pid(void);
int check_owner(const char *op, const jval *args, int allow_force, op_error *e);
int new_token(char out[33]);
void clear_owner(void);
void ensure_lock_pre_callback(acl_rt *a);
int cb_devices_known(void);
void ids_json(sbuf *b, const int32_t *ids, int n);
void acl_err(op_error *e, const char *what, int code);
int call(const char *what, op_error *e);
void state_members(sbuf *b);
void elapsed_member(sbuf *b, double start);
double arg_lease(const jval *args, int *present);

/* ---- ops_steps.c --------------------------------------------------------------------------- */
void devmem_json(sbuf *b);
void close_fd(int *fd);
void devmem_finish(void);
int take_devmem_file(const request *r, int *slot, op_error *e);
int devmem_reload(sbuf *steps, op_error *e);
int devmem_after_unlock(sbuf *steps, op_error *e);
void devmem_steps_json(sbuf *b, const sbuf *steps);
void devmem_begin(const char *mode);
void unlock_after_failure(op_error *e);
int devmem_drain(op_error *e, const char *after);
int devmem_save(op_error *e, const char *nothing_locked);
int call_restore(op_error *e);
int call_backup(op_error *e);
int need_runtime(op_error *e);
void hook_error(op_error *e, const char *rolled_back);
void abort_after_hook(op_error *e, int before);

/* ---- ops_report.c -------------------------------------------------------------------------- */
int op_hello(const request *r, const agent_endpoint *ep, sbuf *res, op_error *e);
int op_status(const request *r, sbuf *res, op_error *e);
int op_hccl_root(const request *r, sbuf *res, op_error *e);
int op_hccl_rebuild(const request *r, sbuf *res, op_error *e);

#endif
