"""What the group asks of one agent at a time (retried while it is busy, rolled back), what an
agent says of its state now, and the refusals before any agent is asked."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional, TypeVar, Union

from npusnap_cli import contract, replies
from npusnap_cli.device.agent_client import NO_AGENT_FIX, AgentClient, AgentOpError
from npusnap_cli.errors import BusyError, NpusnapError, StateUnknownError, TargetError
from npusnap_cli.host import procfs, proctree
from npusnap_cli.jsontypes import JSONObject

BUSY_RETRY_S = 15.0  # a rollback retries an agent that is still finishing an aborted request
STATE_NOW_S = 2.0  # a failed rollback asks each agent once more for its state, this long at most
GONE_GRACE_S = 2.0  # how long a process that could not be reached may take to finish exiting
T = TypeVar("T")


@dataclass(frozen=True)
class NotRolledBack:
    """A rollback's result without the agent's answer: the process was not this command's to roll
    back, or it had exited. Its members are a rollback reply's that say so."""

    warning: str
    state: Optional[str] = None  # "GONE": the process exited

    @property
    def before(self) -> Optional[str]:
        return None

    @property
    def actions(self) -> tuple[str, ...]:
        return ()

    @property
    def warnings(self) -> tuple[str, ...]:
        return (self.warning,)

    def to_json(self) -> JSONObject:
        return {"state": self.state, "before": None, "actions": [], "warnings": [self.warning]}


# What a rollback of one process gives: its agent's answer, or why there was none.
RollbackResult = Union[replies.RollbackReply, NotRolledBack]


def _describe(exc: BaseException) -> str:
    return exc.message if isinstance(exc, NpusnapError) else f"{type(exc).__name__}: {exc}"


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
            if exc.error.name != contract.E_BUSY or time.monotonic() >= deadline:
                raise
            c.close()
            time.sleep(0.2)


def _locked_by_us(c: AgentClient, command: str) -> bool:
    """Whether the agent records this very process as the owner of its lock: a lock request whose
    answer (and token) was lost to an interruption still made us the owner."""
    try:
        owner = _while_busy(c, lambda cl: cl.status().owner)
    except NpusnapError:
        return False
    return owner is not None and owner.pid == os.getpid() and owner.command == command


def _rollback_one(
    c: AgentClient, force: bool = False, owned_only: bool = False, command: str = ""
) -> RollbackResult:
    """Roll back ``c``'s process: with ``owned_only`` only if this client locked it; with
    ``force`` whoever locked it; otherwise as its owner's token allows (BusyError if not)."""
    if owned_only and c.token is None:
        if not (command and _locked_by_us(c, command)):
            return NotRolledBack("not locked by this command")
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
            return NotRolledBack(f"process {c.pid} exited", state="GONE")
        raise


def status_now(pid: int, client: Optional[AgentClient]) -> Optional[replies.StatusReply]:
    """The status reply of ``pid``'s agent within STATE_NOW_S, over ``client`` when the caller
    holds a connection to it (the agent answers one client at a time), else over a new one;
    None if it cannot say (a stopped or busy agent, or none)."""
    try:
        if client is not None:
            return client.status(timeout=STATE_NOW_S)
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
            "failures": {str(p): _describe(e) for p, e in sorted(failures.items())},
            "states": {str(p): states.get(p, "no answer") for p in pids},
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
