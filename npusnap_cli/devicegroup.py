"""The device half of a snapshot for several processes at once (``freeze``/``thaw``, dump, restore).

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

Results are dicts keyed by pid (the agent's result for that pid).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, TypeVar

from npusnap_cli.agent_client import AgentClient
from npusnap_cli.errors import NpusnapError, StateUnknownError

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
    ) -> None:
        self.pids = sorted(set(pids))
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
    def _each(self, fn: Callable[[AgentClient], T]) -> tuple[dict[int, T], dict[int, BaseException]]:
        """Run ``fn`` for every client in parallel; (results, failures) keyed by pid."""
        results: dict[int, T] = {}
        failures: dict[int, BaseException] = {}
        if not self.pids:
            return results, failures
        with ThreadPoolExecutor(max_workers=min(32, len(self.pids)), thread_name_prefix="npusnap-dg") as pool:
            futures = {pid: pool.submit(fn, self.clients[pid]) for pid in self.pids}
            for pid, fut in futures.items():
                try:
                    results[pid] = fut.result()
                except Exception as exc:
                    failures[pid] = exc
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

    def lock_and_backup(
        self, backup: bool = True, device_memory: Optional[str] = None
    ) -> dict[int, dict[str, Any]]:
        """Lock (and Backup) every process; all or nothing (see the module docstring).

        ``device_memory`` is the agents' mode (preserve/app/discard; None: the agent's default,
        preserve)."""
        lease = self.lease_s

        def step(c: AgentClient) -> dict[str, Any]:
            locked = c.lock(lease, device_memory)
            if not backup:
                return locked
            backed = c.backup(lease)
            backed["lock_elapsed_s"] = locked.get("elapsed_s")
            backed["device_memory"] = backed.get("device_memory") or locked.get("device_memory")
            backed["callback_devices"] = locked.get("callback_devices")
            return backed

        results, failures = self._each(step)
        if failures:
            self._rollback_or_state_unknown(failures)
            self._raise_first(
                failures, "lock" if not backup else "lock+backup", "all processes were rolled back"
            )
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

    def unlock(self) -> dict[int, dict[str, Any]]:
        results, failures = self._each(lambda c: c.unlock())
        if failures:
            self._raise_first(failures, "unlock", f"retry with `npusnap thaw {min(failures)}`")
        return results

    def restore(self) -> dict[int, dict[str, Any]]:
        results, failures = self._each(lambda c: c.restore())
        if failures:
            self._raise_first(failures, "restore", "the processes stay locked")
        return results

    def restore_and_unlock(self) -> dict[int, dict[str, Any]]:
        """Restore then Unlock each (CRIU-restored) process; a failed one stays locked."""

        def step(c: AgentClient) -> dict[str, Any]:
            restored = c.restore()
            unlocked = c.unlock()
            unlocked["restore_elapsed_s"] = restored.get("elapsed_s")
            return unlocked

        results, failures = self._each(step)
        if failures:
            pids = " ".join(str(p) for p in sorted(failures))
            self._raise_first(
                failures,
                "restore+unlock",
                f"pid(s) {pids} stay locked; see `npusnap status PID`, retry or `npusnap thaw PID`",
            )
        return results

    def rollback(self) -> dict[int, dict[str, Any]]:
        """Every process back to RUNNING; StateUnknownError if any cannot be brought back."""
        results, failures = self._each(_rollback_one)
        if failures:
            raise _state_unknown(failures)
        return results

    def _rollback_or_state_unknown(self, original: dict[int, BaseException]) -> None:
        _, failures = self._each(_rollback_one)
        if failures:
            err = _state_unknown(failures)
            err.details["original_failures"] = {p: _describe(e) for p, e in sorted(original.items())}
            raise err


def _rollback_one(c: AgentClient) -> dict[str, Any]:
    try:
        if not c.connected:
            c.connect()
        return c.rollback()
    except NpusnapError:
        from npusnap_cli import procfs

        # A process that died (killed mid-dump, say) holds no lock any more: the runtime's exit
        # hook and the device daemon released it. Only a live process that cannot be reached
        # makes the state unknown.
        if not procfs.is_alive(c.pid):
            return {"state": "GONE", "before": None, "actions": [], "warnings": [f"process {c.pid} exited"]}
        raise


def _state_unknown(failures: dict[int, BaseException]) -> StateUnknownError:
    pids = sorted(failures)
    commands = [f"npusnap status {p}" for p in pids] + [f"npusnap thaw {p}" for p in pids]
    return StateUnknownError(
        f"rollback failed for pid(s) {', '.join(map(str, pids))}: they may still be locked",
        why="; ".join(f"pid {p}: {_describe(e)}" for p, e in sorted(failures.items())),
        fix="a human must look: " + " && ".join(commands),
        details={
            "recovery_commands": commands,
            "failures": {p: _describe(e) for p, e in sorted(failures.items())},
        },
    )


def tree_targets(pid: int) -> list[int]:
    """The pids of ``pid``'s tree that use the NPU, each of which must have an agent.

    Raises TargetError when the tree has no NPU process, or when one has no agent (with the ways
    to get one).
    """
    from npusnap_cli import proctree
    from npusnap_cli.agent_client import NO_AGENT_FIX
    from npusnap_cli.errors import TargetError

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
