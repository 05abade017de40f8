"""train.py with test-only snapshot triggers, for the CRIU end-to-end tests of the simulator.

SIGUSR1: Lock + Backup (the device connection is released), then wait for SIGUSR2.
SIGUSR2: Restore (retried on every further SIGUSR2 until it succeeds) + Unlock, then the loop goes
on. Every result is appended to the file named by SNAP_STATUS as ``<call> <rc>``. This stands in
for the npusnap agent, which the simulator tests must not depend on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

WORKLOADS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "npusnap_cli", "workloads")
sys.path.insert(0, os.path.abspath(WORKLOADS))
import train  # noqa: E402

STATUS = os.environ["SNAP_STATUS"]
lib = train.load_acl()  # the same handle train.main() gets: one runtime per process
for name in ("Lock", "Backup", "Restore", "Unlock"):
    getattr(lib, f"aclrtSnapShotProcess{name}").argtypes = [ctypes.c_int, ctypes.c_void_p]


def mark(text: str) -> None:
    with open(STATUS, "a") as f:
        f.write(text + "\n")


def call(name: str) -> int:
    rc = int(getattr(lib, f"aclrtSnapShotProcess{name}")(os.getpid(), None))
    mark(f"{name.lower()} {rc}")
    return rc


def on_usr1(_signum: int, _frame: object) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    if call("Lock") != 0 or call("Backup") != 0:
        call("Unlock")
        return
    while True:
        # Parked here across CRIU dump and restore; device calls of the loop would block anyway.
        signal.sigwait({signal.SIGUSR2})
        if call("Restore") == 0:
            break
    call("Unlock")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, lambda *_: None)  # a handler, not SIG_IGN: ignored signals are dropped
mark("ready")
raise SystemExit(train.main(sys.argv[1:]))
