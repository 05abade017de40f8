"""CRIU's ghost files: one restore at a time per ghost path on this host.

A deleted file the job held open and small enough (CRIU's ``--ghost-limit``, 1 MiB by default)
is saved in the image (``ghost-file-ID.img``). CRIU's restore recreates it under a fixed name
beside the original path, ``PATH.cr.ID.ghost`` (criu/files-reg.c, ``ghost_path``), with
``O_CREAT | O_EXCL`` (``mkreg_ghost``), opens it for the restored tasks and unlinks it only once
every task is restored (``depopulate_roots_yard`` -> ``try_clean_remaps``: after the
``post-restore`` action script, before ``pre-resume`` and before CRIU answers; on a failed restore
at its ``out:`` label, before it answers too). The name depends on the image only, so two
restores of one image (``--replicas``, or two ``npusnap restore`` commands) that overlap fail in
the second's ``mkreg_ghost``: "Can't create ghost regfile: File exists".

A job's own deleted file is not in the way: the running original (``--leave-running``) holds it
without a name, and CRIU's dump writes the ghost's contents into the image, not on the host.

So a restore that will create ghost files holds an ``flock`` per ghost path (in sorted order)
from just before CRIU starts until CRIU has answered (by then its ghost files are gone). Other
restores of the image wait for it; all else (device restore, settle watch) stays parallel. The
holder removes each lock file before it lets go of the lock, so none is left behind; a waiter that
then holds a lock on a name already removed opens the name anew.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

from npusnap_cli import criuimages, paths, safefs
from npusnap_cli.errors import BusyError, PreflightError

WAIT_S = 600.0  # one copy's CRIU restore; a holder past this is stuck, not slow
POLL_S = 0.05
LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def ghost_paths(criu_dir: Path) -> list[str]:
    """The ghost file paths CRIU's restore of ``criu_dir`` creates (``PATH.cr.ID.ghost``), sorted."""
    ghosts = {r.orig_id: r.remap_id for r in criuimages.remaps(criu_dir) if r.kind == "GHOST"}
    if not ghosts:
        return []
    names = criuimages.regular_files(criu_dir)
    return sorted({f"/{names[i].lstrip('/')}.cr.{g:x}.ghost" for i, g in ghosts.items() if i in names})


def for_image(criu_dir: Path, note: Callable[[str], None]) -> contextlib.AbstractContextManager[None]:
    """The locks a restore of ``criu_dir`` holds while CRIU runs. An image with a mount namespace
    of its own (mountpoints-*.img) names its ghosts inside it: still locked by those names, but
    not looked up on this side."""
    ghosts = ghost_paths(criu_dir)
    own_mounts = bool(ghosts) and any(criu_dir.glob("mountpoints-*.img"))
    return held(ghosts, note, leftovers=not own_mounts)


def lock_dir() -> Path:
    # Ghost paths are host-wide, so is the lock: not under a per-run NPUSNAP_RUNTIME_DIR. Directly
    # under /run, where only root creates: a user could plant a directory (and symlinks in it)
    # under the world-writable /run/lock before root makes it.
    return Path("/run/npusnap-ghosts") if os.geteuid() == 0 else paths.agent_runtime_dir() / "ghosts"


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return os.pread(fd, 32, 0).decode().strip()
    return "?"


def _refuse_leftovers(ghosts: list[str]) -> None:
    """Under the locks no restore of ours is making these names: one that exists was left by a
    CRIU killed before its cleanup (or made by something else), and CRIU's O_EXCL would fail."""
    for g in ghosts:
        if os.path.lexists(g):
            raise PreflightError(
                f"{g} exists: CRIU creates that name for a deleted file of the image",
                why="a CRIU restore of this image that was killed before its cleanup leaves its ghost "
                "files behind (or another program made the file); CRIU would fail with "
                '"Can\'t create ghost regfile: File exists"',
                fix=f"once no restore of this image is running, remove it: rm {g}",
                details={"ghost": g},
            )


def _unsafe(where: Path, exc: OSError) -> PreflightError:
    return PreflightError(
        f"cannot take the ghost-file lock {where}: {exc.strerror or exc}",
        why="the lock lives in a directory only root (or this user) may write, and is never "
        "reached through a symbolic link",
        fix=f"look at who made {where} and remove it if it is not npusnap's, then restore again",
    )


@contextlib.contextmanager
def held(
    ghosts: list[str],
    note: Callable[[str], None],
    *,
    wait_s: float = WAIT_S,
    directory: Optional[Path] = None,
    leftovers: bool = True,
) -> Iterator[None]:
    """Hold the lock of every path of ``ghosts`` (waiting up to ``wait_s`` for another restore
    that creates them); release on exit. ``leftovers``: the paths are this namespace's, so one
    that exists is refused."""
    if not ghosts:
        yield
        return
    d = directory or lock_dir()
    # Reached without following a symlink, every directory root's (or this user's) and written by
    # nobody else; the lock files are opened without following one either.
    euid = os.geteuid()
    try:
        dfd = safefs.open_dir(
            str(d),
            owner=euid or None,
            create=True,
            create_uid=euid,
            create_gid=os.getegid(),
            create_mode=0o700,
        )
    except OSError as exc:
        raise _unsafe(d, exc) from None
    held_locks: list[tuple[int, str]] = []
    try:
        deadline = time.monotonic() + wait_s
        for g in ghosts:
            name = hashlib.sha256(g.encode()).hexdigest()[:24] + ".lock"
            waited = False
            while True:
                try:
                    fd = os.open(
                        name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
                    )
                except OSError as exc:
                    raise _unsafe(d / name, exc) from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if _names(dfd, name, fd):
                        break
                    # the holder before us removed the name once done: lock the file there now
                    os.close(fd)
                    continue
                except BlockingIOError:
                    holder = _holder(fd)
                    os.close(fd)  # reopened after the pause: the holder removes the name when done
                    if not waited:
                        note(
                            f"waiting for the CRIU restore of pid {holder} to remove its ghost "
                            f"file {g} (the same image restored at the same time: CRIU creates that "
                            "name, so one copy's CRIU restore runs at a time)"
                        )
                        waited = True
                    if time.monotonic() > deadline:
                        raise BusyError(
                            f"another restore (pid {holder}) has held CRIU's ghost file {g} "
                            f"for more than {wait_s:.0f}s",
                            why="CRIU recreates each deleted file of the image under one fixed name "
                            "and removes it only at the end of its restore; two restores of one "
                            "image at once would collide on it",
                            fix="wait for the other restore to finish (or end it), then restore again",
                            details={"ghost": g},
                        ) from None
                    time.sleep(POLL_S)
            held_locks.append((fd, name))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        if leftovers:
            _refuse_leftovers(ghosts)
        yield
    finally:
        for fd, name in reversed(held_locks):
            # Removed while still locked, so that no lock file outlives its restore; a waiter that
            # opened the old name finds it gone once it holds the lock, and opens the name anew.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
            os.close(fd)  # closing the only descriptor of the open file drops its flock
        os.close(dfd)


def _names(dfd: int, name: str, fd: int) -> bool:
    """Whether ``name`` in ``dfd`` is still the file open as ``fd``."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
