"""The program `npusnap qualify` runs under npusnap's agent to try the node's CANN runtime.

Run as ``python qualifyprobe.py LIBRARY DEVICE``: it loads LIBRARY (the node's libacl_rt.so or
libascendcl.so) with ctypes, calls aclInit and aclrtSetDevice(DEVICE), then answers one request a
line on stdin with one JSON object a line on stdout. It calls public CANN functions only (aclInit,
aclrtSetDevice, aclrtMalloc/Free, aclrtMemcpy, aclrtGetMemInfo, and the VMM calls
aclrtReserveMemAddress, aclrtMallocPhysical, aclrtMapMem): what any job calls, so that what qualify
sees of it is what npusnap will see of a job. The snapshot calls are the agent's, driven by qualify
over the agent's socket (pipelines/qualify.py).

Requests (JSON): ``{"op": "meminfo"}``, ``{"op": "malloc", "size": N, "policy": P}``, ``{"op":
"vmm", "size": N}``, ``{"op": "fill", "ptr": A, "size": N, "seed": S}`` (writes ``pattern(S, N)``
there), ``{"op": "check", "ptr": A, "size": N, "seed": S}`` (reads it back and compares), ``{"op":
"free", "ptr": A}``, ``{"op": "quit"}``. Answers: ``{"ok": true, ...}``, or ``{"ok": false, "call":
NAME, "code": ACL_CODE}`` when a CANN call failed.

Standard library only, Python 3.9+ (it runs as a job would, in the interpreter npusnap runs with).
"""

from __future__ import annotations

import ctypes
import json
import random
import sys
from typing import Any, Dict, Optional

ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_HBM_MEM = 1  # aclrtMemAttr of aclrtGetMemInfo
ACL_HBM_MEM_HUGE = 4  # aclrtMemAttr of a physical allocation
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_MEM_MALLOC_NORMAL_ONLY = 2
OPS = ("meminfo", "malloc", "vmm", "fill", "check", "free", "quit")


def pattern(seed: int, size: int) -> bytes:
    """The bytes a fill of ``seed`` writes: the same in the probe and in qualify, never a run of
    one value (a dropped or poisoned piece shows)."""
    return random.Random(seed).randbytes(size)


class _Loc(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_uint32)]


class _PhysProp(ctypes.Structure):
    """aclrtPhysicalMemProp (acl_rt.h)."""

    _fields_ = [
        ("handleType", ctypes.c_uint32),
        ("allocationType", ctypes.c_uint32),
        ("memAttr", ctypes.c_uint32),
        ("location", _Loc),
        ("reserve", ctypes.c_uint64),
    ]


class AclFailed(Exception):
    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} returned {code}")
        self.call = call
        self.code = code


class Probe:
    def __init__(self, library: str, device: int) -> None:
        self.lib = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        self.device = device
        self.handles: Dict[int, int] = {}  # VMM address -> its physical handle

    def _call(self, name: str, *args: Any) -> None:
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_int
        rc = int(fn(*args))
        if rc != 0:
            raise AclFailed(name, rc)

    def init(self) -> Dict[str, Any]:
        self._call("aclInit", None)
        self._call("aclrtSetDevice", ctypes.c_int32(self.device))
        return {}

    def meminfo(self) -> Dict[str, Any]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._call("aclrtGetMemInfo", ctypes.c_int(ACL_HBM_MEM), ctypes.byref(free), ctypes.byref(total))
        return {"free": free.value, "total": total.value, "used": total.value - free.value}

    def malloc(self, size: int, policy: int = ACL_MEM_MALLOC_NORMAL_ONLY) -> Dict[str, Any]:
        ptr = ctypes.c_void_p()
        self._call("aclrtMalloc", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_int(policy))
        return {"ptr": int(ptr.value or 0)}

    def vmm(self, size: int) -> Dict[str, Any]:
        va = ctypes.c_void_p()
        self._call(
            "aclrtReserveMemAddress",
            ctypes.byref(va),
            ctypes.c_size_t(size),
            ctypes.c_size_t(0),
            None,
            ctypes.c_uint64(0),
        )
        prop = _PhysProp(0, 0, ACL_HBM_MEM_HUGE, _Loc(self.device, ACL_MEM_LOCATION_TYPE_DEVICE), 0)
        handle = ctypes.c_void_p()
        self._call(
            "aclrtMallocPhysical",
            ctypes.byref(handle),
            ctypes.c_size_t(size),
            ctypes.byref(prop),
            ctypes.c_uint64(0),
        )
        self._call("aclrtMapMem", va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
        self.handles[int(va.value or 0)] = int(handle.value or 0)
        return {"ptr": int(va.value or 0)}

    def fill(self, ptr: int, size: int, seed: int) -> Dict[str, Any]:
        data = pattern(seed, size)
        buf = ctypes.create_string_buffer(data, size)
        self._call(
            "aclrtMemcpy",
            ctypes.c_void_p(ptr),
            ctypes.c_size_t(size),
            buf,
            ctypes.c_size_t(size),
            ctypes.c_int(ACL_MEMCPY_HOST_TO_DEVICE),
        )
        return {}

    def check(self, ptr: int, size: int, seed: int) -> Dict[str, Any]:
        buf = ctypes.create_string_buffer(size)
        self._call(
            "aclrtMemcpy",
            buf,
            ctypes.c_size_t(size),
            ctypes.c_void_p(ptr),
            ctypes.c_size_t(size),
            ctypes.c_int(ACL_MEMCPY_DEVICE_TO_HOST),
        )
        got, want = buf.raw, pattern(seed, size)
        first: Optional[int] = None
        if got != want:
            first = next(i for i in range(size) if got[i] != want[i])
        return {"equal": first is None, "differ_at": first}

    def free(self, ptr: int) -> Dict[str, Any]:
        self._call("aclrtFree", ctypes.c_void_p(ptr))
        return {}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        sys.stderr.write("usage: qualifyprobe.py LIBRARY DEVICE\n")
        return 2
    out = sys.stdout

    def answer(doc: Dict[str, Any]) -> None:
        out.write(json.dumps(doc) + "\n")
        out.flush()

    try:
        probe = Probe(argv[1], int(argv[2]))
        answer({"ok": True, "op": "init", **probe.init()})
    except AclFailed as exc:
        answer({"ok": False, "op": "init", "call": exc.call, "code": exc.code})
        return 1
    except OSError as exc:
        answer({"ok": False, "op": "init", "call": "dlopen", "code": -1, "error": str(exc)})
        return 1
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        if op not in OPS:
            answer({"ok": False, "op": op, "call": "probe", "code": -1, "error": "unknown op"})
            continue
        if op == "quit":
            answer({"ok": True, "op": op})
            return 0
        try:
            answer({"ok": True, "op": op, **getattr(probe, op)(**req)})
        except AclFailed as exc:
            answer({"ok": False, "op": op, "call": exc.call, "code": exc.code})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
