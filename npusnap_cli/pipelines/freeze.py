"""`npusnap freeze` and `npusnap thaw`: the device half of a snapshot, the lock kept across two
commands. Each is a short list of steps on the pipeline engine (engine.py) over a ``DeviceGroup``.

freeze: refuse a job that is locked already, Lock (+ Backup) every NPU process of the tree as its
owner, hand the tokens over to ``thaw``. Ctrl-C / SIGTERM during it rolls back what it locked and
raises InterruptedError_ (exit 130) — docs/exit-codes.md.

thaw: roll every NPU process back to RUNNING as the owner of ``freeze``'s lock (its kept tokens),
or over anybody's lock with ``force``. A lock that another command holds is refused (BusyError)
without ``force``. A signal does not cut a thaw in half (it is what gets a job running again);
every request it makes has a timeout, so it ends in bounded time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from npusnap_cli.device.devicegroup import (
    DeviceGroup,
    LockedAndBackedUp,
    RollbackResult,
    forget_lock_tokens,
    load_lock_tokens,
    record_taken_over,
    refuse_stopped,
    save_lock_tokens,
    tree_targets,
)
from npusnap_cli.errors import InterruptedError_, NpusnapError
from npusnap_cli.host import procfs
from npusnap_cli.pipelines.engine import Pipeline, SignalGuard, Step


@dataclass
class FreezeState:
    pid: int
    pids: list[int]
    group: DeviceGroup
    guard: SignalGuard
    backup: bool
    results: dict[int, LockedAndBackedUp] = field(default_factory=dict)  # the agents' answers


def _ensure_unlocked(s: FreezeState) -> None:
    s.group.ensure_unlocked()


def _lock(s: FreezeState) -> None:
    try:
        s.results = s.group.lock_and_backup(backup=s.backup)
    except NpusnapError as err:  # lock_and_backup rolled back whatever it had locked
        if s.guard.received is not None:
            err.details["signal"] = s.guard.name
        raise


def _unlock(s: FreezeState, _err: BaseException) -> None:
    s.group.rollback(owned_only=True)


def _hand_over(s: FreezeState) -> None:
    save_lock_tokens(s.group.tokens())


def freeze_steps(backup: bool) -> list[Step[FreezeState]]:
    locking = "lock+backup" if backup else "lock"
    return [
        Step("preflight", _ensure_unlocked, checkpoint=("before anything was locked", "nothing was locked")),
        Step(
            locking,
            _lock,
            undo=_unlock,
            checkpoint=(
                f"during {locking}: every process it locked was rolled back and is running",
                "rolled back",
            ),
        ),
        # Committed: the locks are thaw's to release from here on, a signal no longer undoes them.
        Step("hand over", _hand_over, commit=True),
    ]


def _freeze_failed(s: FreezeState, err: NpusnapError, _undone: bool) -> NpusnapError:
    if isinstance(err, InterruptedError_) and err.details.get("state") == "rolled back":
        err.fix = f"run `npusnap freeze {s.pid}` again when ready"
        err.details["pids"] = s.pids
    return err


def freeze(
    pid: int, *, lease_s: Optional[float], backup: bool, timeout: float, note: Callable[[str], None]
) -> dict[int, LockedAndBackedUp]:
    """``npusnap freeze`` (see the module docstring); the agents' answers by pid."""
    pids = tree_targets(pid)
    with (
        SignalGuard(note, what="freeze") as guard,
        DeviceGroup(
            pids,
            lease_s=lease_s,
            timeout=timeout,
            command="freeze",
            interrupted=lambda: guard.received is not None,
        ) as group,
    ):
        state = FreezeState(pid=pid, pids=pids, group=group, guard=guard, backup=backup)
        Pipeline("freeze", freeze_steps(backup), guard=guard, on_failure=_freeze_failed).run(state)
    return state.results


@dataclass
class ThawState:
    pids: list[int]
    group: DeviceGroup
    force: bool
    results: dict[int, RollbackResult] = field(default_factory=dict)  # the agents' answers


def _take_tokens(s: ThawState) -> None:
    # Tokens a freeze, or a failed dump or restore, handed over (save_lock_tokens).
    s.group.set_tokens(load_lock_tokens(s.pids))


def _rollback(s: ThawState) -> None:
    owners = _live_owners(s) if s.force else {}
    s.results = s.group.rollback(force=s.force)
    # A live command whose lock was just taken must learn it (a dump would publish an image of
    # a job that ran unlocked): it reads these notes before it goes on.
    with contextlib.suppress(OSError):
        record_taken_over({p: o for p, o in owners.items() if p in s.results})


def _live_owners(s: ThawState) -> dict[int, int]:
    """pid -> the still running npusnap command (not this one) that holds its lock."""
    out = {}
    for pid, c in s.group.clients.items():
        try:
            owner = c.status().owner
        except NpusnapError:
            continue
        if owner is not None and owner.pid != os.getpid() and procfs.is_alive(owner.pid):
            out[pid] = owner.pid
    return out


def _forget_tokens(s: ThawState) -> None:
    forget_lock_tokens(s.pids)


THAW_STEPS: list[Step[ThawState]] = [
    Step("take tokens", _take_tokens),
    Step("rollback", _rollback, commit=True),
    Step("forget tokens", _forget_tokens),
]


def thaw(pid: int, *, force: bool, timeout: float) -> dict[int, RollbackResult]:
    """``npusnap thaw`` (see the module docstring); the agents' answers by pid."""
    pids = tree_targets(pid)
    refuse_stopped(pids, "thaw")
    # The guard only holds the signals off: nothing checks it, the thaw always runs to its end.
    with SignalGuard(what="thaw"), DeviceGroup(pids, timeout=timeout, command="thaw") as group:
        state = ThawState(pids=pids, group=group, force=force)
        Pipeline("thaw", THAW_STEPS).run(state)
    return state.results
