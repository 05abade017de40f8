/* The snapshot calls into the CANN runtime that this process already loaded.
 *
 * The library is found among the loaded objects and opened with RTLD_NOLOAD: loading a second copy
 * would give a second, empty runtime that knows nothing about this process's devices.
 * Calling convention: every snapshot function is called as f(getpid(), NULL). CANN 9.1+
 * declares (int pid, void *args); 8.5/9.0 declare f(void), and on the x86-64 and AArch64 C ABIs
 * extra register arguments to such a function are simply ignored, so one call serves both
 * (npusnap_cli/acl.py does the same through ctypes).
 */
#include "agent_int.h"

#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int (*snap_fn)(int, void *);
typedef int (*state_fn)(int *);
typedef int (*version_fn)(char *, char *);
typedef int (*register_fn)(int, acl_callback, void *);

/* aclrtSnapShotBackupArgs / aclrtSnapShotRestoreArgs (CANN builds with the driver-backed flow). */
typedef struct npusnap_snap_args snap_args;

/* The device-memory part, when linked in, knows the devices the job opened (it interposes
 * aclrtSetDevice/aclrtResetDevice). */

/* "libacl_rt.so.1" -> matches "libacl_rt.so" */
static int lib_matches(const char *path, const char *name) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t n = strlen(name);
    if (strncmp(base, name, n) != 0) return 0;
    const char *rest = base + n;
    if (*rest == 0) return 1;
    if (*rest != '.') return 0;
    for (rest++; *rest; rest++) {
        if ((*rest < '0' || *rest > '9') && *rest != '.') return 0;
    }
    return 1;
}

struct lib_search {
    const char *name;
    char *out;
    size_t outlen;
    int found;
};

static int find_loaded(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct lib_search *q = data;
    if (!info->dlpi_name || !info->dlpi_name[0] || !lib_matches(info->dlpi_name, q->name)) return 0;
    snprintf(q->out, q->outlen, "%s", info->dlpi_name);
    q->found = 1;
    return 1;
}

/* The path the dynamic loader loaded `name` from. Asked of the loader itself, not of
 * /proc/self/maps: a process that chrooted (or runs without /proc) still finds its runtime, and
 * RTLD_NOLOAD matches that path against the loaded objects without touching the file system. */
static int mapped_path(const char *name, char *out, size_t outlen) {
    struct lib_search q = {name, out, outlen, 0};
    dl_iterate_phdr(find_loaded, &q);
    return q.found ? 0 : -1;
}

static void read_version(acl_rt *rt) {
    char real[PATH_MAX];
    rt->version[0] = 0;
    if (!realpath(rt->path, real)) return;
    char *slash = strrchr(real, '/');
    if (!slash) return;
    *slash = 0; /* .../lib64 */
    char *parent = strrchr(real, '/');
    if (!parent) return;
    *parent = 0; /* home, or <home>/<arch>-linux */
    const char *leaf = parent + 1;
    size_t ll = strlen(leaf);
    if (ll > 6 && strcmp(leaf + ll - 6, "-linux") == 0) {
        char *up = strrchr(real, '/');
        if (up) *up = 0;
    }
    char vi[PATH_MAX + 64];
    snprintf(vi, sizeof vi, "%s/share/info/runtime/version.info", real);
    FILE *f = fopen(vi, "re");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = 0;
        char *key = line, *value = eq + 1;
        while (*value == ' ') value++;
        if (strcasecmp(key, "version") == 0 && *value) snprintf(rt->version, sizeof rt->version, "%s", value);
    }
    fclose(f);
}

int acl_find(acl_rt *rt) {
    static const char *names[] = {"libacl_rt.so", "libascendcl.so"};
    memset(rt, 0, sizeof *rt);
    for (size_t i = 0; i < 2; i++) {
        if (mapped_path(names[i], rt->path, sizeof rt->path) == 0) {
            rt->lib = dlopen(rt->path, RTLD_NOW | RTLD_NOLOAD);
            if (rt->lib) break;
        }
    }
    if (!rt->lib) return -1;
    char rpath[512];
    if (mapped_path("libruntime.so", rpath, sizeof rpath) == 0) {
        rt->runtime = dlopen(rpath, RTLD_NOW | RTLD_NOLOAD);
    }
    read_version(rt);
    if (!rt->version[0]) {
        /* No version.info: ask the library (CANN 8+), as npusnap_cli/acl.py does. */
        version_fn fn = (version_fn)dlsym(rt->lib, "aclsysGetVersionStr");
        char buf[128] = "";
        if (fn && fn((char *)"runtime", buf) == 0 && buf[0]) {
            buf[sizeof buf - 1] = 0;
            snprintf(rt->version, sizeof rt->version, "%s", buf);
        }
    }
    return 0;
}

int acl_call(acl_rt *rt, const char *what) { return acl_call_flags(rt, what, -1); }

int acl_call_flags(acl_rt *rt, const char *what, int flags) {
    char name[64];
    snprintf(name, sizeof name, "aclrtSnapShotProcess%s", what);
    snap_fn fn = (snap_fn)dlsym(rt->lib, name);
    if (!fn) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* this build has no snapshot API */
    if (flags < 0) return fn((int)getpid(), NULL);
    snap_args args;
    memset(&args, 0, sizeof args);
    args.flags = (uint32_t)flags;
    return fn((int)getpid(), &args);
}

/* "9.2.0" -> 1 when at least DRIVER_FLOW_MIN_MAJOR.DRIVER_FLOW_MIN_MINOR (acl.py's
 * DRIVER_FLOW_MIN_VERSION); NPUSNAP_DRIVER_FLOW=0 turns the driver-backed flow off. */
int acl_may_have_driver_flow(const acl_rt *rt) {
    const char *env = getenv("NPUSNAP_DRIVER_FLOW");
    if (env && strcmp(env, "0") == 0) return 0;
    int nums[2] = {0, 0}, n = 0;
    const char *p = rt->version;
    while (*p && n < 2) {
        if (*p >= '0' && *p <= '9') {
            char *end;
            nums[n++] = (int)strtol(p, &end, 10);
            p = end;
        } else {
            p++;
        }
    }
    if (n == 0) return 0;
    if (nums[0] != DRIVER_FLOW_MIN_MAJOR) return nums[0] > DRIVER_FLOW_MIN_MAJOR;
    return nums[1] >= DRIVER_FLOW_MIN_MINOR;
}

int acl_register_callback(acl_rt *rt, int stage, acl_callback cb) {
    register_fn fn = (register_fn)dlsym(rt->lib, "aclrtSnapShotCallbackRegister");
    if (!fn) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* 8.5 has no snapshot callbacks (CANN 9.0+) */
    return fn(stage, cb, NULL);
}

int acl_state(acl_rt *rt, int *code) {
    *code = 0;
    if (!rt || !rt->runtime) return ST_UNKNOWN;
    state_fn fn = (state_fn)dlsym(rt->runtime, "rtSnapShotProcessGetState");
    if (!fn) return ST_UNKNOWN;
    int st = -1;
    int rc = fn(&st);
    if (rc != 0) {
        *code = rc;
        return ST_UNKNOWN;
    }
    return st;
}


/* Names from the contract's table (native/contract/npusnap.toml), which npusnap_cli/acl.py uses
 * to explain an error it receives. */
const char *acl_error_name(int code) { return npusnap_acl_error_name(code); }

const char *state_name(int st) { return npusnap_snapshot_state_name(st); }
