/* The run's state, the plugin's configuration (criu-plugin.conf, the environment), its exit-code
 * texts, and what it reads of a task in /proc: its pid in its own namespace, its state, its CANN
 * library, and the agent sockets it may have. */
#define _GNU_SOURCE
#include "plugin.h"

/* The run's state (plugin.h): defined down here, beside what reads the configuration, so that the
 * plugin's files read it without a reference back up into the hooks' file. */
struct plugin_state P;
struct job_state J = {.member = -1, .fd = -1};

/* "exit 7 (device: a CANN snapshot call failed)"; one buffer per thread, used at once. */
const char *exit_meaning(int code) {
    static __thread char buf[160];
    const char *summary = npusnap_exit_summary(code);
    if (!summary || code == NPUSNAP_EXIT_OK) {
        code = NPUSNAP_EXIT_INTERNAL;
        summary = npusnap_exit_summary(code);
    }
    snprintf(buf, sizeof buf, "exit %d (%s)", code, summary);
    return buf;
}


static double env_double(const char *name, double dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    double d = strtod(v, &end);
    return (*end || d <= 0) ? dflt : d;
}

const char *config_path(void) {
    const char *p = getenv("NPUSNAP_PLUGIN_CONFIG");
    return (p && *p) ? p : "/etc/npusnap/criu-plugin.conf";
}

/* /etc/npusnap/criu-plugin.conf (NPUSNAP_PLUGIN_CONFIG): KEY=VALUE lines, '#' comments. A file
 * because container engines scrub the environment they hand to runc and CRIU. The environment
 * (NPUSNAP_PLUGIN_LEASE_S, NPUSNAP_PLUGIN_REQUIRE_AGENT, NPUSNAP_PLUGIN_LOG) wins where set. */
void load_config(void) {
    P.lease_s = 60.0;
    P.require_agent = 0;
    P.job_barrier_s = 600.0;
    snprintf(P.log_path, sizeof P.log_path, "/var/log/npusnap/criu-plugin.log");
    FILE *f = fopen(config_path(), "re");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f)) {
            char *k = line;
            while (*k == ' ' || *k == '\t') k++;
            if (*k == '#' || *k == '\n' || !*k) continue;
            char *eq = strchr(k, '=');
            if (!eq) continue;
            *eq = 0;
            char *v = eq + 1;
            v[strcspn(v, "\r\n")] = 0;
            char *kend = eq;
            while (kend > k && (kend[-1] == ' ' || kend[-1] == '\t')) *--kend = 0;
            while (*v == ' ' || *v == '\t') v++;
            if (!strcmp(k, "lease_s") && atof(v) > 0) P.lease_s = atof(v);
            else if (!strcmp(k, "require_agent")) P.require_agent = atoi(v) != 0;
            else if (!strcmp(k, "log")) snprintf(P.log_path, sizeof P.log_path, "%s", v);
            else if (!strcmp(k, "job_barrier_s") && atof(v) > 0) P.job_barrier_s = atof(v);
            else if (!strcmp(k, "device_memory") && npusnap_devmem_mode_valid(v))
                snprintf(P.device_memory, sizeof P.device_memory, "%s", v);
            else
                LOGW("%s: unknown key or value %s=%s (known: lease_s, require_agent, log, job_barrier_s, "
                     "device_memory=one of " NPUSNAP_DEVMEM_MODES_TEXT ")\n", config_path(), k, v);
        }
        fclose(f);
    }
    P.lease_s = env_double("NPUSNAP_PLUGIN_LEASE_S", P.lease_s);
    const char *ra = getenv("NPUSNAP_PLUGIN_REQUIRE_AGENT");
    if (ra && *ra) P.require_agent = atoi(ra) != 0;
    const char *lg = getenv("NPUSNAP_PLUGIN_LOG");
    if (lg && *lg) snprintf(P.log_path, sizeof P.log_path, "%s", lg);
}

/* ---- small helpers ----------------------------------------------------------------------- */

static int read_file(const char *path, char *buf, size_t len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t got = 0;
    while (got + 1 < len) {
        ssize_t n = read(fd, buf + got, len - 1 - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    buf[got] = 0;
    return (int)got;
}

/* The innermost pid of a host pid (last field of NSpid), or -1. */
int ns_pid(int pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    if (read_file(path, buf, sizeof buf) < 0) return -1;
    char *l = strstr(buf, "\nNSpid:");
    if (!l) return pid;
    l += 7;
    char *end = strchr(l, '\n');
    if (end) *end = 0;
    int last = -1;
    for (char *tok = strtok(l, " \t"); tok; tok = strtok(NULL, " \t")) last = atoi(tok);
    return last;
}

int status_field(int pid, const char *field) {
    char path[64], buf[4096], key[64];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    if (read_file(path, buf, sizeof buf) < 0) return -1;
    snprintf(key, sizeof key, "\n%s:", field);
    char *l = strstr(buf, key);
    return l ? atoi(l + strlen(key)) : -1;
}

/* 'R', 'S', 'Z', 't', ... of a pid; 0 if it is gone. */
char proc_state(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    if (read_file(path, buf, sizeof buf) <= 0) return 0;
    char *rp = strrchr(buf, ')');
    return (rp && rp[1] == ' ') ? rp[2] : 0;
}

/* Does the task have a CANN runtime library mapped? (Then it needs an agent to be dumped.) */
int maps_cann(int pid, char *lib, size_t liblen) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/maps", pid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    char line[4096];
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        char *slash = strrchr(line, '/');
        if (!slash) continue;
        if (!strncmp(slash, "/libacl_rt.so", 13) || !strncmp(slash, "/libascendcl.so", 15) ||
            !strncmp(slash, "/libruntime.so", 14)) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            char *p = strchr(line, '/');
            snprintf(lib, liblen, "%s", p ? p : slash);
            found = 1;
            break;
        }
    }
    fclose(f);
    return found;
}

/* The agent's listening socket for a task, as bound inside its mount namespace: a listening
 * AF_UNIX path ".../npusnap*<dir>/<nspid>.sock" (or in the target's NPUSNAP_RUNTIME_DIR) in the
 * task's network namespace (/proc/PID/net/unix). Returns the number of candidates written (at most max). */
/* The target's NPUSNAP_RUNTIME_DIR (an agent started with it binds its socket there), or "". */
static void target_runtime_dir(int pid, char *out, size_t len) {
    char path[64];
    static char env[1 << 16];
    out[0] = 0;
    snprintf(path, sizeof path, "/proc/%d/environ", pid);
    int n = read_file(path, env, sizeof env);
    for (int i = 0; i < n; i += (int)strlen(env + i) + 1) {
        size_t kl = strlen(NPUSNAP_AGENT_SOCKET_ENV_DIR);
        if (!strncmp(env + i, NPUSNAP_AGENT_SOCKET_ENV_DIR, kl) && env[i + kl] == '=') {
            snprintf(out, len, "%s", env + i + kl + 1);
            size_t l = strlen(out);
            while (l > 1 && out[l - 1] == '/') out[--l] = 0;
        }
    }
}

/* Whether the directory `dir` (len bytes, in the task's mount namespace) may hold the task's agent
 * socket: it belongs to the task's user or to root. Any user can listen as ".../npusnap-x/<pid>.sock"
 * in a directory of their own: such a socket is never the task's agent, and taking it for one
 * would fail the checkpoint of a task that has none (the paths.py may_serve rule). */
static int dir_may_serve(int pid, const char *dir, size_t len) {
    char path[600], proc[64];
    struct stat dst, pst;
    snprintf(path, sizeof path, "/proc/%d/root%.*s", pid, (int)len, dir);
    snprintf(proc, sizeof proc, "/proc/%d", pid);
    if (stat(path, &dst) != 0 || stat(proc, &pst) != 0) return 0;
    return dst.st_uid == 0 || dst.st_uid == pst.st_uid;
}

int agent_sockets(int pid, int nspid, char out[][256], int max) {
    char path[64], want[32], rtdir[256];
    target_runtime_dir(pid, rtdir, sizeof rtdir);
    snprintf(path, sizeof path, "/proc/%d/net/unix", pid);
    snprintf(want, sizeof want, "/" NPUSNAP_AGENT_SOCKET_NAME, nspid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    char line[1024];
    int n = 0;
    if (!fgets(line, sizeof line, f)) { /* header */
        fclose(f);
        return 0;
    }
    while (n < max && fgets(line, sizeof line, f)) {
        char num[32], sp[256] = "";
        unsigned long refc, proto, flags, type, st, ino;
        if (sscanf(line, "%31s %lx %lx %lx %lx %lx %lu %255s", num, &refc, &proto, &flags, &type, &st, &ino, sp) < 8)
            continue;
        if (sp[0] != '/' || !(flags & 0x10000)) continue;
        size_t l = strlen(sp), wl = strlen(want);
        if (l <= wl || strcmp(sp + l - wl, want)) continue;
        /* the parent directory's name starts with "npusnap" (the contract's agent socket rules) */
        char *dir_end = sp + l - wl;
        char *dir_start = dir_end;
        while (dir_start > sp && dir_start[-1] != '/') dir_start--;
        int in_rtdir = rtdir[0] && (size_t)(dir_end - sp) == strlen(rtdir) && !strncmp(sp, rtdir, strlen(rtdir));
        if (strncmp(dir_start, NPUSNAP_AGENT_SOCKET_DIR_PREFIX, strlen(NPUSNAP_AGENT_SOCKET_DIR_PREFIX)) && !in_rtdir)
            continue;
        if (!dir_may_serve(pid, sp, (size_t)(dir_end - sp))) continue;
        snprintf(out[n++], 256, "%s", sp);
    }
    fclose(f);
    return n;
}
