"""A toy training loop whose parameters live in NPU device memory (ctypes, no framework needed).

Each step copies the parameters device->host, applies a deterministic update, copies them back
host->device and prints ``step N loss X checksum Y``. The output of an uninterrupted run is a pure
function of the options, so a run that was dumped and restored midway must print exactly the same
lines: that is how the demo and the tests prove that device memory survived.

    eval "$(npusnap sim env)"
    python3 train.py --steps 100 --interval 0.5 --param-bytes 1048576 --device 0 --seed 1

Runs on any Python 3.9+. Other code may import it and drive ``Trainer`` itself (the tests do).
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

ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_ERROR_REPEAT_INITIALIZE = 100002
_MULT = 6364136223846793005  # Knuth's MMIX LCG multiplier: a cheap, deterministic "update"
_INC = 1442695040888963407


class AclFailure(RuntimeError):
    pass


def load_acl() -> ctypes.CDLL:
    """The ACL library of the CANN install named by $ASCEND_HOME_PATH (as set_env.sh sets it)."""
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        raise AclFailure(
            'ASCEND_HOME_PATH is not set: source your CANN set_env.sh, or eval "$(npusnap sim env)"'
        )
    lib = ctypes.CDLL(os.path.join(home, "lib64", "libacl_rt.so"))
    lib.aclInit.argtypes = [ctypes.c_char_p]
    lib.aclrtSetDevice.argtypes = [ctypes.c_int32]
    lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    lib.aclrtFree.argtypes = [ctypes.c_void_p]
    lib.aclrtMemcpy.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
    ]
    lib.aclrtResetDevice.argtypes = [ctypes.c_int32]
    for name in ("aclInit", "aclrtSetDevice", "aclrtMalloc", "aclrtFree", "aclrtMemcpy", "aclrtResetDevice"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


# Codes a user of these samples is likely to meet, with what to do about them.
HINTS = {
    507033: "the device cannot be opened (63 processes already use it): see `npusnap sim status`",
    507899: 'the simulated NPU is not running: `npusnap sim start`, then eval "$(npusnap sim env)"',
}


def check(code: int, what: str) -> None:
    if code != 0:
        hint = HINTS.get(code)
        raise AclFailure(f"{what} failed with ACL error {code}" + (f" ({hint})" if hint else ""))


class Trainer:
    """Parameters in device memory, updated one deterministic step at a time."""

    def __init__(self, lib: ctypes.CDLL, device: int, param_bytes: int, seed: int) -> None:
        if param_bytes < 8:
            raise ValueError("--param-bytes must be at least 8")
        self.lib = lib
        self.nbytes = param_bytes
        self.device = device
        rc = lib.aclInit(None)
        if rc not in (0, ACL_ERROR_REPEAT_INITIALIZE):
            check(rc, "aclInit")
        check(lib.aclrtSetDevice(device), f"aclrtSetDevice({device})")
        self.dev_ptr = ctypes.c_void_p()
        check(lib.aclrtMalloc(ctypes.byref(self.dev_ptr), param_bytes, 0), "aclrtMalloc")
        self.host = ctypes.create_string_buffer(param_bytes)
        init = hashlib.shake_256(f"npusnap-train-seed-{seed}".encode()).digest(param_bytes)
        ctypes.memmove(self.host, init, param_bytes)
        self._h2d()
        self.mask = (1 << (8 * param_bytes)) - 1

    def _h2d(self) -> None:
        check(
            self.lib.aclrtMemcpy(
                self.dev_ptr, self.nbytes, self.host, self.nbytes, ACL_MEMCPY_HOST_TO_DEVICE
            ),
            "aclrtMemcpy(host to device)",
        )

    def _d2h(self) -> None:
        check(
            self.lib.aclrtMemcpy(
                self.host, self.nbytes, self.dev_ptr, self.nbytes, ACL_MEMCPY_DEVICE_TO_HOST
            ),
            "aclrtMemcpy(device to host)",
        )

    def step(self, n: int) -> str:
        """Run step ``n``: read the parameters back, update them, write them back; return the line."""
        self._d2h()
        x = int.from_bytes(self.host.raw, "little")
        x = (x * _MULT + _INC + n) & self.mask
        data = x.to_bytes(self.nbytes, "little")
        ctypes.memmove(self.host, data, self.nbytes)
        self._h2d()
        crc = zlib.crc32(data)
        loss = 1.0 / (1.0 + 0.05 * n) + (crc & 0xFFF) / 1e5
        return f"step {n} loss {loss:.6f} checksum {crc:08x}"

    def close(self) -> None:
        self.lib.aclrtFree(self.dev_ptr)
        self.lib.aclrtResetDevice(self.device)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="number of steps, 0 = run forever (default 100)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds to wait between steps (default 0.5)")
    ap.add_argument("--param-bytes", type=int, default=1 << 20, help="size of the parameters (default 1 MiB)")
    ap.add_argument("--device", type=int, default=0, help="device id (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial parameters (default 0)")
    ap.add_argument("--prefix", default="", help="text put before every printed line (launcher: the rank)")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        trainer = Trainer(load_acl(), args.device, args.param_bytes, args.seed)
        n = 0
        while args.steps == 0 or n < args.steps:
            n += 1
            # One write per line, so that ranks sharing a stdout never interleave within a line.
            sys.stdout.write(args.prefix + trainer.step(n) + "\n")
            sys.stdout.flush()
            if args.interval > 0 and (args.steps == 0 or n < args.steps):
                time.sleep(args.interval)
        trainer.close()
    except (AclFailure, OSError, ValueError) as exc:
        print(f"{args.prefix}train: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
