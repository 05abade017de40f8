"""The npusnap agent: a control thread inside a process that uses the Ascend NPU.

Standard library only, Python 3.9+. Importing this package starts nothing and imports nothing
heavy. Ways in:

* ``npusnap run -- python train.py`` starts it in every Python process of the launched tree
  (env-gated ``sitecustomize``, ``NPUSNAP_AGENT=1``);
* ``import npusnap_cli.agent as agent; agent.start()`` in the application;
* ``npusnap attach PID`` injects a bootstrap that calls ``start()``.

The agent serves ``paths.agent_socket_path(os.getpid())`` and lets the npusnap CLI Lock / Back
up / Restore / Unlock this process's CANN runtime (the snapshot API only acts on the calling
process). It never raises into the application: failures are logged to stderr with an
``npusnap-agent:`` prefix.

Application hooks::

    agent.register_hook("pre_lock", torch_npu.npu.synchronize)
    agent.register_hook("post_unlock", reload_weights)

Stages: ``pre_lock``, ``post_backup``, ``post_restore``, ``post_unlock`` (see ``hooks.py``).
A hook that raises aborts the operation and the snapshot state is rolled back.

Device memory (docs/device-memory.md): under ``npusnap run`` every aclrtMalloc is seen and kept
across a snapshot. Otherwise, or for memory npusnap cannot see being allocated, declare it::

    agent.register_buffer(dev_ptr, nbytes)   # npusnap copies it before Lock, back after Restore
    agent.exclude_buffer(kv_ptr, nbytes)     # needs no copy (scratch, a KV cache to recompute)
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from npusnap_cli.agent.hooks import STAGES, Hook, HookRegistry
from npusnap_cli.agent.server import Agent, log

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

_lock = threading.Lock()
_agent: Optional[Agent] = None
_hooks = HookRegistry()  # kept across agent restarts and inherited by forked children
_fork_handler_installed = False


def start() -> Optional[str]:
    """Start the agent thread (idempotent); return the socket path, or None if it failed.

    Never raises: a process must not die because its snapshot agent could not start.
    """
    global _agent
    try:
        with _lock:
            _install_fork_handler()
            if _agent is not None and _agent.pid == os.getpid():
                return str(_agent.socket_path)
            agent = Agent(hooks=_hooks)
            agent.bind()
            agent.start_thread()
            _agent = agent
            return str(agent.socket_path)
    except Exception as exc:
        log(f"could not start the agent: {type(exc).__name__}: {exc}")
        return None


def stop() -> None:
    """Stop serving and remove the socket (the snapshot state is left as it is)."""
    global _agent
    try:
        with _lock:
            if _agent is not None:
                _agent.stop()
            _agent = None
    except Exception as exc:
        log(f"could not stop the agent: {exc}")


def running() -> bool:
    """True if this process's agent thread is alive."""
    agent = _agent
    return bool(agent is not None and agent.pid == os.getpid() and agent.thread and agent.thread.is_alive())


def socket_path() -> Optional[str]:
    agent = _agent
    return str(agent.socket_path) if agent is not None and agent.pid == os.getpid() else None


def register_hook(stage: str, fn: Hook, name: str = "") -> str:
    """Run ``fn()`` (no arguments) at ``stage``; returns the name it is reported under.

    Raises ValueError for an unknown stage: that is a programming error in the caller.
    """
    return _hooks.register(stage, fn, name)


def unregister_hook(stage: str, fn: Hook) -> bool:
    return _hooks.unregister(stage, fn)


def register_buffer(dev_ptr: int, size: int) -> None:
    """Have npusnap keep ``size`` bytes of device memory at ``dev_ptr`` across snapshots.

    For buffers whose allocation npusnap did not see (an attached agent, a custom allocator).
    Raises RuntimeError if npusnap's library is not available or a snapshot is in progress.
    """
    from npusnap_cli.agent import devmem

    try:
        devmem.register(int(dev_ptr), int(size))
    except devmem.DevMemError as exc:
        raise RuntimeError(str(exc)) from None


def exclude_buffer(dev_ptr: int, size: int) -> None:
    """Declare that the device memory in ``[dev_ptr, dev_ptr + size)`` needs no copy (scratch, a
    KV cache to recompute): allocations lying wholly inside it come back with undefined contents."""
    from npusnap_cli.agent import devmem

    try:
        devmem.exclude(int(dev_ptr), int(size))
    except devmem.DevMemError as exc:
        raise RuntimeError(str(exc)) from None


def _after_fork_in_child() -> None:
    """The child of a fork must not serve (or keep open) its parent's socket."""
    global _agent, _lock
    try:
        _lock = threading.Lock()  # the parent's lock may have been held by another thread
        _hooks.reinit_after_fork()  # so may the hook registry's
        if _agent is not None:
            _agent.close_inherited()
        _agent = None
        if os.environ.get(ENV_SWITCH) == "1":
            start()
    except Exception as exc:
        log(f"agent reset after fork failed: {exc}")


def _install_fork_handler() -> None:
    global _fork_handler_installed
    if not _fork_handler_installed:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_handler_installed = True
