"""freeze / thaw: the device half only, the lock kept across two commands (its tokens in files
of the runtime directory), and the note `thaw --force` leaves the command it took a lock from."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from npusnap_cli import paths
from npusnap_cli.host import hostclean


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
