/* See realsym.h. */
#define _GNU_SOURCE
#include "realsym.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

static dlsym_fn g_real_dlsym;

dlsym_fn npusnap_real_dlsym(void) {
    dlsym_fn f = __atomic_load_n(&g_real_dlsym, __ATOMIC_ACQUIRE);
    if (f) return f;
    f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!f) f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&g_real_dlsym, f, __ATOMIC_RELEASE);
    return f;
}

int npusnap_is_agents(void *p) {
    Dl_info mine, theirs;
    if (!p || !dladdr((const void *)npusnap_is_agents, &mine) || !dladdr(p, &theirs)) return 0;
    return mine.dli_fbase == theirs.dli_fbase;
}

struct libfind {
    const char *want;
    char path[1024];
};

static int find_lib(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct libfind *lf = data;
    const char *name = info->dlpi_name;
    if (!name || !*name || lf->path[0]) return 0;
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    if (!strncmp(base, lf->want, strlen(lf->want))) snprintf(lf->path, sizeof lf->path, "%s", name);
    return 0;
}

void *npusnap_next_definition(const char *name, const char *const *libs, size_t nlibs, int (*is_wrapper)(void *)) {
    dlsym_fn ds = npusnap_real_dlsym();
    if (!ds) return NULL;
    void *p = ds(RTLD_NEXT, name);
    if (p && !is_wrapper(p)) return p;
    for (size_t k = 0; k < nlibs; k++) {
        struct libfind lf = {libs[k], ""};
        dl_iterate_phdr(find_lib, &lf);
        if (!lf.path[0]) continue;
        void *h = dlopen(lf.path, RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        void *q = ds(h, name);
        dlclose(h); /* NOLOAD handle: only drops the reference it took */
        if (q && !is_wrapper(q)) return q;
    }
    return NULL;
}
