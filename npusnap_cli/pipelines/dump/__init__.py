"""The dump pipeline: NPU processes locked and backed up, the tree dumped by CRIU, the image published.

design.md §3, in order:

1. resolve the tree of PID and its NPU processes (attach where an agent is missing);
2. preflight (CRIU, privileges, DIR, free space against the expected image, host RAM against
   the device bytes);
3. Lock + Backup every NPU process in parallel under a lease (``DeviceGroup``);
4. close the agent connections, CRIU dump of the whole tree into a temporary sibling of DIR;
5. publish (checksums, manifest, fsync, the checks of ``verify`` on the complete work
   directory, rename), then the original tree is killed — or, with ``leave_running``, every NPU
   process is unlocked and keeps running. The manifest lists exactly what CRIU dumped (zombies
   included), and host files its restore would refuse are refused at preflight: a dump never
   reports success for an image its own restore refuses.

Never lose the job: CRIU dumps with ``leave_stopped`` rather than letting CRIU kill the tree, so
that the original is killed only once the image is safely on disk; until then every failure
(CRIU refused or crashed, disk full, a device call or an agent failed, Ctrl-C / SIGTERM) rolls
every locked process back to RUNNING and removes the partial image; if npusnap itself dies while
the tree is stopped, ``StopGuard``'s watcher resumes it and the leases roll it back. If the
rollback itself fails the error is ``StateUnknownError`` with the commands to inspect and recover.

The steps (``STEPS``, steps.py) run on the pipeline engine (engine.py), over a ``DumpState``:
each step's undo is its share of that rollback, and ``_failed`` says on the way out what was
rolled back and where the discarded image's logs went. A job dump runs the same steps per rank
with the job's barriers (jobsnap/).

Core module: returns frozen dataclasses, reports progress through ``DumpCallbacks``, never prints.

The modules, in the order they build on one another: options.py (what the dump is asked and
answers), target.py (the tree), treechecks.py (what CRIU or the restore would refuse), state.py
(``DumpState``), devmemory.py (the device memory), manifest.py (manifest, checksums, publish),
agents.py (connect, hello, lock + backup, unlock), criudump.py (the CRIU step), checks.py (the
checks, also of `dump --dry-run`), steps.py (``STEPS``, ``dump``, ``dry_run``).
"""

from __future__ import annotations

from npusnap_cli.pipelines.dump.agents import _disconnect, _roll_back_devices
from npusnap_cli.pipelines.dump.criudump import _resume
from npusnap_cli.pipelines.dump.devmemory import check_device_memory
from npusnap_cli.pipelines.dump.options import DumpCallbacks, DumpOptions, DumpOutcome
from npusnap_cli.pipelines.dump.state import DumpState
from npusnap_cli.pipelines.dump.steps import STEPS, DryRunOutcome, _discard, dry_run, dump
from npusnap_cli.pipelines.dump.target import _Target
from npusnap_cli.pipelines.dump.treechecks import _check_npu_plugin, _check_session, _check_space_and_memory

__all__ = [
    "STEPS",
    "DryRunOutcome",
    "DumpCallbacks",
    "DumpOptions",
    "DumpOutcome",
    "DumpState",
    "_Target",
    "_check_npu_plugin",
    "_check_session",
    "_check_space_and_memory",
    "_discard",
    "_disconnect",
    "_resume",
    "_roll_back_devices",
    "check_device_memory",
    "dry_run",
    "dump",
]
