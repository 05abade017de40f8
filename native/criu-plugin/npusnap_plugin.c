/* npusnap_plugin.so: a CRIU plugin that drives the npusnap agent inside each dumped task, so that
 * container engines (podman, CRI-O, the kubelet's checkpoint API, through runc and CRIU) and a
 * plain `criu dump` snapshot an NPU process's device state without any npusnap command.
 *
 * Dump:    init(DUMP)            interrupt-only mode (runc's cgroup is thawed for the plugin)
 *          PAUSE_DEVICES(pid)    task still running: find its agent (also through the container's
 *                                mount and pid namespaces), lock (owner criu-plugin/<criu pid>) and
 *                                back up, read the replies to EOF and close: nothing is left on
 *                                the socket while the tasks are frozen. Inventory entry once.
 *          CHECKPOINT_DEVICES    nothing to do (the backup is taken while the task could answer)
 *          fini(DUMP, ret)       ok: npusnap-plugin.json (tokens, processes, sha256 of every
 *                                image file) in the images directory. Always: a detached helper
 *                                rolls back every task this run locked once CRIU has let it go
 *                                (failed dump, --leave-running, a post-dump script's veto); a
 *                                task that CRIU killed after a good dump needs nothing.
 * Restore: init(RESTORE)         only when the inventory says the image needs this plugin; reads
 *                                npusnap-plugin.json.
 *          RESUME_DEVICES_LATE   records which restored task is which dumped one (the task is
 *                                stopped by CRIU: its agent cannot answer yet)
 *          fini(RESTORE, 0)      restore + unlock through each agent (the tasks run again; any
 *                                device call they make waits for the unlock).
 *
 * A job across containers (pods): when the dumped tree's root has NPUSNAP_JOB_COORDINATOR=HOST:PORT
 * and NPUSNAP_JOB_MEMBER=N in its environment, the plugin joins that coordinator (`npusnap k8s
 * checkpoint`, npusnap_cli/pipelines/netcoord.py's protocol, member N as its node; joined at the first
 * PAUSE_DEVICES, before anything is locked, or the dump fails there) and holds two
 * barriers: "locked" at the first CHECKPOINT_DEVICES (every task of this container locked, backed up
 * and frozen; no container's memory is dumped before every container got there) and "saved" in
 * fini(DUMP) after the images are written (no container is let go before every one is saved). A
 * failure anywhere, here or in another member, aborts every member: the dump fails at "locked" (CRIU
 * lets the tasks run, the helper unlocks them); after "saved" the coordinator discards the archives.
 *
 * A task without an agent, or one whose lock is held by someone else (`npusnap dump`/`freeze`
 * drive it themselves), is not ours: -ENOTSUP, so another device plugin can claim the hook.
 * Log lines start with "npusnap-plugin: " and name the npusnap exit code a failure maps to.
 *
 * This file holds the hooks; the rest is split by concern (plugin.h lists what each file offers):
 * plugin_agent.c (a connection to an agent), plugin_job.c (the job coordinator), plugin_state.c
 * (npusnap-plugin.json), plugin_rollback.c (the detached helper), plugin_util.c (the run's state,
 * configuration, /proc, the agents' sockets). They call into each other downwards only, never
 * back into this file.
 */
#define _GNU_SOURCE
#include "plugin.h"

/* ---- dump -------------------------------------------------------------------------------- */
static task *task_of(int pid) {
    for (int i = 0; i < P.ntasks; i++)
        if (P.tasks[i].pid == pid) return &P.tasks[i];
    return NULL;
}

static void rollback_one(conn *c, const task *t) {
    char err[512];
    sbuf args;
    sb_init(&args);
    token_args(&args, t->token, 0);
    reply r;
    int rc = agent_request(c, "rollback", args.p, 120, &r, err, sizeof err);
    sb_free(&args);
    if (rc < 0) {
        FAIL(EX_STATE_UNKNOWN, "rollback of pid %d: %s; its lease (%.0fs) rolls it back, or run `npusnap thaw %d`",
             t->pid, err, P.lease_s, t->pid);
        return;
    }
    if (!r.ok)
        FAIL(EX_STATE_UNKNOWN, "rollback of pid %d: %s: %s; its lease rolls it back, or run `npusnap thaw %d`",
             t->pid, r.name, r.message, t->pid);
    else
        LOGI("pid %d rolled back (unlocked)\n", t->pid);
    reply_free(&r);
}

/* A process whose agent cannot be asked (stopped, or a copy made without fork handlers) and
 * that never opened a device has nothing to lock: CRIU dumps it as any other, and
 * checkpoint_devices checks again once it is frozen. 1 when it is left to CRIU. */
static int leave_idle(int pid, int nspid, const char *why) {
    if (P.nidle >= MAX_TASKS || !npusnap_never_opened_a_device(pid, nspid)) return 0;
    P.idle[P.nidle][0] = pid;
    P.idle[P.nidle][1] = nspid;
    P.nidle++;
    LOGI("pid %d %s and never opened an NPU device (its agent's record, /proc): the plugin leaves it to CRIU\n",
         pid, why);
    return 1;
}

static int pause_devices(int pid) {
    if (P.disabled || P.stage != CR_PLUGIN_STAGE__DUMP) return -ENOTSUP;
    if (!J.checked) {
        job_read_env(pid); /* the first call is for the dumped tree's root */
        if (J.member == -2) {
            FAIL(EX_TARGET, "pid %d has NPUSNAP_JOB_COORDINATOR=%s but no valid NPUSNAP_JOB_MEMBER (a number) in "
                            "its environment: set both in the pod spec", pid, J.addr);
            return -1;
        }
        if (J.member >= 0) {
            /* Join now, while nothing is locked or frozen: a coordinator that is not there fails
             * this checkpoint before it touches the job. */
            char err[512];
            if (job_connect(err, sizeof err) < 0) {
                J.aborted = 1;
                FAIL(EX_TARGET, "pid %d is member %d of a job (NPUSNAP_JOB_COORDINATOR=%s): %s; a job member is "
                                "checkpointed with its job: `npusnap k8s checkpoint --listen %s`", pid, J.member,
                     J.addr, err, J.addr);
                return -1;
            }
            LOGI("member %d of the job coordinated at %s\n", J.member, J.addr);
        }
    }
    if (task_of(pid)) return 0;
    int nspid = ns_pid(pid);
    if (nspid < 0) return -ENOTSUP; /* gone: CRIU sees it too */
    char pst = proc_state(pid);
    if (pst == 'T' || pst == 't') {
        char cands[1][256];
        if (pst == 'T' && leave_idle(pid, nspid, "is stopped")) return -ENOTSUP;
        if (agent_sockets(pid, nspid, cands, 1) > 0) {
            FAIL(EX_TARGET, "pid %d is stopped (SIGSTOP, Ctrl-Z or a debugger): its agent cannot lock or back up "
                            "the device; continue it (kill -CONT %d) and checkpoint again", pid, pid);
            return -1;
        }
    }
    char sock[256], err[512];
    conn c;
    int rc = -1;
    double deadline = now_s() + 2.0;
    reply r;
    sbuf args;
    for (;;) {
        rc = find_and_connect(pid, nspid, sock, sizeof sock, &c, err, sizeof err);
        if (rc == 1) {
            char lib[512];
            if (leave_idle(pid, nspid, "has no agent of its own")) return -ENOTSUP;
            if (maps_cann(pid, lib, sizeof lib)) {
                if (P.require_agent) {
                    FAIL(EX_TARGET,
                         "pid %d (pid %d in its namespace) has the CANN runtime loaded (%s) but no npusnap agent: "
                         "its device state would be lost; start it under `npusnap run` or with "
                         "LD_PRELOAD=libnpusnap_agent.so NPUSNAP_AGENT=1 (require_agent=1 in %s)",
                         pid, nspid, lib, config_path());
                    return -1;
                }
                LOGW("pid %d (pid %d in its namespace) has the CANN runtime loaded (%s) but no npusnap agent: the "
                     "plugin does not touch it, its device state is up to the application or another plugin "
                     "(set require_agent=1 in %s to refuse such dumps)\n",
                     pid, nspid, lib, config_path());
                return -ENOTSUP;
            }
            LOGI("pid %d has no agent and no CANN runtime: not ours\n", pid);
            return -ENOTSUP;
        }
        if (rc < 0) {
            FAIL(EX_AGENT, "pid %d: %s", pid, err);
            return -1;
        }
        sb_init(&args);
        sb_raw(&args, "{");
        sb_key(&args, "lease_s");
        sb_num(&args, P.lease_s);
        if (P.device_memory[0]) {
            sb_key(&args, "device_memory");
            sb_str(&args, P.device_memory);
        }
        sb_key(&args, "owner");
        sb_raw(&args, "{");
        sb_key(&args, "command");
        sb_str(&args, NPUSNAP_PLUGIN_OWNER_COMMAND);
        sb_key(&args, "pid");
        sb_printf(&args, "%d", (int)getpid());
        sb_raw(&args, "}}");
        int sent = agent_request(&c, "lock", args.p, 90, &r, err, sizeof err);
        int e = errno;
        sb_free(&args);
        if (sent < 0) {
            agent_close(&c);
            if ((e == EPIPE || e == ECONNRESET) && now_s() < deadline) {
                /* Refused at accept: another client (npusnap renewing its lease, `npusnap
                 * status`) is talking to the agent for a moment. Retried like a BUSY reply. */
                usleep(100 * 1000);
                continue;
            }
            FAIL(EX_AGENT, "lock of pid %d: %s", pid, err);
            return -1;
        }
        if (!r.ok && !strcmp(r.name, NPUSNAP_ERR_BUSY) && now_s() < deadline) {
            reply_free(&r);
            agent_close(&c);
            usleep(100 * 1000);
            continue;
        }
        break;
    }
    if (!r.ok) {
        if (!strcmp(r.name, NPUSNAP_ERR_NO_ACL_RUNTIME)) {
            LOGI("pid %d has an agent but no CANN runtime: not ours\n", pid);
            reply_free(&r);
            agent_close(&c);
            return -ENOTSUP;
        }
        if (!strcmp(r.name, NPUSNAP_ERR_ALREADY_LOCKED)) {
            const jval *owner = r.body ? json_get(r.body, "owner") : NULL;
            const jval *cmd = owner ? json_get(owner, "command") : NULL;
            int ours = cmd && cmd->t == J_STR && !strcmp(cmd->s, NPUSNAP_PLUGIN_OWNER_COMMAND);
            if (!ours) {
                /* `npusnap dump` or `freeze` holds the lock and drives the device state itself. */
                LOGI("pid %d: %s; that command drives its device state, the plugin leaves it alone\n", pid,
                     r.message);
                reply_free(&r);
                agent_close(&c);
                return -ENOTSUP;
            }
        }
        int code = error_exit_code(&r);
        FAIL(code, "lock of pid %d: %s: %s", pid, r.name, r.message);
        reply_free(&r);
        agent_close(&c);
        return -1;
    }
    task *t = &P.tasks[P.ntasks];
    memset(t, 0, sizeof *t);
    t->pid = pid;
    t->nspid = nspid;
    snprintf(t->sock, sizeof t->sock, "%s", sock);
    const jval *tok = r.body ? json_get(r.body, "token") : NULL;
    if (!tok || tok->t != J_STR || strlen(tok->s) != TOKEN_LEN) {
        FAIL(EX_AGENT, "lock of pid %d: the agent's answer carries no token (an agent older than the lock-owner "
                       "protocol?)", pid);
        reply_free(&r);
        if (agent_request(&c, "rollback", "{\"force\":true}", 120, &r, err, sizeof err) == 0) reply_free(&r);
        agent_close(&c);
        return -1;
    }
    snprintf(t->token, sizeof t->token, "%s", tok->s);
    reply_free(&r);
    if (P.ntasks >= MAX_TASKS) {
        FAIL(EX_TARGET, "more than %d NPU processes in one dump", MAX_TASKS);
        rollback_one(&c, t);
        agent_close(&c);
        return -1;
    }
    P.ntasks++; /* from here on fini rolls it back if the dump does not go through */
    sb_init(&args);
    token_args(&args, t->token, P.lease_s);
    int sent = agent_request(&c, "backup", args.p, 900, &r, err, sizeof err);
    sb_free(&args);
    if (sent < 0) {
        FAIL(EX_AGENT, "backup of pid %d: %s", pid, err);
        agent_close(&c);
        return -1;
    }
    if (!r.ok) {
        FAIL(error_exit_code(&r), "backup of pid %d: %s: %s", pid, r.name, r.message);
        reply_free(&r);
        rollback_one(&c, t);
        P.ntasks--;
        agent_close(&c);
        return -1;
    }
    reply_free(&r);
    agent_close(&c); /* nothing may stay on the socket while the task is frozen */
    if (!P.inventory_added) {
        if (add_inventory_plugin(PLUGIN_NAME)) {
            FAIL(EX_IMAGE, "cannot record %s in the image inventory", PLUGIN_NAME);
            return -1;
        }
        P.inventory_added = 1;
    }
    LOGI("pid %d (pid %d in its namespace, agent %s): locked and backed up, lease %gs\n", pid, nspid, sock,
         P.lease_s);
    return 0;
}

static int checkpoint_devices(int pid) {
    if (P.disabled || P.stage != CR_PLUGIN_STAGE__DUMP) return -ENOTSUP;
    if (J.member >= 0 && !J.locked) {
        /* The first call: every task of this tree is locked, backed up and frozen. */
        char err[512];
        double t0 = now_s();
        if (job_sync("locked", err, sizeof err) < 0) {
            FAIL(EX_DEVICE, "job member %d: %s; this container is rolled back", J.member, err);
            return -1;
        }
        J.locked = 1;
        LOGI("job member %d: every member locked (waited %.3fs)\n", J.member, now_s() - t0);
    }
    for (int i = 0; i < P.nidle; i++) {
        if (P.idle[i][0] != pid) continue;
        if (!npusnap_never_opened_a_device(pid, P.idle[i][1])) {
            FAIL(EX_TARGET, "pid %d opened an NPU device while the checkpoint ran (it was stopped, or had no agent of "
                            "its own, and had opened none when it began); checkpoint again", pid);
            return -1;
        }
        return -ENOTSUP;
    }
    if (!task_of(pid)) return -ENOTSUP;
    return 0; /* backed up at PAUSE_DEVICES, while the agent could still answer */
}

/* ---- restore ----------------------------------------------------------------------------- */
static int resume_devices_late(int pid) {
    if (P.disabled || P.stage != CR_PLUGIN_STAGE__RESTORE) return -ENOTSUP;
    int nspid = ns_pid(pid);
    for (int i = 0; i < P.ntasks; i++) {
        task *t = &P.tasks[i];
        if (t->nspid == nspid && !t->restored) {
            t->restored = 1;
            t->newpid = pid;
            LOGI("restored pid %d is dumped pid %d (pid %d in its namespace): restore + unlock once it runs\n", pid,
                 t->pid, nspid);
            return 0;
        }
    }
    return -ENOTSUP;
}

static void restore_one(task *t) {
    conn c;
    char err[512];
    int pid = t->newpid;
    if (agent_connect(&c, pid, t->sock, err, sizeof err) < 0) {
        FAIL(EX_AGENT, "restore of pid %d: %s; the agent's lease (%.0fs) restores and unlocks it by itself", pid, err,
             P.lease_s);
        return;
    }
    sbuf args;
    sb_init(&args);
    token_args(&args, t->token, 0);
    const char *ops[] = {"restore", "unlock"};
    for (int i = 0; i < 2; i++) {
        reply r;
        if (agent_request(&c, ops[i], args.p, 900, &r, err, sizeof err) < 0) {
            sb_free(&args);
            FAIL(EX_AGENT, "%s of pid %d: %s; the agent's lease restores and unlocks it by itself", ops[i], pid, err);
            agent_close(&c);
            return;
        }
        if (!r.ok) {
            FAIL(error_exit_code(&r), "%s of pid %d: %s: %s; run `npusnap status %d`, then `npusnap thaw %d`", ops[i],
                 pid, r.name, r.message, pid, pid);
            reply_free(&r);
            sb_free(&args);
            agent_close(&c);
            return;
        }
        reply_free(&r);
    }
    sb_free(&args);
    agent_close(&c);
    LOGI("pid %d: device state restored, unlocked\n", pid);
}

/* ---- init / fini ------------------------------------------------------------------------- */
static int plugin_init(int stage) {
    memset(&P, 0, sizeof P);
    memset(&J, 0, sizeof J);
    J.member = -1;
    J.fd = -1;
    P.stage = stage;
    load_config();
    if (stage == CR_PLUGIN_STAGE__PRE_DUMP) {
        P.disabled = 1; /* pre-dump never freezes device state */
        return 0;
    }
    if (stage == CR_PLUGIN_STAGE__RESTORE) {
        if (!check_and_remove_inventory_plugin(PLUGIN_NAME, strlen(PLUGIN_NAME))) {
            P.disabled = 1; /* not an image this plugin took part in */
            return 0;
        }
        return load_state_file() < 0 ? -1 : 0;
    }
    /* Dump: talk to the agents before CRIU stops the tasks, also under runc (which asks CRIU to
     * freeze the container's cgroup): CRIU thaws it and interrupts the tasks one by one. */
    set_compel_interrupt_only_mode();
    LOGI("loaded (dump), lease %gs, require_agent %d, config %s\n", P.lease_s, P.require_agent, config_path());
    return 0;
}

static void plugin_fini(int stage, int ret) {
    if (P.disabled) return;
    if (stage == CR_PLUGIN_STAGE__DUMP) {
        int saved = ret == 0;
        if (saved && P.ntasks > 0 && write_state_file() < 0) {
            FAIL(EX_IMAGE, "the checkpoint has no %s: it cannot be restored with its device state", STATE_FILE);
            saved = 0;
        }
        if (J.member >= 0) {
            char err[512];
            if (!saved) {
                job_abort(ret ? "its dump failed (CRIU's log says why)" : "its state file could not be written");
            } else if (job_sync("saved", err, sizeof err) < 0) {
                /* CRIU's outcome is decided before fini: the coordinator discards this checkpoint. */
                FAIL(EX_DEVICE, "job member %d: saved, but %s: `npusnap k8s checkpoint` discards this "
                                "checkpoint", J.member, err);
            } else {
                LOGI("job member %d: every member saved\n", J.member);
            }
            if (J.fd >= 0) close(J.fd);
            J.fd = -1;
        }
        if (P.ntasks == 0) return;
        spawn_rollback_helper();
    } else if (stage == CR_PLUGIN_STAGE__RESTORE) {
        if (ret != 0) { /* CRIU removed the restored tasks */
            if (J.member >= 0) job_abort("its restore failed (CRIU's log says why)");
            if (J.fd >= 0) close(J.fd);
            return;
        }
        if (J.member >= 0) {
            /* Every member's tasks are back (locked: their device calls wait) before any member's
             * device state is restored and unlocked: the job is released together. */
            char err[512];
            if (job_connect(err, sizeof err) < 0) {
                LOGW("job member %d: %s: restored on its own, without the job's barrier\n", J.member, err);
            } else if (job_sync("restored", err, sizeof err) < 0) {
                FAIL(EX_DEVICE, "job member %d: %s; its NPU processes stay locked: their agents' leases (%.0fs) "
                                "restore and unlock them, or `npusnap thaw PID`", J.member, err, P.lease_s);
                close(J.fd);
                J.fd = -1;
                return;
            } else {
                LOGI("job member %d: every member restored\n", J.member);
            }
            if (J.fd >= 0) close(J.fd);
            J.fd = -1;
        }
        for (int i = 0; i < P.ntasks; i++) {
            if (!P.tasks[i].restored) {
                FAIL(EX_IMAGE, "dumped pid %d (pid %d in its namespace) was not among the restored tasks",
                     P.tasks[i].pid, P.tasks[i].nspid);
                continue;
            }
            restore_one(&P.tasks[i]);
        }
    }
}

CR_PLUGIN_REGISTER(PLUGIN_NAME, plugin_init, plugin_fini)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__PAUSE_DEVICES, pause_devices)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__CHECKPOINT_DEVICES, checkpoint_devices)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, resume_devices_late)
