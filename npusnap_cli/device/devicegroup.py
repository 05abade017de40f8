"""The device half of a snapshot for several processes at once (for dump, restore, freeze, thaw).

``DeviceGroup(pids)`` holds one ``AgentClient`` per pid and runs each step on all of them in
parallel threads. The contract the pipelines rely on:

* ``lock_and_backup(backup=True)``: Lock (+ Backup) every process under a lease. If any process
  fails, every process is rolled back to RUNNING and the first failure is raised (its
  ``details["failures"]`` lists every pid's error). If a rollback fails too: ``StateUnknownError``.
* ``close()``: drop every connection (needed before a CRIU dump: CRIU refuses to dump a connected
  stream socket whose peer is outside the tree). The leases keep running in the agents, counted
  in run time only, so a CRIU freeze does not eat them.
* ``reconnect()``: connect again (after the dump, or to the restored processes).
* ``renew()`` / ``release()``: keep / drop the leases.
* ``unlock()``: Unlock every process (e.g. ``--leave-running`` from BACKED_UP).
* ``restore_and_unlock()``: in CRIU-restored processes: Restore, then Unlock. A failure leaves
  that process locked (never half-running) and raises with the retry command.
* ``rollback()``: back to RUNNING from any state; ``StateUnknownError`` if that fails.

Lock ownership (docs/internals.md, "Lock ownership"): each lock is taken as ``npusnap COMMAND``
and its token kept per pid (``tokens()``; ``set_tokens()`` hands a dump's or a freeze's tokens to
restore or thaw). ``ensure_unlocked()`` is the preflight that refuses, with who holds it and
since when, a job that another command locked. After a failure only the processes this group
locked are rolled back: a dump that fails at Lock never thaws someone else's freeze.

Results are dicts keyed by pid (the agent's result for that pid).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Optional, TypeVar

from npusnap_cli import contract, paths
from npusnap_cli.device import protocol
from npusnap_cli.device.agent_client import NO_AGENT_FIX, AgentClient, AgentOpError, owner_text
from npusnap_cli.errors import (
    BusyError,
    ImageError,
    InterruptedError_,
    NpusnapError,
    StateUnknownError,
    TargetError,
)
from npusnap_cli.host import hostclean, procfs, proctree

POLL_S = 0.1  # how often a wait on the agents looks at `interrupted`


class _AllBusy(Exception):
    """An attempt whose every failure was a device that did not drain (DEVICE_BUSY), rolled back."""

    def __init__(self, error: NpusnapError) -> None:
        super().__init__(error.message)
        self.error = error


ABORT_WAIT_S = 2.0  # after aborting the connections, how long the worker threads get to finish
BUSY_RETRY_S = 15.0  # a rollback retries an agent that is still finishing an aborted request
STATE_NOW_S = 2.0  # a failed rollback asks each agent once more for its state, this long at most
GONE_GRACE_S = 2.0  # how long a process that could not be reached may take to finish exiting

DEFAULT_LEASE_S = 60.0
T = TypeVar("T")


def _describe(exc: BaseException) -> str:
    return exc.message if isinstance(exc, NpusnapError) else f"{type(exc).__name__}: {exc}"


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
        self.clients: dict[int, AgentClient] = {
            pid: AgentClient(pid, timeout=timeout, connect=False) for pid in self.pids
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
        summary = {p: _describe(e) for p, e in sorted(failures.items())}
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
    def hello(self) -> dict[int, dict[str, Any]]:
        results, failures = self._each(lambda c: c.hello())
        if failures:
            self._raise_first(failures, "hello")
        return results

    def status(self) -> dict[int, dict[str, Any]]:
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

    def ensure_unlocked(self) -> dict[int, dict[str, Any]]:
        """Preflight: refuse (BusyError, nothing changed) if any process is locked or has an owner."""
        refuse_stopped(self.pids, self.command)
        results = self.status()
        taken = {
            pid: r
            for pid, r in results.items()
            if r.get("owner") or (r.get("state") not in (None, contract.SnapshotState.RUNNING.name))
        }
        if taken:
            pid = min(taken)
            owner = taken[pid].get("owner")
            holder = owner.get("pid") if isinstance(owner, dict) else None
            gone = isinstance(holder, int) and not procfs.is_alive(holder)
            raise BusyError(
                f"pid {pid} is already locked ({taken[pid].get('state')}) by {owner_text(owner)}; "
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
                        str(p): {"state": r.get("state"), "owner": r.get("owner")} for p, r in taken.items()
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
    ) -> dict[int, dict[str, Any]]:
        """Lock (and Backup) every process; all or nothing (see the module docstring).

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
    ) -> dict[int, dict[str, Any]]:
        lease = self.lease_s
        files = device_memory_files or {}
        # A process done early keeps its lease renewed (on its own connection, from its own
        # thread) until every process is done: another's long Backup must not run it out.
        left = [len(self.pids)]
        counted = threading.Lock()
        all_done = threading.Event()

        def work(c: AgentClient) -> dict[str, Any]:
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
                return locked
            backed = c.backup(lease)
            backed["lock_elapsed_s"] = locked.get("elapsed_s")
            backed["runtime_lock_s"] = locked.get("runtime_lock_s")
            backed["lock_device_copy_s"] = locked.get("device_copy_s")
            backed["lock_drain_s"] = locked.get("drain_s")
            backed["device_memory"] = backed.get("device_memory") or locked.get("device_memory")
            backed["callback_devices"] = locked.get("callback_devices")
            return backed

        def step(c: AgentClient) -> dict[str, Any]:
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

    def renew(self, lease_s: Optional[float] = None) -> dict[int, dict[str, Any]]:
        results, failures = self._each(lambda c: c.renew(lease_s if lease_s is not None else self.lease_s))
        if failures:
            self._raise_first(failures, "renew")
        return results

    def release(self) -> dict[int, dict[str, Any]]:
        results, failures = self._each(lambda c: c.release())
        if failures:
            self._raise_first(failures, "release")
        return results

    def unlock(
        self, force: bool = False, device_memory_files: Optional[dict[int, tuple[int, str]]] = None
    ) -> dict[int, dict[str, Any]]:
        """Unlock every process; ``device_memory_files``: pid -> (fd, name) where its concurrent
        copy goes (``lock_and_backup(concurrent=...)`` planned it)."""
        files = device_memory_files or {}
        results, failures = self._each(lambda c: c.unlock(force, files.get(c.pid)))
        if failures:
            self._raise_first(failures, "unlock", f"retry with `npusnap thaw {min(failures)}`")
        return results

    def copy_wait(self, pids: Collection[int], deadline_s: float) -> dict[int, dict[str, Any]]:
        """Wait for the concurrent copy of each of ``pids`` (those whose unlock carried a file;
        the others have none), at most ``deadline_s`` in all."""
        end = time.monotonic() + deadline_s

        def wait(c: AgentClient) -> dict[str, Any]:
            if c.pid not in pids:
                return {}
            while True:
                left = end - time.monotonic()
                r = c.copy_wait(max(0.05, min(5.0, left)))
                if r.get("complete") or left <= 0:
                    return r

        results, failures = self._each(wait)
        if failures:
            self._raise_first(failures, "copy_wait", "the job runs on; the image was not kept")
        return {pid: r for pid, r in results.items() if pid in pids}

    def restore(
        self, device_memory_files: Optional[dict[int, tuple[int, str]]] = None
    ) -> dict[int, dict[str, Any]]:
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
    ) -> dict[int, dict[str, Any]]:
        """Restore then Unlock each (CRIU-restored) process; a failed one stays locked.
        ``device_memory_files``: pid -> fd of its device-memory file (see ``restore``);
        ``before_unlock``: runs between the two (may raise: that process stays locked)."""
        files = device_memory_files or {}

        def step(c: AgentClient) -> dict[str, Any]:
            restored = c.restore(files.get(c.pid))
            if before_unlock is not None:
                before_unlock()
            unlocked = c.unlock()
            unlocked["restore_elapsed_s"] = restored.get("elapsed_s")
            return unlocked

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

    def rollback(self, *, force: bool = False, owned_only: bool = False) -> dict[int, dict[str, Any]]:
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
            out[pid] = str((st or {}).get("state") or "") or "no answer"
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
            err.details["original_failures"] = {p: _describe(e) for p, e in sorted(original.items())}
            raise err
        # None: this command never locked that process (it failed before its Lock).
        return {p: str(r.get("state") or "not locked") for p, r in results.items()}


def refuse_stopped(pids: Iterable[int], command: str) -> None:
    """A stopped process's agent cannot answer: it is being checkpointed (CRIU seizes and stops
    the tree) or someone stopped it. Refuse now, having changed nothing, instead of waiting for
    an answer that comes only when the checkpoint is over — and then acting under it."""
    for pid in pids:
        stopped = procfs.stop_state(pid)
        if stopped is None:
            continue
        _state, tracer = stopped
        by = f" (traced by pid {tracer}: {procfs.cmdline(tracer)[:60]})" if tracer else " (SIGSTOP)"
        raise BusyError(
            f"pid {pid} is stopped{by}; npusnap {command} changed nothing",
            why="a checkpoint is probably in progress (CRIU stops the tree while it dumps it); its agent "
            "cannot answer until the process runs again",
            fix=f"wait for the checkpoint to finish and retry; `npusnap status {pid}` shows the lock's owner "
            f"once it runs (a stray stop: kill -CONT {pid})",
            details={"pid": pid, "tracer": tracer or None},
        )


def _while_busy(c: AgentClient, request: Callable[[AgentClient], T]) -> T:
    """``request`` on ``c``, connecting first; retried for at most ``BUSY_RETRY_S`` while the
    agent answers BUSY (an aborted request still running in it: one client at a time)."""
    deadline = time.monotonic() + BUSY_RETRY_S
    while True:
        try:
            if not c.connected:
                c.connect()
            return request(c)
        except AgentOpError as exc:
            if exc.error.get("name") != contract.E_BUSY or time.monotonic() >= deadline:
                raise
            c.close()
            time.sleep(0.2)


def _locked_by_us(c: AgentClient, command: str) -> bool:
    """Whether the agent records this very process as the owner of its lock: a lock request whose
    answer (and token) was lost to an interruption still made us the owner."""
    try:
        owner = _while_busy(c, lambda cl: cl.status().get("owner"))
    except NpusnapError:
        return False
    return isinstance(owner, dict) and owner.get("pid") == os.getpid() and owner.get("command") == command


def _rollback_one(
    c: AgentClient, force: bool = False, owned_only: bool = False, command: str = ""
) -> dict[str, Any]:
    """Roll back ``c``'s process: with ``owned_only`` only if this client locked it; with
    ``force`` whoever locked it; otherwise as its owner's token allows (BusyError if not)."""
    if owned_only and c.token is None:
        if not (command and _locked_by_us(c, command)):
            return {"state": None, "before": None, "actions": [], "warnings": ["not locked by this command"]}
        force = True  # ours, though the token never reached us
    try:
        return _while_busy(c, lambda cl: cl.rollback(force))
    except BusyError:
        raise
    except NpusnapError:
        # A process that died (killed mid-dump, say) holds no lock any more: the runtime's exit
        # hook and the device daemon released it. Only a live process that cannot be reached
        # makes the state unknown. One that was killed a moment ago may still be exiting (its
        # socket already closed): give it a bounded moment to become a zombie.
        deadline = time.monotonic() + GONE_GRACE_S
        while procfs.is_alive(c.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not procfs.is_alive(c.pid):
            return {"state": "GONE", "before": None, "actions": [], "warnings": [f"process {c.pid} exited"]}
        raise


def status_now(pid: int, client: Optional[AgentClient]) -> Optional[dict[str, Any]]:
    """The status reply of ``pid``'s agent within STATE_NOW_S, over ``client`` when the caller
    holds a connection to it (the agent answers one client at a time), else over a new one;
    None if it cannot say (a stopped or busy agent, or none)."""
    try:
        if client is not None:
            return client.request("status", timeout=STATE_NOW_S)
        with AgentClient(pid, timeout=STATE_NOW_S, connect_retry_s=0.2) as fresh:
            return fresh.status()
    except NpusnapError:
        return None


def _state_unknown(failures: dict[int, BaseException], states: dict[int, str]) -> StateUnknownError:
    """The rollback of ``failures`` failed; ``states``: what each is in now (states_now)."""
    pids = sorted(failures)
    commands = [f"npusnap status {p}" for p in pids] + [f"npusnap thaw {p}" for p in pids]
    now = ", ".join(f"pid {p} {_state_words(states.get(p, 'no answer'))}" for p in pids)
    return StateUnknownError(
        f"rollback failed: {now}",
        why="; ".join(f"pid {p}: {_describe(e)}" for p, e in sorted(failures.items())),
        fix="a human must look: " + " && ".join(commands),
        details={
            "recovery_commands": commands,
            "failures": {p: _describe(e) for p, e in sorted(failures.items())},
            "states": {p: states.get(p, "no answer") for p in pids},
        },
    )


def _state_words(state: str) -> str:
    if state == "gone":
        return "has ended"
    if state == "no answer":
        return f"did not answer within {STATE_NOW_S:.0f}s (its state is not known)"
    return f"is {state}"


def tree_targets(pid: int) -> list[int]:
    """The pids of ``pid``'s tree that use the NPU, each of which must have an agent.

    Raises TargetError when the tree has no NPU process, or when one has no agent (with the ways
    to get one).
    """
    tree = proctree.process_tree(pid)
    npu = proctree.npu_processes(tree)
    if not npu:
        raise TargetError(
            f"no process in the tree of pid {pid} uses the NPU",
            why="none of them has the CANN runtime (libacl_rt.so / libascendcl.so) loaded",
            fix=f"check the pid; `npusnap status {pid}` shows the tree",
            details={"tree": [p.to_dict() for p in tree]},
        )
    missing = [p.pid for p in npu if not p.has_agent]
    if missing:
        first = missing[0]
        raise TargetError(
            f"NPU process(es) {', '.join(map(str, missing))} have no npusnap agent",
            why="the device half of a snapshot can only be done from inside each process",
            fix=NO_AGENT_FIX.format(pid=first),
            details={"without_agent": missing},
        )
    return [p.pid for p in npu]


# --------------------------------------------------------------------------------------------
# freeze / thaw: the device half only, the lock kept across two commands
# --------------------------------------------------------------------------------------------


def _token_path(pid: int) -> Path:
    return paths.agent_runtime_dir() / f"{pid}{paths.LOCK_TOKEN_SUFFIX}"


def save_lock_tokens(tokens: dict[int, str]) -> None:
    """Hand locks over to ``thaw``: a freeze's, or those a failed dump or restore leaves behind
    (whose fix is `npusnap thaw PID`). One file per pid under the runtime directory (created
    0700 and checked like the agents' socket directory; files 0600, never followed)."""
    paths.ensure_private_dir(paths.agent_runtime_dir())
    for stale in hostclean.stale_lock_tokens():  # those of dead processes go as new ones come
        with contextlib.suppress(OSError):
            os.unlink(stale.path)
    for pid, token in tokens.items():
        path = _token_path(pid)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
        os.replace(tmp, path)


def load_lock_tokens(pids: Iterable[int]) -> dict[int, str]:
    """The tokens ``freeze`` left for ``pids`` (those it has); a file that is not a regular file
    of this user, 0600, holding 32 hex digits, is ignored."""
    out: dict[int, str] = {}
    for pid in pids:
        try:
            fd = os.open(_token_path(pid), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "r", encoding="ascii", errors="replace") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                continue
            text = f.read(100).strip()
        if re.fullmatch(r"[0-9a-f]{32}", text):
            out[pid] = text
    return out


def forget_lock_tokens(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.unlink(_token_path(pid))


def _taken_path(pid: int) -> Path:
    return paths.agent_runtime_dir() / f"{pid}{paths.LOCK_TAKEN_SUFFIX}"


def record_taken_over(owners: dict[int, int]) -> None:
    """``thaw --force`` took the lock of each pid from the npusnap command ``owners[pid]``, which
    still runs: leave that command a note. Its lock was its only hold on the job's state (a dump
    would otherwise go on and publish an image of a job that ran unlocked meanwhile); the
    agent's answers cannot tell it once CRIU has frozen the job. Files as save_lock_tokens'."""
    if not owners:
        return
    paths.ensure_private_dir(paths.agent_runtime_dir())
    for pid, owner in owners.items():
        path = _taken_path(pid)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{int(owner)}\n")
        os.replace(tmp, path)


def taken_over(pids: Iterable[int], owner: int) -> list[int]:
    """The pids whose lock a `thaw --force` took from the command ``owner`` (record_taken_over);
    a note that is not a regular 0600 file of this user is ignored."""
    out = []
    for pid in pids:
        try:
            fd = os.open(_taken_path(pid), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "r", encoding="ascii", errors="replace") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                continue
            text = f.read(32).strip()
        if text.isdigit() and int(text) == owner:
            out.append(pid)
    return out


def forget_taken_over(pids: Iterable[int], owner: int) -> None:
    for pid in taken_over(pids, owner):
        with contextlib.suppress(OSError):
            os.unlink(_taken_path(pid))
