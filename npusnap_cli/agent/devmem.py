"""ctypes view of npusnap's device-memory library (native/agent/devmem.c, libnpusnap_agent.so).

Standard library only, Python 3.9+ (runs inside the target).

``npusnap run`` puts libnpusnap_agent.so in LD_PRELOAD: it tracks every device allocation at the
driver layer (halMemAlloc and the VMM calls of libascend_hal.so) and copies them with the driver's
drvMemcpy while the runtime is locked. This module finds that copy (``ctypes.CDLL(None)``: the
preloaded symbols are global) and calls it; ctypes releases the GIL during each call.
Where the library is not preloaded (an attached agent, ``agent.start()`` in a program started
without ``npusnap run``) it is loaded from the build directory so that explicit registration
works, and ``info()["interposed"]`` is False: npusnap cannot see the allocations.

These are the calls the native agent core will make from C at the same protocol steps; keep this
module the only place the Python agent touches them.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, List, Optional

from npusnap_cli import contract, paths

LIBRARY_NAME = contract.AGENT_LIBRARY
ENV_LIBRARY = "NPUSNAP_AGENT_LIB"  # set by `npusnap run` to the preloaded file's path
ERRLEN = 512

MODES = contract.DEVICE_MEMORY_MODES
DEFAULT_MODE = contract.DEFAULT_DEVICE_MEMORY_MODE


_Info = contract.DevmemInfo  # npusnap_devmem_info


class DevMemError(Exception):
    def __init__(self, call: str, rc: int, message: str) -> None:
        super().__init__(f"{call} failed ({os.strerror(-rc) if rc < 0 else rc}): {message}")
        self.call = call
        self.rc = rc
        self.message = message


def library_path() -> Optional[str]:
    """Where libnpusnap_agent.so is: $NPUSNAP_AGENT_LIB, else the build directory."""
    env = os.environ.get(ENV_LIBRARY)
    if env and os.path.isfile(env):
        return env
    try:
        p = paths.build_dir() / "agent" / LIBRARY_NAME
    except Exception:
        return None
    return str(p) if p.is_file() else None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.npusnap_devmem_save.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.npusnap_devmem_save.restype = ctypes.c_int
    lib.npusnap_devmem_reload.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.npusnap_devmem_reload.restype = ctypes.c_int
    lib.npusnap_devmem_finish.argtypes = []
    lib.npusnap_devmem_finish.restype = None
    lib.npusnap_devmem_get_info.argtypes = [ctypes.POINTER(_Info)]
    lib.npusnap_devmem_get_info.restype = None
    lib.npusnap_devmem_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.npusnap_devmem_register.restype = ctypes.c_int
    lib.npusnap_devmem_exclude.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.npusnap_devmem_exclude.restype = ctypes.c_int
    lib.npusnap_devmem_registered_count.argtypes = []
    lib.npusnap_devmem_registered_count.restype = ctypes.c_uint64
    lib.npusnap_devmem_devices.argtypes = [ctypes.POINTER(ctypes.c_int32), ctypes.c_int]
    lib.npusnap_devmem_devices.restype = ctypes.c_int
    return lib


_cached: Optional[ctypes.CDLL] = None


def library(load: bool = True) -> Optional[ctypes.CDLL]:
    """The process's libnpusnap_agent.so: the preloaded one, else (``load``) the built file."""
    global _cached
    if _cached is not None:
        return _cached
    try:
        glob = ctypes.CDLL(None)
        if hasattr(glob, "npusnap_devmem_get_info"):
            _cached = _bind(glob)
            return _cached
    except OSError:
        pass
    if not load:
        return None
    path = library_path()
    if path is None:
        return None
    try:
        _cached = _bind(ctypes.CDLL(path))
    except (OSError, AttributeError):
        return None
    return _cached


def info() -> Dict[str, Any]:
    """What the library knows (all zero and ``available`` False when it cannot be loaded)."""
    lib = library()
    if lib is None:
        return {"available": False, "interposed": False, "allocations": 0, "bytes": 0, "registered": 0}
    i = _Info()
    lib.npusnap_devmem_get_info(ctypes.byref(i))
    return {
        "available": True,
        "interposed": bool(i.interposed),
        "allocations": int(i.allocations),
        "bytes": int(i.bytes),
        "saved_bytes": int(i.saved_bytes),
        "excluded_bytes": int(i.excluded_bytes),
        "gate_closed": bool(i.gate_closed),
        "vmm_bytes": int(i.vmm_bytes),
        "reserved_bytes": int(i.reserved_bytes),
        "saved": bool(i.saved),
        "registered": int(lib.npusnap_devmem_registered_count()),
        "devices": devices(lib),
    }


def devices(lib: ctypes.CDLL) -> List[int]:
    """Device ids the job opened, as seen by the interposed aclrtSetDevice/aclrtResetDevice."""
    ids = (ctypes.c_int32 * 1024)()
    n = int(lib.npusnap_devmem_devices(ids, 1024))
    return [int(ids[i]) for i in range(max(0, min(n, 1024)))]


def _need() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise DevMemError("load", -2, f"{LIBRARY_NAME} is not loaded and not built (run ./scripts/setup.sh)")
    return lib


def save(timeout_ms: int) -> None:
    err = ctypes.create_string_buffer(ERRLEN)
    rc = int(_need().npusnap_devmem_save(int(timeout_ms), err, ERRLEN))
    if rc != 0:
        raise DevMemError("npusnap_devmem_save", rc, err.value.decode("utf-8", "replace"))


def reload() -> None:
    err = ctypes.create_string_buffer(ERRLEN)
    rc = int(_need().npusnap_devmem_reload(err, ERRLEN))
    if rc != 0:
        raise DevMemError("npusnap_devmem_reload", rc, err.value.decode("utf-8", "replace"))


def finish() -> None:
    lib = library(load=False)
    if lib is not None:
        lib.npusnap_devmem_finish()


def register(ptr: int, size: int) -> None:
    rc = int(_need().npusnap_devmem_register(ctypes.c_void_p(ptr), size))
    if rc != 0:
        raise DevMemError("npusnap_devmem_register", rc, "cannot register the buffer now")


def exclude(ptr: int, size: int) -> None:
    rc = int(_need().npusnap_devmem_exclude(ctypes.c_void_p(ptr), size))
    if rc != 0:
        raise DevMemError("npusnap_devmem_exclude", rc, "cannot exclude the buffer now")
