/* The agent's state logic: the protocol operations, lock ownership, the lease, CRIU-restore
 * detection and the device-memory steps around them.
 *
 * Everything here runs on the agent thread only (requests and ticks are serialised by its
 * loop), so no lock guards this state. No function here takes the GIL: Python hooks are run
 * through hooks_run(), which waits for them with a deadline.
 *
 * Lock ownership is the contract of docs/internals.md ("Lock ownership"). A lease counts the
 * target's run time: a gap between ticks longer than FREEZE_GAP means the whole process was
 * stopped (CRIU, SIGSTOP) and counts as one tick; time spent inside an operation is not silence.
 *
 * The lock-state operations and the tick are here; the reporting and HCCL operations are in
 * ops_report.c; what they are built from is in ops_steps.c and ops_base.c (ops_int.h). */
#include "ops_int.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- CRIU restore detection, the lease tick ---------------------------------------------- */
static void refresh_restored(void) {
    long long now = read_start_ticks();
    if (now < 0 || start_ticks < 0 || now == start_ticks) return;
    start_ticks = now;
    restored = 1;
    int st = state_now();
    restore_pending = st == ST_UNKNOWN || st == ST_BACKED_UP;
    ops_event("process was restored by CRIU (start time changed)");
    if (lease.active) {
        /* The restore command carries on under the same lease: if it dies before Unlock, the
         * lease restores and unlocks this process by itself. Restart it in full. */
        lease_grant(lease.duration);
        ops_event("lease of %gs restarted for the restored process: it rolls back by itself unless "
                  "the restore command finishes or renews it", lease.duration);
    }
}

static int do_rollback(sbuf *res, op_error *e);

void ops_tick(const agent_endpoint *ep) {
    /* The tick opens no descriptor: one opened every 100 ms would, now and then, take the number a
     * program's own open() expected (the lowest free one), and a dump that froze this thread
     * between fopen and fclose of /proc/self/stat would save that fd as /proc/<host pid>/stat,
     * which a restore in a pid namespace of its own (other host pids) cannot open ("Can't open
     * file proc/N/stat on restore"). A CRIU restore shows without one: it makes a new listening
     * socket (another inode) and, in such a namespace, another host pid (a readlink). Only then
     * is the start time read. */
    static long last_host_pid = -1;
    static unsigned long long last_ino;
    long host_pid = host_pid_now();
    unsigned long long ino = ep->ino;
    int moved = (last_ino && ino && ino != last_ino) || (last_host_pid >= 0 && host_pid >= 0 && host_pid != last_host_pid);
    if (ino) last_ino = ino;
    if (host_pid >= 0) last_host_pid = host_pid;
    if (moved) refresh_restored();
    double now = now_s();
    double delta = now - lease.last;
    if (delta < 0) delta = 0;
    lease.last = now;
    if (!lease.active) return;
    if (delta > FREEZE_GAP) {
        lease.frozen_gaps++;
        delta = delta < TICK ? delta : TICK;
    }
    lease.remaining -= delta;
    if (lease.remaining > 0) return;
    lease.expired_duration = lease.duration;
    lease_release();
    ops_event("lease of %gs expired without renew: rolling back by itself", lease.expired_duration);
    sbuf res;
    sb_init(&res);
    op_error e;
    err_init(&e);
    if (do_rollback(&res, &e) == 0) {
        ops_event("lease rollback done: state %s", state_name(state_now()) ? state_name(state_now()) : "unknown");
    } else {
        /* The command first: an event is cut at its buffer's end, and the message can be long. */
        ops_event("lease rollback FAILED, run `npusnap thaw %d`: %s", user_pid(), e.message);
    }
    err_free(&e);
    sb_free(&res);
    lease_skip_gap();
}

/* ---- operations -------------------------------------------------------------------------- */
static int op_lock(const request *r, int peer_pid, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0) return -1;
    int st = state_now();
    if (owner.set || (st != ST_RUNNING && st != ST_UNKNOWN)) {
        char who[256], msg[400];
        if (owner.set) owner_text(who, sizeof who);
        else snprintf(who, sizeof who, "no recorded owner (an external Lock)");
        snprintf(msg, sizeof msg, "pid %d is already locked (%s) by %s", user_pid(),
                 st == ST_UNKNOWN ? "state unknown" : state_name(st), who);
        if (owner.set) {
            owner_error(e, NPUSNAP_ERR_ALREADY_LOCKED, msg);
        } else {
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_ALREADY_LOCKED, 0, "%s", msg);
            sb_raw(&e->extra, ",\"owner\":null");
        }
        return -1;
    }
    const jval *dm = json_get(r->args, "device_memory");
    const char *mode = dm && dm->t == J_STR ? dm->s : NPUSNAP_DEVMEM_MODE_DEFAULT;
    const jval *dt = json_get(r->args, "drain_timeout_s");
    drain_ms = dt && dt->t == J_NUM ? (int)(dt->num * 1000 + 0.5) : DEVMEM_SAVE_TIMEOUT_MS;
    if (drain_ms < 1) drain_ms = 1;
    if (take_devmem_file(r, &devmem.save_fd, e) < 0) return -1;
    if (strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) != 0) close_fd(&devmem.save_fd); /* nothing to save */
    if (npusnap_devmem_save_since) {
        /* An incremental save: only what was written since that save of this process's history. */
        const jval *since = json_get(r->args, "device_memory_since");
        const jval *check = json_get(r->args, "device_memory_check_writes");
        uint64_t id = since && since->t == J_STR ? strtoull(since->s, NULL, 16) : 0;
        npusnap_devmem_save_since(id, check && check->t == J_BOOL && check->b);
    }
    if (npusnap_devmem_plan_next) {
        /* --leave-running: only the cut now; the job's memory is copied after Unlock, while it
         * runs (the unlock brings the file). Checked: a full copy now all the same. */
        const jval *cc = json_get(r->args, "device_memory_concurrent");
        const jval *ck = json_get(r->args, "device_memory_check_concurrent");
        int on = cc && cc->t == J_BOOL && cc->b && devmem.save_fd >= 0;
        npusnap_devmem_plan_next(on ? (ck && ck->t == J_BOOL && ck->b ? 2 : 1) : 0);
    }
    double start = now_s();
    double lock_call_s = 0;
    copy_s = 0;
    drain_s = 0;
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_PRE_LOCK, &ran, e) < 0) {
        close_fd(&devmem.save_fd);
        hook_error(e, "nothing was locked");
        sb_free(&ran);
        return -1;
    }
    devmem_begin(mode);
    ensure_lock_pre_callback(&rt);
    pthread_mutex_lock(&cb.mu);
    cb.n_seen = 0;
    pthread_mutex_unlock(&cb.mu);
    /* No thread inside a collective at Lock: each is wholly before or after the snapshot. */
    if (npusnap_hccl_hold(HCCL_HOLD_TIMEOUT_S) < 0)
        ops_event("an HCCL call was still running %gs after the hold: locking anyway", HCCL_HOLD_TIMEOUT_S);
    /* No writer of the job past the runtime's entry check at Lock either: such a call runs to its
     * end after Lock, into the drain and the copy (npusnap_devmem_hold_writers). */
    int inside = npusnap_devmem_hold_writers ? npusnap_devmem_hold_writers(drain_ms) : 0;
    if (inside > 0) {
        npusnap_devmem_release_writers();
        npusnap_hccl_release();
        close_fd(&devmem.save_fd);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_BUSY, 0,
                "%d call(s) of the job that write device memory were still running after %d ms; "
                "nothing was locked",
                inside, drain_ms);
        return -1;
    }
    double lock_call_start = now_s();
    int locked_rc = call("Lock", e);
    lock_call_s = now_s() - lock_call_start;
    if (npusnap_devmem_release_writers) npusnap_devmem_release_writers();
    if (locked_rc < 0) {
        npusnap_hccl_release();
        close_fd(&devmem.save_fd);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        return -1;
    }
    int32_t seen[MAX_CB_DEVICES];
    pthread_mutex_lock(&cb.mu);
    int n_seen = cb.n_seen;
    memcpy(seen, cb.seen, sizeof seen[0] * (size_t)n_seen);
    cb.n_known = n_seen; /* the devices open now (none: a launcher) */
    memcpy(cb.known, seen, sizeof seen[0] * (size_t)n_seen);
    int cb_ok = strcmp(cb.state, "registered") == 0;
    pthread_mutex_unlock(&cb.mu);
    npusnap_devmem_info pre;
    memset(&pre, 0, sizeof pre);
    if (npusnap_devmem_get_info) npusnap_devmem_get_info(&pre);
    no_device = 0;
    if (cb_ok && n_seen == 0 && pre.allocations == 0) {
        /* The runtime calls LOCK_PRE once per open device: none was called, so this process
         * (a launcher that loaded ACL and never opened a device) has nothing to back up, and
         * Backup would refuse it (107002, no context). It is not left locked: it runs on, and the
         * dump takes it as a plain process. */
        if (call("Unlock", e) < 0) {
            sb_free(&ran);
            return -1;
        }
        no_device = 1;
        npusnap_hccl_release();
        close_fd(&devmem.save_fd);
        ops_event("no device open (no LOCK_PRE callback ran): not locked, nothing to back up");
    } else if ((strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) != 0 || acl_may_have_driver_flow(&rt)) &&
               devmem_drain(e, "the process was unlocked and runs on") < 0) {
        unlock_after_failure(e);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        return -1;
    } else if (strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) == 0 && acl_may_have_driver_flow(&rt)) {
        /* The driver-backed flow keeps device memory itself where the driver has the feature;
         * Backup tells (207000 otherwise), and then npusnap takes its own copy, still locked. */
        snprintf(devmem.flow, sizeof devmem.flow, "driver?");
    } else if (strcmp(mode, NPUSNAP_DEVMEM_MODE_PRESERVE) == 0 && devmem_save(e, "the process was unlocked and runs on") < 0) {
        /* Nothing of the job ran while it was locked; Unlock gives it back as it was. */
        unlock_after_failure(e);
        devmem.mode[0] = 0;
        devmem.flow[0] = 0;
        sb_free(&ran);
        return -1;
    }
    const jval *ow = json_get(r->args, "owner");
    if (ow && ow->t != J_OBJ) ow = NULL; /* null: none named */
    if (ow || !ALLOW_UNOWNED_LOCK) {
        const jval *cmd = ow ? json_get(ow, "command") : NULL;
        const jval *pid = ow ? json_get(ow, "pid") : NULL;
        owner.set = 1;
        snprintf(owner.command, sizeof owner.command, "%s", cmd ? cmd->s : "unknown");
        owner.pid = pid ? pid->i : peer_pid;
        time_t now = time(NULL);
        struct tm tm;
        gmtime_r(&now, &tm);
        strftime(owner.since, sizeof owner.since, "%Y-%m-%dT%H:%M:%SZ", &tm);
        if (new_token(owner.token) < 0) {
            /* No randomness: refuse to pretend there is an owner; undo the lock. */
            int saved_errno = errno;
            clear_owner();
            op_error again;
            err_init(&again);
            call("Unlock", &again);
            err_free(&again);
            devmem_finish();
            npusnap_hccl_release();
            err_set(e, NPUSNAP_ERRTYPE_INTERNAL, NPUSNAP_ERR_NO_RANDOM, saved_errno, "getrandom failed: %s; the lock was undone",
                    strerror(saved_errno));
            sb_free(&ran);
            return -1;
        }
    }
    int present;
    double l = arg_lease(r->args, &present);
    if (present) lease_grant(l);
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "runtime_lock_s");
    sb_num(res, lock_call_s);
    sb_key(res, "device_copy_s");
    sb_num(res, copy_s);
    sb_key(res, "drain_s");
    sb_num(res, drain_s);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_key(res, "token");
    sb_str(res, owner.set ? owner.token : NULL);
    sb_key(res, "device_memory");
    devmem_json(res);
    sb_key(res, "callback_devices");
    ids_json(res, seen, n_seen);
    sb_key(res, "callback");
    sb_str(res, cb.state);
    sb_key(res, "no_device");
    sb_raw(res, no_device ? "true" : "false");
    sb_free(&ran);
    return 0;
}

static int op_backup(const request *r, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0 || check_owner("backup", r->args, 0, e) < 0) return -1;
    int before = state_now();
    double start = now_s();
    copy_s = 0;
    drain_s = 0;
    int rc = no_device ? 0 : call_backup(e);
    if (rc < 0 && e->code == ACL_ERROR_RT_CONTEXT_NULL && !cb_devices_known()) {
        /* No active context (a launcher on a runtime without callbacks, so Lock could not tell):
         * nothing to back up. Unlock, and the dump takes it as a plain process. */
        op_error again;
        err_init(&again);
        if (call("Unlock", &again) == 0) {
            err_free(e);
            err_init(e);
            no_device = 1;
            rc = 0;
            ops_event("Backup found no active context (ACL_ERROR_RT_CONTEXT_NULL): no device open, unlocked");
        }
        err_free(&again);
    }
    /* Unused when the driver-backed flow kept the memory: nothing of the image being written
     * may stay open in the process that CRIU saves. */
    close_fd(&devmem.save_fd);
    if (rc < 0) return -1;
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_POST_BACKUP, &ran, e) < 0) {
        abort_after_hook(e, before);
        sb_free(&ran);
        return -1;
    }
    int present;
    double l = arg_lease(r->args, &present);
    if (present) lease_grant(l);
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "device_copy_s");
    sb_num(res, copy_s);
    sb_key(res, "drain_s");
    sb_num(res, drain_s);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_key(res, "device_memory");
    devmem_json(res);
    sb_free(&ran);
    return 0;
}

static int op_renew(const request *r, sbuf *res, op_error *e) {
    if (check_owner("renew", r->args, 0, e) < 0) return -1;
    if (!lease.active) {
        if (lease.voided[0]) err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_NO_LEASE, 0, "%s", lease.voided);
        else
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_NO_LEASE, 0,
                    "no lease is active (it expired, was released, or was never granted)");
        return -1;
    }
    int present;
    double l = arg_lease(r->args, &present);
    lease_grant(present ? l : lease.duration);
    state_members(res);
    return 0;
}

static int op_release(const request *r, sbuf *res, op_error *e) {
    if (check_owner("release", r->args, 0, e) < 0) return -1;
    lease_release();
    state_members(res);
    return 0;
}

static int op_restore(const request *r, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0 || check_owner("restore", r->args, 0, e) < 0) return -1;
    if (npusnap_devmem_copy_cancel) npusnap_devmem_copy_cancel(); /* the dump's plan, not this copy's */
    if (take_devmem_file(r, &devmem.reload_fd, e) < 0) return -1;
    int before = state_now();
    double start = now_s();
    if (!no_device && call_restore(e) < 0) return -1;
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_POST_RESTORE, &ran, e) < 0) {
        abort_after_hook(e, before);
        sb_free(&ran);
        return -1;
    }
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_free(&ran);
    return 0;
}

static int op_unlock(const request *r, sbuf *res, op_error *e) {
    if (need_runtime(e) < 0 || check_owner("unlock", r->args, 1, e) < 0) return -1;
    int before = state_now();
    if (restore_pending && before == ST_BACKED_UP) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_RESTORE_REQUIRED, 0,
                "this process was restored by CRIU and its device state is still backed up: run "
                "`restore` before `unlock`");
        return -1;
    }
    double start = now_s();
    sbuf steps;
    sb_init(&steps);
    const jval *f = json_get(r->args, "device_memory_file");
    if (npusnap_devmem_copy_start) {
        /* A concurrent copy (lock planned it): started before Unlock, so that the job's first
         * writes already find it; without its file the plan is dropped. */
        char err[512] = "";
        if (f && f->t == J_STR && r->fd >= 0) {
            if (npusnap_devmem_copy_start(r->fd, err, sizeof err) < 0) {
                err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, EIO, "%s; still locked", err);
                sb_free(&steps);
                return -1;
            }
            sb_raw(&steps, "\"concurrent copy started\"");
        } else {
            npusnap_devmem_copy_cancel();
        }
    }
    if ((!no_device && devmem_reload(&steps, e) < 0) || (!no_device && call("Unlock", e) < 0)) {
        if (npusnap_devmem_copy_cancel) npusnap_devmem_copy_cancel();
        sb_free(&steps);
        return -1;
    }
    npusnap_hccl_release();
    devmem_after_unlock(&steps, e);
    sbuf ran;
    sb_init(&ran);
    if (run_hooks(NPUSNAP_HOOK_POST_UNLOCK, &ran, e) < 0) {
        abort_after_hook(e, before);
        sb_free(&ran);
        sb_free(&steps);
        return -1;
    }
    lease_release();
    clear_owner();
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "hooks_run");
    sb_printf(res, "[%s]", ran.p ? ran.p : "");
    sb_key(res, "warnings");
    sb_raw(res, "[]");
    sb_key(res, "device_memory");
    devmem_steps_json(res, &steps);
    sb_free(&ran);
    sb_free(&steps);
    return 0;
}

/* Back to RUNNING from any state. From BACKED_UP, Unlock directly (the device memory is still
 * there) unless this process was CRIU-restored, where Restore must come first. */
static int do_rollback(sbuf *res, op_error *e) {
    if (need_runtime(e) < 0) return -1;
    if (npusnap_devmem_copy_cancel) npusnap_devmem_copy_cancel();
    double start = now_s();
    int before = state_now();
    sbuf actions, warnings, steps;
    sb_init(&actions);
    sb_init(&warnings);
    sb_init(&steps);
    if (before == ST_BACKED_UP && restore_pending) {
        if (call_restore(e) < 0) goto fail;
        sb_raw(&actions, "\"restore\"");
    }
    if ((before == ST_LOCKED || before == ST_BACKED_UP) && devmem_reload(&steps, e) < 0) goto fail;
    if (before == ST_LOCKED || before == ST_BACKED_UP || before == ST_UNKNOWN) {
        int code = acl_call(&rt, "Unlock");
        if (code == 0) {
            sb_raw(&actions, actions.len ? ",\"unlock\"" : "\"unlock\"");
        } else if (before != ST_UNKNOWN) {
            acl_err(e, "Unlock", code);
            goto fail;
        } /* state unknown (no GetState): Unlock from RUNNING fails harmlessly */
    }
    npusnap_hccl_release();
    if (devmem_after_unlock(&steps, e) < 0) goto fail;
    lease_release();
    clear_owner();
    if (actions.len) {
        sbuf ran;
        sb_init(&ran);
        op_error he;
        err_init(&he);
        if (run_hooks(NPUSNAP_HOOK_POST_UNLOCK, &ran, &he) < 0) {
            /* Rollback's job is to get the process running; a hook failure is reported. */
            if (warnings.len) sb_raw(&warnings, ",");
            sb_str(&warnings, he.message);
        }
        err_free(&he);
        sb_free(&ran);
    }
    state_members(res);
    elapsed_member(res, start);
    sb_key(res, "actions");
    sb_printf(res, "[%s]", actions.p ? actions.p : "");
    sb_key(res, "before");
    sb_state(res, before);
    sb_key(res, "warnings");
    sb_printf(res, "[%s]", warnings.p ? warnings.p : "");
    sb_key(res, "device_memory");
    devmem_steps_json(res, &steps);
    sb_free(&actions);
    sb_free(&warnings);
    sb_free(&steps);
    return 0;
fail:
    sb_free(&actions);
    sb_free(&warnings);
    sb_free(&steps);
    return -1;
}

static int op_rollback(const request *r, sbuf *res, op_error *e) {
    if (check_owner("rollback", r->args, 1, e) < 0) return -1;
    return do_rollback(res, e);
}

/* After a --leave-running dump's unlock: wait (at most timeout_s) for the concurrent copy of the
 * device memory; {"complete": bool, "left", "cow_pieces", "background_pieces"}. */
static int op_copy_wait(const request *r, sbuf *res, op_error *e) {
    if (!npusnap_devmem_copy_wait) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_UNAVAILABLE, 0, "this agent has no device-memory part");
        return -1;
    }
    const jval *t = json_get(r->args, "timeout_s");
    int ms = t && t->t == J_NUM ? (int)(t->num * 1000 + 0.5) : 10000;
    uint64_t stats[3] = {0, 0, 0};
    char err[512] = "";
    int rc = npusnap_devmem_copy_wait(ms, stats, err, sizeof err);
    if (rc != 0 && rc != -ETIMEDOUT) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, rc, "the concurrent copy of the device memory failed: %s", err);
        return -1;
    }
    sb_key(res, "complete");
    sb_raw(res, rc == 0 ? "true" : "false");
    sb_printf(res, ",\"left\":%llu,\"cow_pieces\":%llu,\"background_pieces\":%llu", (unsigned long long)stats[0],
              (unsigned long long)stats[1], (unsigned long long)stats[2]);
    return 0;
}

void ops_handle(const request *r, int peer_pid, const agent_endpoint *ep, sbuf *out) {
    refresh_restored();
    sbuf res;
    sb_init(&res);
    sb_raw(&res, "{"); /* so that sb_key knows the first member; stripped below */
    op_error e;
    err_init(&e);
    int rc;
    const char *op = r->op;
    if (strcmp(op, "hello") == 0) rc = op_hello(r, ep, &res, &e);
    else if (strcmp(op, "status") == 0) rc = op_status(r, &res, &e);
    else if (strcmp(op, "lock") == 0) rc = op_lock(r, peer_pid, &res, &e);
    else if (strcmp(op, "backup") == 0) rc = op_backup(r, &res, &e);
    else if (strcmp(op, "renew") == 0) rc = op_renew(r, &res, &e);
    else if (strcmp(op, "release") == 0) rc = op_release(r, &res, &e);
    else if (strcmp(op, "restore") == 0) rc = op_restore(r, &res, &e);
    else if (strcmp(op, "unlock") == 0) rc = op_unlock(r, &res, &e);
    else if (strcmp(op, "rollback") == 0) rc = op_rollback(r, &res, &e);
    else if (strcmp(op, "hccl_root") == 0) rc = op_hccl_root(r, &res, &e);
    else if (strcmp(op, "hccl_rebuild") == 0) rc = op_hccl_rebuild(r, &res, &e);
    else if (strcmp(op, "copy_wait") == 0) rc = op_copy_wait(r, &res, &e);
    else {
        err_set(&e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_UNKNOWN_OP, 0, "unknown op '%s'", op);
        rc = -1;
    }
    if (rc == 0 && !res.oom) {
        proto_result_line(out, r->id, res.p + 1);
    } else {
        if (rc == 0) err_set(&e, NPUSNAP_ERRTYPE_INTERNAL, NPUSNAP_ERR_OUT_OF_MEMORY, ENOMEM, "agent out of memory in %s", op);
        proto_error_line(out, r->id, &e);
    }
    err_free(&e);
    sb_free(&res);
    lease_skip_gap(); /* time spent in an operation is not silence */
}

