/* Wire format between the simulated runtime (C) and the device daemon (npusnap_cli/sim/daemon.py).
 * Keep in sync with npusnap_cli/sim/wire.py. Little-endian, fixed-size headers and small payloads.
 * Device memory never crosses the socket: each allocation is a memfd that the daemon owns, and
 * NPUSIM_OP_MAP passes it (SCM_RIGHTS) to the runtime, which copies to and from a mapping of it. */
#ifndef NPUSIM_WIRE_H
#define NPUSIM_WIRE_H
#include <stdint.h>

enum npusim_op {
    NPUSIM_OP_CLAIM = 1,    /* dev, b                  -> opens the device for the caller (shared) */
    NPUSIM_OP_RELEASE = 2,  /* dev                     -> frees caller's memory on dev, releases it */
    NPUSIM_OP_ALLOC = 3,    /* dev, n                  -> value = device address */
    NPUSIM_OP_ALLOC_AT = 4, /* dev, a, n               -> recreate an allocation at address a */
    NPUSIM_OP_FREE = 5,     /* a                       */
    /* 6, 7, 8: the byte-streaming WRITE, READ and COPY of earlier versions; answered EOPNOTSUPP */
    NPUSIM_OP_STATUS = 9,   /*                         -> JSON payload */
    NPUSIM_OP_SHUTDOWN = 10,
    NPUSIM_OP_HAS = 11,     /* dev, a, n               -> 0 if the caller owns exactly [a, a+n) on dev */
    NPUSIM_OP_CONFIG = 12,  /*                         -> value = NPUSIM_CONFIG_* bits */
    NPUSIM_OP_MAP = 13,     /* a, n                    -> the memfd of the caller's allocation holding
                             *                            [a, a+n) as SCM_RIGHTS on the answer's header,
                             *                            payload struct npusim_map */
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
struct npusim_map { /* NPUSIM_OP_MAP's payload, 24 bytes */
    uint64_t base;    /* the allocation's device address: offset 0 of the memfd */
    uint64_t size;    /* its size in bytes (the memfd's size) */
    double link_mbps; /* the daemon's --bandwidth-mbps (MB/s) that copies are paced to; 0: none */
};
#pragma pack(pop)

#endif
