/* The real definitions behind the agent's wrappers (devmem_hooks.c: the driver's and the runtime's
 * names; hccl.c: HCCL's). Both live in libnpusnap_agent.so, so RTLD_NEXT means "after the agent"
 * for each. */
#ifndef NPUSNAP_AGENT_REALSYM_H
#define NPUSNAP_AGENT_REALSYM_H

#include <stddef.h>

typedef void *(*dlsym_fn)(void *, const char *);

/* glibc's dlsym, past the agent's own interposer (resolved once). NULL if glibc has none. */
dlsym_fn npusnap_real_dlsym(void);

/* 1 if `p` lies in the agent's own library (libnpusnap_agent.so): a definition there of a CANN or
 * HCCL name is one of the agent's wrappers, never the real function. */
int npusnap_is_agents(void *p);

/* `name`'s definition after the agent (programs linked against the library), else the one
 * exported by the first of `libs` mapped in the process (matched by file name prefix, opened
 * with RTLD_NOLOAD: never a second copy); never a definition `is_wrapper` says is the agent's. */
void *npusnap_next_definition(const char *name, const char *const *libs, size_t nlibs, int (*is_wrapper)(void *));

#endif
