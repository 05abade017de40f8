"""A scriptable user of the simulated CANN runtime, run as a child process by the sim tests.

It loads ``$ASCEND_HOME_PATH/lib64/libacl_rt.so`` with ctypes (like a real program) and executes
one JSON command per stdin line, answering one JSON object per stdout line. Commands run on the
main thread unless sent with ``bg`` (a new thread), so a test can show that another thread's
device call blocks while the process is locked.

    ["set", 0] ["reset", 0] ["reset_force", 0] ["count"] ["malloc", n] ["free", addr] ["fill", addr, n, seed]
    ["read", addr, n] -> {"rc", "crc"} ["write_hex", addr, hex] ["lock"] ["backup"] ["restore"]
    ["unlock"] ["raw", name, pid_delta, nonnull] ["state"] ["devices"] ["getdev"]
    ["register", stage, ret] ["unregister", stage] ["register_twice", stage] ["calls"]
    ["bg", id, <command...>] ["bgwait", id, timeout_s] ["pid"] ["exit"]
    ["race_set_reset", dev, delay_us]: one thread sets dev and reads its current context while
    this one resets dev, released together (the set spins delay_us first; a negative delay_us:
    the reset sleeps that long first, so that the set most likely comes first)
    npusnap's device-memory library (preloaded, or loaded from $NPUSNAP_AGENT_LIB):
    ["dm_save", timeout_ms] ["dm_reload"] ["dm_finish"] ["dm_info"] ["dm_register", addr, n]
    ["dm_exclude", addr, n] ["dm_save_file", path, timeout_ms] ["dm_reload_file", path]
    ["vmm_alloc", n, device]: aclrtReserveMemAddress + aclrtMallocPhysical + aclrtMapMem
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import threading
import time
import zlib
from typing import Any, Dict, List

from npusnap_cli.contract import DevmemInfo

HOME = os.environ["ASCEND_HOME_PATH"]
lib = ctypes.CDLL(os.path.join(HOME, "lib64", "libacl_rt.so"))
rt = ctypes.CDLL(os.path.join(HOME, "lib64", "libruntime.so"))
lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
lib.aclrtFree.argtypes = [ctypes.c_void_p]
lib.aclrtMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
SNAP = {
    "lock": "aclrtSnapShotProcessLock",
    "backup": "aclrtSnapShotProcessBackup",
    "restore": "aclrtSnapShotProcessRestore",
    "unlock": "aclrtSnapShotProcessUnlock",
}
for fn in SNAP.values():
    getattr(lib, fn).argtypes = [ctypes.c_int, ctypes.c_void_p]
CB = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_int32, ctypes.c_void_p)
lib.aclrtSnapShotCallbackRegister.argtypes = [ctypes.c_int, CB, ctypes.c_void_p]
lib.aclrtSnapShotCallbackUnregister.argtypes = [ctypes.c_int, CB]


DmInfo = DevmemInfo  # npusnap_devmem_info, the contract's layout


class PhysicalMemProp(ctypes.Structure):
    """aclrtPhysicalMemProp (include/external/acl/acl_rt.h)."""

    _fields_ = [
        ("handleType", ctypes.c_int),
        ("allocationType", ctypes.c_int),
        ("memAttr", ctypes.c_int),
        ("locationId", ctypes.c_uint32),
        ("locationType", ctypes.c_int),
        ("reserve", ctypes.c_uint64),
    ]


ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_HBM_MEM_HUGE = 4


def devmem() -> Any:
    glob = ctypes.CDLL(None)
    if hasattr(glob, "npusnap_devmem_save"):
        return glob
    return ctypes.CDLL(os.environ["NPUSNAP_AGENT_LIB"])


calls: List[List[int]] = []
callbacks: Dict[int, Any] = {}  # stage -> ctypes callback (kept alive)
bg_results: Dict[str, Any] = {}
bg_threads: Dict[str, threading.Thread] = {}
out_lock = threading.Lock()


def get_state() -> int:
    s = ctypes.c_int(-1)
    rc = rt.rtSnapShotProcessGetState(ctypes.byref(s))
    return s.value if rc == 0 else -rc


def make_cb(stage: int, ret: int) -> Any:
    def cb(device_id: int, _args: Any) -> int:
        calls.append([stage, int(device_id), get_state()])
        return ret

    return CB(cb)


def run(cmd: List[Any]) -> Dict[str, Any]:
    op = cmd[0]
    if op == "pid":
        return {"rc": 0, "pid": os.getpid()}
    if op == "set":
        return {"rc": lib.aclrtSetDevice(ctypes.c_int32(cmd[1]))}
    if op == "reset":
        return {"rc": lib.aclrtResetDevice(ctypes.c_int32(cmd[1]))}
    if op == "reset_force":
        return {"rc": lib.aclrtResetDeviceForce(ctypes.c_int32(cmd[1]))}
    if op == "count":
        n = ctypes.c_uint32(0)
        return {"rc": lib.aclrtGetDeviceCount(ctypes.byref(n)), "count": n.value}
    if op == "getdev":
        d = ctypes.c_int32(-1)
        return {"rc": lib.aclrtGetDevice(ctypes.byref(d)), "dev": d.value}
    if op == "malloc":
        p = ctypes.c_void_p()
        rc = lib.aclrtMalloc(ctypes.byref(p), cmd[1], 0)
        return {"rc": rc, "addr": p.value or 0}
    if op == "free":
        return {"rc": lib.aclrtFree(ctypes.c_void_p(cmd[1]))}
    if op == "fill":
        data = hashlib.shake_256(str(cmd[3]).encode()).digest(cmd[2])
        buf = ctypes.create_string_buffer(data, cmd[2])
        rc = lib.aclrtMemcpy(ctypes.c_void_p(cmd[1]), cmd[2], buf, cmd[2], 1)
        return {"rc": rc, "crc": zlib.crc32(data)}
    if op == "write_hex":
        data = bytes.fromhex(cmd[2])
        buf = ctypes.create_string_buffer(data, len(data))
        return {"rc": lib.aclrtMemcpy(ctypes.c_void_p(cmd[1]), len(data), buf, len(data), 1)}
    if op == "read":
        buf = ctypes.create_string_buffer(cmd[2])
        rc = lib.aclrtMemcpy(buf, cmd[2], ctypes.c_void_p(cmd[1]), cmd[2], 2)
        return {"rc": rc, "crc": zlib.crc32(buf.raw), "head": buf.raw[:16].hex()}
    if op == "memcpy":  # ["memcpy", dst, dest_max, src, count, kind]: raw argument checks
        return {
            "rc": lib.aclrtMemcpy(ctypes.c_void_p(cmd[1]), cmd[2], ctypes.c_void_p(cmd[3]), cmd[4], cmd[5])
        }
    if op == "d2d":
        return {"rc": lib.aclrtMemcpy(ctypes.c_void_p(cmd[1]), cmd[3], ctypes.c_void_p(cmd[2]), cmd[3], 3)}
    if op in SNAP:
        return {"rc": getattr(lib, SNAP[op])(os.getpid(), None)}
    if op == "flags":  # ["flags", "backup", flags]: the driver-backed flow's args struct
        args = ctypes.create_string_buffer(64)
        ctypes.memmove(args, int(cmd[2]).to_bytes(4, "little"), 4)
        return {"rc": getattr(lib, SNAP[cmd[1]])(os.getpid(), ctypes.cast(args, ctypes.c_void_p))}
    if op == "raw":  # ["raw", "lock", pid_delta, nonnull]
        arg = ctypes.c_void_p(ctypes.addressof(ctypes.create_string_buffer(64))) if cmd[3] else None
        return {"rc": getattr(lib, SNAP[cmd[1]])(os.getpid() + cmd[2], arg)}
    if op == "state":
        return {"rc": 0, "state": get_state()}
    if op == "state_rc":
        value = ctypes.c_int(-1)
        return {"rc": rt.rtSnapShotProcessGetState(ctypes.byref(value)), "state": value.value}
    if op == "register_new":  # a new, distinct callback each time (no fixed limit)
        cb = make_cb(cmd[1], 0)
        rc = lib.aclrtSnapShotCallbackRegister(cmd[1], cb, None)
        callbacks[-1000 - len(callbacks)] = cb
        return {"rc": rc}
    if op == "state_null":
        return {"rc": rt.rtSnapShotProcessGetState(None)}
    if op == "devices":
        ids = (ctypes.c_int32 * 16)()
        n = lib.npusimGetOpenDevices(ids, 16)
        return {"rc": 0, "devices": [ids[i] for i in range(n)]}
    if op == "register":
        cb = make_cb(cmd[1], cmd[2])
        rc = lib.aclrtSnapShotCallbackRegister(cmd[1], cb, None)
        if rc == 0:
            callbacks[cmd[1]] = cb
        return {"rc": rc}
    if op == "register_twice":
        return {"rc": lib.aclrtSnapShotCallbackRegister(cmd[1], callbacks[cmd[1]], None)}
    if op == "register_null":
        return {"rc": lib.aclrtSnapShotCallbackRegister(cmd[1], ctypes.cast(None, CB), None)}
    if op == "unregister":
        cb = callbacks.get(cmd[1]) or make_cb(cmd[1], 0)
        rc = lib.aclrtSnapShotCallbackUnregister(cmd[1], cb)
        if rc == 0:
            callbacks.pop(cmd[1], None)
        else:
            callbacks.setdefault(-100 - cmd[1], cb)  # keep alive
        return {"rc": rc}
    if op == "calls":
        return {"rc": 0, "calls": list(calls)}
    if op == "version":
        buf = ctypes.create_string_buffer(128)
        return {"rc": lib.aclsysGetVersionStr(b"runtime", buf), "version": buf.value.decode()}
    if op == "ascendcl":  # ["ascendcl", "unlock"]: the same call through the other front-end
        other = ctypes.CDLL(os.path.join(HOME, "lib64", "libascendcl.so"))
        fn = getattr(other, SNAP[cmd[1]])
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
        return {"rc": fn(os.getpid(), None)}
    if op == "init":
        return {"rc": lib.aclInit(None)}
    if op == "finalize":
        return {"rc": lib.aclFinalize()}
    if op == "sync":
        return {"rc": lib.aclrtSynchronizeDevice()}
    if op == "vmm_alloc":  # ["vmm_alloc", n, device]: an expandable segment of one chunk, as torch_npu
        va, h = ctypes.c_void_p(), ctypes.c_void_p()
        prop = PhysicalMemProp(0, 0, ACL_HBM_MEM_HUGE, cmd[2], ACL_MEM_LOCATION_TYPE_DEVICE, 0)
        lib.aclrtReserveMemAddress.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_uint64,
        ]
        lib.aclrtMallocPhysical.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_size_t,
            ctypes.POINTER(PhysicalMemProp),
            ctypes.c_uint64,
        ]
        lib.aclrtMapMem.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_uint64,
        ]
        rc = lib.aclrtReserveMemAddress(ctypes.byref(va), cmd[1], 0, None, 0)
        rc = rc or lib.aclrtMallocPhysical(ctypes.byref(h), cmd[1], ctypes.byref(prop), 0)
        rc = rc or lib.aclrtMapMem(va, cmd[1], 0, h, 0)
        return {"rc": rc, "addr": va.value or 0}
    if op.startswith("dm_"):
        dm = devmem()
        err = ctypes.create_string_buffer(512)
        if op == "dm_save":
            rc = dm.npusnap_devmem_save(cmd[1], err, 512)
            return {"rc": rc, "message": err.value.decode()}
        if op == "dm_reload":
            rc = dm.npusnap_devmem_reload(err, 512)
            return {"rc": rc, "message": err.value.decode()}
        if op in ("dm_save_file", "dm_reload_file"):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC if op == "dm_save_file" else os.O_RDONLY
            fd = os.open(cmd[1], flags | os.O_CLOEXEC, 0o600)
            try:
                if op == "dm_save_file":
                    written = ctypes.c_uint64(0)
                    rc = dm.npusnap_devmem_save_fd(fd, cmd[2], ctypes.byref(written), err, 512)
                    return {"rc": rc, "message": err.value.decode(), "written": written.value}
                rc = dm.npusnap_devmem_reload_fd(fd, err, 512)
                return {"rc": rc, "message": err.value.decode()}
            finally:
                os.close(fd)
        if op == "dm_finish":
            dm.npusnap_devmem_finish()
            return {"rc": 0}
        if op == "dm_info":
            info = DmInfo()
            dm.npusnap_devmem_get_info(ctypes.byref(info))
            return {"rc": 0, **{name: getattr(info, name) for name, _ in DmInfo._fields_}}
        fn = dm.npusnap_devmem_register if op == "dm_register" else dm.npusnap_devmem_exclude
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return {"rc": fn(cmd[1], cmd[2])}
    if op == "race_set_reset":
        return race_set_reset(cmd[1], cmd[2])
    if op == "bg":
        key, sub = cmd[1], cmd[2:]

        def work() -> None:
            bg_results[key] = run(sub)

        t = threading.Thread(target=work, daemon=True)
        bg_threads[key] = t
        t.start()
        return {"rc": 0}
    if op == "bgwait":
        t = bg_threads[cmd[1]]
        t.join(cmd[2])
        if t.is_alive():
            return {"rc": 0, "done": False}
        return {"rc": 0, "done": True, "result": bg_results[cmd[1]]}
    raise ValueError(f"unknown command {op}")


def race_set_reset(dev: int, delay_us: int) -> Dict[str, Any]:
    """aclrtSetDevice + aclrtGetCurrentContext in a new thread against aclrtResetDevice here, as
    torch_npu's threads set the device while its main thread resets it at exit. ctypes drops the
    GIL around each call, so the two run at once."""
    start = threading.Barrier(2)
    got: Dict[str, int] = {}

    def setter() -> None:
        start.wait()
        until = time.perf_counter() + max(delay_us, 0) / 1e6
        while time.perf_counter() < until:
            pass
        got["set"] = lib.aclrtSetDevice(ctypes.c_int32(dev))
        ctx = ctypes.c_void_p()
        got["ctx"] = lib.aclrtGetCurrentContext(ctypes.byref(ctx))

    t = threading.Thread(target=setter, daemon=True)
    t.start()
    start.wait()
    if delay_us < 0:
        time.sleep(-delay_us / 1e6)  # drops the GIL: the setter runs meanwhile
    reset = lib.aclrtResetDevice(ctypes.c_int32(dev))
    t.join(30)
    return {"rc": 0, "reset": reset, **got}


def main() -> int:
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd[0] == "exit":
            code = cmd[1] if len(cmd) > 1 else 0
            sys.stdout.flush()
            os._exit(code) if len(cmd) > 2 and cmd[2] == "hard" else sys.exit(code)
        try:
            res = run(cmd)
        except Exception as exc:  # report to the test instead of dying silently
            res = {"rc": -1, "error": repr(exc)}
        with out_lock:
            sys.stdout.write(json.dumps(res) + "\n")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
