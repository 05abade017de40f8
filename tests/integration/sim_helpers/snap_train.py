"""train.py with test-only snapshot triggers, for the CRIU end-to-end tests of the simulator.

SIGUSR1: Lock + Backup (the device connection stays open: CRIU needs npusim_plugin.so), then wait
for SIGUSR2.
SIGUSR2: Restore (retried on every further SIGUSR2 until it succeeds) + Unlock, then the loop goes
on. Every result is appended to the file named by SNAP_STATUS as ``<call> <rc>``. This stands in
for the npusnap agent, which the simulator tests must not depend on.

With SNAP_DEVMEM=1 (and libnpusnap_agent.so in LD_PRELOAD) it also does what the agent does for
device memory: npusnap_devmem_save before Lock, npusnap_devmem_reload + finish after Unlock.
Without it, the parameters are lost at Restore, as on real CANN.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

WORKLOADS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "npusnap_workloads")
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


DEVMEM = os.environ.get("SNAP_DEVMEM") == "1"
me = ctypes.CDLL(None)
err = ctypes.create_string_buffer(256)


def devmem(name: str, *args: object) -> None:
    rc = int(getattr(me, f"npusnap_devmem_{name}")(*args))
    mark(f"devmem_{name} {rc} {err.value.decode()}".rstrip())


def on_usr1(_signum: int, _frame: object) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    if DEVMEM:
        devmem("save", 5000, err, 256)
    if call("Lock") != 0 or call("Backup") != 0:
        call("Unlock")
        return
    while True:
        # Parked here across CRIU dump and restore; device calls of the loop would block anyway.
        signal.sigwait({signal.SIGUSR2})
        if call("Restore") == 0:
            break
    call("Unlock")
    if DEVMEM:
        devmem("reload", err, 256)
        me.npusnap_devmem_finish()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, lambda *_: None)  # a handler, not SIG_IGN: ignored signals are dropped
mark("ready")
raise SystemExit(train.main(sys.argv[1:]))
