"""Raw-CRIU baseline workload: holds N MiB of host memory, like bigalloc.py without a device.

An npusnap image of bigalloc holds its device memory (backed up into host memory) plus its own
host memory, so the "equivalent process" for a raw CRIU dump holds the sum in plain host memory.
Prints ``ready`` and then ``tick N checksum C`` every interval, flushed.

With ``--floor-file PATH``, SIGUSR1 makes it write every block it holds into PATH with plain
``write()`` calls, ``fsync`` it, remove it and print ``floor write_s W durable_s D``: the machine's
floor for writing these bytes from this memory (bench/floor.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import zlib


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, required=True, help="host memory to hold, MiB")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--floor-file", help="on SIGUSR1, write every block here, fsync, remove it")
    ns = p.parse_args()
    chunk = bytes(range(256)) * 4096  # 1 MiB, non-zero so CRIU must write every page
    blocks = [bytearray(chunk) for _ in range(ns.mib)]
    asked: list[int] = []
    if ns.floor_file:
        signal.signal(signal.SIGUSR1, lambda signum, _frame: asked.append(signum))
    print("ready", flush=True)
    n = 0
    while True:
        if asked:
            asked.clear()
            write_floor(ns.floor_file, blocks)
        c = zlib.crc32(blocks[n % len(blocks)][:4096])
        print(f"tick {n} checksum {c:08x}", flush=True)
        n += 1
        time.sleep(ns.interval)


def write_floor(path: str, blocks: list[bytearray]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        start = time.perf_counter()
        for b in blocks:
            view = memoryview(b)
            while view:
                view = view[os.write(fd, view) :]
        written = time.perf_counter()
        os.fsync(fd)
        durable = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    print(f"floor write_s {written - start:.6f} durable_s {durable - start:.6f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
