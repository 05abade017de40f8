"""tmpfs files, locked files and CRIU's link-remap files: found, saved into the image while the
tree is frozen, and put back at restore (or refused when a different file is in the way)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criuimages, safefs
from npusnap_cli.errors import ImageError, PreflightError
from npusnap_cli.host import procfs
from npusnap_cli.host.hostres.procfds import _all_pids, _fd_links
from npusnap_cli.image import digest
from npusnap_cli.image.hostrecords import (
    LOCK_FILE_MAX,
    HostFile,
    check_host_files,
    in_place,
    lease_holders,
    tmpfs_mounts,
)
from npusnap_cli.image.hostrecords import NOT_DATA as _NOT_DATA
from npusnap_cli.image.hostrecords import on_mounts as _on
from npusnap_cli.image.hostrecords import place_problem as _place_problem
from npusnap_cli.image.hostrecords import split_parent as _split_parent

_O_ACCMODE, _O_WRONLY, _O_APPEND = 0o3, 0o1, 0o2000


def _append_only(pid: int, fd: int) -> bool:
    """An fd opened write-only with O_APPEND: a log; CRIU itself does not check its size."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("flags:"):
                    flags = int(line.split()[1], 8)
                    return flags & _O_ACCMODE == _O_WRONLY and bool(flags & _O_APPEND)
    except (OSError, ValueError, IndexError):
        pass
    return False


def find_tmpfs_files(tree: Iterable[int], mounts: Optional[list[str]] = None) -> list[str]:
    """Regular files on tmpfs that the tree has mapped or open (not deleted ones, not logs
    opened write-only with O_APPEND, whose later growth CRIU tolerates)."""
    mounts = tmpfs_mounts() if mounts is None else mounts
    paths: set[str] = set()
    for pid in tree:
        candidates = [t for fd, t in _fd_links(pid).items() if not _append_only(pid, fd)]
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        candidates.append(parts[5].strip())
        except OSError:
            pass
        for p in candidates:
            if not p.startswith("/") or p.endswith(" (deleted)") or p.startswith(_NOT_DATA):
                continue
            if _on(p, mounts):
                paths.add(p)
    out = []
    for p in sorted(paths):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append(p)
    return out


def find_locked_files(tree: Iterable[int]) -> list[str]:
    """Small regular files the tree holds a lock on (/proc/locks: flock, POSIX, OFD), wherever
    they live: lock files and pid files that the original removes when it exits, which CRIU's
    restore (``--file-locks``) must reopen by path."""
    pids = set(tree)
    keys: set[tuple[int, int, int]] = set()
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks a blocked waiter)
                if len(fields) < 6 or fields[1] == "->":
                    continue
                try:
                    pid = int(fields[4])
                    major, minor, ino = fields[5].split(":")
                    keys.add((int(major, 16), int(minor, 16), int(ino)))
                except ValueError:
                    continue
                if pid not in pids and pid > 0:
                    keys.discard((int(major, 16), int(minor, 16), int(ino)))
    except OSError:
        return []
    if not keys:
        return []
    found = set()
    for pid in pids:
        for fd, target in _fd_links(pid).items():
            if not target.startswith("/") or target.endswith(" (deleted)") or target.startswith(_NOT_DATA):
                continue
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
            if key in keys and stat.S_ISREG(st.st_mode) and st.st_size <= LOCK_FILE_MAX:
                found.add(target)
    return sorted(found)


def _digest(f: HostFile) -> str:
    return digest.of_file(Path(f.path), f.algo)


def planned_files(paths: list[str]) -> list[HostFile]:
    """The records ``save_files`` would make of ``paths``, without copying or hashing them
    (digest empty): what dump's preflight checks against restore's rules."""
    out = []
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone meanwhile: nothing to carry
        mode = stat.S_IMODE(st.st_mode)
        out.append(HostFile(path=path, size=st.st_size, mode=mode, uid=st.st_uid, gid=st.st_gid, digest=""))
    return out


def save_files(paths: list[str], image_tmp: Path, *, remap: bool = False) -> tuple[HostFile, ...]:
    """Copy each file into ``image_tmp/hostfiles/<path>`` (0600); call while the tree is frozen."""
    saved = []
    for path in paths:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{path} is not a regular file any more", fix="dump again")
        dest = image_tmp / ("hostfiles" + path)
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        h = digest.new()
        src = _open_to_copy(path, st)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            try:
                at = 0
                while src is not None and (chunk := os.pread(src, 1 << 20, at)):
                    h.update(chunk)
                    out.write(chunk)
                    at += len(chunk)
            finally:
                if src is not None:
                    os.close(src)
        saved.append(
            HostFile(
                path=path,
                size=dest.stat().st_size,
                mode=stat.S_IMODE(st.st_mode),
                uid=st.st_uid,
                gid=st.st_gid,
                digest=h.hexdigest(),
                remap=remap,
            )
        )
    return tuple(saved)


def _open_to_copy(path: str, st: os.stat_result) -> Optional[int]:
    """An fd to read ``path`` from (pread: a shared file offset stays where it is), or None for
    an empty file nobody may open. A file the job holds a lease on is read through the holder's
    own fd (pidfd_getfd): an open of ours would break the lease (fcntl(2)), and with the holder
    frozen the open waits out the kernel's lease-break time (45 s by default), then takes the
    lease away from the job."""
    holders = lease_holders(st)
    for pid in holders or ():
        fd = procfs.fd_of_file(pid, st)
        if fd is not None:
            return fd
    if holders and st.st_size == 0:
        return None
    if holders:
        raise PreflightError(unreadable_lease(path))
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def unreadable_lease(path: str) -> str:
    return (
        f"cannot copy {path}: the job holds a lease on it and no descriptor open for reading, and "
        "an open of npusnap's would break its lease"
    )


def leases_unreadable(paths: list[str]) -> list[str]:
    """The problems of copying ``paths`` at the dump (checked before anything is touched): a
    non-empty file leased by a holder with no fd open for reading cannot be read without breaking
    the lease."""
    out = []
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        holders = lease_holders(st)
        if not holders or st.st_size == 0:
            continue
        fds = [fd for pid in holders if (fd := procfs.fd_of_file(pid, st)) is not None]
        for fd in fds:
            os.close(fd)
        if not fds:
            out.append(unreadable_lease(path))
    return out


def link_remaps(criu_dir: Path) -> list[str]:
    """The ``link_remap.N`` files CRIU made in this dump (hard links to deleted files the tree
    had open): the ``files.img`` names of the LINKED ids in ``remap-fpath.img``."""
    ids = {r.remap_id for r in criuimages.remaps(criu_dir) if r.kind == "LINKED"}
    if not ids:
        return []
    paths = sorted({name for i, name in criuimages.regular_files(criu_dir).items() if i in ids})
    for p in paths:
        if not p.startswith("/"):
            raise ImageError(
                f"CRIU recorded the link-remap file {p!r} without an absolute path", fix="dump again"
            )
    # Only those on tmpfs travel in the image: restore writes host files on tmpfs (or lock files
    # where their owner could) only; one on a disk stays there, where CRIU's restore finds it.
    mounts = tmpfs_mounts()
    return [p for p in paths if _on(p, mounts)]


def drop_remaps(files: Iterable[HostFile]) -> list[str]:
    """Remove the link-remap files among ``files`` from the host (the image holds them); a file
    by that name whose contents are not the image's copy is left alone. The paths removed."""
    return remove_copies([f for f in files if f.remap])


def absent(files: Iterable[HostFile]) -> list[HostFile]:
    """Those of ``files`` not on the host now (a restore that fails removes what it created)."""
    return [f for f in files if _lstat_safe(f) is None]


def remove_copies(files: Iterable[HostFile]) -> list[str]:
    """Remove each of ``files`` from the host if it still holds the image's copy (reached without
    following a symlink); a file by that name with other contents is left alone. The paths removed."""
    removed = []
    for f in files:
        parent, name = _split_parent(f.path)
        try:
            with safefs.dir_fd(parent, owner=f.uid) as dfd:
                st = safefs.lstat_at(dfd, name)
                if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                    continue
                if _digest_safe(f) != f.digest:
                    continue
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            continue
        except OSError:
            continue  # a symlink or a foreign directory on the way: not ours to remove
        removed.append(f.path)
    return removed


def _refuse_host_files(problems: list[str]) -> None:
    if problems:
        raise ImageError(
            f"the image asks to write a host file it may not: {problems[0]}",
            why="restore writes, as root, only the tmpfs files, directories and FIFOs a dump "
            "recorded, as the job had them; this image's host_files or host_nodes were crafted or "
            "edited (or dumped on a host whose tmpfs mounts differ from this one's)",
            fix="do not restore this image; `npusnap inspect DIR` lists its host files and nodes",
            details={"problems": problems},
        )


def _lstat_safe(f: HostFile) -> Optional[os.stat_result]:
    """lstat of ``f.path`` reached without following a symlink; None when it (or a parent) is
    missing. A symlink or a foreign directory on the way is a PreflightError."""
    parent, name = _split_parent(f.path)
    try:
        with safefs.dir_fd(parent, owner=f.uid) as dfd:
            return safefs.lstat_at(dfd, name)
    except FileNotFoundError:
        return None
    except safefs.UnsafePath as exc:
        raise PreflightError(
            f"cannot put {f.path} back: {exc.filename}: {exc.strerror}",
            why="restore writes the job's tmpfs files as root, and never through a symbolic link or "
            "into a directory another user controls (that user could choose where root writes)",
            fix=f"remove {exc.filename} (or make it a plain directory of root or uid {f.uid}), "
            "then restore again",
            details={"path": f.path, "unsafe": exc.filename},
        ) from None


def _digest_safe(f: HostFile) -> str:
    parent, name = _split_parent(f.path)
    with safefs.dir_fd(parent, owner=f.uid) as dfd:
        fd = safefs.open_read_at(dfd, name)
    h = digest.new(f.algo)
    with os.fdopen(fd, "rb") as src:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            h.update(chunk)
    return str(h.hexdigest())


def check_put_back(
    files: tuple[HostFile, ...],
    *,
    replace: bool,
    uids: Optional[Iterable[int]] = None,
    nodes: Iterable[Any] = (),
) -> list[HostFile]:
    """The files to write at restore; refuse when a different file is in the way (no --replace),
    when one is not on a tmpfs mount of this host, or belongs to no user of the job (``uids``)."""
    mounts = tmpfs_mounts()
    nodes = list(nodes)
    problems = [p for f in files if (p := _place_problem(f, mounts, nodes)) is not None]
    if uids is not None:
        problems = check_host_files(files, uids, nodes)
    _refuse_host_files(problems)
    todo: list[HostFile] = []
    for f in files:
        if not f.remap and not _on(f.path, mounts) and in_place(f):
            continue  # a lock file outside tmpfs, there as the job had it: nothing to write
        st = _lstat_safe(f)
        if st is None:
            todo.append(f)
            continue
        if not stat.S_ISREG(st.st_mode):
            raise PreflightError(
                f"{f.path} exists and is not a regular file",
                why="the image holds the dump-time contents of that tmpfs file for the job",
                fix=f"remove it (`rm {f.path}`) and restore again",
            )
        if st.st_size == f.size and _digest_safe(f) == f.digest:
            continue
        if not replace and f.remap:
            raise PreflightError(
                f"{f.path} is in the way: CRIU's restore of this image needs that name for a deleted "
                "file the job had open",
                why="another dump (plain CRIU, or an older npusnap) left a link-remap file "
                "with the same name; the image it belongs to may still need it",
                fix=f"if no unrestored image needs it, remove it (`rm {f.path}`), or rerun restore "
                "with --replace-tmpfs-files; then restore again",
                details={"changed_file": f.path, "size_at_dump": f.size, "size_now": st.st_size},
            )
        if not replace and _is_semaphore(f.path) and not file_holders(f.path, st):
            # A POSIX semaphore nobody has open or mapped: what a job killed after its dump
            # leaves (a spawn context's multiprocessing locks, which its resource tracker did not
            # live to unlink). It is synchronisation state, not data, and the job it belongs to
            # is the one being restored: it gets its dump-time value back.
            todo.append(f)
            continue
        if not replace:
            raise PreflightError(
                f"{f.path} changed since the dump ({f.size} bytes then, {st.st_size} now)",
                why="the job had this tmpfs file open or mapped; restoring it onto other contents "
                "would make it compute on data it never saw (a shared-memory segment, usually)",
                fix=f"stop whatever uses {f.path} and remove it (the image puts the dump-time copy "
                "back), or rerun restore with --replace-tmpfs-files to overwrite it",
                details={"changed_file": f.path, "size_at_dump": f.size, "size_now": st.st_size},
            )
        todo.append(f)
    return todo


def _is_semaphore(path: str) -> bool:
    """A named POSIX semaphore: glibc's sem_open keeps ``NAME`` as /dev/shm/sem.NAME."""
    return os.path.dirname(path) == "/dev/shm" and os.path.basename(path).startswith("sem.")


def file_holders(path: str, st: os.stat_result) -> list[int]:
    """The pids that have the file ``st`` (at ``path``) open or mapped now."""
    out = []
    for pid in _all_pids():
        held = False
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    fst = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                    held = True
                    break
            if not held:
                with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as m:
                    ino = str(st.st_ino)
                    held = any(ln.rstrip("\n").endswith(" " + path) and ln.split()[4] == ino for ln in m)
        except (OSError, IndexError):
            continue
        if held:
            out.append(pid)
    return out


def put_back(files: list[HostFile], image: Path, nodes: Iterable[Any] = ()) -> list[str]:
    """Write the saved copies to their paths (owner and mode as at dump, never set-id), each in
    its directory reached without following a symlink (safefs); the paths written."""
    written: list[str] = []
    mounts = tmpfs_mounts()
    nodes = list(nodes)
    for f in files:
        problem = _place_problem(f, mounts, nodes)  # checked by check_put_back too; never write elsewhere
        if problem is not None:
            _refuse_host_files([problem])
        src = image / f.rel
        with open(src, "rb") as s:
            try:
                safefs.write_file(
                    f.path,
                    iter(lambda: s.read(1 << 20), b""),
                    mode=f.mode,
                    uid=f.uid,
                    gid=f.gid,
                    owner=f.uid,
                    create_dirs=_on(f.path, mounts),  # elsewhere, only into a directory that exists
                )
            except safefs.UnsafePath as exc:
                raise PreflightError(
                    f"cannot put {f.path} back: {exc.filename}: {exc.strerror}",
                    why="restore writes the job's tmpfs files as root, and never through a symbolic "
                    "link or into a directory another user controls",
                    fix=f"remove {exc.filename}, then restore again",
                    details={"path": f.path, "unsafe": exc.filename, "written": written},
                ) from None
        written.append(f.path)
    return written
