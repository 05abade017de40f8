/* Kernels for the simulated device (the binary format of native/npusim/npusim_kernel.h), used by
 * tests/integration/test_sim_compute.py: loaded with aclrtBinaryLoadFromFile, launched with
 * aclrtLaunchKernel. Each reaches device memory only through ctx->dev_ptr. */
#include <stdint.h>
#include <time.h>

#include "npusim_kernel.h"

#define EXPORT __attribute__((visibility("default")))

/* Fills `chunks` chunks of `chunk` bytes at addr with the 32-bit word `value`, sleeping delay_ms
 * after each: a long kernel whose progress a copy can observe. */
struct fill_args {
    uint64_t addr;
    uint64_t chunk;
    uint32_t chunks;
    uint32_t value;
    uint32_t delay_ms;
    uint32_t pad;
};

EXPORT int npusim_slow_fill(const npusim_kernel_ctx *ctx, const void *args, size_t size) {
    const struct fill_args *a = args;
    if (size != sizeof *a) return 1;
    uint32_t *p = ctx->dev_ptr(ctx, a->addr, a->chunk * a->chunks);
    if (!p) return 2;
    for (uint32_t c = 0; c < a->chunks; c++) {
        uint32_t *q = p + c * (a->chunk / 4);
        for (uint64_t i = 0; i < a->chunk / 4; i++) q[i] = a->value;
        struct timespec ts = {a->delay_ms / 1000, (long)(a->delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* Adds `add` to each of `count` 32-bit words at addr. */
struct add_args {
    uint64_t addr;
    uint64_t count;
    uint32_t add;
    uint32_t pad;
};

EXPORT int npusim_add(const npusim_kernel_ctx *ctx, const void *args, size_t size) {
    const struct add_args *a = args;
    if (size != sizeof *a || ctx->block_dim == 0) return 1;
    uint32_t *p = ctx->dev_ptr(ctx, a->addr, a->count * 4);
    if (!p) return 2;
    for (uint64_t i = 0; i < a->count; i++) p[i] += a->add;
    return 0;
}

/* An AI-core exception. */
EXPORT int npusim_fail(const npusim_kernel_ctx *ctx, const void *args, size_t size) {
    (void)ctx, (void)args, (void)size;
    return 7;
}
