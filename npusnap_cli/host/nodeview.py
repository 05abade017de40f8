"""Every process on this node that has an npusnap agent: its state, its lock holder (alive or
not) and its last snapshot, for `npusnap ps`.

Agents are found as `status` finds them: listening unix sockets named ``<pid>.sock`` in an
``npusnap*`` directory (/proc/net/unix of this network namespace). Core module: never prints.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from npusnap_cli import contract, paths
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import NpusnapError
from npusnap_cli.jsontypes import JSONObject, JSONValue

_REPLICA = re.compile(r"^(?P<of>\d+)-[0-9a-f]+$")  # host/pidns.py names a copy's socket PID-TAG.sock


def _agent_sockets() -> list[tuple[str, str]]:
    """(path, socket inode) of every listening ``*.sock`` in an agent directory."""
    ours = str(paths.agent_runtime_dir())
    found = []
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) < 8 or not fields[7].startswith("/") or not int(fields[3], 16) & 0x10000:
                    continue
                path = Path(fields[7])
                if str(path.parent) != ours and not path.parent.name.startswith(
                    contract.AGENT_SOCKET_DIR_PREFIX
                ):
                    continue
                if path.name.endswith(paths.SOCKET_SUFFIX):
                    found.append((fields[7], fields[6]))
    except (OSError, ValueError):
        return []
    return found


def _socket_holders(inodes: set[str]) -> dict[str, int]:
    """Socket inode -> the pid that holds it (the lowest, for a socket inherited by children)."""
    holders: dict[str, int] = {}
    if not inodes:
        return holders
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            ino = target[8:-1] if target.startswith("socket:[") else ""
            if ino in inodes and (ino not in holders or int(entry) < holders[ino]):
                holders[ino] = int(entry)
    return holders


def agents() -> dict[int, tuple[Path, Optional[int]]]:
    """pid -> (its agent socket, the pid it is a replica of or None), for every process with a
    listening agent: ``<pid>.sock``, and a copy restored by ``restore --replicas`` whose agent
    listens as ``<original pid>-<tag>.sock`` (found by the process that holds that socket)."""
    found: dict[int, tuple[Path, Optional[int]]] = {}
    replicas: dict[str, tuple[Path, int]] = {}
    for path, inode in _agent_sockets():
        stem = Path(path).name[: -len(paths.SOCKET_SUFFIX)]
        m = _REPLICA.match(stem)
        if stem.isdigit() and os.path.exists(path) and paths.may_serve(Path(path), int(stem)):
            found.setdefault(int(stem), (Path(path), None))
        elif m is not None and os.path.exists(path):
            replicas[inode] = (Path(path), int(m.group("of")))
    for inode, pid in _socket_holders(set(replicas)).items():
        found.setdefault(pid, replicas[inode])
    return found


def agent_pids() -> list[int]:
    return sorted(agents())


def pid_alive(pid: Optional[int]) -> Optional[bool]:
    """Whether a lock holder's pid still runs (None: no pid recorded)."""
    if not pid:
        return None
    return os.path.exists(f"/proc/{int(pid)}")


def owner_view(owner: JSONValue) -> Optional[JSONObject]:
    """The agent's lock owner (its JSON, as it sent it) with ``alive``: a dump that exited
    without unlocking (killed) still shows as the owner in the agent until its lease returns the
    process, but nobody will finish or undo its work: the lock is stale."""
    if not isinstance(owner, Mapping) or not owner:
        return None
    if owner.get("command") == "freeze":
        # freeze exits on purpose and leaves the lock to a person or an external tool.
        return {**owner, "alive": None}
    pid = owner.get("pid")
    return {**owner, "alive": pid_alive(pid if isinstance(pid, int) else None)}


def owner_text(
    owner: Optional[Mapping[str, JSONValue]], lease: Optional[Mapping[str, JSONValue]] = None
) -> str:
    if not owner:
        return "-"
    text = f"{owner.get('command')} (pid {owner.get('pid')}) since {owner.get('since')}"
    if owner.get("alive") is False:
        back = (
            f"its lease unlocks it in {lease.get('remaining_s')}s"
            if lease and lease.get("active")
            else "no lease will unlock it"
        )
        text += f" -- EXITED: nobody will finish this; {back}, `npusnap thaw --force PID` now"
    return text


# Agents asked at once. Every agent socket is a name any local user can make (a process listening
# as ``/tmp/npusnap-x/<its pid>.sock`` passes the peer checks and need never answer): asked one
# after another, N silent ones cost N timeouts; asked all at once, N threads. So a bounded pool
# shares one deadline for the whole listing, and root's and the caller's own agents go first, so
# that another user's silent sockets cannot crowd them out of the pool.
MAX_PARALLEL = 32


@dataclass(frozen=True)
class AgentAnswer:
    """What one agent said to hello + status (the agent's own JSON where it is its record)."""

    state: JSONValue = None
    lease: JSONValue = None
    owner: Optional[JSONObject] = None  # owner_view's
    devices: tuple[JSONValue, ...] = ()
    restored: bool = False
    events: tuple[JSONValue, ...] = ()


def _ask(pid: int, socket: Path, deadline: float) -> AgentAnswer | str:
    """hello + status of one agent, within what is left before ``deadline``; or why not."""
    left = deadline - time.monotonic()
    if left <= 0:
        return "not asked: the time for all agents (--timeout) was up"
    try:
        with AgentClient(pid, timeout=left, socket_path=socket, connect_retry_s=0) as client:
            hello = client.hello(timeout=max(0.01, deadline - time.monotonic()))
            st = client.status(timeout=max(0.01, deadline - time.monotonic()))
    except NpusnapError as exc:
        return exc.message
    return AgentAnswer(
        state=st.state,
        lease=st.lease.to_json(),
        owner=owner_view(None if st.owner is None else st.owner.to_json()),
        devices=hello.acl.devices,
        restored=st.restored,
        # The agent's own record (time-stamped, finished): what it did by itself, e.g. a
        # lease that ran out, which it otherwise tells only the job's agent log.
        events=st.events[-3:],
    )


@dataclass(frozen=True)
class ProcessView:
    """One line of `npusnap ps`: a process with an agent."""

    pid: int
    replica_of: Optional[int]  # the pid this is a copy of (`restore --replicas`)
    user: Optional[str] = None
    cmdline: tuple[str, ...] = ()
    answer: Optional[AgentAnswer] = None  # None: the agent did not answer
    agent_error: Optional[str] = None
    last_snapshot: Optional[JSONObject] = None  # time, op, image, user of the history's record
    restored_from: Optional[JSONObject] = None  # time, image

    def to_json(self) -> JSONObject:
        a = self.answer or AgentAnswer()
        d: JSONObject = {
            "pid": self.pid,
            "user": self.user,
            "cmdline": list(self.cmdline),
            "state": a.state,
            "lease": a.lease,
            "owner": a.owner,
            "devices": list(a.devices),
            "last_snapshot": self.last_snapshot,
            "restored_from": self.restored_from,
            "replica_of": self.replica_of,
            "events": list(a.events),
            "agent_error": self.agent_error,
        }
        if self.answer is not None:  # last, and only from an agent that answered
            d["restored"] = self.answer.restored
        return d


def _uid_of(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def processes(timeout: float = 2.0) -> list[ProcessView]:
    """One entry per agent: pid, user, command, state, lease, owner, devices, last snapshot;
    ``replica_of`` for a copy restored by ``restore --replicas``. All agents are asked within
    ``timeout`` seconds in total; one that has not answered by then has ``agent_error``."""
    import psutil

    from npusnap_cli.host import oplog  # lazy: `npusnap status` imports this module, never oplog

    deadline = time.monotonic() + timeout
    found = agents()
    me = os.geteuid()
    order = sorted(found, key=lambda p: (_uid_of(p) not in (0, me), p))
    answers: dict[int, AgentAnswer | str] = {}
    if order:
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(order)), thread_name_prefix="ps") as pool:
            futures = {pid: pool.submit(_ask, pid, found[pid][0], deadline) for pid in order}
            for pid, future in futures.items():
                answers[pid] = future.result()

    snapshots = oplog.last_snapshots()
    restores = {}
    for record in oplog.history():
        if record.op == "restore" and record.ok:
            for pid in record.pids:
                restores[(pid, record.start_of(pid))] = record
    out = []
    for pid in sorted(found):
        entry = ProcessView(pid, found[pid][1])
        try:
            proc = psutil.Process(pid)
            entry = replace(entry, user=proc.username(), cmdline=tuple(proc.cmdline()))
        except (psutil.Error, KeyError):
            pass
        answer = answers.get(pid)
        if isinstance(answer, str):
            entry = replace(entry, agent_error=answer)
        elif answer is not None:
            entry = replace(entry, answer=answer)
        key = (pid, oplog.start_time(pid))
        last = snapshots.get(key)
        if last is not None:
            entry = replace(
                entry,
                last_snapshot={"time": last.time, "op": last.op, "image": last.image, "user": last.user},
            )
        restored = restores.get(key)
        if restored is not None:
            entry = replace(entry, restored_from={"time": restored.time, "image": restored.image})
        out.append(entry)
    return out
