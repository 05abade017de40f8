"""What restore does once CRIU has brought the tree back: bounded waits, honest failures.

After CRIU's restore the tree exists again and every NPU process is locked (by the dump's
token) until its agent restores the device state and unlocks. Three things must never happen
there: waiting without bound for an agent that cannot answer (its process stopped), ignoring
Ctrl-C / SIGTERM during that wait, and reporting "nothing was changed" (exit 11) for a tree that
was restored and stays locked. ``DeviceWait`` is the ``interrupted`` callback of the restore's
DeviceGroup: a signal, or a process that stays stopped, ends the wait; ``after_failure`` turns
the error into one that says what state the tree is in and the exact commands that recover it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Optional

from npusnap_cli import criu
from npusnap_cli.errors import BusyError, CriuError, InterruptedError_, NpusnapError, StateUnknownError
from npusnap_cli.host import procfs
from npusnap_cli.host.stopguard import StopGuard
from npusnap_cli.jsontypes import array
from npusnap_cli.pipelines.engine import SignalGuard

STOPPED_LIMIT_S = 10.0  # a restored process stopped (not by us) this long: its agent will not answer


class DeviceWait:
    """Polled by the device step's waits (DeviceGroup ``interrupted``)."""

    def __init__(
        self, pids: Iterable[int], guard: Optional[SignalGuard], stopped_limit_s: float = STOPPED_LIMIT_S
    ) -> None:
        self.pids = list(pids)
        self.guard = guard
        self.limit = stopped_limit_s
        self._since: dict[int, float] = {}
        self.stalled: Optional[int] = None

    def __call__(self) -> bool:
        if self.guard is not None and self.guard.received is not None:
            return True
        now = time.monotonic()
        for pid in self.pids:
            if procfs.stop_state(pid) is None:
                self._since.pop(pid, None)
            elif now - self._since.setdefault(pid, now) >= self.limit:
                self.stalled = pid
                return True
        return False


def recovery(pids: Iterable[int], root_pid: int) -> list[str]:
    """The commands that bring a restored, locked tree to running (or end it)."""
    cmds = []
    for p in pids:
        cmds += [f"kill -CONT {p}", f"npusnap status {p}", f"npusnap thaw --force {p}"]
    cmds.append(f"(or end the restored job: kill -KILL {root_pid})")
    return cmds


def after_failure(
    err: NpusnapError, wait: Optional[DeviceWait], pids: tuple[int, ...], root_pid: int
) -> NpusnapError:
    """The device step failed after CRIU restored the tree: never "nothing was changed"."""
    cmds = recovery(pids, root_pid)
    if wait is not None and wait.stalled is not None:
        return StateUnknownError(
            f"CRIU restored the tree (root pid {root_pid}), but pid {wait.stalled} stayed stopped for "
            f"{wait.limit:g}s: its agent cannot restore the device state; the tree stays locked",
            why="something stopped the restored process (SIGSTOP, a debugger, a CRIU plugin that "
            "waits for the same agent)",
            fix="recover it: " + " ; ".join(cmds),
            details={**err.details, "recovery_commands": cmds, "restored_root_pid": root_pid},
        )
    if isinstance(err, InterruptedError_):
        err.message = (
            f"restore interrupted after CRIU restored the tree (root pid {root_pid}); its NPU "
            "process(es) stay locked"
        )
        err.fix = "recover: " + " ; ".join(cmds)
        err.details["recovery_commands"] = cmds
        return err
    if isinstance(err, BusyError):
        # The restored agents' lock is not the dump's (a token mismatch): the tree was changed.
        return StateUnknownError(
            f"CRIU restored the tree (root pid {root_pid}), but its lock is not the dump's: "
            + err.message.replace(", nothing was changed", "").replace("nothing was changed", ""),
            why="the image's agents were locked by another owner than the dump that wrote its manifest "
            "(a dump that lost its lock, or an edited manifest); the tree stays locked",
            fix="if you trust the image: " + " ; ".join(cmds) + "; else kill the restored tree",
            details={**err.details, "recovery_commands": cmds, "restored_root_pid": root_pid},
        )
    return err


def restore_stop_guard() -> StopGuard:
    """A StopGuard that, should npusnap die, kills the CRIU it starts next and what it restored."""
    guard = StopGuard([], kill_restored=True)

    def started(pid: int) -> None:
        guard.tell("criu", pid)
        criu.SWRK_STARTED.remove(started)

    criu.SWRK_STARTED.append(started)
    return guard


def concurrent_restore(err: CriuError, manifest_pids: Iterable[int]) -> Optional[BusyError]:
    """A CRIU restore that failed because another restore took the image's pids first."""
    excerpt = "\n".join(str(x) for x in array(err.details.get("criu_log_excerpt")))
    if "File exists" not in excerpt or ("fork" not in excerpt.lower() and "ns_last_pid" not in excerpt):
        return None
    pids = sorted(set(manifest_pids))
    return BusyError(
        f"a pid of the image is taken (another restore of it, or a process that started meanwhile): "
        f"CRIU could not recreate pid(s) among {pids[:8]}",
        why="CRIU restores each process with its original pid; a concurrent restore of the same image "
        "won that race; this restore changed nothing",
        fix="wait for the other restore to finish (`npusnap status PID`); restore again only once the "
        "image's pids are free",
        details=dict(err.details),
    )
