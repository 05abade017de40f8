/* Wire format between the simulated runtime (C) and the device daemon (npusnap_cli/sim/daemon.py).
 * Keep in sync with npusnap_cli/sim/wire.py. Little-endian, fixed-size headers, raw payloads so that
 * GiB-sized copies go straight between the socket and the destination buffer. */
#ifndef NPUSIM_WIRE_H
#define NPUSIM_WIRE_H
#include <stdint.h>

enum npusim_op {
    NPUSIM_OP_CLAIM = 1,    /* dev, b                  -> opens the device for the caller (shared) */
    NPUSIM_OP_RELEASE = 2,  /* dev                     -> frees caller's memory on dev, releases it */
    NPUSIM_OP_ALLOC = 3,    /* dev, n                  -> value = device address */
    NPUSIM_OP_ALLOC_AT = 4, /* dev, a, n               -> recreate an allocation at address a */
    NPUSIM_OP_FREE = 5,     /* a                       */
    NPUSIM_OP_WRITE = 6,    /* a, n, payload n bytes   -> host to device */
    NPUSIM_OP_READ = 7,     /* a, n                    -> payload n bytes: device to host */
    NPUSIM_OP_COPY = 8,     /* a = dst, b = src, n     -> device to device */
    NPUSIM_OP_STATUS = 9,   /*                         -> JSON payload */
    NPUSIM_OP_SHUTDOWN = 10,
    NPUSIM_OP_HAS = 11,     /* dev, a, n               -> 0 if the caller owns exactly [a, a+n) on dev */
    NPUSIM_OP_CONFIG = 12,  /*                         -> value = NPUSIM_CONFIG_* bits */
};

#define NPUSIM_CLAIM_EXCLUSIVE 1u       /* CLAIM's b: no other live process on the device (Restore) */
#define NPUSIM_CONFIG_KEEP_CONTENTS 1u
#define NPUSIM_CONFIG_DRIVER_SNAPSHOT 2u /* the driver feature of the driver-backed flow; version << 16 */ /* Restore brings back allocation contents (not CANN's behaviour) */
#define NPUSIM_ALLOC_POISON 1u         /* ALLOC_AT's b: fill the allocation with the poison pattern */
#define NPUSIM_POISON_WORD 0xDEADBEEFu /* little-endian 32-bit words */

#pragma pack(push, 1)
struct npusim_req {  /* 32 bytes */
    uint32_t op;
    int32_t dev;
    uint64_t a;
    uint64_t b;
    uint64_t n;
};
struct npusim_resp { /* 24 bytes; status is 0 or a negative errno */
    int32_t status;
    uint32_t pad;
    uint64_t value;
    uint64_t payload_len;
};
#pragma pack(pop)

#endif
