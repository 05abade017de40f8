"""Every process on this node that has an npusnap agent: its state, its lock holder (alive or
not) and its last snapshot, for `npusnap ps`.

Agents are found as `status` finds them: listening unix sockets named ``<pid>.sock`` in an
``npusnap*`` directory (/proc/net/unix of this network namespace). Core module: never prints.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import contract, paths
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import NpusnapError

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


def owner_view(owner: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The agent's lock owner with ``alive``: a dump that exited without unlocking (killed) still
    shows as the owner in the agent until its lease returns the process, but nobody will finish
    or undo its work: the lock is stale."""
    if not owner:
        return None
    if owner.get("command") == "freeze":
        # freeze exits on purpose and leaves the lock to a person or an external tool.
        return {**owner, "alive": None}
    return {**owner, "alive": pid_alive(owner.get("pid"))}


def owner_text(owner: Optional[dict[str, Any]], lease: Optional[dict[str, Any]] = None) -> str:
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


def _ask(pid: int, socket: Path, deadline: float) -> dict[str, Any]:
    """hello + status of one agent, within what is left before ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        return {"agent_error": "not asked: the time for all agents (--timeout) was up"}
    try:
        with AgentClient(pid, timeout=left, socket_path=socket, connect_retry_s=0) as client:
            hello = client.request("hello", timeout=max(0.01, deadline - time.monotonic()))
            st = client.request("status", timeout=max(0.01, deadline - time.monotonic()))
    except NpusnapError as exc:
        return {"agent_error": exc.message}
    return {
        "state": st.get("state"),
        "lease": st.get("lease"),
        "owner": owner_view(st.get("owner")),
        "devices": list((hello.get("acl") or {}).get("devices") or []),
        "restored": bool(st.get("restored")),
        # The agent's own record (time-stamped, finished): what it did by itself, e.g. a
        # lease that ran out, which it otherwise tells only the job's agent log.
        "events": list(st.get("events") or [])[-3:],
    }


def _uid_of(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def processes(timeout: float = 2.0) -> list[dict[str, Any]]:
    """One entry per agent: pid, user, command, state, lease, owner, devices, last snapshot;
    ``replica_of`` for a copy restored by ``restore --replicas``. All agents are asked within
    ``timeout`` seconds in total; one that has not answered by then has ``agent_error``."""
    import psutil

    from npusnap_cli.host import oplog  # lazy: `npusnap status` imports this module, never oplog

    deadline = time.monotonic() + timeout
    found = agents()
    me = os.geteuid()
    order = sorted(found, key=lambda p: (_uid_of(p) not in (0, me), p))
    answers: dict[int, dict[str, Any]] = {}
    if order:
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(order)), thread_name_prefix="ps") as pool:
            futures = {pid: pool.submit(_ask, pid, found[pid][0], deadline) for pid in order}
            for pid, future in futures.items():
                answers[pid] = future.result()

    snapshots = oplog.last_snapshots()
    restores = {}
    for record in oplog.history():
        if record.get("op") == "restore" and record.get("exit_code") == 0:
            for pid in record.get("pids") or []:
                restores[(int(pid), (record.get("starts") or {}).get(str(pid)))] = record
    out = []
    for pid in sorted(found):
        entry: dict[str, Any] = {
            "pid": pid,
            "user": None,
            "cmdline": [],
            "state": None,
            "lease": None,
            "owner": None,
            "devices": [],
            "last_snapshot": None,
            "restored_from": None,
            "replica_of": found[pid][1],
            "events": [],
            "agent_error": None,
        }
        try:
            proc = psutil.Process(pid)
            entry["user"] = proc.username()
            entry["cmdline"] = proc.cmdline()
        except (psutil.Error, KeyError):
            pass
        entry.update(answers.get(pid) or {})
        key = (pid, oplog.start_time(pid))
        last = snapshots.get(key)
        if last is not None:
            entry["last_snapshot"] = {k: last.get(k) for k in ("time", "op", "image", "user")}
        restored = restores.get(key)
        if restored is not None:
            entry["restored_from"] = {k: restored.get(k) for k in ("time", "image")}
        out.append(entry)
    return out
