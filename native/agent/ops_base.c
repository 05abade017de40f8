/* The state of the agent's state logic (ops_int.h says what each holds) and the helpers its
 * operations are built from: the process's start time, events, Python hooks, the lease, lock
 * ownership, npusnap's LOCK_PRE callback, the calls into the runtime, the members of results. */
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

/* The state (ops_int.h says what each part holds). */
acl_rt rt;
int rt_found;
long long start_ticks;
int restored;
int restore_pending;
int device_restored;
int no_device;
int drain_ms = DEVMEM_SAVE_TIMEOUT_MS;
struct ops_lease lease;
struct ops_owner owner;
struct ops_devmem devmem = {.save_fd = -1, .reload_fd = -1};
struct ops_cb cb = {.mu = PTHREAD_MUTEX_INITIALIZER};
char events[N_EVENTS][400];
int n_events;

/* ---- small helpers ----------------------------------------------------------------------- */
long long read_start_ticks(void) {
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "re");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    p += 2;
    /* fields after the comm: state is field 3; starttime is field 22 -> the 20th from here */
    for (int i = 0; i < 19 && p; i++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    return p ? strtoll(p, NULL, 10) : -1;
}

double boot_time(void) {
    FILE *f = fopen("/proc/stat", "re");
    if (!f) return -1;
    char line[256];
    double bt = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "btime ", 6) == 0) {
            bt = strtod(line + 6, NULL);
            break;
        }
    }
    fclose(f);
    return bt;
}

void ops_event(const char *fmt, ...) {
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    agent_log("%s", msg);
    char stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
    if (n_events == N_EVENTS) {
        memmove(events[0], events[1], sizeof events[0] * (N_EVENTS - 1));
        n_events--;
    }
    snprintf(events[n_events++], sizeof events[0], "%s %s", stamp, msg);
}

/* The Python hooks of a stage (hooks.c); one that timed out is also an event `status` shows. */
int run_hooks(const char *stage, sbuf *ran, op_error *e) {
    int rc = hooks_run(stage, ran, e);
    if (rc < 0 && strcmp(e->name, NPUSNAP_ERR_HOOK_TIMEOUT) == 0) ops_event("%s", e->message);
    return rc;
}

void ops_init(void) {
    memset(&lease, 0, sizeof lease);
    memset(&owner, 0, sizeof owner);
    memset(&devmem, 0, sizeof devmem);
    devmem.save_fd = devmem.reload_fd = -1; /* none yet (0 would be stdin) */
    n_events = 0;
    rt_found = 0;
    restored = restore_pending = device_restored = no_device = 0;
    start_ticks = read_start_ticks();
    lease.last = now_s();
}

acl_rt *runtime(void) {
    if (!rt_found) rt_found = acl_find(&rt) == 0;
    return rt_found ? &rt : NULL;
}

int state_now(void) {
    acl_rt *r = runtime();
    if (!r) return ST_UNKNOWN;
    int code;
    return acl_state(r, &code);
}

void sb_state(sbuf *b, int st) {
    const char *name = state_name(st);
    if (name) sb_str(b, name);
    else sb_raw(b, "null");
}

/* ---- lease ------------------------------------------------------------------------------- */
void lease_grant(double seconds) {
    lease.active = 1;
    lease.duration = lease.remaining = seconds;
    lease.voided[0] = 0;
    lease.last = now_s();
}

void lease_release(void) {
    lease.active = 0;
    lease.duration = lease.remaining = 0;
}

void lease_skip_gap(void) { lease.last = now_s(); }

static void lease_json(sbuf *b) {
    sb_raw(b, "{");
    sb_key(b, "active");
    sb_raw(b, lease.active ? "true" : "false");
    sb_key(b, "lease_s");
    if (lease.active) sb_num(b, lease.duration);
    else sb_raw(b, "null");
    sb_key(b, "remaining_s");
    if (lease.active) sb_num(b, (double)(long long)((lease.remaining > 0 ? lease.remaining : 0) * 1000 + 0.5) / 1000);
    else sb_raw(b, "null");
    sb_key(b, "voided_reason");
    sb_str(b, lease.voided[0] ? lease.voided : NULL);
    sb_key(b, "frozen_gaps");
    sb_printf(b, "%d", lease.frozen_gaps);
    sb_raw(b, "}");
}

/* ---- ownership --------------------------------------------------------------------------- */
void owner_json(sbuf *b) {
    if (!owner.set) {
        sb_raw(b, "null");
        return;
    }
    sb_raw(b, "{");
    sb_key(b, "command");
    sb_str(b, owner.command);
    sb_key(b, "pid");
    sb_printf(b, "%lld", owner.pid);
    sb_key(b, "since");
    sb_str(b, owner.since);
    sb_raw(b, "}");
}

/* "`npusnap dump` (pid 42) since 2026-...Z", as the Python agent words it. */
void owner_text(char *out, size_t len) {
    snprintf(out, len, "`npusnap %s` (pid %lld) since %s", owner.command, owner.pid, owner.since);
}

void owner_error(op_error *e, const char *name, const char *message) {
    err_set(e, NPUSNAP_ERRTYPE_STATE, name, 0, "%s", message);
    sb_raw(&e->extra, ",\"owner\":");
    owner_json(&e->extra);
}

/* The host pid, which /proc/self names (`npusnap run --pid-ns` keeps the host's /proc), read
 * without opening a file. */
long host_pid_now(void) {
    char buf[32];
    ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
    if (n <= 0) return -1;
    buf[n] = 0;
    return strtol(buf, NULL, 10);
}

/* The pid a message asks the user to act on: the host's. getpid() is 1 for init of a
 * `--pid-ns` job, which on the host names another process entirely. */
int user_pid(void) {
    long v = host_pid_now();
    return v > 0 ? (int)v : (int)getpid();
}

/* 0 if the request may act on the lock; -1 with NOT_OWNER in e otherwise. */
int check_owner(const char *op, const jval *args, int allow_force, op_error *e) {
    if (!owner.set) return 0;
    char who[256], msg[400];
    owner_text(who, sizeof who);
    const jval *force = json_get(args, "force");
    if (allow_force && force && force->t == J_BOOL && force->b) {
        ops_event("%s forced over the lock of %s", op, who);
        return 0;
    }
    const jval *tok = json_get(args, "token");
    if (tok && tok->t == J_STR && tok->slen == 32) {
        unsigned char diff = 0; /* constant time: the comparison must not leak the token */
        for (int i = 0; i < 32; i++) diff |= (unsigned char)(tok->s[i] ^ owner.token[i]);
        if (!diff) return 0;
    }
    snprintf(msg, sizeof msg, "pid %d is locked by %s; only its owner may %s it", user_pid(), who, op);
    owner_error(e, NPUSNAP_ERR_NOT_OWNER, msg);
    return -1;
}

int new_token(char out[33]) {
    unsigned char raw[16];
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        got += (size_t)n;
    }
    for (int i = 0; i < 16; i++) snprintf(out + 2 * i, 3, "%02x", raw[i]);
    return 0;
}

void clear_owner(void) { memset(&owner, 0, sizeof owner); }

/* ---- npusnap's LOCK_PRE callback --------------------------------------------------------- */
static uint32_t on_lock_pre(int32_t device_id, void *args) {
    (void)args;
    pthread_mutex_lock(&cb.mu);
    int dup = 0;
    for (int i = 0; i < cb.n_seen; i++) dup |= cb.seen[i] == device_id;
    if (!dup && cb.n_seen < MAX_CB_DEVICES) {
        int i = cb.n_seen++;
        for (; i > 0 && cb.seen[i - 1] > device_id; i--) cb.seen[i] = cb.seen[i - 1]; /* sorted */
        cb.seen[i] = device_id;
    }
    pthread_mutex_unlock(&cb.mu);
    return 0; /* non-zero would abort the Lock */
}

void ensure_lock_pre_callback(acl_rt *a) {
    if (cb.tried) return;
    cb.tried = 1;
    int code = acl_register_callback(a, STAGE_LOCK_PRE, on_lock_pre);
    if (code == 0) {
        snprintf(cb.state, sizeof cb.state, "registered");
    } else { /* 8.5 has no callbacks: the devices then come from elsewhere */
        snprintf(cb.state, sizeof cb.state, "not registered: aclrtSnapShotCallbackRegister failed: %s (%d)",
                 acl_error_name(code), code);
        agent_log("LOCK_PRE callback %s", cb.state);
    }
}

/* The LOCK_PRE callback is registered and saw at least one device at the last Lock. */
int cb_devices_known(void) {
    pthread_mutex_lock(&cb.mu);
    int known = strcmp(cb.state, "registered") == 0 && cb.n_known > 0;
    pthread_mutex_unlock(&cb.mu);
    return known;
}

void ids_json(sbuf *b, const int32_t *ids, int n) {
    sb_raw(b, "[");
    for (int i = 0; i < n; i++) sb_printf(b, i ? ",%d" : "%d", ids[i]);
    sb_raw(b, "]");
}

/* ---- errors ------------------------------------------------------------------------------ */
void acl_err(op_error *e, const char *what, int code) {
    err_set(e, NPUSNAP_ERRTYPE_ACL, acl_error_name(code), code, "%s failed: %s (%d)", what, acl_error_name(code), code);
}

int call(const char *what, op_error *e) {
    int code = acl_call(&rt, what);
    if (code != 0) {
        acl_err(e, what, code);
        return -1;
    }
    return 0;
}

/* Restore in the flow of the current snapshot (the driver-backed one wants its args again). */
/* ---- results ----------------------------------------------------------------------------- */
void state_members(sbuf *b) {
    sb_key(b, "state");
    sb_state(b, state_now());
    sb_key(b, "lease");
    lease_json(b);
    sb_key(b, "owner");
    owner_json(b);
}

void elapsed_member(sbuf *b, double start) {
    sb_key(b, "elapsed_s");
    sb_num(b, (double)(long long)((now_s() - start) * 1e6 + 0.5) / 1e6);
}

double arg_lease(const jval *args, int *present) {
    const jval *v = json_get(args, "lease_s");
    *present = v && v->t == J_NUM;
    return *present ? v->num : 0;
}

