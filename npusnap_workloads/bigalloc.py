"""Holds a large device allocation (and some host memory) for dump/restore benchmarks.

Fills ``--device-mib`` of device memory and ``--host-mib`` of host memory with a seeded pattern,
prints ``ready``, then every ``--interval`` seconds prints ``tick N checksum Y``, where Y covers
the host memory and the first and last MiB of the device memory (read back from the device), so
a restore that lost or shifted device memory changes the checksum.

    eval "$(npusnap sim env)"
    python3 bigalloc.py --device-mib 1024 --host-mib 64 --interval 1
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
import time
import zlib
from typing import List, Optional

MiB = 1 << 20
H2D, D2H = 1, 2


# Codes a user of these samples is likely to meet, with what to do about them.
HINTS = {
    507033: "the device cannot be opened (63 processes already use it): see `npusnap sim status`",
    507899: 'the simulated NPU is not running: `npusnap sim start`, then eval "$(npusnap sim env)"',
}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device-mib", type=int, default=1024, help="device memory to hold, MiB (default 1024)")
    ap.add_argument("--host-mib", type=int, default=64, help="host memory to hold, MiB (default 64)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between ticks (default 1)")
    ap.add_argument("--ticks", type=int, default=0, help="stop after this many ticks, 0 = forever")
    ap.add_argument("--device", type=int, default=0, help="device id (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="pattern seed (default 0)")
    ap.add_argument(
        "--fill-host",
        action="store_true",
        help="write every page of the host memory (default: 64 bytes per MiB; untouched pages are "
        "not in a CRIU image)",
    )
    ap.add_argument(
        "--tick-mib",
        type=int,
        default=-1,
        help="MiB of host memory each tick's checksum reads (default: all of it); a job whose step "
        "touches little of its host memory is where a lazy restore pays",
    )
    args = ap.parse_args(argv)
    if args.device_mib < 1 or args.host_mib < 0:
        print("bigalloc: --device-mib must be >= 1 and --host-mib >= 0", file=sys.stderr)
        return 2

    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        print('bigalloc: ASCEND_HOME_PATH is not set: eval "$(npusnap sim env)"', file=sys.stderr)
        return 1
    lib = ctypes.CDLL(os.path.join(home, "lib64", "libacl_rt.so"))
    lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    lib.aclrtMemcpy.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
    ]

    def check(code: int, what: str) -> None:
        if code != 0:
            hint = HINTS.get(code)
            raise SystemExit(
                f"bigalloc: {what} failed with ACL error {code}" + (f" ({hint})" if hint else "")
            )

    rc = lib.aclInit(None)
    if rc not in (0, 100002):
        check(rc, "aclInit")
    check(lib.aclrtSetDevice(ctypes.c_int32(args.device)), "aclrtSetDevice")
    size = args.device_mib * MiB
    dev = ctypes.c_void_p()
    check(lib.aclrtMalloc(ctypes.byref(dev), size, 0), f"aclrtMalloc({args.device_mib} MiB)")
    base = int(dev.value or 0)

    # One MiB of pattern, each MiB of the device tagged with its index so shifted data shows.
    block = bytearray(hashlib.shake_256(f"bigalloc-{args.seed}".encode()).digest(MiB))
    for i in range(args.device_mib):
        block[:8] = i.to_bytes(8, "little")
        src = (ctypes.c_char * MiB).from_buffer(block)
        check(lib.aclrtMemcpy(ctypes.c_void_p(base + i * MiB), MiB, src, MiB, H2D), "aclrtMemcpy")
        del src
    host = bytearray(args.host_mib * MiB)
    for i in range(args.host_mib):
        tag = hashlib.sha256(f"host-{args.seed}-{i}".encode()).digest() * 2
        if args.fill_host:
            host[i * MiB : (i + 1) * MiB] = tag * (MiB // len(tag))
        else:
            host[i * MiB : i * MiB + 64] = tag
    view = memoryview(host)[: args.tick_mib * MiB] if args.tick_mib >= 0 else memoryview(host)
    print("ready", flush=True)

    probe = ctypes.create_string_buffer(MiB)
    n = 0
    while args.ticks == 0 or n < args.ticks:
        n += 1
        crc = zlib.crc32(view)
        for off in (0, size - MiB):
            check(lib.aclrtMemcpy(probe, MiB, ctypes.c_void_p(base + off), MiB, D2H), "aclrtMemcpy")
            crc = zlib.crc32(probe.raw, crc)
        print(f"tick {n} checksum {crc:08x}", flush=True)
        if args.ticks == 0 or n < args.ticks:
            time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
