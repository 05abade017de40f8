"""Does a dump still hold every lock it took? Renewing the leases, and knowing when they may be gone.

An agent's lease counts the target's *run* time (native/agent/ops.c): while CRIU has the tree
frozen, or leaves it stopped, it does not run out. It does run out while the tree runs and nobody
renews it: npusnap stopped (SIGSTOP, a debugger, a swapped-out host), or CRIU slow to reach the
freeze (its startup, a slow `criu swrk`). The agent then rolls the job back and it runs on
unlocked; a CRIU device plugin may even lock it again under its own name. A dump that went on
would publish an image of a job that was not locked by it and kill the original.

``LeaseKeeper`` closes that:

* ``renew()`` renews every lease (fresh connections, the dump's tokens) and remembers when it
  *sent* the renewals: the agents' leases cannot end before ``renewed_at + lease_s`` of wall
  time (run time never exceeds wall time);
* while CRIU works, a thread renews every third of the lease until CRIU starts seizing the tree
  (a connection of ours must not be open when CRIU collects the tree's sockets), then watches
  for the moment every thread of the NPU processes is stopped (``frozen_at``);
* ``check()`` after CRIU, and ``check_before_kill()`` at the kill: the dump still holds its locks
  only if the tree froze (or is still stopped) before ``renewed_at + lease_s - MARGIN``. Else it
  raises ``LockLostError`` (exit 7): the dump fails, the job runs on (rolled back).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from typing import Optional

from npusnap_cli.device.agent_client import AgentBusyError, AgentClient, AgentOpError
from npusnap_cli.device.devicegroup import forget_taken_over, taken_over
from npusnap_cli.errors import DeviceError, NpusnapError, StateUnknownError
from npusnap_cli.host import procfs

POLL_S = 0.02  # how often the freeze is looked for while CRIU runs
MARGIN_S = 0.5  # the agent's tick (0.1 s) and the time a renewal takes to be answered
BUSY_RETRY_S = 5.0  # a renewal asks an agent still serving another connection again this long


class LockLostError(DeviceError):
    """The dump can no longer be sure it holds the locks it took: it fails, the job runs on."""


def _threads_stopped(pid: int) -> Optional[bool]:
    """True when every thread of ``pid`` is stopped (CRIU's seize: t, SIGSTOP: T); None if gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        st = procfs.stat(pid, tid)
        if st is None:
            continue
        if st.state not in ("t", "T"):
            return False
    return True


def _traced(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1]) != 0
    except (OSError, ValueError, IndexError):
        pass
    return False


class LeaseKeeper:
    """The leases of ``tokens`` (pid -> the dump's lock token), each ``lease_s`` long."""

    def __init__(self, tokens: dict[int, str], lease_s: Optional[float], *, timeout: float = 5.0) -> None:
        self.tokens = dict(tokens)
        self.lease_s = lease_s
        self.timeout = timeout
        self.renewed_at: Optional[float] = None
        self.frozen_at: Optional[float] = None
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- renewing ----------------------------------------------------------------------------
    def renew(self) -> bool:
        """Renew every lease now; False (and ``lost`` says why) when one was already gone."""
        if not self.tokens or self.lease_s is None:
            return True
        sent = time.monotonic()
        for pid, token in sorted(self.tokens.items()):
            # Another connection may still be served (ours, just closed, on a loaded machine):
            # the agent said nothing of its lease. Asked again, for a while; then not renewed
            # now, and the time rule decides.
            wait = min(BUSY_RETRY_S, self.lease_s / 4)
            try:
                with AgentClient(pid, timeout=self.timeout, connect_retry_s=0.5, busy_wait_s=wait) as c:
                    c.token = token
                    c.renew(self.lease_s)
            except AgentBusyError:
                return False
            except AgentOpError as exc:
                self.lost = f"pid {pid}: {exc.message}"
                return False
            except NpusnapError:  # not reached while the time check above decides first
                return False
        self.renewed_at = sent
        return True

    def renew_or_fail(self, where: str) -> None:
        """Renew now; an agent that says its lease is gone fails the dump at once (LockLostError).
        One that cannot be reached is left to ``check``'s time rule."""
        if not self.renew() and self.lost is not None:
            raise self._error(where, time.monotonic())

    def start(self, pids: Iterable[int]) -> LeaseKeeper:
        """While CRIU runs: renew until it starts seizing ``pids``, then note when all froze."""
        watched = sorted(set(pids) | set(self.tokens))
        self._thread = threading.Thread(target=self._run, args=(watched,), name="npusnap-lease", daemon=True)
        self._thread.start()
        return self

    def _run(self, pids: list[int]) -> None:
        interval = max(0.5, (self.lease_s or 60.0) / 3)
        next_renew = time.monotonic() + interval
        seizing = False
        while not self._stop.is_set():
            npu = list(self.tokens) or pids
            if not seizing and any(_traced(p) for p in pids):
                seizing = True  # from here no connection of ours may be open
            if seizing:
                states = [_threads_stopped(p) for p in npu]
                if all(s is not False for s in states):
                    self.frozen_at = time.monotonic()
                    return
            elif time.monotonic() >= next_renew:
                self.renew()
                next_renew = time.monotonic() + interval
            self._stop.wait(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1)
            self._thread = None

    # -- deciding ----------------------------------------------------------------------------
    def _deadline(self) -> Optional[float]:
        if self.lease_s is None or not self.tokens:
            return None
        if self.renewed_at is None:
            return float("-inf")
        return self.renewed_at + self.lease_s - MARGIN_S

    def check(self, where: str) -> None:
        """After CRIU: raise LockLostError unless the tree froze while every lease still ran and
        nobody took a lock away (`thaw --force`, which leaves a note: devicegroup/tokens.py)."""
        self.stop()
        taken = taken_over(self.tokens, os.getpid())
        if taken:
            forget_taken_over(taken, os.getpid())
            pids = ", ".join(map(str, taken))
            self.lost = f"pid(s) {pids}: `npusnap thaw --force` took the dump's lock"
            raise LockLostError(
                f"the dump lost its lock {where}: `npusnap thaw --force` unlocked pid(s) {pids} while "
                "the dump ran",
                why="the job ran unlocked before CRIU froze it: an image taken now would not hold a "
                "locked device state, and its restore could not finish",
                fix="the job keeps running (unlocked by the thaw); dump again, and leave a job alone "
                "while a dump holds it",
                details={"taken_by_thaw": taken, "lost": self.lost},
            )
        deadline = self._deadline()
        if deadline is None:
            return
        frozen = self.frozen_at if self.frozen_at is not None else time.monotonic()
        if self.lost is not None or frozen > deadline:
            raise self._error(where, frozen)

    def check_before_kill(self, pids: Iterable[int]) -> None:
        """At the kill: the tree must still be stopped since the freeze (or the lease still run)."""
        deadline = self._deadline()
        if deadline is None:
            return
        now = time.monotonic()
        if now <= deadline:
            return
        if all(_threads_stopped(p) is not False for p in set(pids) | set(self.tokens)):
            return
        raise self._error("before the original was killed (it was resumed meanwhile)", now)

    def gave_up(self, err: BaseException, timeout: float = 20.0) -> bool:
        """After ``err``: if it is a lost lock, wait (bounded) until every process runs unlocked
        (the agents' leases rolled the dump's locks back; a CRIU device plugin that locked the
        job again during the dump unlocks it once CRIU lets it go) and return True; raise
        StateUnknownError with the recovery commands if one does not. False otherwise, and also
        when a process is still locked by this dump under a lease that never ran out: the caller
        rolls it back with its token."""
        if not isinstance(err, LockLostError):
            return False

        left = set(self.tokens)
        deadline = time.monotonic() + timeout
        states: dict[int, str] = {}
        while left and time.monotonic() < deadline:
            for pid in sorted(left):
                try:
                    with AgentClient(pid, timeout=2.0, connect_retry_s=0.2) as c:
                        st = c.status()
                except NpusnapError as exc:
                    states[pid] = exc.message
                    continue
                states[pid] = str(st.state)
                if states[pid] in ("RUNNING", "None"):
                    left.discard(pid)
                elif st.lease.active and st.owner is not None and st.owner.pid == os.getpid():
                    # Still this dump's lock, its lease never ran out (a lapsed lease rolls back
                    # and ends): the time rule was only unsure. Ours to roll back, with our token.
                    return False
            if left:
                time.sleep(0.2)
        if left:
            cmds = [c for p in sorted(left) for c in (f"npusnap status {p}", f"npusnap thaw --force {p}")]
            raise StateUnknownError(
                f"{err}; pid(s) {sorted(left)} still do not run unlocked",
                why="; ".join(f"pid {p}: {states.get(p)}" for p in sorted(left)),
                fix="look and recover: " + " ; ".join(cmds),
                details={"recovery_commands": cmds, "original_error": str(err)},
            )
        return True

    def _error(self, where: str, at: float) -> LockLostError:
        late = at - (self.renewed_at or at)
        why = (
            self.lost
            if self.lost
            else f"{late:.1f}s passed between the last lease renewal and the tree's freeze, with a "
            f"lease of {self.lease_s:g}s: npusnap was stopped, or CRIU took that long to start"
        )
        return LockLostError(
            f"the dump lost its lock {where}: the agents' leases may have run out, so they rolled the "
            "job back while it ran",
            why=f"{why}; an image taken now would not hold a locked device state",
            fix="the job keeps running (rolled back); dump again, with a longer --lease if CRIU is "
            "slow to start here, and keep npusnap running until it ends",
            details={"lease_s": self.lease_s, "renew_to_freeze_s": round(late, 3), "lost": self.lost},
        )


@contextlib.contextmanager
def keeping(keeper: Optional[LeaseKeeper], pids: Iterable[int]):  # type: ignore[no-untyped-def]
    """Run the body (CRIU) with ``keeper`` renewing and watching; checked by the caller."""
    if keeper is None:
        yield
        return
    keeper.start(pids)
    try:
        yield
    finally:
        keeper.stop()
