/*
 * libnpusnap_attach.so — the payload that `npusnap attach` makes a running Python (3.9–3.13)
 * load with dlopen (through gdb, see gdb_inject.py next to this file).
 *
 * Why it looks like this: the thread that gdb borrows to call dlopen() was stopped at an
 * arbitrary (if carefully chosen) point, so running Python on it could deadlock on the GIL or
 * the allocator. The constructor therefore does the one thing that is safe there: it starts a
 * new, detached thread and returns at once. That thread takes the GIL the proper way
 * (PyGILState_Ensure) and runs a small bootstrap file that the CLI wrote next to this copy of
 * the payload (found through dladdr), which starts the npusnap agent and writes a status file.
 *
 * The Python C API is resolved at run time with dlsym, so one payload serves every CPython
 * version, whether libpython is a shared library or linked into the executable.
 *
 * Each attach uses its own copy of this file (a fresh path), because dlopen() of a path that is
 * already loaded returns the old handle without running the constructor again.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BOOTSTRAP_NAME "bootstrap.py"
#define STATUS_NAME "status.json"

typedef int (*gil_ensure_fn)(void);
typedef void (*gil_release_fn)(int);
typedef int (*run_string_fn)(const char *);
typedef int (*is_initialized_fn)(void);

static char payload_dir[512];
/*
 * pthread_self() of the main thread when gdb borrowed the main thread (always so for a
 * single-threaded target), else 0. On Python < 3.13 `threading`, if the application never
 * imported it, takes the thread that first imports it for the main thread; the bootstrap
 * uses this to put that right.
 */
static unsigned long main_ident;

/* Write {"ok": false, "stage": "payload", "error": msg} unless the bootstrap already reported. */
static void report_failure(const char *msg) {
    char path[600], tmp[620];
    snprintf(path, sizeof path, "%s/%s", payload_dir, STATUS_NAME);
    if (access(path, F_OK) == 0) {
        return;
    }
    snprintf(tmp, sizeof tmp, "%s/.status.payload.tmp", payload_dir);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        return;
    }
    char buf[1024];
    /* msg is always one of our fixed strings or a symbol name: nothing to escape. */
    int n = snprintf(buf, sizeof buf,
                     "{\"ok\": false, \"stage\": \"payload\", \"pid\": %d, \"error\": \"%s\"}\n",
                     (int)getpid(), msg);
    if (n > 0 && write(fd, buf, (size_t)n) == n) {
        close(fd);
        rename(tmp, path);
        return;
    }
    close(fd);
    unlink(tmp);
}

/* dl_iterate_phdr callback: remember the first loaded object whose name contains "libpython". */
static int find_libpython(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    if (info->dlpi_name && strstr(info->dlpi_name, "libpython")) {
        snprintf((char *)data, 512, "%s", info->dlpi_name);
        return 1;
    }
    return 0;
}

/*
 * Look a Python C API symbol up in the global scope first (python executable or a libpython
 * it links), then in a libpython that was loaded RTLD_LOCAL (an application embedding Python).
 */
static void *py_symbol(const char *name) {
    void *sym = dlsym(RTLD_DEFAULT, name);
    if (sym) {
        return sym;
    }
    char lib[512] = "";
    dl_iterate_phdr(find_libpython, lib);
    if (!lib[0]) {
        return NULL;
    }
    void *handle = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
    if (!handle) {
        return NULL;
    }
    sym = dlsym(handle, name);
    dlclose(handle); /* RTLD_NOLOAD took a reference; the library stays loaded by its owner. */
    return sym;
}

static int path_is_plain(const char *p) {
    for (; *p; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '/' ||
              c == '.' || c == '_' || c == '-')) {
            return 0;
        }
    }
    return 1;
}

static void *attach_thread(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "npusnap-attach");

    is_initialized_fn is_initialized = (is_initialized_fn)py_symbol("Py_IsInitialized");
    gil_ensure_fn ensure = (gil_ensure_fn)py_symbol("PyGILState_Ensure");
    gil_release_fn release = (gil_release_fn)py_symbol("PyGILState_Release");
    run_string_fn run = (run_string_fn)py_symbol("PyRun_SimpleString");
    if (!is_initialized || !ensure || !release || !run) {
        report_failure("the Python C API (PyGILState_Ensure, PyRun_SimpleString) was not found in the target");
        return NULL;
    }
    if (!is_initialized()) {
        report_failure("the Python interpreter in the target is not initialized (starting up or shutting down)");
        return NULL;
    }
    if (!path_is_plain(payload_dir)) {
        report_failure("the payload directory path has characters the bootstrap loader does not accept");
        return NULL;
    }

    /* The CLI removes the bootstrap when it gives up waiting: then do nothing at all. */
    char bootstrap[600];
    snprintf(bootstrap, sizeof bootstrap, "%s/" BOOTSTRAP_NAME, payload_dir);
    if (access(bootstrap, R_OK) != 0) {
        return NULL;
    }

    int gil = ensure();
    /* From here the job's Python threads wait: the bootstrap reports how long it held the GIL
     * from this moment (CLOCK_MONOTONIC is Python's time.monotonic()), its compiling and
     * imports included. */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    /* exec() with a fresh globals dict: nothing leaks into the application's __main__. */
    char code[2048];
    snprintf(code, sizeof code,
             "exec(compile(__import__('io').open_code('%s/" BOOTSTRAP_NAME "').read(), '%s/" BOOTSTRAP_NAME
             "', 'exec'), {'__name__': '__npusnap_attach__', '__npusnap_dir__': '%s', "
             "'__npusnap_main_ident__': %lu, '__npusnap_gil_t0__': %ld.%09ld})",
             payload_dir, payload_dir, payload_dir, main_ident, (long)now.tv_sec, now.tv_nsec);
    int rc = run(code);
    release(gil);
    if (rc != 0) {
        report_failure("the bootstrap raised before it could report (see the target's stderr)");
    }
    return NULL;
}

__attribute__((constructor)) static void npusnap_attach_init(void) {
    Dl_info info;
    if (!dladdr((void *)npusnap_attach_init, &info) || !info.dli_fname) {
        return;
    }
    snprintf(payload_dir, sizeof payload_dir, "%s", info.dli_fname);
    char *slash = strrchr(payload_dir, '/');
    if (!slash) {
        return;
    }
    *slash = '\0';
    if ((pid_t)syscall(SYS_gettid) == getpid()) {
        main_ident = (unsigned long)pthread_self();
    }

    /*
     * Block every asynchronous signal in the new thread (and in the agent thread it starts,
     * which inherits the mask): signals keep going to the application's own threads.
     */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t tid;
    int err = pthread_create(&tid, &attr, attach_thread, NULL);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        report_failure("pthread_create failed in the target");
    }
}
