/* The simulated device's kernel binary format.
 *
 * On a real Ascend device a kernel is AI-core code in an ELF that aclrtBinaryLoadFromFile loads
 * and aclrtBinaryGetFunction names; aclrtLaunchKernel(funcHandle, blockDim, argsData, argsSize,
 * stream) queues it on a stream (runtime include/external/acl/acl_rt.h). The simulated device's
 * "AI core" is an engine thread of the runtime, so its kernel binary is a shared object whose
 * exported kernels have the signature below. argsData is copied at launch, as the real runtime
 * copies kernel args into its args pool, so the caller may reuse its buffer at once.
 *
 * This header is the one contract between the runtime (which loads binaries and runs queued
 * kernels) and the operator library (which ships the kernels and launches them). */
#ifndef NPUSIM_KERNEL_H
#define NPUSIM_KERNEL_H
#include <stddef.h>
#include <stdint.h>

typedef struct npusim_kernel_ctx npusim_kernel_ctx;

struct npusim_kernel_ctx {
    /* Host view of len bytes of device memory at dev_addr, or NULL if that range is not
     * allocated and mapped (the kernel then fails, as an AI core faults on a bad address). */
    void *(*dev_ptr)(const npusim_kernel_ctx *ctx, uint64_t dev_addr, size_t len);
    void *priv;         /* the runtime's own */
    uint32_t block_dim; /* as launched */
    int32_t device_id;  /* user device id of the stream */
};

/* 0 on success; anything else is an AI-core exception reported on the stream (the next
 * synchronize of that stream returns an error). */
typedef int (*npusim_kernel_fn)(const npusim_kernel_ctx *ctx, const void *args, size_t args_size);

#endif
