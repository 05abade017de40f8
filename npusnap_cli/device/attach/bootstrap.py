"""The per-attach directory (0700, the target's user's) and the bootstrap the target runs in it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from npusnap_cli.device.attach.probe import PythonTarget

STATUS_NAME = "status.json"
BOOTSTRAP_NAME = "bootstrap.py"


# -- the per-attach directory and the bootstrap ---------------------------------------------------
@dataclass(frozen=True)
class _Workdir:
    host: Path  # where we write it
    target: str  # the same directory as the target sees it


@contextmanager
def _workdir(target: PythonTarget) -> Iterator[_Workdir]:
    """A fresh 0700 directory in the target's /tmp, owned by the target's user; removed afterwards."""
    base = "/tmp" if target.root == "/" else f"{target.root}/tmp"
    host = Path(tempfile.mkdtemp(prefix="npusnap-attach-", dir=base))
    try:
        if os.geteuid() == 0 and (target.uid, target.gid) != (0, 0):
            os.chown(host, target.uid, target.gid)
        target_path = str(host) if target.root == "/" else "/tmp/" + host.name
        yield _Workdir(host=host, target=target_path)
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _write_private(path: Path, data: bytes, mode: int, target: PythonTarget) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        if os.geteuid() == 0 and (target.uid, target.gid) != (0, 0):
            os.fchown(fd, target.uid, target.gid)
    finally:
        os.close(fd)


_BOOTSTRAP_FRAME = """\
import _thread, json, os, sys, time, traceback
_T0 = __npusnap_gil_t0__
_DIR = {dir!r}
def _report(data):
    data.update(pid=os.getpid(), python="%d.%d.%d" % sys.version_info[:3],
                native_tid=_thread.get_native_id(), gil_s=round(time.monotonic() - _T0, 4))
    tmp = os.path.join(_DIR, ".status.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(_DIR, {status!r}))
def _guess_main(me):
    found = []
    for ident, frame in sys._current_frames().items():
        while ident != me and frame.f_back is not None:
            frame = frame.f_back
        name = frame.f_globals.get("__name__")
        if ident != me and ((frame.f_code.co_name == "<module>" and name == "__main__")
                            or (name == "runpy" and frame.f_code.co_name == "_run_module_as_main")):
            found.append(ident)
    return found[0] if len(found) == 1 else 0
def _import_threading():
    # Before 3.13 `threading` takes whichever thread imports it first for the main thread. If the
    # application never imported it, that would be us: point it at the real main thread, with a
    # lock that stays held while the process lives (threading._shutdown releases it at exit).
    if "threading" in sys.modules or sys.version_info >= (3, 13):
        return None
    me = _thread.get_ident()
    main = __npusnap_main_ident__ or _guess_main(me)
    import threading
    mt = threading._main_thread
    if mt.ident != me:
        return None
    if not main:
        return "threading was first imported by the attach thread and the main thread is unknown"
    lock = _thread.allocate_lock()
    lock.acquire()
    with threading._active_limbo_lock:
        threading._active.pop(me, None)
        mt._ident = main
        mt._native_id = os.getpid()
        mt._tstate_lock = lock
        threading._active[main] = mt
    return None
try:
    _threading_note = _import_threading()
{body}
except BaseException as _exc:
    _report({{"ok": False, "stage": "bootstrap", "error": "%s: %s" % (type(_exc).__name__, _exc),
              "traceback": traceback.format_exc()}})
"""

# Starts the agent from npusnap's own package directory: put it on sys.path only for the import
# (the package keeps its __path__ for later submodule imports), so that the application's own
# imports never see our directory.
AGENT_BODY = """\
_parent = {parent!r}
_added = "npusnap_cli" not in sys.modules and _parent not in sys.path
if _added:
    sys.path.insert(0, _parent)
try:
    import npusnap_cli.agent as _agent
finally:
    if _added and _parent in sys.path:
        sys.path.remove(_parent)
_sock = _agent.start()
if _sock is None:
    raise RuntimeError("npusnap_cli.agent.start() failed; the agent log (<runtime dir>/<pid>.log) says why")
_report({{"ok": True, "socket": _sock, "agent_module": _agent.__file__, "note": _threading_note}})
"""


def bootstrap_source(body: str, target_dir: str) -> str:
    """The bootstrap file: one exec() statement, so that it leaves no names in any namespace.

    ``body`` runs inside ``try:`` with ``_report(dict)`` available and must call it on success.
    """
    inner = _BOOTSTRAP_FRAME.format(
        dir=target_dir, status=STATUS_NAME, body="\n".join("    " + ln for ln in body.splitlines())
    )
    # The gdb payload passes __npusnap_main_ident__ (sys.remote_exec, 3.14+, does not need it)
    # and when it took the GIL (__npusnap_gil_t0__); without that, the GIL is held from here.
    return (
        f"exec(compile({inner!r}, {target_dir + '/' + BOOTSTRAP_NAME!r}, 'exec'), "
        "{'__npusnap_main_ident__': globals().get('__npusnap_main_ident__', 0), "
        "'__npusnap_gil_t0__': globals().get('__npusnap_gil_t0__') or __import__('time').monotonic()})\n"
    )
