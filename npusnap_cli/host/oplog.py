"""A record of what npusnap did on this node: one syslog line and one history entry per dump,
restore, freeze and thaw (who, what, result).

* **syslog** (the journal on systemd hosts, ``journalctl -t npusnap``): through the local syslog
  socket ``/dev/log`` (``NPUSNAP_SYSLOG_SOCKET`` overrides) when there is one. No socket (a
  container, a minimal host): nothing is sent and the command goes on; a record is never a
  reason to fail an operation.
* **history**: JSON lines in ``history.jsonl`` under the state directory (root:
  ``/var/lib/npusnap``; others: ``$XDG_STATE_HOME/npusnap`` or ``~/.local/state/npusnap``;
  ``NPUSNAP_STATE_DIR`` overrides). `npusnap ps` reads it for each job's last snapshot. Bounded
  to the newest ``KEEP`` entries.

Core module: never prints.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import pwd
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from npusnap_cli import paths, safefs
from npusnap_cli.errors import ExitCode, NpusnapError
from npusnap_cli.host import hostclean
from npusnap_cli.jsontypes import (
    JSONObject,
    JSONValue,
    ShapeError,
    as_record,
    int_list,
    opt_float,
    opt_int,
    opt_str,
    req_int,
    req_obj,
    req_str,
)

SYSLOG_SOCKET = "/dev/log"
HISTORY = "history.jsonl"
KEEP = 1000


def state_dir() -> Path:
    return paths.state_dir()


def _user() -> str:
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    sudo = os.environ.get("SUDO_USER")
    return f"{name}(uid {uid}{', sudo from ' + sudo if sudo else ''})"


def start_time(pid: int) -> Optional[float]:
    return hostclean.process_start_time(pid)


def syslog_socket() -> str:
    return os.environ.get("NPUSNAP_SYSLOG_SOCKET") or SYSLOG_SOCKET


def _syslog(line: str, failed: bool) -> bool:
    """Send one line to the local syslog socket (RFC 3164 framing, as logger(1) and libc's
    syslog() do, which journald and rsyslog both read); False, and nothing else, without one."""
    import socket

    path = syslog_socket()
    if not os.path.exists(path):
        return False
    priority = 8 + (4 if failed else 6)  # facility user (1 << 3), severity warning or info
    stamp = time.strftime("%b %d %H:%M:%S")
    message = f"<{priority}>{stamp} npusnap[{os.getpid()}]: {line}".encode(errors="replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(1.0)  # a stuck syslog daemon never holds an operation
            sock.sendto(message, path)
    except OSError:
        return False
    return True


# A history line or running file that is JSON but not the record: skipped by its readers.
MalformedRecord = ShapeError


@dataclass(frozen=True)
class HistoryRecord:
    """One line of ``history.jsonl``: one finished operation."""

    op: str
    pids: tuple[int, ...]
    exit_code: int
    time: Optional[str] = None
    # str(pid) -> its start time then: a pid is reused, so ps matches a job by pid and start time.
    starts: Mapping[str, Optional[float]] = field(default_factory=dict)
    image: Optional[str] = None
    user: Optional[str] = None
    npusnap_pid: Optional[int] = None
    result: Optional[str] = None
    error: Optional[str] = None
    duration_s: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def start_of(self, pid: int) -> Optional[float]:
        return self.starts.get(str(pid))

    def to_json(self) -> JSONObject:
        return {
            "time": self.time,
            "op": self.op,
            "pids": list(self.pids),
            "starts": dict(self.starts),
            "image": self.image,
            "user": self.user,
            "npusnap_pid": self.npusnap_pid,
            "exit_code": self.exit_code,
            "result": self.result,
            "error": self.error,
            "duration_s": self.duration_s,
        }

    @classmethod
    def from_json(cls, data: JSONValue) -> HistoryRecord:
        """The record of one history line; MalformedRecord naming the field that is not.

        ``op``, ``pids`` and ``exit_code`` are required; the rest may be absent (null then)."""
        data = as_record(data, "the history line")
        starts = {} if data.get("starts") is None else req_obj(data, "starts")
        return cls(
            op=req_str(data, "op"),
            pids=int_list(data, "pids", optional=True),
            exit_code=req_int(data, "exit_code"),
            time=opt_str(data, "time"),
            starts={pid: opt_float(starts, pid) for pid in starts},
            image=opt_str(data, "image"),
            user=opt_str(data, "user"),
            npusnap_pid=opt_int(data, "npusnap_pid"),
            result=opt_str(data, "result"),
            error=opt_str(data, "error"),
            duration_s=opt_float(data, "duration_s"),
        )


def _append(entry: JSONObject) -> None:
    directory = state_dir()
    with contextlib.suppress(OSError):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / HISTORY
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
        if path.stat().st_size > KEEP * 600:
            _trim(path)


def _trim(path: Path) -> None:
    lines = path.read_text(errors="replace").splitlines()[-KEEP:]
    # A random O_EXCL temporary name, renamed over the history: never a name planted beside it.
    safefs.write_file(str(path), iter([("\n".join(lines) + "\n").encode()]), mode=0o600, check=False)


def record(
    op: str,
    *,
    pids: list[int],
    image: Optional[str],
    exit_code: int,
    error: Optional[str] = None,
    duration_s: Optional[float] = None,
    starts: Optional[Mapping[int, Optional[float]]] = None,
) -> tuple[HistoryRecord, bool]:
    """Record one finished operation; returns the entry and whether syslog took its line."""
    entry = HistoryRecord(
        time=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        op=op,
        pids=tuple(pids),
        starts={str(p): t for p, t in (starts or {}).items()},
        image=image,
        user=_user(),
        npusnap_pid=os.getpid(),
        exit_code=exit_code,
        result="ok" if exit_code == 0 else "failed",
        error=error,
        duration_s=None if duration_s is None else round(duration_s, 3),
    )
    line = (
        f"{op} pid {','.join(map(str, pids)) or '-'}"
        + (f" image {image}" if image else "")
        + f" by {entry.user}: {entry.result}"
        + (f" (exit {exit_code}: {error})" if exit_code else "")
        + (f" in {duration_s:.2f}s" if duration_s is not None else "")
    )
    _append(entry.to_json())
    return entry, _syslog(line, failed=exit_code != 0)


RUNNING = "running"


@dataclass(frozen=True)
class RunningRecord:
    """The file ``running/<npusnap pid>.json``: an npusnap command at work on ``pids`` now."""

    op: str
    pid: int  # the npusnap command's
    start: Optional[float]  # its start time: a pid reused by another process is not it
    pids: tuple[int, ...]
    since: Optional[str]

    def to_json(self) -> JSONObject:
        return {
            "op": self.op,
            "pid": self.pid,
            "start": self.start,
            "pids": list(self.pids),
            "since": self.since,
        }

    @classmethod
    def from_json(cls, data: JSONValue) -> RunningRecord:
        data = as_record(data, "the running file")
        return cls(
            op=req_str(data, "op"),
            pid=req_int(data, "pid"),
            start=opt_float(data, "start"),
            pids=int_list(data, "pids", optional=True),
            since=opt_str(data, "since"),
        )


def _mark_running(op: str, pids: list[int]) -> Optional[Path]:
    """A file naming this command and its pids while it runs: an agent busy with a long dump
    answers nobody else, and `status` must say who holds it instead of "error"."""
    if not pids:
        return None
    try:
        d = state_dir() / RUNNING
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = d / f"{os.getpid()}.json"
        entry = RunningRecord(
            op=op,
            pid=os.getpid(),
            start=start_time(os.getpid()),
            pids=tuple(pids),
            since=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(entry.to_json()))
        return path
    except OSError:
        return None  # a record is never a reason to fail an operation


def running_on(pid: int) -> Optional[RunningRecord]:
    """The npusnap command (still alive) working on ``pid`` now, from its running file."""
    try:
        files = sorted((state_dir() / RUNNING).glob("*.json"))
    except OSError:
        return None
    for f in files:
        try:
            entry = RunningRecord.from_json(json.loads(f.read_text()))
        except (OSError, ValueError):  # MalformedRecord is a ValueError
            continue
        holder = entry.pid
        if holder == os.getpid() or start_time(holder) != entry.start or start_time(holder) is None:
            continue  # ours, or a command that ended without removing its file
        if pid in entry.pids:
            return entry
    return None


def held_by_command(pid: int) -> bool:
    """Whether another npusnap command (still alive) works on ``pid`` now."""
    return running_on(pid) is not None


@dataclass
class Operation:
    """What ``operation`` records when its body ends: the body sets ``pids`` and ``image`` once
    it knows them (a restore learns its pids at the end)."""

    pids: list[int]
    image: Optional[str]
    starts: dict[int, Optional[float]] = field(default_factory=dict)


@contextlib.contextmanager
def operation(op: str, pids: list[int], image: Optional[str]) -> Iterator[Operation]:
    """Record the operation in the body when it ends, however it ends. The body may update the
    yielded Operation (``pids``, ``image``) once it knows them."""
    info = Operation(list(pids), os.path.abspath(image) if image else None, {p: start_time(p) for p in pids})
    t0 = time.monotonic()
    code, error = 0, None
    marker = _mark_running(op, list(pids))
    try:
        yield info
    except NpusnapError as exc:
        code, error = int(exc.exit_code), exc.message
        raise
    except KeyboardInterrupt:
        code, error = int(ExitCode.INTERRUPTED), "interrupted"
        raise
    except BaseException as exc:
        import click

        if isinstance(exc, click.exceptions.Exit) and not exc.exit_code:
            raise
        code, error = int(getattr(exc, "exit_code", 0) or ExitCode.INTERNAL), type(exc).__name__
        raise
    finally:
        if marker is not None:
            with contextlib.suppress(OSError):
                marker.unlink()
        with contextlib.suppress(Exception):
            starts = dict(info.starts)
            for p in info.pids:
                starts.setdefault(p, start_time(p))
            record(
                op,
                pids=list(info.pids),
                image=info.image,
                exit_code=code,
                error=error,
                duration_s=time.monotonic() - t0,
                starts=starts,
            )


def history() -> list[HistoryRecord]:
    """The recorded operations, oldest first (unreadable or malformed lines skipped: a record is
    never a reason to fail a command)."""
    try:
        text = (state_dir() / HISTORY).read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # MalformedRecord is a ValueError
            out.append(HistoryRecord.from_json(json.loads(line)))
    return out


def last_snapshots() -> dict[tuple[int, Optional[float]], HistoryRecord]:
    """(pid, start time) -> the newest successful dump or freeze of that process."""
    found: dict[tuple[int, Optional[float]], HistoryRecord] = {}
    for entry in history():
        if entry.op not in ("dump", "freeze") or not entry.ok:
            continue
        if entry.op == "dump" and entry.image and not os.path.isdir(entry.image):
            continue  # removed since (`--keep-last`, by hand): not a snapshot to restore any more
        for pid in entry.pids:
            found[(pid, entry.start_of(pid))] = entry
    return found
