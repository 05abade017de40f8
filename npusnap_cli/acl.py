"""The ctypes layer over the CANN runtime snapshot API: discovery, symbols, version, error codes.

Used on both sides of the control socket: the CLI uses ``find_cann`` (preflight, manifests) and
the in-target agent uses ``AclRuntime.in_process()`` to drive the four snapshot calls on the copy
of the runtime the process already loaded. It is therefore standard-library only and must import
and run on Python 3.9 (see docs/internals.md).

Facts it relies on are collected in shared/cann-snapshot-api.md: the calling convention that works
on every CANN version (argtypes ``[c_int, c_void_p]``, called as ``(os.getpid(), None)``), the
library names and locations, the ``devlib`` stub trap and the error codes. The error table, the
states and the stages come from npusnap_cli/contract.py, generated from native/contract/npusnap.toml
with the native agent's copy (native/include/npusnap/contract.h).
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

from npusnap_cli import contract, elf, paths
from npusnap_cli.jsontypes import JSONObject

# -- constants -----------------------------------------------------------------------------------

ACL_LIBRARY_NAMES = ("libacl_rt.so", "libascendcl.so")  # 9.1+ name first; the old one still exports
RUNTIME_LIBRARY_NAME = "libruntime.so"
DEFAULT_HOMES = ("/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest")
VERSION_INFO = Path("share") / "info" / "runtime" / "version.info"

SNAPSHOT_FUNCTIONS = (
    "aclrtSnapShotProcessLock",
    "aclrtSnapShotProcessBackup",
    "aclrtSnapShotProcessRestore",
    "aclrtSnapShotProcessUnlock",
)
CALLBACK_FUNCTIONS = ("aclrtSnapShotCallbackRegister", "aclrtSnapShotCallbackUnregister")
GET_STATE_FUNCTION = "rtSnapShotProcessGetState"  # in libruntime.so; no ACL query exists yet


# The snapshot states, callback stages and ACL error table are npusnap's contract with CANN,
# shared with the native agent: generated from native/contract/npusnap.toml.
SnapshotState = contract.SnapshotState
Stage = contract.Stage
ERRORS: Dict[int, Tuple[str, str, str]] = contract.ACL_ERRORS
ACL_ERROR_INVALID_PARAM = contract.ACL_ERROR_INVALID_PARAM
ACL_ERROR_REPEAT_INITIALIZE = contract.ACL_ERROR_REPEAT_INITIALIZE
ACL_ERROR_RT_CONTEXT_NULL = contract.ACL_ERROR_RT_CONTEXT_NULL
ACL_ERROR_RT_STREAM_SUBSCRIBE = contract.ACL_ERROR_RT_STREAM_SUBSCRIBE
ACL_ERROR_RT_THREAD_SUBSCRIBE = contract.ACL_ERROR_RT_THREAD_SUBSCRIBE
ACL_ERROR_RT_REPORT_TIMEOUT = contract.ACL_ERROR_RT_REPORT_TIMEOUT
ACL_ERROR_RT_DEV_SETUP_ERROR = contract.ACL_ERROR_RT_DEV_SETUP_ERROR
ACL_ERROR_RT_DRV_INTERNAL_ERROR = contract.ACL_ERROR_RT_DRV_INTERNAL_ERROR
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = contract.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
ACL_ERROR_RT_MEMORY_ALLOCATION = contract.ACL_ERROR_RT_MEMORY_ALLOCATION
ACL_ERROR_RT_NO_PERMISSION = contract.ACL_ERROR_RT_NO_PERMISSION
ACL_ERROR_RT_PARAM_INVALID = contract.ACL_ERROR_RT_PARAM_INVALID
ACL_ERROR_RT_STREAM_NOT_COMPLETE = contract.ACL_ERROR_RT_STREAM_NOT_COMPLETE
ACL_ERROR_RT_EVENT_NOT_COMPLETE = contract.ACL_ERROR_RT_EVENT_NOT_COMPLETE
ACL_ERROR_RT_AICORE_EXCEPTION = contract.ACL_ERROR_RT_AICORE_EXCEPTION
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = contract.ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
ACL_ERROR_SNAPSHOT_BACKUP_FAILED = contract.ACL_ERROR_SNAPSHOT_BACKUP_FAILED
ACL_ERROR_SNAPSHOT_CALLBACK_FAILED = contract.ACL_ERROR_SNAPSHOT_CALLBACK_FAILED
ACL_ERROR_SNAPSHOT_LOCK_FAILED = contract.ACL_ERROR_SNAPSHOT_LOCK_FAILED
ACL_ERROR_SNAPSHOT_LOCK_TIMEOUT = contract.ACL_ERROR_SNAPSHOT_LOCK_TIMEOUT
ACL_ERROR_SNAPSHOT_REGISTER_CALLBACK_FAILED = contract.ACL_ERROR_SNAPSHOT_REGISTER_CALLBACK_FAILED
ACL_ERROR_SNAPSHOT_RESTORE_FAILED = contract.ACL_ERROR_SNAPSHOT_RESTORE_FAILED
ACL_ERROR_SNAPSHOT_UNLOCK_FAILED = contract.ACL_ERROR_SNAPSHOT_UNLOCK_FAILED
ACL_ERROR_UNINITIALIZE = contract.ACL_ERROR_UNINITIALIZE
ACL_SUCCESS = contract.ACL_SUCCESS
DRIVER_FLOW_FLAGS = contract.DRIVER_FLOW_FLAGS
DRIVER_FLOW_MIN_VERSION = contract.DRIVER_FLOW_MIN_VERSION


def describe(code: int) -> Tuple[str, str, str]:
    """(name, meaning, hint) of an ACL error code; unknown codes are described as such."""
    if code in ERRORS:
        return ERRORS[code]
    return contract.ACL_ERROR_UNKNOWN


class AclError(Exception):
    """A failed ACL call. ``str(e)`` names the code, its meaning and the likely cause / next step."""

    def __init__(self, code: int, call: str = "", detail: str = "", pid: Optional[int] = None) -> None:
        name, meaning, hint = describe(code)
        self.code = code
        self.name = name
        self.meaning = meaning
        self.hint = hint.replace("{pid}", str(os.getpid() if pid is None else pid))
        self.call = call
        self.detail = detail
        super().__init__(self._render())

    def _render(self) -> str:
        text = f"{self.code}: {self.meaning}"
        if self.detail:
            text += f" ({self.detail})"
        if self.hint:
            text += f" — {self.hint}"
        return text

    def to_dict(self) -> JSONObject:
        return {
            "code": self.code,
            "name": self.name,
            "meaning": self.meaning,
            "hint": self.hint,
            "call": self.call,
            "message": str(self),
        }


class CannNotFound(AclError):
    """No usable CANN installation (or a stub/devlib one). Not an ACL return code: ``code`` is -1."""

    def __init__(self, message: str, hint: str) -> None:
        Exception.__init__(self, f"{message} — {hint}")
        self.code = -1
        self.name = "CANN_NOT_FOUND"
        self.meaning = message
        self.hint = hint
        self.call = ""
        self.detail = ""


# -- ELF symbol table (so discovery never has to load a library into the caller) -----------------


def elf_defined_symbols(path: str) -> Optional[Set[str]]:
    """Names of the functions and objects ``path`` exports (its defined dynamic symbols), or None
    if it cannot be read as a 64-bit ELF file.

    Reading .dynsym avoids dlopen()ing a real CANN library into the CLI, which would run its
    constructors and pull in the driver.
    """
    try:
        with elf.open_elf(path) as lib:
            return {s.name for s in lib.symbols() if s.type in (elf.STT_OBJECT, elf.STT_FUNC)}
    except (OSError, elf.ElfError):
        return None


# -- discovery -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CannInstall:
    """A CANN installation as found on disk (nothing loaded)."""

    home: str
    source: str  # "--ascend-home", "ASCEND_HOME_PATH" or "default path"
    version: Optional[str]
    acl_library: str
    runtime_library: Optional[str]
    simulated: bool
    symbols: Dict[str, bool] = field(default_factory=dict)


def _is_devlib(path: str) -> bool:
    return "devlib" in Path(os.path.realpath(path)).parts or "devlib" in Path(path).parts


def library_dirs(home: str) -> List[str]:
    """Where a CANN tree keeps its libraries: ``lib64`` and ``<arch>-linux/lib64``."""
    arch = platform.machine()
    return [os.path.join(home, "lib64"), os.path.join(home, f"{arch}-linux", "lib64")]


def read_version_info(home: str) -> Tuple[Optional[str], bool]:
    """(version, simulated) from ``share/info/runtime/version.info``; (None, False) if absent."""
    version: Optional[str] = None
    simulated = False
    try:
        text = (Path(home) / VERSION_INFO).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, False
    for line in text.splitlines():
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if key.lower() == "version" and value:
            version = value
        elif key.lower() == "simulated" and value:
            simulated = True
    return version, simulated


def home_of_library(lib: str) -> str:
    """The CANN home a library belongs to: lib64/.. or <arch>-linux/lib64/../.."""
    d = Path(os.path.realpath(lib)).parent
    if d.name == "lib64" and d.parent.name.endswith("-linux"):
        return str(d.parent.parent)
    return str(d.parent)


def inspect_home(home: str, source: str) -> CannInstall:
    """Look at one candidate CANN home; raise CannNotFound saying what is wrong with it."""
    if not os.path.isdir(home):
        raise CannNotFound(
            f"CANN home {home} (from {source}) does not exist",
            "pass --ascend-home DIR, or source the installation's set_env.sh",
        )
    candidates: List[str] = []
    for d in library_dirs(home):
        for name in ACL_LIBRARY_NAMES:
            p = os.path.join(d, name)
            if os.path.isfile(p):
                candidates.append(p)
    stubs = [p for p in candidates if _is_devlib(p)]
    candidates = [p for p in candidates if not _is_devlib(p)]
    if not candidates:
        if stubs or os.path.isdir(os.path.join(home, "devlib")):
            raise CannNotFound(
                f"{home} (from {source}) has only stub libraries (devlib)",
                "devlib/ holds link-time stubs for machines without a driver, not a runtime; install "
                "the CANN runtime package with the NPU driver, or point --ascend-home at a real install",
            )
        raise CannNotFound(
            f"no libacl_rt.so or libascendcl.so under {home}/lib64 (from {source})",
            "this is not a CANN installation; pass --ascend-home DIR or source its set_env.sh",
        )
    exported: Dict[str, Set[str]] = {}
    for p in candidates:
        exported[p] = elf_defined_symbols(p) or set()
    # The library that exports the snapshot functions wins (libacl_rt.so first); if none does,
    # report the first one so that the caller can say which functions are missing.
    chosen = next((p for p in candidates if all(s in exported[p] for s in SNAPSHOT_FUNCTIONS)), candidates[0])
    runtime: Optional[str] = None
    for d in library_dirs(home):
        p = os.path.join(d, RUNTIME_LIBRARY_NAME)
        if os.path.isfile(p) and not _is_devlib(p):
            runtime = p
            break
    runtime_syms = (elf_defined_symbols(runtime) or set()) if runtime else set()
    symbols = {s: s in exported[chosen] for s in SNAPSHOT_FUNCTIONS + CALLBACK_FUNCTIONS}
    symbols[GET_STATE_FUNCTION] = GET_STATE_FUNCTION in runtime_syms
    version, simulated = read_version_info(home)
    return CannInstall(
        home=os.path.abspath(home),
        source=source,
        version=version,
        acl_library=chosen,
        runtime_library=runtime,
        simulated=simulated,
        symbols=symbols,
    )


def find_cann(ascend_home: Optional[str] = None) -> CannInstall:
    """Find the CANN installation: ``--ascend-home``, then ``$ASCEND_HOME_PATH``, then the defaults.

    An explicitly named home (argument or environment) that is unusable is an error, never a
    silent fall back to another installation.
    """
    if ascend_home:
        return inspect_home(ascend_home, "--ascend-home")
    env = os.environ.get("ASCEND_HOME_PATH")
    if env:
        return inspect_home(env, "ASCEND_HOME_PATH")
    for home in DEFAULT_HOMES:
        if os.path.isdir(home):
            return inspect_home(home, "default path")
    raise CannNotFound(
        "no CANN installation found (ASCEND_HOME_PATH is not set; "
        + " and ".join(DEFAULT_HOMES)
        + " do not exist)",
        "source your CANN set_env.sh or pass --ascend-home DIR"
        + (
            ', or use the simulated NPU: eval "$(npusnap sim env)"'
            if paths.standin_installed("npusnap_sim")
            else ""
        ),
    )


def _maps_paths(pid: Optional[int]) -> List[str]:
    where = "/proc/self/maps" if pid is None else f"/proc/{pid}/maps"
    paths: List[str] = []
    with open(where, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6:
                p = parts[5].strip()
                if p.startswith("/") and p not in paths:
                    paths.append(p)
    return paths


def _lib_basename(path: str) -> str:
    # "libacl_rt.so.1" -> "libacl_rt.so"
    return re.sub(r"(\.so)(\.[0-9.]+)?$", r"\1", os.path.basename(path))


def loaded_acl_library(pid: Optional[int] = None) -> Optional[str]:
    """Path of the ACL library (libacl_rt.so, else libascendcl.so) mapped in a process.

    ``pid`` None means this process. Returns None when none is mapped, or when the maps file
    cannot be read (no such process / no permission).
    """
    try:
        paths = _maps_paths(pid)
    except OSError:
        return None
    for name in ACL_LIBRARY_NAMES:
        for p in paths:
            if _lib_basename(p) == name and not p.endswith(" (deleted)"):
                return p
    return None


def loaded_runtime_library(pid: Optional[int] = None) -> Optional[str]:
    try:
        paths = _maps_paths(pid)
    except OSError:
        return None
    return next((p for p in paths if _lib_basename(p) == RUNTIME_LIBRARY_NAME), None)


# -- the runtime ---------------------------------------------------------------------------------


# ``aclrtSnapShotBackupArgs`` / ``aclrtSnapShotRestoreArgs`` (64 bytes): passing one selects the
# driver-backed flow of newer CANN builds; flags 0 = required device memory, 1 = also the optional
# memory. 9.1.x refuses any non-NULL args (100000). The first CANN version npusnap tries it on
# (DRIVER_FLOW_MIN_VERSION): the released 9.1.x refuses it; the simulator's 9.2.0 tree stands in
# for the newer builds (an assumption, see device-memory.md).
SnapShotArgs = contract.SnapArgs


def version_tuple(version: Optional[str]) -> Tuple[int, ...]:
    nums = re.findall(r"\d+", version or "")
    return tuple(int(n) for n in nums[:3])


# uint32_t (*aclrtSnapShotCallBack)(int32_t deviceId, void *args)
CALLBACK_TYPE = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_int32, ctypes.c_void_p)
StageCallback = Callable[[int], int]


class AclRuntime:
    """The snapshot API of one loaded CANN runtime. Each call acts on the calling process only."""

    def __init__(self, lib: ctypes.CDLL, path: str, runtime: Optional[ctypes.CDLL] = None) -> None:
        self._lib = lib
        self._runtime = runtime
        self.path = path
        self.version = self._read_version()
        self.simulated = read_version_info(home_of_library(path))[1]
        # ctypes callback objects must outlive their registration or the C side calls freed code.
        self._callbacks: Dict[Tuple[int, StageCallback], object] = {}
        self.callback_errors: List[BaseException] = []
        for name in SNAPSHOT_FUNCTIONS:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
                fn.restype = ctypes.c_int

    @classmethod
    def in_process(cls) -> Optional[AclRuntime]:
        """The runtime this process already loaded (never a second copy), or None if none is."""
        path = loaded_acl_library()
        if path is None:
            return None
        # RTLD_NOLOAD: only take a handle on the mapped copy; a second copy would be a second,
        # empty runtime that knows nothing about this process's devices.
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        rt_path = loaded_runtime_library()
        runtime = ctypes.CDLL(rt_path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL) if rt_path else None
        return cls(lib, path, runtime)

    @classmethod
    def load(cls, path: str) -> AclRuntime:
        """Load (or reuse, if already mapped) the ACL library at ``path``."""
        if _is_devlib(path):
            raise CannNotFound(
                f"refusing to load {path}: it is a devlib stub library",
                "devlib/ holds link-time stubs without a runtime; use the library in lib64/",
            )
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        rt_path = loaded_runtime_library()
        if rt_path is None:
            sibling = os.path.join(os.path.dirname(path), RUNTIME_LIBRARY_NAME)
            rt_path = sibling if os.path.isfile(sibling) else None
        runtime = ctypes.CDLL(rt_path, mode=ctypes.RTLD_GLOBAL) if rt_path else None
        return cls(lib, path, runtime)

    def _read_version(self) -> Optional[str]:
        version, _ = read_version_info(home_of_library(self.path))
        if version:
            return version
        fn = getattr(self._lib, "aclsysGetVersionStr", None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        fn.restype = ctypes.c_int
        buf = ctypes.create_string_buffer(128)
        if fn(b"runtime", buf) != 0:
            return None
        return buf.value.decode("ascii", "replace") or None

    def has(self, name: str) -> bool:
        return getattr(self._lib, name, None) is not None

    def _call(self, name: str, flags: Optional[int] = None) -> None:
        fn = getattr(self._lib, name, None)
        if fn is None:
            raise AclError(
                ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call=name, detail=f"{self.path} does not export {name}"
            )
        if flags is None:
            code = int(fn(os.getpid(), None))
        else:
            args = SnapShotArgs(flags=flags)
            code = int(fn(os.getpid(), ctypes.cast(ctypes.byref(args), ctypes.c_void_p)))
        if code != ACL_SUCCESS:
            raise AclError(code, call=name, detail="driver-backed flow" if flags is not None else "")

    def lock(self) -> None:
        self._call("aclrtSnapShotProcessLock")

    def backup(self, flags: Optional[int] = None) -> None:
        """Backup; ``flags`` (0/1) selects the driver-backed flow, None the legacy one."""
        self._call("aclrtSnapShotProcessBackup", flags)

    def restore(self, flags: Optional[int] = None) -> None:
        self._call("aclrtSnapShotProcessRestore", flags)

    def may_have_driver_flow(self) -> bool:
        """Whether this CANN is new enough to try the driver-backed flow (Backup then says
        207000 where the driver lacks the feature, and npusnap falls back to the legacy flow)."""
        if os.environ.get("NPUSNAP_DRIVER_FLOW") == "0":
            return False
        return version_tuple(self.version) >= DRIVER_FLOW_MIN_VERSION

    def unlock(self) -> None:
        self._call("aclrtSnapShotProcessUnlock")

    def state(self) -> Optional[SnapshotState]:
        """The process's snapshot state, or None when this runtime cannot tell. Never blocks."""
        fn = getattr(self._runtime, GET_STATE_FUNCTION, None) if self._runtime is not None else None
        if fn is None:
            return None
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        value = ctypes.c_int(-1)
        code = int(fn(ctypes.byref(value)))
        if code != 0:
            raise AclError(code, call=GET_STATE_FUNCTION)
        return SnapshotState(value.value)

    def register_callback(self, stage: Stage, fn: StageCallback) -> None:
        """Run ``fn(device_id)`` at ``stage`` (once per open device); non-zero aborts the operation.

        An exception in ``fn`` counts as failure (returns 1 to the runtime) and is kept in
        ``callback_errors``, because ctypes would otherwise print it and return 0 — success.
        """
        key = (int(stage), fn)
        if key in self._callbacks:
            raise AclError(ACL_ERROR_SNAPSHOT_REGISTER_CALLBACK_FAILED, call="aclrtSnapShotCallbackRegister")

        def trampoline(device_id: int, _args: Optional[int]) -> int:
            try:
                return int(fn(int(device_id))) & 0xFFFFFFFF
            except BaseException as exc:  # must not propagate into C
                self.callback_errors.append(exc)
                return 1

        cfn = CALLBACK_TYPE(trampoline)
        reg = getattr(self._lib, "aclrtSnapShotCallbackRegister", None)
        if reg is None:
            raise AclError(
                ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                call="aclrtSnapShotCallbackRegister",
                detail=f"{self.path} does not export it (CANN 9.0+ needed)",
            )
        reg.argtypes = [ctypes.c_int, CALLBACK_TYPE, ctypes.c_void_p]
        reg.restype = ctypes.c_int
        code = int(reg(int(stage), cfn, None))
        if code != ACL_SUCCESS:
            raise AclError(code, call="aclrtSnapShotCallbackRegister")
        self._callbacks[key] = cfn

    def unregister_callback(self, stage: Stage, fn: StageCallback) -> None:
        key = (int(stage), fn)
        cfn = self._callbacks.get(key)
        if cfn is None:
            raise AclError(
                ACL_ERROR_RT_PARAM_INVALID, call="aclrtSnapShotCallbackUnregister", detail="not registered"
            )
        unreg = getattr(self._lib, "aclrtSnapShotCallbackUnregister", None)
        if unreg is None:
            raise AclError(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, call="aclrtSnapShotCallbackUnregister")
        unreg.argtypes = [ctypes.c_int, CALLBACK_TYPE]
        unreg.restype = ctypes.c_int
        code = int(unreg(int(stage), cfn))
        if code != ACL_SUCCESS:
            raise AclError(code, call="aclrtSnapShotCallbackUnregister")
        del self._callbacks[key]
