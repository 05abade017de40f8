"""A Python job whose "extension" calls the NPU runtime without releasing the GIL.

ctypes.PyDLL keeps the GIL held during each foreign call, as many C/C++ extensions do. While the
runtime is locked for a snapshot, the job's next device call waits inside the runtime with the
GIL held, so no other Python thread of the process can run until Unlock. The agent must not
need one.

A 64-bit value lives in device memory; every step copies it to the host, mixes in the step
number and copies it back, in a tight loop. Every 50th step prints "step N value X" (see
``expected`` below for the sequence).

    python gil_job.py [--steps N] [--device D]     (steps 0 = forever)
"""

import ctypes
import os
import sys

MASK = (1 << 64) - 1


def expected(step: int, value: int) -> int:
    return (value * 6364136223846793005 + step + 1442695040888963407) & MASK


def main() -> None:
    args = sys.argv[1:]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 0
    device = int(args[args.index("--device") + 1]) if "--device" in args else 0
    lib = ctypes.PyDLL("libacl_rt.so")  # the GIL stays held during every call
    lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    lib.aclrtMemcpy.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
    ]
    for rc, what in ((lib.aclInit(None), "aclInit"), (lib.aclrtSetDevice(device), "aclrtSetDevice")):
        if rc != 0:
            raise SystemExit(f"{what} failed: {rc}")
    dev = ctypes.c_void_p()
    if lib.aclrtMalloc(ctypes.byref(dev), 8, 0) != 0:
        raise SystemExit("aclrtMalloc failed")
    host = ctypes.c_uint64(0)
    lib.aclrtMemcpy(dev, 8, ctypes.byref(host), 8, 1)
    os.write(1, f"ready {os.getpid()}\n".encode())
    step = 0
    while steps == 0 or step < steps:
        if lib.aclrtMemcpy(ctypes.byref(host), 8, dev, 8, 2) != 0:
            raise SystemExit("D2H failed")
        host.value = expected(step, host.value)
        if lib.aclrtMemcpy(dev, 8, ctypes.byref(host), 8, 1) != 0:
            raise SystemExit("H2D failed")
        if step % 50 == 0:
            os.write(1, f"step {step} value {host.value}\n".encode())
        step += 1


if __name__ == "__main__":
    main()
