"""Every process on this node that has an npusnap agent: its state, its lock holder (alive or
not) and its last snapshot, for `npusnap ps`.

Agents are found as `status` finds them: listening unix sockets named ``<pid>.sock`` in an
``npusnap*`` directory (/proc/net/unix of this network namespace). Core module: never prints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import paths
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import NpusnapError


def agent_pids() -> list[int]:
    found = set()
    ours = str(paths.agent_runtime_dir())
    for p in paths.listening_unix_paths():
        path = Path(p)
        if str(path.parent) != ours and not path.parent.name.startswith("npusnap"):
            continue
        stem = path.name[: -len(paths.SOCKET_SUFFIX)] if path.name.endswith(paths.SOCKET_SUFFIX) else ""
        if stem.isdigit() and os.path.exists(p) and os.path.exists(f"/proc/{stem}"):
            found.add(int(stem))
    return sorted(found)


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


def processes(timeout: float = 2.0) -> list[dict[str, Any]]:
    """One entry per agent: pid, user, command, state, lease, owner, devices, last snapshot."""
    import psutil

    from npusnap_cli.host import oplog  # lazy: `npusnap status` imports this module, never oplog

    snapshots = oplog.last_snapshots()
    restores = {}
    for record in oplog.history():
        if record.get("op") == "restore" and record.get("exit_code") == 0:
            for pid in record.get("pids") or []:
                restores[(int(pid), (record.get("starts") or {}).get(str(pid)))] = record
    out = []
    for pid in agent_pids():
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
            "events": [],
            "agent_error": None,
        }
        try:
            proc = psutil.Process(pid)
            entry["user"] = proc.username()
            entry["cmdline"] = proc.cmdline()
        except (psutil.Error, KeyError):
            pass
        try:
            with AgentClient(pid, timeout=timeout, connect_retry_s=0.2) as client:
                hello = client.hello()
                st = client.status()
            entry["state"] = st.get("state")
            entry["lease"] = st.get("lease")
            entry["owner"] = owner_view(st.get("owner"))
            entry["devices"] = list((hello.get("acl") or {}).get("devices") or [])
            entry["restored"] = bool(st.get("restored"))
            # The agent's own record (time-stamped, finished): what it did by itself, e.g. a
            # lease that ran out, which it otherwise tells only the job's agent log.
            entry["events"] = list(st.get("events") or [])[-3:]
        except NpusnapError as exc:
            entry["agent_error"] = exc.message
        key = (pid, oplog.start_time(pid))
        last = snapshots.get(key)
        if last is not None:
            entry["last_snapshot"] = {k: last.get(k) for k in ("time", "op", "image", "user")}
        restored = restores.get(key)
        if restored is not None:
            entry["restored_from"] = {k: restored.get(k) for k in ("time", "image")}
        out.append(entry)
    return out
