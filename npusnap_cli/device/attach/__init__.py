"""Inject the npusnap agent into an already-running Python process (`npusnap attach PID`).

Two methods, chosen by the target's Python version:

* **3.14+**: ``sys.remote_exec(pid, bootstrap.py)`` (PEP 768). It needs the caller to run the
  same major.minor as the target, so when npusnap's own Python differs we run the *target's*
  interpreter (``/proc/PID/exe -I -c ...``). The script runs on the target's main thread at
  its next bytecode boundary, which the interpreter guarantees is safe.
* **3.9-3.13**: gdb makes one thread of the target ``dlopen()`` a tiny payload
  (``native/attach/payload.c``) whose constructor only starts a new thread; that thread takes
  the GIL properly and runs the bootstrap. gdb calls dlopen only on a thread at a safe point.
  First, reading no symbols at all (``native_attach.dlopen_in``, as for a native program): a
  thread blocked in a lock-free system call, looked for during FAST_WINDOW_S; gdb reading the
  symbols of a large job's hundreds of libraries is what stops it for seconds. Otherwise at a
  breakpoint on the entry of a libpython function reached from clean points, or on a thread
  blocked in a system call whose stack holds no allocator/loader frame; that driver
  (``native/attach/gdb_inject.py``) explains why, and reads only the symbols it needs. Neither
  runs Python code on a borrowed thread; both always detach.

How long the job could not run because of the attach is measured (``stopped_s``, an upper
bound): how long gdb had it traced, watched from outside, plus the time the bootstrap held the GIL.

Either way the bootstrap writes a status file, and attach succeeds only once the agent answers
``hello`` over its control socket with the target's pid. Before acting we probe (memray-style):
the pid exists, is a Python we support, is not stopped or already traced, we may trace it, and
whether an agent is already there (then attach is a no-op success). When anything fails the
error says what the target is doing (each thread's top frames, /proc state and wchan) and what
to do.

The per-attach files (bootstrap, status, payload copy) live in a fresh 0700 directory, files
0600 (the payload copy 0700, it is mapped executable), owned by the target's user, and are
deleted afterwards. The payload stays mapped in the target (a deleted file mapping, 16 KiB),
which CRIU saves as a ghost file.

The modules: probe.py (``probe``), bootstrap.py (the per-attach directory and the bootstrap),
inject.py (``inject``, ``diagnose``), attaching.py (``attach``, ``attach_native``).
"""

from __future__ import annotations

from npusnap_cli.device.attach.attaching import attach
from npusnap_cli.device.attach.bootstrap import BOOTSTRAP_NAME, STATUS_NAME, bootstrap_source
from npusnap_cli.device.attach.inject import diagnose, inject
from npusnap_cli.device.attach.probe import _proc_state, probe

__all__ = [
    "BOOTSTRAP_NAME",
    "STATUS_NAME",
    "_proc_state",
    "attach",
    "bootstrap_source",
    "diagnose",
    "inject",
    "probe",
]
