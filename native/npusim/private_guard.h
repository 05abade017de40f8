/* The simulator's own exported functions (npusim*: a helper between its layers, the hooks of its
 * node faults) have no counterpart on a real node. npusnap's binaries may not call them
 * (tests/integration/test_sim_exports.py checks their names statically); this checks every call
 * at run time as well: one from an object named like npusnap's (libnpusnap*, npusnap_plugin*)
 * aborts the process, naming the function and the caller. The including file defines _GNU_SOURCE
 * before its first system header (dladdr). */
#ifndef NPUSIM_PRIVATE_GUARD_H
#define NPUSIM_PRIVATE_GUARD_H
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline void npusim_private_guard(const void *caller, const char *fn) {
    Dl_info info;
    if (!caller || !dladdr(caller, &info) || !info.dli_fname) return;
    const char *base = strrchr(info.dli_fname, '/');
    base = base ? base + 1 : info.dli_fname;
    if (strncmp(base, "libnpusnap", 10) == 0 || strncmp(base, "npusnap_plugin", 14) == 0) {
        fprintf(stderr, "npusim: %s() called from %s: npusnap may use only what a real node offers\n", fn,
                info.dli_fname);
        abort();
    }
}

/* First statement of every npusim* export. */
#define NPUSIM_PRIVATE() npusim_private_guard(__builtin_extract_return_addr(__builtin_return_address(0)), __func__)
#endif
