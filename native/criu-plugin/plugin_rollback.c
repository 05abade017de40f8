/* The detached helper a dump leaves behind: it rolls back every task the dump locked once CRIU
 * has let it go (a failed dump, --leave-running, a post-dump script's veto). */
#define _GNU_SOURCE
#include "plugin.h"

static FILE *helper_log(void) {
    if (!strcmp(P.log_path, "/var/log/npusnap/criu-plugin.log")) mkdir("/var/log/npusnap", 0700);
    FILE *f = fopen(P.log_path, "ae");
    if (f) setvbuf(f, NULL, _IOLBF, 0);
    return f;
}

static void hlog(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void hlog(FILE *f, const char *fmt, ...) {
    if (!f) return;
    char when[32];
    iso_now(when, sizeof when);
    fprintf(f, "%s [%d] " PREFIX, when, (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
}

/* The detached helper: once CRIU lets a task go (it is no longer traced), roll it back. A task
 * that CRIU killed after a good dump is gone: nothing to do. Bounded by the lease (+30 s). */
/* Whether the dumped task has exited. A restore from the image (criu restore keeps pids) can
 * bring back a task with the same pid, namespace pid, socket and lock token within the helper's
 * polling interval; only the pidfd taken while CRIU still held the task tells them apart. */
static int task_gone(const task *t) {
    if (t->pidfd < 0) return 0;
    struct pollfd p = {t->pidfd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
}

static void helper_main(void) {
    P.stage = -1; /* CRIU's dump (and its freeze timeout) is over for this process */
    FILE *lf = helper_log();
    hlog(lf, "helper for %d task(s) of criu pid %d", P.ntasks, P.criu_pid);
    double deadline = now_s() + P.lease_s + 30;
    int left = P.ntasks;
    int done[MAX_TASKS] = {0};
    while (left && now_s() < deadline) {
        for (int i = 0; i < P.ntasks; i++) {
            if (done[i]) continue;
            task *t = &P.tasks[i];
            if (t->pidfd == -2) {
                hlog(lf, "pid %d: no pidfd, not touched; its agent's lease rolls it back if it runs on", t->pid);
                done[i] = 1;
                left--;
                continue;
            }
            char st = proc_state(t->pid);
            if (task_gone(t) || st == 0 || st == 'Z' || st == 'X' || ns_pid(t->pid) != t->nspid) {
                hlog(lf, "pid %d exited (a dump that was not --leave-running ends the task): nothing to unlock",
                     t->pid);
                done[i] = 1;
                left--;
                continue;
            }
            if (status_field(t->pid, "TracerPid") != 0 || st == 't' || st == 'T') continue; /* CRIU holds it */
            conn c;
            char err[512];
            if (agent_connect(&c, t->pid, t->sock, err, sizeof err) < 0) {
                hlog(lf, "pid %d: %s (retrying)", t->pid, err);
                continue;
            }
            if (task_gone(t)) {
                /* It died while we connected: the peer (same pid) can only be a task CRIU restored
                 * from this very image, which holds the same token. Not ours to roll back. */
                close(c.fd);
                continue;
            }
            sbuf args;
            sb_init(&args);
            token_args(&args, t->token, 0);
            reply r;
            int rc = agent_request(&c, "rollback", args.p, 10, &r, err, sizeof err);
            sb_free(&args);
            if (rc < 0) {
                hlog(lf, "pid %d: rollback: %s (retrying)", t->pid, err);
                close(c.fd);
                continue;
            }
            if (!r.ok && !strcmp(r.name, NPUSNAP_ERR_BUSY)) {
                /* The agent still serves another connection: the dumping CRIU's own (closed only as
                 * CRIU ends), or a status. It serves one at a time: ask again. */
                reply_free(&r);
                agent_close(&c);
                continue;
            }
            if (r.ok)
                hlog(lf, "pid %d rolled back: running, unlocked", t->pid);
            else if (!strcmp(r.name, NPUSNAP_ERR_NOT_OWNER) || !strcmp(r.type, NPUSNAP_ERRTYPE_STATE))
                hlog(lf, "pid %d: nothing to roll back: %s: %s", t->pid, r.name, r.message);
            else
                hlog(lf, "FAILED, npusnap %s: rollback of pid %d: %s: %s; its lease rolls it back, or run `npusnap "
                         "thaw %d`", exit_meaning(EX_STATE_UNKNOWN), t->pid, r.name, r.message, t->pid);
            reply_free(&r);
            agent_close(&c);
            done[i] = 1;
            left--;
        }
        if (left) usleep(50 * 1000);
    }
    for (int i = 0; i < P.ntasks; i++)
        if (!done[i])
            hlog(lf, "FAILED, npusnap %s: pid %d was not released by CRIU within %.0fs; its lease rolls it back, or "
                     "run `npusnap thaw %d`", exit_meaning(EX_STATE_UNKNOWN), P.tasks[i].pid, P.lease_s + 30,
                 P.tasks[i].pid);
    if (lf) fclose(lf);
}

void spawn_rollback_helper(void) {
    P.criu_pid = (int)getpid();
    /* CRIU still holds every task here (killed or resumed only after fini), so each pid is still
     * the task we locked. */
    for (int i = 0; i < P.ntasks; i++) {
        P.tasks[i].pidfd = (int)syscall(SYS_pidfd_open, P.tasks[i].pid, 0);
        if (P.tasks[i].pidfd < 0) {
            FAIL(EX_STATE_UNKNOWN, "pidfd_open(%d): %s; the helper cannot tell it from a restored task with its pid, "
                                   "so it leaves it to the agent's lease (%.0fs)", P.tasks[i].pid, strerror(errno),
                 P.lease_s);
            P.tasks[i].pidfd = -2; /* the helper leaves it alone */
        }
    }
    pid_t child = fork();
    if (child < 0) {
        FAIL(EX_STATE_UNKNOWN, "cannot fork the rollback helper: %s; the agents' leases (%.0fs) roll back",
             strerror(errno), P.lease_s);
        return;
    }
    if (child == 0) {
        setsid();
        if (fork() != 0) _exit(0);
        /* Keep nothing of CRIU's: runc waits for EOF on CRIU's RPC socket. */
        int devnull = open("/dev/null", O_RDWR);
        if (devnull >= 0) {
            dup2(devnull, 0);
            dup2(devnull, 1);
            dup2(devnull, 2);
        }
        /* Close everything of CRIU's but the pidfds: the gaps between them, in fd order. */
        unsigned from = 3;
        for (;;) {
            unsigned next = ~0U;
            for (int i = 0; i < P.ntasks; i++)
                if (P.tasks[i].pidfd >= (int)from && (unsigned)P.tasks[i].pidfd < next) next = (unsigned)P.tasks[i].pidfd;
            if (next > from) syscall(SYS_close_range, from, next == ~0U ? ~0U : next - 1, 0);
            if (next == ~0U) break;
            from = next + 1;
        }
        signal(SIGPIPE, SIG_IGN);
        helper_main();
        _exit(0);
    }
    int st;
    while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
    }
    for (int i = 0; i < P.ntasks; i++)
        if (P.tasks[i].pidfd >= 0) close(P.tasks[i].pidfd);
    LOGI("a detached helper rolls back the %d locked task(s) if CRIU lets them run (failed dump, --leave-running); "
         "log: %s\n", P.ntasks, P.log_path);
}
