/* Python hooks, run by the Python face on a thread of the job's and waited for by the agent
 * thread only with a deadline: a hook that holds the job (the GIL, a lock) cannot hold the agent. */
#include "agent_int.h"

#include <npusnap/agent.h>
#include <npusnap/quietthread.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEFAULT_HOOK_TIMEOUT 10.0

/* ---- Python hooks, with a deadline ------------------------------------------------------- */
typedef int (*hook_cb_t)(void *handle, const char *stage, char *out, size_t outlen);

enum { HC_PENDING, HC_RUNNING, HC_DONE, HC_CANCELLED };

typedef struct hook_call {
    char stage[16];
    int state;
    int rc;
    int refs;
    char out[16384];
} hook_call;

static pthread_mutex_t hook_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hook_cv;
static int hook_cv_ready;
static hook_cb_t hook_cb;
static double hook_timeout = DEFAULT_HOOK_TIMEOUT;
static unsigned hook_mask;
static char *hook_names;
static char *python_info;

static const char *STAGES[] = {NPUSNAP_HOOK_STAGES_INIT};

static void hook_cv_init(void) {
    monotonic_cond_init(&hook_cv);
    hook_cv_ready = 1;
}

/* Called by the Python face: cb runs the hooks of a stage (it must call npusnap_agent_hook_claim
 * first and do nothing if that says the call was cancelled); timeout_s bounds each stage. */
AGENT_API void npusnap_agent_set_hook_callback(hook_cb_t cb, double timeout_s) {
    pthread_mutex_lock(&hook_mu);
    hook_cb = cb;
    if (timeout_s > 0) hook_timeout = timeout_s;
    pthread_mutex_unlock(&hook_mu);
}

/* mask: bit i set when stage STAGES[i] has hooks; names: {"pre_lock": [...], ...} for hello. */
AGENT_API void npusnap_agent_set_hooks(unsigned mask, const char *names_json) {
    pthread_mutex_lock(&hook_mu);
    hook_mask = mask;
    free(hook_names);
    hook_names = names_json ? strdup(names_json) : NULL;
    pthread_mutex_unlock(&hook_mu);
}

AGENT_API void npusnap_agent_set_python_info(const char *json) {
    pthread_mutex_lock(&hook_mu);
    free(python_info);
    python_info = json ? strdup(json) : NULL;
    pthread_mutex_unlock(&hook_mu);
}

/* 0: go ahead and run the hooks; 1: the agent gave up waiting (the stage already failed and was
 * rolled back), so the late hook must do nothing. */
AGENT_API int npusnap_agent_hook_claim(void *handle) {
    hook_call *c = handle;
    pthread_mutex_lock(&hook_mu);
    int go = c->state == HC_PENDING;
    if (go) c->state = HC_RUNNING;
    pthread_mutex_unlock(&hook_mu);
    return go ? 0 : 1;
}

static void hook_call_put(hook_call *c) { /* with hook_mu held */
    if (--c->refs == 0) free(c);
}

static void *hook_thread(void *arg) {
    hook_call *c = arg;
    pthread_mutex_lock(&hook_mu);
    hook_cb_t cb = hook_cb;
    pthread_mutex_unlock(&hook_mu);
    /* This call takes the GIL (ctypes does): it may wait for as long as the application holds
     * it. The agent thread does not wait for it longer than hook_timeout. */
    int rc = cb ? cb(c, c->stage, c->out, sizeof c->out - 1) : -1;
    pthread_mutex_lock(&hook_mu);
    c->rc = rc;
    if (c->state != HC_CANCELLED) c->state = HC_DONE;
    pthread_cond_broadcast(&hook_cv);
    hook_call_put(c);
    pthread_mutex_unlock(&hook_mu);
    return NULL;
}

void hooks_names_json(sbuf *out) {
    pthread_mutex_lock(&hook_mu);
    if (hook_names) sb_raw(out, hook_names);
    else sb_raw(out, "{\"pre_lock\":[],\"post_backup\":[],\"post_restore\":[],\"post_unlock\":[]}");
    pthread_mutex_unlock(&hook_mu);
}

void python_info_json(sbuf *out) {
    pthread_mutex_lock(&hook_mu);
    sb_raw(out, python_info ? python_info : "null");
    pthread_mutex_unlock(&hook_mu);
}

static void hook_fail(op_error *e, const char *stage, const char *hook, const char *exc, const char *name,
                      const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void hook_fail(op_error *e, const char *stage, const char *hook, const char *exc, const char *name,
                      const char *fmt, ...) {
    e->type = NPUSNAP_ERRTYPE_HOOK;
    snprintf(e->name, sizeof e->name, "%s", name);
    e->code = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    sb_raw(&e->extra, ",\"hook\":");
    sb_str(&e->extra, hook);
    sb_raw(&e->extra, ",\"stage\":");
    sb_str(&e->extra, stage);
    sb_raw(&e->extra, ",\"exception\":");
    sb_str(&e->extra, exc);
}

int hooks_run(const char *stage, sbuf *ran, op_error *e) {
    unsigned bit = 0;
    for (unsigned i = 0; i < 4; i++) {
        if (strcmp(STAGES[i], stage) == 0) bit = 1u << i;
    }
    pthread_mutex_lock(&hook_mu);
    int wanted = hook_cb && (hook_mask & bit);
    double timeout = hook_timeout;
    pthread_mutex_unlock(&hook_mu);
    if (!wanted) return 0;
    hook_call *c = calloc(1, sizeof *c);
    if (!c) {
        hook_fail(e, stage, "", "MemoryError", NPUSNAP_ERR_HOOK_FAILED, "hooks of stage %s not run: out of memory", stage);
        return -1;
    }
    snprintf(c->stage, sizeof c->stage, "%s", stage);
    c->refs = 2;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = npusnap_quiet_thread_create(&t, &attr, hook_thread, c);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(c);
        hook_fail(e, stage, "", "OSError", NPUSNAP_ERR_HOOK_FAILED, "hooks of stage %s not run: pthread_create: %s", stage,
                  strerror(rc));
        return -1;
    }
    pthread_mutex_lock(&hook_mu);
    struct timespec ts = deadline_in(timeout);
    while (c->state != HC_DONE) {
        if (pthread_cond_timedwait(&hook_cv, &hook_mu, &ts) == ETIMEDOUT) break;
    }
    int state = c->state;
    int cb_rc = c->rc;
    char *out = NULL;
    if (state == HC_DONE) {
        out = strdup(c->out);
    } else {
        c->state = HC_CANCELLED; /* a late hook sees this in npusnap_agent_hook_claim */
    }
    hook_call_put(c);
    pthread_mutex_unlock(&hook_mu);
    if (state != HC_DONE) {
        if (state == HC_PENDING) {
            hook_fail(e, stage, "", "TimeoutError", NPUSNAP_ERR_HOOK_TIMEOUT,
                      "the Python hooks of stage %s could not start within %gs: the interpreter's GIL was "
                      "not released (a native extension holding it while it waits for the device?)",
                      stage, timeout);
        } else {
            hook_fail(e, stage, "", "TimeoutError", NPUSNAP_ERR_HOOK_TIMEOUT,
                      "the Python hooks of stage %s did not finish within %gs", stage, timeout);
        }
        return -1; /* the caller records it (ops.c: an event `status` shows) */
    }
    jval v;
    char perr[64];
    int ok = out && json_parse(out, strlen(out), &v, perr, sizeof perr) == 0;
    free(out);
    if (!ok || v.t != J_OBJ) {
        if (ok) json_free(&v);
        hook_fail(e, stage, "", "RuntimeError", NPUSNAP_ERR_HOOK_FAILED,
                  "the hook runner of stage %s returned %d without a result", stage, cb_rc);
        return -1;
    }
    const jval *okv = json_get(&v, "ok");
    if (okv && okv->t == J_BOOL && okv->b) {
        const jval *names = json_get(&v, "ran");
        for (size_t i = 0; names && names->t == J_ARR && i < names->n; i++) {
            if (ran->len) sb_raw(ran, ",");
            sb_json(ran, &names->items[i]);
        }
        json_free(&v);
        return 0;
    }
    const jval *hook = json_get(&v, "hook");
    const jval *err = json_get(&v, "error");
    const char *hs = hook && hook->t == J_STR ? hook->s : "?";
    const char *es = err && err->t == J_STR ? err->s : "?";
    hook_fail(e, stage, hs, es, NPUSNAP_ERR_HOOK_FAILED, "hook '%s' at stage %s failed: %s", hs, stage, es);
    agent_log("%s", e->message);
    json_free(&v);
    return -1;
}

/* A forked child: the parent's hook thread and callers are not in it. */
void hooks_after_fork(void) {
    pthread_mutex_init(&hook_mu, NULL);
    hook_cv_init();
}

void hooks_init(void) { hook_cv_init(); }
