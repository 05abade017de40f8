"""The npusnap agent's Python face: ``start()`` and application hooks.

Standard library only, Python 3.9+. Importing this package starts nothing and imports nothing
heavy. The agent itself is native (``libnpusnap_agent.so``, see docs/agent.md): its own pthread
serves the control socket, calls the CANN snapshot API and runs the lease, and never needs the
GIL. This module only loads it, tells it about the interpreter, and runs Python hooks for it.

Ways in:

* ``npusnap run -- PROG`` preloads the library into any program (Python or not) and starts it;
  in Python processes the env-gated ``sitecustomize`` also calls ``start()`` so hooks work;
* ``import npusnap_cli.agent as agent; agent.start()`` in the application;
* ``npusnap attach PID`` loads it into a running process.

Application hooks::

    agent.register_hook("pre_lock", torch_npu.npu.synchronize)
    agent.register_hook("post_unlock", reload_weights)

Stages: ``pre_lock``, ``post_backup``, ``post_restore``, ``post_unlock`` (see ``hooks.py``).
A hook that raises aborts the operation and the snapshot state is rolled back. The agent waits
for the hooks of a stage at most ``hook_timeout_s`` (default 10 s): if the GIL cannot be had in
time (an extension holds it while it waits for the device), the stage fails, the agent rolls
back natively, and the hooks, should they get the GIL later, see that they were cancelled and
do nothing.

Device memory (docs/device-memory.md): under ``npusnap run`` every aclrtMalloc is seen and kept
across a snapshot. Otherwise, or for memory npusnap cannot see being allocated, declare it::

    agent.register_buffer(dev_ptr, nbytes)   # npusnap copies it after Lock, back after Restore
    agent.exclude_buffer(kv_ptr, nbytes)     # needs no copy (scratch, a KV cache to recompute)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from typing import Any, Optional

from npusnap_cli import contract, paths
from npusnap_cli.agent import native
from npusnap_cli.agent.hooks import STAGES, Hook, HookFailed, HookRegistry

__all__ = [
    "STAGES",
    "exclude_buffer",
    "register_buffer",
    "register_hook",
    "running",
    "socket_path",
    "start",
    "stop",
    "unregister_hook",
]

ENV_SWITCH = "NPUSNAP_AGENT"
DEFAULT_HOOK_TIMEOUT_S = 10.0

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_hooks = HookRegistry()  # kept across agent restarts and inherited by forked children
_callback: Any = None  # the ctypes callback object must outlive its registration
_fork_handler_installed = False


def log(message: str) -> None:
    """One line into the agent's log, never into the application's streams (docs/agent.md,
    "Messages"): through the native core when it is loaded, else appended to the file that
    ``npusnap run`` named in NPUSNAP_AGENT_LOG (and to stderr only with NPUSNAP_AGENT_STDERR=1).
    Never raises."""
    try:
        lib = _lib
        if lib is not None:
            lib.npusnap_agent_log(message.encode("utf-8", "replace"))
            return
        line = f"npusnap-agent: [{os.getpid()}] {message}\n"
        write_log_line(line)
    except Exception:
        pass


def append_log_line(path: str, line: str) -> bool:
    """``line``, time-stamped, appended to the agent log at ``path`` (created 0600, never through a
    symlink). False when it could not be written. Never raises."""
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        try:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime())
            os.write(fd, (stamp + line).encode("utf-8", "replace"))
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def write_log_line(line: str) -> None:
    """``line`` appended to the agent log as the native core would name it (it is not there to do
    it): NPUSNAP_AGENT_LOG, else ``<runtime dir>/<pid>.log`` when that directory is there and
    private; and to stderr when NPUSNAP_AGENT_STDERR=1. Never raises."""
    path = os.environ.get(contract.AGENT_LOG_ENV) or ""
    if not path.startswith("/"):
        runtime = paths.agent_runtime_dir()
        if runtime.is_dir() and paths.runtime_dir_problem(runtime) is None:
            path = str(paths.agent_log_path(os.getpid()))
    if path.startswith("/"):
        append_log_line(path, line)
    if os.environ.get(contract.AGENT_STDERR_ENV) == "1":
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except Exception:
            pass


def _run_stage(handle: Optional[int], stage: bytes, out: Optional[int], outlen: int) -> int:
    """Called by the native core on a helper thread (ctypes takes the GIL first)."""
    try:
        lib = _lib
        if lib is None or out is None:
            return 1
        if lib.npusnap_agent_hook_claim(handle) != 0:
            return 2  # the agent gave up waiting and rolled back: do nothing
        payload: dict[str, Any]
        try:
            payload = {"ok": True, "ran": _hooks.run(stage.decode())}
        except HookFailed as exc:
            log(str(exc))
            payload = {"ok": False, "hook": exc.hook, "error": exc.error[:2000]}
        data = json.dumps(payload).encode("utf-8")
        if len(data) >= outlen:
            data = json.dumps({"ok": False, "hook": "?", "error": "hook result too large"}).encode()
        ctypes.memmove(out, data + b"\0", len(data) + 1)
        return 0
    except BaseException:
        return 1


def _sync_hooks() -> None:
    lib = _lib
    if lib is None:
        return
    names = _hooks.names()
    mask = sum(1 << i for i, stage in enumerate(STAGES) if names.get(stage))
    lib.npusnap_agent_set_hooks(mask, json.dumps(names).encode("utf-8"))


def start(hook_timeout_s: float = DEFAULT_HOOK_TIMEOUT_S) -> Optional[str]:
    """Start the agent (idempotent); return the socket path, or None if it failed.

    Never raises: a process must not die because its snapshot agent could not start.
    """
    global _lib, _callback
    try:
        with _lock:
            _install_fork_handler()
            if _lib is None:
                _lib = native.load()
            lib = _lib
            if _callback is None:
                _callback = native.HOOK_CALLBACK(_run_stage)
            lib.npusnap_agent_set_hook_callback(_callback, float(hook_timeout_s))
            info = {
                "version": sys.version.split()[0],
                "executable": sys.executable,
                "implementation": sys.implementation.name,
            }
            lib.npusnap_agent_set_python_info(json.dumps(info).encode("utf-8"))
            _sync_hooks()
            path = lib.npusnap_agent_start()
            if not path:
                log(f"could not start the agent: {lib.npusnap_agent_last_error().decode(errors='replace')}")
                return None
            return str(path.decode())
    except Exception as exc:
        log(f"could not start the agent: {type(exc).__name__}: {exc}")
        return None


def stop() -> None:
    """Stop serving and remove the socket (the snapshot state is left as it is)."""
    try:
        with _lock:
            if _lib is not None:
                _lib.npusnap_agent_stop()
    except Exception as exc:
        log(f"could not stop the agent: {exc}")


def running() -> bool:
    """True if this process's agent thread is running."""
    lib = _lib
    return bool(lib is not None and lib.npusnap_agent_running())


def socket_path() -> Optional[str]:
    lib = _lib
    path = lib.npusnap_agent_socket_path() if lib is not None else None
    return path.decode() if path else None


def register_hook(stage: str, fn: Hook, name: str = "") -> str:
    """Run ``fn()`` (no arguments) at ``stage``; returns the name it is reported under.

    Raises ValueError for an unknown stage: that is a programming error in the caller.
    """
    label = _hooks.register(stage, fn, name)
    _sync_hooks()
    return label


def unregister_hook(stage: str, fn: Hook) -> bool:
    done = _hooks.unregister(stage, fn)
    _sync_hooks()
    return done


def register_buffer(dev_ptr: int, size: int) -> None:
    """Have npusnap keep ``size`` bytes of device memory at ``dev_ptr`` across snapshots.

    For buffers whose allocation npusnap did not see (an attached agent, a custom allocator).
    Raises RuntimeError if npusnap's library is not available or a snapshot is in progress.
    """
    from npusnap_cli.agent import devmem  # lazy: the agent starts in every Python of the tree; few use it

    try:
        devmem.register(int(dev_ptr), int(size))
    except devmem.DevMemError as exc:
        raise RuntimeError(str(exc)) from None


def exclude_buffer(dev_ptr: int, size: int) -> None:
    """Declare that the device memory in ``[dev_ptr, dev_ptr + size)`` needs no copy (scratch, a
    KV cache to recompute): allocations lying wholly inside it come back with undefined contents."""
    from npusnap_cli.agent import devmem  # lazy: the agent starts in every Python of the tree; few use it

    try:
        devmem.exclude(int(dev_ptr), int(size))
    except devmem.DevMemError as exc:
        raise RuntimeError(str(exc)) from None


def _after_fork_in_child() -> None:
    """The native core resets itself in a forked child (and, under ``NPUSNAP_AGENT=1``, starts
    again there when the child first opens a device: native/agent/core.c); Python's own locks may
    have been held by another thread at fork time."""
    global _lock
    try:
        _lock = threading.Lock()
        _hooks.reinit_after_fork()
    except Exception as exc:
        log(f"agent reset after fork failed: {exc}")


def _install_fork_handler() -> None:
    global _fork_handler_installed
    if not _fork_handler_installed:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_handler_installed = True
