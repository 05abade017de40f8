/* The steps the agent's operations are made of: the device-memory steps around Lock, Backup,
 * Restore and Unlock (the file the copies go to, the drain, the save, the reload), and the
 * runtime calls that move the state (Restore and Backup in the current flow, a hook's failure
 * rolled back). */
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

/* ---- device memory ----------------------------------------------------------------------- */

/* ,"tracking":{...}: what the agent knows of the job's writes (writes.c), its last saves, and
 * after a file save which of its pieces were left out ("unchanged": a hex bitmap, piece i in bit
 * i % 8 of byte i / 8, pieces in file order). */
static void tracking_json(sbuf *b) {
    npusnap_devmem_tracking_info t;
    npusnap_devmem_tracking(&t);
    sb_raw(b, ",\"tracking\":{");
    sb_printf(b, "\"epoch\":%u,\"app_bytes\":%llu,\"marks_all\":%llu", t.epoch, (unsigned long long)t.app_bytes,
              (unsigned long long)t.marks_all);
    sb_key(b, "all_why");
    sb_str(b, t.all_why[0] ? t.all_why : NULL);
    sb_key(b, "untracked");
    sb_str(b, t.untracked[0] ? t.untracked : NULL);
    sb_raw(b, ",\"lineage\":[");
    for (int i = 0; i < t.nlineage; i++)
        sb_printf(b, "%s[\"%016llx\",%u]", i ? "," : "", (unsigned long long)t.lineage_ids[i], t.lineage_epochs[i]);
    sb_raw(b, "]");
    if (t.save_id && devmem.file_bytes && t.unchanged) {
        sb_printf(b, ",\"save\":{\"id\":\"%016llx\",\"epoch\":%u,\"since_used\":%s,\"pieces\":%zu,\"unchanged\":\"",
                  (unsigned long long)t.save_id, t.save_epoch, t.since_used ? "true" : "false", t.npieces);
        for (size_t i = 0; i < t.npieces; i += 8) {
            unsigned v = 0;
            for (size_t k = 0; k < 8 && i + k < t.npieces; k++) v |= (unsigned)(t.unchanged[i + k] ? 1 : 0) << k;
            sb_printf(b, "%02x", v);
        }
        sb_raw(b, "\"}");
    }
    sb_raw(b, "}");
}

void devmem_json(sbuf *b) {
    sb_raw(b, "{");
    sb_key(b, "available");
    sb_raw(b, npusnap_devmem_get_info ? "true" : "false");
    sb_key(b, "mode");
    sb_str(b, devmem.mode[0] ? devmem.mode : NULL);
    sb_key(b, "saved");
    sb_raw(b, devmem.saved ? "true" : "false");
    sb_key(b, "flow");
    sb_str(b, devmem.flow[0] ? devmem.flow : NULL);
    if (devmem.file_bytes) {
        sb_key(b, "file_bytes"); /* the copies are in the dump's device-memory file */
        sb_printf(b, "%llu", devmem.file_bytes);
    }
    if (devmem.fallback[0]) {
        sb_key(b, "fallback");
        sb_str(b, devmem.fallback);
    }
    if (npusnap_devmem_registered_count) {
        sb_key(b, "registered");
        sb_printf(b, "%llu", (unsigned long long)npusnap_devmem_registered_count());
    }
    if (npusnap_devmem_devices) {
        int32_t ids[MAX_CB_DEVICES];
        int n = npusnap_devmem_devices(ids, MAX_CB_DEVICES);
        if (n > MAX_CB_DEVICES) n = MAX_CB_DEVICES;
        sb_key(b, "devices");
        sb_raw(b, "[");
        for (int i = 0; i < n; i++) sb_printf(b, i ? ",%d" : "%d", ids[i]);
        sb_raw(b, "]");
    }
    if (npusnap_devmem_get_info) {
        npusnap_devmem_info info;
        memset(&info, 0, sizeof info);
        npusnap_devmem_get_info(&info);
        sb_printf(b,
                  ",\"allocations\":%llu,\"bytes\":%llu,\"saved_bytes\":%llu,\"excluded_bytes\":%llu,"
                  "\"vmm_bytes\":%llu,\"reserved_bytes\":%llu,\"interposed\":%s,\"gate_closed\":%s",
                  (unsigned long long)info.allocations, (unsigned long long)info.bytes,
                  (unsigned long long)info.saved_bytes, (unsigned long long)info.excluded_bytes,
                  (unsigned long long)info.vmm_bytes, (unsigned long long)info.reserved_bytes,
                  info.interposed ? "true" : "false", info.gate_closed ? "true" : "false");
    }
    if (npusnap_devmem_tracking) tracking_json(b);
    sb_raw(b, "}");
}

void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

void devmem_finish(void) {
    if (devmem.saved && npusnap_devmem_finish) npusnap_devmem_finish();
    devmem.saved = 0;
    devmem.mode[0] = 0;
    devmem.file_bytes = 0;
    devmem.file_path[0] = 0;
    close_fd(&devmem.save_fd);
    close_fd(&devmem.reload_fd);
}

/* The device-memory file sent with a lock (where the copies go) or a restore (where they come
 * back from): args "device_memory_file": its name, and its descriptor with the line. Kept
 * (dup) until devmem_finish. */
int take_devmem_file(const request *r, int *slot, op_error *e) {
    const jval *f = json_get(r->args, "device_memory_file");
    if (!f || f->t != J_STR) return 0;
    if (r->fd < 0) {
        err_set(e, NPUSNAP_ERRTYPE_PROTOCOL, NPUSNAP_ERR_BAD_ARGS, 0,
                "device_memory_file names a file but no file descriptor came with the request (SCM_RIGHTS)");
        return -1;
    }
    if (!npusnap_devmem_save_fd || !npusnap_devmem_reload_fd) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_UNAVAILABLE, 0,
                "this agent has no device-memory part: it cannot use a device-memory file");
        return -1;
    }
    close_fd(slot);
    *slot = fcntl(r->fd, F_DUPFD_CLOEXEC, agent_fd_floor());
    if (*slot < 0) *slot = fcntl(r->fd, F_DUPFD_CLOEXEC, 3);
    if (*slot < 0) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, errno, "cannot keep the device-memory file: %s",
                strerror(errno));
        return -1;
    }
    snprintf(devmem.file_path, sizeof devmem.file_path, "%s", f->s);
    return 0;
}

/* The stream an index of chunks lists (image-format.md, "Device-memory chunks": JSON, "pieces":
 * [[digest, size], ...] in stream order, each piece the file chunks/<digest> beside the index),
 * put together in a memory file; its descriptor, or -1 with err set. The digests are not checked
 * here: this is the reload of a rollback without the restore's descriptor, which reads the
 * image's own file as it is, like the single-file layout. */
static int assemble_index(int idx, char *err, size_t errlen) {
    struct stat st;
    if (fstat(idx, &st) != 0 || st.st_size <= 0 || st.st_size > (64 << 20)) {
        snprintf(err, errlen, "%s: not a device-memory index of a sane size", devmem.file_path);
        return -1;
    }
    char *buf = malloc((size_t)st.st_size);
    jval root;
    memset(&root, 0, sizeof root);
    int out = -1, ok = 0;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", devmem.file_path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    if (!buf || pread(idx, buf, (size_t)st.st_size, 0) != st.st_size) {
        snprintf(err, errlen, "cannot read %s", devmem.file_path);
    } else if (json_parse(buf, (size_t)st.st_size, &root, err, errlen) != 0) {
        /* err says why */
    } else {
        const jval *pieces = json_get(&root, "pieces");
        const jval *fmt = json_get(&root, "format");
        if (!pieces || pieces->t != J_ARR || !fmt || fmt->t != J_STR || strcmp(fmt->s, "npusnap-devmem-chunks") != 0) {
            snprintf(err, errlen, "%s is not a device-memory index", devmem.file_path);
        } else if ((out = agent_fd_high(memfd_create("npusnap-devmem", MFD_CLOEXEC))) < 0) {
            snprintf(err, errlen, "memfd_create: %s", strerror(errno));
        } else {
            ok = 1;
            off_t off = 0;
            for (size_t i = 0; ok && i < pieces->n; i++) {
                const jval *p = &pieces->items[i];
                if (p->t != J_ARR || p->n != 2 || p->items[0].t != J_STR || !p->items[1].is_int ||
                    p->items[1].i < 0 || strchr(p->items[0].s, '/')) {
                    snprintf(err, errlen, "%s: piece %zu is not [digest, size]", devmem.file_path, i);
                    ok = 0;
                    break;
                }
                char path[4200];
                snprintf(path, sizeof path, "%s/chunks/%s", dir, p->items[0].s);
                int c = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
                if (c < 0) {
                    snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
                    ok = 0;
                    break;
                }
                long long n = p->items[1].i;
                off_t from = 0;
                while (ok && n > 0) {
                    char part[1 << 16];
                    ssize_t r = pread(c, part, n < (long long)sizeof part ? (size_t)n : sizeof part, from);
                    ssize_t w = r > 0 ? pwrite(out, part, (size_t)r, off) : -1;
                    if (r <= 0 || w != r) {
                        snprintf(err, errlen, "cannot copy %s: %s", path, r < 0 || w < 0 ? strerror(errno) : "it is short");
                        ok = 0;
                    } else {
                        n -= r;
                        from += r;
                        off += r;
                    }
                }
                close(c);
            }
        }
    }
    json_free(&root);
    free(buf);
    if (!ok && out >= 0) {
        close(out);
        out = -1;
    }
    return out;
}

/* The reload's file: the restore's descriptor, else (the restore was interrupted before it sent
 * one, and a lease or `thaw` rolls back) the file by the name recorded at lock or restore. -1
 * with err set when there is none. */
static int reload_file(char *err, size_t errlen) {
    if (devmem.reload_fd >= 0) return devmem.reload_fd;
    if (!devmem.file_path[0]) {
        snprintf(err, errlen, "the copies are in the image's device-memory file and no file was named");
        return -1;
    }
    int fd = agent_fd_high(open(devmem.file_path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (fd < 0) {
        snprintf(err, errlen, "no descriptor of the image's device-memory file came with the restore, and %s "
                 "cannot be opened: %s (restore the image again, or copy it back there)",
                 devmem.file_path, strerror(errno));
        return -1;
    }
    char first = 0;
    if (pread(fd, &first, 1, 0) == 1 && first == '{') {
        /* An index of chunks (the image's device memory shared with other images of the job):
         * the stream is put together again from them. */
        int memfd = assemble_index(fd, err, errlen);
        close(fd);
        if (memfd < 0) return -1;
        fd = memfd;
    }
    devmem.reload_fd = fd;
    ops_event("reloading device memory from %s (no descriptor came with the restore)", devmem.file_path);
    return devmem.reload_fd;
}

/* After Restore, before Unlock (the runtime's lock still holds every thread of the job): write the
 * saved device memory back. A failure leaves the process LOCKED -- held, never computing on lost
 * memory -- and a later unlock/rollback/`thaw` tries the reload again before it unlocks. */
int devmem_reload(sbuf *steps, op_error *e) {
    if (!device_restored || !devmem.saved || !npusnap_devmem_reload) return 0;
    char err[512] = "";
    npusnap_devmem_info info;
    memset(&info, 0, sizeof info);
    if (npusnap_devmem_get_info) npusnap_devmem_get_info(&info);
    int rc;
    if (!info.in_file) {
        rc = npusnap_devmem_reload(err, sizeof err);
    } else {
        int fd = reload_file(err, sizeof err);
        rc = fd < 0 ? -ENOENT : npusnap_devmem_reload_fd(fd, err, sizeof err);
    }
    if (rc != 0) {
        ops_event("device memory reload FAILED, the process stays locked (%d): %s", rc, err);
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_RELOAD_FAILED, rc,
                "the runtime was restored but npusnap could not write the job's device memory back: %s; the "
                "process stays locked (`npusnap thaw %d` tries again)",
                err, user_pid());
        return -1;
    }
    device_restored = 0;
    sb_raw(steps, steps->len ? ",\"reload device memory\"" : "\"reload device memory\"");
    return 0;
}

/* After Unlock: drop the copies (they were reloaded before Unlock, or the device kept the memory). */
int devmem_after_unlock(sbuf *steps, op_error *e) {
    (void)e;
    int had_copy = devmem.saved;
    devmem_finish();
    device_restored = 0;
    no_device = 0;
    if (had_copy) sb_raw(steps, steps->len ? ",\"drop copies\"" : "\"drop copies\"");
    return 0;
}

/* device_memory of an unlock/rollback result: the report and the steps done after Unlock. */
void devmem_steps_json(sbuf *b, const sbuf *steps) {
    devmem_json(b);
    if (b->oom || !b->len) return;
    b->len--; /* reopen the object: drop its '}' */
    sb_printf(b, ",\"steps\":[%s]}", steps->p ? steps->p : "");
}

/* Start the bookkeeping of a snapshot in `mode`, in the legacy flow until told otherwise. */
void devmem_begin(const char *mode) {
    snprintf(devmem.mode, sizeof devmem.mode, "%s", mode);
    devmem.saved = 0;
    snprintf(devmem.flow, sizeof devmem.flow, "legacy");
    devmem.fallback[0] = 0;
    device_restored = 0;
}

/* Unlock after a failed drain or save (nothing of the job ran meanwhile); a failed Unlock is
 * added to e's message with what to do. */
void unlock_after_failure(op_error *e) {
    op_error again;
    err_init(&again);
    npusnap_hccl_release();
    if (call("Unlock", &again) < 0) {
        ops_event("unlock after a failed lock step FAILED: %s", again.message);
        size_t n = strlen(e->message);
        snprintf(e->message + n, sizeof e->message - n, " -- and Unlock FAILED: %s; run `npusnap thaw %d`",
                 again.message, user_pid());
    }
    err_free(&again);
}

/* After Lock without a copy of npusnap's: the bounded drain of every device the job opened, so
 * that Backup's synchronize (no timeout in CANN) finds them idle. */
double drain_s;

static double last_drain_s(void) { return npusnap_devmem_last_drain_s ? npusnap_devmem_last_drain_s() : 0; }

int devmem_drain(op_error *e, const char *after) {
    if (!npusnap_devmem_drain) return 0;
    char err[512] = "";
    int rc = npusnap_devmem_drain(drain_ms, err, sizeof err);
    drain_s += last_drain_s();
    if (rc != 0) {
        err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_BUSY, rc, "the devices did not finish their queued work: %s; %s", err, after);
        return -1;
    }
    return 0;
}

/* Seconds the current lock or backup spent copying device memory: reported apart from the
 * runtime's own Lock and Backup, which are short, so that a dump's phase table does not put a
 * multi-second copy under "lock". */
double copy_s;

/* After Lock in preserve mode: drain the devices (bounded) and copy the device memory with the
 * driver's copy, which the runtime's lock does not gate. */

int devmem_save(op_error *e, const char *nothing_locked) {
    if (!npusnap_devmem_save) return 0;
    char err[512] = "";
    int rc;
    double copy_start = now_s();
    const char *where = devmem.save_fd >= 0 ? "into the image's file" : "to host memory";
    if (devmem.save_fd >= 0) {
        uint64_t written = 0;
        rc = npusnap_devmem_save_fd(devmem.save_fd, drain_ms, &written, err, sizeof err);
        devmem.file_bytes = rc == 0 ? (unsigned long long)written : 0;
        close_fd(&devmem.save_fd); /* written: the dump owns the file now */
    } else {
        rc = npusnap_devmem_save(drain_ms, err, sizeof err);
    }
    /* The save drains first: that wait is the job's own work finishing, not the copy. */
    double drained = last_drain_s();
    drain_s += drained;
    copy_s += now_s() - copy_start - drained;
    if (rc != 0) {
        if (rc == -ETIMEDOUT)
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_BUSY, rc, "the devices did not finish their queued work: %s; %s", err,
                    nothing_locked);
        else
            err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_DEVICE_MEMORY_SAVE_FAILED, rc, "could not copy the device memory %s: %s; %s",
                    where, err, nothing_locked);
        return -1;
    }
    devmem.saved = 1;
    return 0;
}

int call_restore(op_error *e) {
    int flags = strcmp(devmem.flow, "driver") == 0 ? DRIVER_FLOW_FLAGS : -1;
    int code = acl_call_flags(&rt, "Restore", flags);
    if (code != 0) {
        acl_err(e, "Restore", code);
        return -1;
    }
    restore_pending = 0;
    npusnap_hccl_restored(); /* HCCL's RESTORE_POST made every communicator invalid */
    /* CANN's legacy Restore gives the allocations back at their addresses, not their contents:
     * npusnap writes them back before the Unlock that follows (unlock, rollback), still LOCKED --
     * by then the restore command has checked the device-memory file's checksum. */
    device_restored = 1;
    return 0;
}

/* Backup in the flow chosen at Lock. Where the driver-backed flow turns out not to be supported
 * (207000: the driver lacks the feature; 100000: a build that wants NULL args), the runtime does
 * not fall back, so npusnap does: Unlock, its own copy of the device memory, Lock, legacy Backup. */
int call_backup(op_error *e) {
    if (strcmp(devmem.flow, "driver?") != 0) {
        int flags = strcmp(devmem.flow, "driver") == 0 ? DRIVER_FLOW_FLAGS : -1;
        int code = acl_call_flags(&rt, "Backup", flags);
        if (code != 0) {
            acl_err(e, "Backup", code);
            return -1;
        }
        return 0;
    }
    int code = acl_call_flags(&rt, "Backup", DRIVER_FLOW_FLAGS);
    if (code == 0) {
        snprintf(devmem.flow, sizeof devmem.flow, "driver");
        return 0;
    }
    if (code != ACL_ERROR_RT_FEATURE_NOT_SUPPORT && code != ACL_ERROR_INVALID_PARAM) {
        acl_err(e, "Backup", code);
        return -1;
    }
    snprintf(devmem.fallback, sizeof devmem.fallback, "driver-backed Backup refused with %d (%s)", code,
             acl_error_name(code));
    snprintf(devmem.flow, sizeof devmem.flow, "legacy");
    ops_event("%s: npusnap keeps the device memory itself (legacy flow)", devmem.fallback);
    /* Still LOCKED: the copy is taken now, then the legacy Backup. A failure leaves the process
     * LOCKED for the caller's rollback, as any failed Backup does. */
    if (devmem_save(e, "the process is still locked") < 0) return -1;
    if (call("Backup", e) < 0) return -1;
    return 0;
}

int need_runtime(op_error *e) {
    if (runtime()) return 0;
    err_set(e, NPUSNAP_ERRTYPE_STATE, NPUSNAP_ERR_NO_ACL_RUNTIME, 0,
            "the CANN runtime (libacl_rt.so / libascendcl.so) is not loaded in this process");
    return -1;
}

void hook_error(op_error *e, const char *rolled_back) {
    /* hooks_run filled name/message and the hook/stage/exception extras */
    size_t n = strlen(e->message);
    snprintf(e->message + n, sizeof e->message - n, "; %s", rolled_back);
}

/* Drive the runtime back to `target` without hooks after a hook failed; steps into `steps`. */
static int move_to(int target, sbuf *steps, op_error *e) {
    int current = state_now();
    if (current == target) return 0;
    if (target == ST_RUNNING || (current == ST_BACKED_UP && target == ST_LOCKED)) {
        if (current == ST_BACKED_UP && restore_pending) {
            if (call_restore(e) < 0) return -1;
            sb_raw(steps, steps->len ? ", restore" : "restore");
        }
        sbuf done;
        sb_init(&done);
        int rr = devmem_reload(&done, e);
        sb_free(&done);
        if (rr < 0 || call("Unlock", e) < 0) return -1;
        sb_raw(steps, steps->len ? ", unlock" : "unlock");
        if (target == ST_RUNNING) {
            sbuf done;
            sb_init(&done);
            int rc = devmem_after_unlock(&done, e);
            sb_free(&done);
            if (rc < 0) return -1;
        }
        current = ST_RUNNING;
    }
    if ((target == ST_LOCKED || target == ST_BACKED_UP) && current == ST_RUNNING) {
        if (call("Lock", e) < 0) return -1;
        sb_raw(steps, steps->len ? ", lock" : "lock");
        current = ST_LOCKED;
    }
    if (target == ST_BACKED_UP && current == ST_LOCKED) {
        if (call_backup(e) < 0) return -1;
        sb_raw(steps, steps->len ? ", backup" : "backup");
    }
    return 0;
}

void abort_after_hook(op_error *e, int before) {
    char msg[600];
    if (before == ST_UNKNOWN) {
        hook_error(e, "snapshot state unknown, not rolled back");
        return;
    }
    sbuf steps;
    sb_init(&steps);
    op_error again;
    err_init(&again);
    if (move_to(before, &steps, &again) < 0) {
        ops_event("rollback after hook failure FAILED: %s", again.message);
        snprintf(msg, sizeof msg, "rollback to %s FAILED: %s", state_name(before), again.message);
    } else {
        if (before == ST_RUNNING) {
            lease_release();
            clear_owner();
        }
        snprintf(msg, sizeof msg, "rolled back to %s (%s)", state_name(before), steps.p ? steps.p : "no change");
    }
    hook_error(e, msg);
    err_free(&again);
    sb_free(&steps);
}

