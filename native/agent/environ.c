/* getenv("LD_PRELOAD") as the program would see it without npusnap.
 *
 * `npusnap run` preloads libnpusnap_agent.so through LD_PRELOAD, so that every process of the job,
 * children exec'ed by any means included, gets the agent. A library that asks getenv whether
 * something is preloaded would then decide differently under npusnap: torch_npu's FunctionLoader
 * prints "LD_PRELOAD detected, FunctionLoader prefers RTLD_DEFAULT for symbol resolution" on
 * stderr and switches its lookups to RTLD_DEFAULT (both lookups reach the agent's dlsym() anyway).
 * This getenv answers LD_PRELOAD without the agent's own entries -- NULL when there is nothing
 * else -- and every other name as the C library does. The environment itself is untouched:
 * `environ`, /proc/PID/environ, Python's os.environ and every exec'ed child still carry the
 * agent. NPUSNAP_AGENT_SHOW_PRELOAD=1 turns it off.
 *
 * It reads `environ` itself (as getenv does) and calls nothing that could call getenv: it runs
 * before the agent's constructors and inside the dynamic loader's callers. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>

#include "npusnap/contract.h"

#define API __attribute__((visibility("default")))

extern char **environ;

static const char *lookup(const char *name) {
    size_t n = strlen(name);
    if (!environ || !n || strchr(name, '=')) return NULL;
    for (char **e = environ; *e; e++)
        if (!strncmp(*e, name, n) && (*e)[n] == '=') return *e + n + 1;
    return NULL;
}

/* One LD_PRELOAD entry (separated by ':' or ' ', as ld.so reads the list) names the agent. */
static int is_agent(const char *p, size_t len) {
    static const char base[] = NPUSNAP_AGENT_LIBRARY;
    size_t b = sizeof base - 1;
    return len >= b && !memcmp(p + len - b, base, b) && (len == b || p[len - b - 1] == '/');
}

/* The value without the agent's entries, kept per value seen (the environment changes rarely). */
static const char *filtered(const char *value) {
    static __thread const char *t_seen; /* per thread: no lock, nothing shared to race on */
    static __thread char *t_out;
    if (t_seen == value) return t_out;
    size_t len = strlen(value);
    char *out = malloc(len + 1);
    if (!out) return value; /* no memory: the truth, unfiltered */
    size_t o = 0;
    for (const char *p = value; *p;) {
        size_t k = strcspn(p, ": ");
        if (k && !is_agent(p, k)) {
            if (o) out[o++] = ':';
            memcpy(out + o, p, k);
            o += k;
        }
        p += k;
        while (*p == ':' || *p == ' ') p++;
    }
    out[o] = 0;
    free(t_out);
    t_out = o ? out : NULL;
    if (!o) free(out);
    t_seen = value;
    return t_out;
}

API char *getenv(const char *name) {
    const char *v = lookup(name);
    if (v && name[0] == 'L' && !strcmp(name, "LD_PRELOAD")) {
        const char *show = lookup(NPUSNAP_AGENT_SHOW_PRELOAD_ENV);
        if (!show || strcmp(show, "1") != 0) v = filtered(v);
    }
    return (char *)v;
}

API char *secure_getenv(const char *name) {
    /* glibc: NULL in a set-uid/set-gid program (AT_SECURE), where the agent is not preloaded */
    return getauxval(AT_SECURE) ? NULL : getenv(name);
}
