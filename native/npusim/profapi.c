/* libprofapi.so of the simulated CANN tree: the profiling entry points every CANN library (and
 * torch_npu, at link time) imports (runtime src/dfx/msprof/collector/dvvp/profapi; libruntime.so
 * links it, src/runtime/cmake/runtime.cmake). No profiling session is ever started on the
 * simulator, so the reports are deliberate failures (failures.toml); what needs no session works. */
#include <stdint.h>
#include <stddef.h>
#include <time.h>

#include "errmsg.h"
#include "npusim.h"

/* ProfCannPlugin::ProfRegisterCallback: a NULL handle is refused (-1); a module's callback is kept
 * for the session that never starts. */
typedef int32_t (*ProfCommandHandle)(uint32_t type, void *data, uint32_t len);
#define MAX_MODULES 128
static ProfCommandHandle g_callbacks[MAX_MODULES];
NPUSIM_API int32_t MsprofRegisterCallback(uint32_t moduleId, ProfCommandHandle handle) {
    if (!handle || moduleId >= MAX_MODULES) return -1;
    __atomic_store_n(&g_callbacks[moduleId], handle, __ATOMIC_SEQ_CST);
    return 0;
}

/* The timestamps of profiling records: the host's monotonic clock in ns (prof_api.c reads the
 * CPU's cycle counter; the unit is the record's own). */
NPUSIM_API uint64_t MsprofSysCycleTime(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ProfCannPlugin::ProfReportGetHashId: the id of a string for compact records; 0 when no profiling
 * library took it (none here), as the real one answers without libmsprofiler. */
NPUSIM_API uint64_t MsprofGetHashId(const char *hashInfo, size_t length) {
    (void)hashInfo;
    (void)length;
    return 0;
}

#define NPUSIM_FAILURES_PROFAPI
#include "failures.inc"
