"""Raw-CRIU baseline workload: holds N MiB of host memory, like bigalloc.py without a device.

An npusnap image of bigalloc holds its device memory (backed up into host memory) plus its own
host memory, so the "equivalent process" for a raw CRIU dump holds the sum in plain host memory.
Prints ``ready`` and then ``tick N checksum C`` every interval, flushed.
"""

from __future__ import annotations

import argparse
import time
import zlib


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, required=True, help="host memory to hold, MiB")
    p.add_argument("--interval", type=float, default=0.1)
    ns = p.parse_args()
    chunk = bytes(range(256)) * 4096  # 1 MiB, non-zero so CRIU must write every page
    blocks = [bytearray(chunk) for _ in range(ns.mib)]
    print("ready", flush=True)
    n = 0
    while True:
        c = zlib.crc32(blocks[n % len(blocks)][:4096])
        print(f"tick {n} checksum {c:08x}", flush=True)
        n += 1
        time.sleep(ns.interval)


if __name__ == "__main__":
    raise SystemExit(main())
