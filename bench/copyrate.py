"""This machine's memcpy rate and the simulated NPU's copy rate, measured side by side.

    eval "$(npusnap sim env)"; python3 bench/copyrate.py --mib 1024 [--json]

``memcpy``: ``ctypes.memmove`` between two host buffers of ``--mib`` MiB (both touched first),
best of ``--reps``. ``host_to_device`` / ``device_to_host``: ``aclrtMemcpy`` of the same size
through the simulated runtime of ``ASCEND_HOME_PATH``, best of ``--reps``. Run by the benchmark
in its own process, so that it measures what a workload sees. Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

MiB = 1 << 20
H2D, D2H, D2D = 1, 2, 3


def best_rate(nbytes: int, reps: int, fn: Callable[[], object]) -> float:
    """Bytes per second of the fastest of ``reps`` calls of ``fn``."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure(mib: int, reps: int) -> Dict[str, float]:
    n = mib * MiB
    src = (ctypes.c_char * n)()
    dst = (ctypes.c_char * n)()
    ctypes.memset(src, 0x5A, n)
    ctypes.memset(dst, 0xA5, n)
    out = {"bytes": float(n), "memcpy": best_rate(n, reps, lambda: ctypes.memmove(dst, src, n))}
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        raise SystemExit('copyrate: ASCEND_HOME_PATH is not set: eval "$(npusnap sim env)"')
    lib = ctypes.CDLL(os.path.join(home, "lib64", "libacl_rt.so"))
    lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    lib.aclrtMemcpy.argtypes = [ptr, size, ptr, size, ctypes.c_int]
    lib.aclrtFree.argtypes = [ctypes.c_void_p]

    def check(code: int, what: str) -> None:
        if code != 0:
            raise SystemExit(f"copyrate: {what} failed with ACL error {code}")

    rc = lib.aclInit(None)
    if rc not in (0, 100002):
        check(rc, "aclInit")
    check(lib.aclrtSetDevice(ctypes.c_int32(0)), "aclrtSetDevice")
    dev = ctypes.c_void_p()
    check(lib.aclrtMalloc(ctypes.byref(dev), n, 0), f"aclrtMalloc({mib} MiB)")
    h = ctypes.cast(src, ctypes.c_void_p)
    d = ctypes.cast(dst, ctypes.c_void_p)
    check(lib.aclrtMemcpy(dev, n, h, n, H2D), "aclrtMemcpy (first touch)")
    out["host_to_device"] = best_rate(n, reps, lambda: check(lib.aclrtMemcpy(dev, n, h, n, H2D), "H2D"))
    out["device_to_host"] = best_rate(n, reps, lambda: check(lib.aclrtMemcpy(d, n, dev, n, D2H), "D2H"))
    check(lib.aclrtFree(dev), "aclrtFree")
    lib.aclrtResetDevice(ctypes.c_int32(0))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per copy (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="copies per direction; the best counts (default 3)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.reps < 1:
        print("copyrate: --mib and --reps must be >= 1", file=sys.stderr)
        return 2
    rates = measure(args.mib, args.reps)
    if args.json:
        print(json.dumps(rates))
    else:
        for k in ("memcpy", "host_to_device", "device_to_host"):
            print(f"{k:15} {rates[k] / 1e9:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
