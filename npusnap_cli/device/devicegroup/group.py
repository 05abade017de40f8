"""``DeviceGroup``: one ``AgentClient`` per pid, each step run on all of them in parallel threads."""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Optional, Union

from npusnap_cli import contract, replies
from npusnap_cli.device import protocol
from npusnap_cli.device.agent_client import PASSING_CLIENT_WAIT_S, AgentClient, owner_text
from npusnap_cli.device.devicegroup.agentops import (
    RollbackResult,
    T,
    _describe,
    _rollback_one,
    _state_unknown,
    refuse_stopped,
    status_now,
)
from npusnap_cli.device.devicegroup.tokens import save_lock_tokens
from npusnap_cli.errors import BusyError, ImageError, InterruptedError_, NpusnapError
from npusnap_cli.host import oplog, procfs
from npusnap_cli.jsontypes import JSONObject

POLL_S = 0.1  # how often a wait on the agents looks at `interrupted`


class _AllBusy(Exception):
    """An attempt whose every failure was a device that did not drain (DEVICE_BUSY), rolled back."""

    def __init__(self, error: NpusnapError) -> None:
        super().__init__(error.message)
        self.error = error


ABORT_WAIT_S = 2.0  # after aborting the connections, how long the worker threads get to finish

DEFAULT_LEASE_S = 60.0


@dataclass(frozen=True)
class LockedAndBackedUp:
    """One process's answers to ``lock_and_backup``: its lock's, and its backup's (None: it
    was locked only)."""

    lock: replies.LockReply
    backup: Optional[replies.BackupReply] = None

    @property
    def last(self) -> Union[replies.LockReply, replies.BackupReply]:
        return self.backup if self.backup is not None else self.lock

    @property
    def state(self) -> Optional[str]:
        return self.last.state

    @property
    def lease(self) -> replies.Lease:
        return self.last.lease

    @property
    def device_memory(self) -> replies.DeviceMemory:
        return self.last.device_memory

    def to_json(self) -> JSONObject:
        """The lock's answer; after a backup, the backup's with the lock's times and devices."""
        if self.backup is None:
            return self.lock.to_json()
        out = self.backup.to_json()
        out["lock_elapsed_s"] = self.lock.elapsed_s
        out["runtime_lock_s"] = self.lock.runtime_lock_s
        out["lock_device_copy_s"] = self.lock.device_copy_s
        out["lock_drain_s"] = self.lock.drain_s
        out["callback_devices"] = list(self.lock.callback_devices)
        return out


@dataclass(frozen=True)
class RestoredAndUnlocked:
    """One process's answers to ``restore_and_unlock``."""

    restore: replies.RestoreReply
    unlock: replies.UnlockReply


class DeviceGroup:
    """The agents of ``pids``, driven together. Connects on construction unless ``connect=False``."""

    def __init__(
        self,
        pids: Iterable[int],
        *,
        lease_s: Optional[float] = DEFAULT_LEASE_S,
        timeout: float = 30.0,
        connect: bool = True,
        command: str = "unknown",
        interrupted: Callable[[], bool] = lambda: False,
    ) -> None:
        """``command``: recorded as the owner of the locks this group takes. ``interrupted``:
        polled while waiting for the agents (a signal arrived); when true, the wait stops within
        ``ABORT_WAIT_S`` and the unfinished requests fail as interrupted."""
        self.pids = sorted(set(pids))
        self.command = command
        self.interrupted = interrupted
        self.lease_s = lease_s
        self.timeout = timeout
        # A client only passing by (`npusnap ps`, `status`) is waited for; another command
        # working on the process is not.
        self.clients: dict[int, AgentClient] = {
            pid: AgentClient(
                pid,
                timeout=timeout,
                connect=False,
                busy_wait_s=PASSING_CLIENT_WAIT_S,
                held_by_command=functools.partial(oplog.held_by_command, pid),
            )
            for pid in self.pids
        }
        if connect:
            self.connect()

    def __enter__(self) -> DeviceGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------
    def _each(
        self, fn: Callable[[AgentClient], T], interruptible: bool = True
    ) -> tuple[dict[int, T], dict[int, BaseException]]:
        """Run ``fn`` for every client in parallel; (results, failures) keyed by pid.

        Never waits on a thread without a bound: the requests have their own timeouts, and an
        interruption aborts the connections still waiting (their pids fail as interrupted)."""
        results: dict[int, T] = {}
        failures: dict[int, BaseException] = {}
        if not self.pids:
            return results, failures
        pool = ThreadPoolExecutor(max_workers=min(32, len(self.pids)), thread_name_prefix="npusnap-dg")
        try:
            futures = {pid: pool.submit(fn, self.clients[pid]) for pid in self.pids}
            pending = set(futures.values())
            while pending:
                _, pending = wait(pending, timeout=POLL_S)
                if pending and interruptible and self.interrupted():
                    for pid, fut in futures.items():
                        if not fut.done():
                            self.clients[pid].abort()
                    wait(pending, timeout=ABORT_WAIT_S)
                    break
            for pid, fut in futures.items():
                if not fut.done() or (interruptible and self.interrupted() and fut.exception() is not None):
                    failures[pid] = InterruptedError_(
                        f"interrupted while waiting for the agent of pid {pid}",
                        why="Ctrl-C or SIGTERM; the agent finishes the operation it had begun and its "
                        "lease rolls it back if nobody does",
                        fix=f"check `npusnap status {pid}`",
                        details={"pid": pid},
                    )
                    continue
                try:
                    results[pid] = fut.result()
                except Exception as exc:
                    failures[pid] = exc
        finally:
            pool.shutdown(wait=False)
        return results, failures

    @staticmethod
    def _raise_first(failures: dict[int, BaseException], what: str, note: str = "") -> None:
        pid = min(failures)
        err = failures[pid]
        summary = {str(p): _describe(e) for p, e in sorted(failures.items())}
        if isinstance(err, NpusnapError):
            err.details["failures"] = summary
            if note:
                err.message = f"{err.message} ({note})"
            raise err
        raise NpusnapError(
            f"{what} failed in pid {pid}: {_describe(err)}" + (f" ({note})" if note else ""),
            why="unexpected error while talking to the agents",
            fix="rerun with -v and report it",
            details={"failures": summary},
        ) from err

    def connect(self) -> None:
        _, failures = self._each(lambda c: c.connect())
        if failures:
            self.close()
            self._raise_first(failures, "connect")

    def reconnect(self) -> None:
        self.close()
        self.connect()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    # -- the steps ----------------------------------------------------------------------------
    def hello(self) -> dict[int, replies.HelloReply]:
        results, failures = self._each(lambda c: c.hello())
        if failures:
            self._raise_first(failures, "hello")
        return results

    def status(self) -> dict[int, replies.StatusReply]:
        results, failures = self._each(lambda c: c.status())
        if failures:
            self._raise_first(failures, "status")
        return results

    def tokens(self) -> dict[int, str]:
        """The tokens of the locks this group holds, by pid."""
        return {pid: c.token for pid, c in self.clients.items() if c.token is not None}

    def set_tokens(self, tokens: dict[int, str]) -> None:
        """Act as the owner of locks another command took (restore: the dump's; thaw: a freeze's)."""
        for pid, token in tokens.items():
            if pid in self.clients:
                self.clients[pid].token = token

    def ensure_unlocked(self) -> dict[int, replies.StatusReply]:
        """Preflight: refuse (BusyError, nothing changed) if any process is locked or has an owner."""
        refuse_stopped(self.pids, self.command)
        results = self.status()
        taken = {
            pid: r
            for pid, r in results.items()
            if r.owner is not None or (r.state not in (None, contract.SnapshotState.RUNNING.name))
        }
        if taken:
            pid = min(taken)
            owner = taken[pid].owner
            holder = owner.pid if owner is not None else None
            gone = holder is not None and not procfs.is_alive(holder)
            raise BusyError(
                f"pid {pid} is already locked ({taken[pid].state}) by {owner_text(owner)}; "
                f"npusnap {self.command} changed nothing",
                why="another command holds the lock (an external checkpoint, a freeze, a dump in "
                "progress); only its owner may release it"
                + (f" (its owner, pid {holder}, has exited: nobody will finish this)" if gone else ""),
                # The next step `npusnap status` gives for the same lock: waiting is offered only
                # while its holder runs.
                fix=(
                    f"`npusnap thaw --force {pid}` returns the process now (or wait for its lease)"
                    if gone
                    else f"wait for it to finish (`npusnap status {pid}` shows the owner), or take the "
                    f"lock away with `npusnap thaw --force {pid}`"
                ),
                details={
                    "locked": {
                        str(p): {"state": r.state, "owner": r.owner.to_json() if r.owner else None}
                        for p, r in taken.items()
                    }
                },
            )
        return results

    def lock_and_backup(
        self,
        backup: bool = True,
        device_memory: Optional[str] = None,
        device_memory_files: Optional[dict[int, tuple[int, str]]] = None,
        drain_timeout_s: Optional[float] = None,
        busy_retries: int = 0,
        before_retry: Optional[Callable[[], None]] = None,
        since: Optional[dict[int, str]] = None,
        check_writes: bool = False,
        concurrent: int = 0,
    ) -> dict[int, LockedAndBackedUp]:
        """Lock (and Backup) every process; all or nothing (see the package's docstring).

        ``device_memory`` is the agents' mode (preserve/app/discard; None: the agent's default,
        preserve). ``device_memory_files``: pid -> (fd open for writing, its name once published),
        the image file each agent writes its copy of the device memory into.

        A device that does not drain in ``drain_timeout_s`` after Lock (DEVICE_BUSY: typically
        one rank's all-reduce waiting for another rank whose launch the lock holds) fails the
        attempt; everything is rolled back, and it is tried again at most ``busy_retries`` times
        after a short, random pause (``before_retry`` runs first: the device-memory files are
        emptied). ``since``: pid -> an earlier save of that process to copy only the changes
        since (AgentClient.lock)."""
        for attempt in range(busy_retries + 1):
            try:
                return self._lock_and_backup(
                    backup,
                    device_memory,
                    device_memory_files,
                    drain_timeout_s,
                    since or {},
                    check_writes,
                    concurrent,
                )
            except _AllBusy as busy:
                if attempt == busy_retries:
                    raise busy.error from None
            if self.interrupted():
                raise InterruptedError_(
                    "interrupted between lock attempts", fix="nothing is locked; dump again"
                )
            time.sleep(random.uniform(0.05, 0.3))
            if before_retry is not None:
                before_retry()
        raise AssertionError("unreachable")

    def _lock_and_backup(
        self,
        backup: bool,
        device_memory: Optional[str],
        device_memory_files: Optional[dict[int, tuple[int, str]]],
        drain_timeout_s: Optional[float],
        since: dict[int, str],
        check_writes: bool,
        concurrent: int,
    ) -> dict[int, LockedAndBackedUp]:
        lease = self.lease_s
        files = device_memory_files or {}
        # A process done early keeps its lease renewed (on its own connection, from its own
        # thread) until every process is done: another's long Backup must not run it out.
        left = [len(self.pids)]
        counted = threading.Lock()
        all_done = threading.Event()

        def work(c: AgentClient) -> LockedAndBackedUp:
            locked = c.lock(
                lease,
                self.command,
                device_memory,
                files.get(c.pid),
                drain_timeout_s,
                since.get(c.pid),
                check_writes,
                concurrent if c.pid in files else 0,
            )
            if not backup:
                return LockedAndBackedUp(locked)
            return LockedAndBackedUp(locked, c.backup(lease))

        def step(c: AgentClient) -> LockedAndBackedUp:
            try:
                result = work(c)
            finally:
                with counted:
                    left[0] -= 1
                    if left[0] <= 0:
                        all_done.set()
            while lease is not None and not all_done.wait(max(0.5, lease / 3)):
                c.renew(lease)
            return result

        results, failures = self._each(step)
        if failures:
            states = self._rollback_or_state_unknown(failures)
            busy: dict[int, BaseException] = {p: e for p, e in failures.items() if isinstance(e, BusyError)}
            if busy:
                self._raise_first(busy, "lock", "this command's own locks were rolled back")
            undrained = all(getattr(e, "name", "") == protocol.DEVICE_BUSY for e in failures.values())
            try:
                self._raise_first(
                    failures,
                    "lock" if not backup else "lock+backup",
                    "all processes were rolled back: "
                    + ", ".join(f"pid {p} {st}" for p, st in sorted(states.items())),
                )
            except NpusnapError as err:
                if undrained:
                    raise _AllBusy(err) from None
                raise
        return results

    def renew(self, lease_s: Optional[float] = None) -> dict[int, replies.RenewReply]:
        results, failures = self._each(lambda c: c.renew(lease_s if lease_s is not None else self.lease_s))
        if failures:
            self._raise_first(failures, "renew")
        return results

    def release(self) -> dict[int, replies.ReleaseReply]:
        results, failures = self._each(lambda c: c.release())
        if failures:
            self._raise_first(failures, "release")
        return results

    def unlock(
        self, force: bool = False, device_memory_files: Optional[dict[int, tuple[int, str]]] = None
    ) -> dict[int, replies.UnlockReply]:
        """Unlock every process; ``device_memory_files``: pid -> (fd, name) where its concurrent
        copy goes (``lock_and_backup(concurrent=...)`` planned it)."""
        files = device_memory_files or {}
        results, failures = self._each(lambda c: c.unlock(force, files.get(c.pid)))
        if failures:
            self._raise_first(failures, "unlock", f"retry with `npusnap thaw {min(failures)}`")
        return results

    def copy_wait(self, pids: Collection[int], deadline_s: float) -> dict[int, replies.CopyWaitReply]:
        """Wait for the concurrent copy of each of ``pids`` (those whose unlock carried a file;
        the others have none), at most ``deadline_s`` in all."""
        end = time.monotonic() + deadline_s

        def wait(c: AgentClient) -> Optional[replies.CopyWaitReply]:
            if c.pid not in pids:
                return None
            while True:
                left = end - time.monotonic()
                r = c.copy_wait(max(0.05, min(5.0, left)))
                if r.complete or left <= 0:
                    return r

        results, failures = self._each(wait)
        if failures:
            self._raise_first(failures, "copy_wait", "the job runs on; the image was not kept")
        return {pid: r for pid, r in results.items() if r is not None}

    def restore(
        self, device_memory_files: Optional[dict[int, tuple[int, str]]] = None
    ) -> dict[int, replies.RestoreReply]:
        """Restore every process; ``device_memory_files``: pid -> (fd open for reading, its
        name), the image file its agent writes back after Unlock."""
        files = device_memory_files or {}
        results, failures = self._each(lambda c: c.restore(files.get(c.pid)))
        if failures:
            self._raise_first(failures, "restore", "the processes stay locked")
        return results

    def restore_and_unlock(
        self,
        device_memory_files: Optional[dict[int, tuple[int, str]]] = None,
        before_unlock: Optional[Callable[[], None]] = None,
    ) -> dict[int, RestoredAndUnlocked]:
        """Restore then Unlock each (CRIU-restored) process; a failed one stays locked.
        ``device_memory_files``: pid -> fd of its device-memory file (see ``restore``);
        ``before_unlock``: runs between the two (may raise: that process stays locked)."""
        files = device_memory_files or {}

        def step(c: AgentClient) -> RestoredAndUnlocked:
            restored = c.restore(files.get(c.pid))
            if before_unlock is not None:
                before_unlock()
            return RestoredAndUnlocked(restored, c.unlock())

        results, failures = self._each(step)
        corrupt = [e for e in failures.values() if isinstance(e, ImageError)]
        if corrupt:
            raise corrupt[0]  # before_unlock found the image corrupt (and dealt with the tree)
        if failures:
            pids = " ".join(str(p) for p in sorted(failures))
            self._raise_first(
                failures,
                "restore+unlock",
                f"pid(s) {pids} stay locked; see `npusnap status PID`, retry or `npusnap thaw PID`",
            )
        return results

    def rollback(self, *, force: bool = False, owned_only: bool = False) -> dict[int, RollbackResult]:
        """Every process back to RUNNING; StateUnknownError if any cannot be brought back.

        ``owned_only``: only the processes this group locked (after a failure of its own);
        ``force``: also those another command locked (``thaw --force``). Without either, a
        process locked by another command is refused (BusyError, nothing changed).

        Not interruptible (it is what an interruption runs), but bounded: each agent request
        has its timeout, and an agent still busy is retried for at most ``BUSY_RETRY_S``.
        """
        results, failures = self._each(
            lambda c: _rollback_one(c, force=force, owned_only=owned_only, command=self.command),
            interruptible=False,
        )
        busy: dict[int, BaseException] = {p: e for p, e in failures.items() if isinstance(e, BusyError)}
        if busy and len(busy) == len(failures):
            self._raise_first(busy, "rollback")
        if failures:
            self.hand_over(failures)
            raise _state_unknown(failures, self.states_now(failures))
        return results

    def states_now(self, pids: Iterable[int]) -> dict[int, str]:
        """What each of ``pids`` is in now, as its agent says within STATE_NOW_S ("LOCKED", ...),
        "gone" for a process that ended, or "no answer" — never a guess."""
        out: dict[int, str] = {}
        for pid in sorted(pids):
            if not procfs.is_alive(pid):
                out[pid] = "gone"
                continue
            client = self.clients.get(pid)
            st = status_now(pid, client)
            if st is None and client is not None:
                client.close()  # one client at a time: a fresh one needs this one gone
                st = status_now(pid, None)
            out[pid] = (st.state if st is not None else None) or "no answer"
        return out

    def hand_over(self, pids: Iterable[int]) -> None:
        """Leave the tokens of ``pids`` (still locked by this group) for `npusnap thaw PID`."""
        mine = self.tokens()
        with contextlib.suppress(OSError):
            save_lock_tokens({p: mine[p] for p in pids if p in mine})

    def _rollback_or_state_unknown(self, original: dict[int, BaseException]) -> dict[int, str]:
        """Roll back what this group locked; the processes' states by pid, or StateUnknownError."""
        results, failures = self._each(
            lambda c: _rollback_one(c, owned_only=True, command=self.command), interruptible=False
        )
        if failures:
            self.hand_over(failures)
            err = _state_unknown(failures, self.states_now(failures))
            err.details["original_failures"] = {str(p): _describe(e) for p, e in sorted(original.items())}
            raise err
        # None: this command never locked that process (it failed before its Lock).
        return {p: r.state or "not locked" for p, r in results.items()}
