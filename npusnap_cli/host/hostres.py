"""Host resources of a process tree that a plain CRIU image does not carry safely.

CRIU saves a tree's memory, fds and sockets, but three kinds of things a real job holds break
it, some only after a restore that said "ok" (criu-here.md, November 2026):

* **pipes and terminals to a process outside the tree** (``train.py | tee log``): CRIU dumps
  the pipe and re-creates it at restore with no reader, and the job dies of SIGPIPE a moment
  later. ``find_external_stdio`` finds them so that dump can refuse (or record them, for restore
  to hand the job a new fd through CRIU's ``--inherit-fd``).
* **files on tmpfs** (``/dev/shm`` segments of ``multiprocessing.shared_memory``, a tmpfs
  ``/tmp``): CRIU records only their path; the bytes must be there, unchanged, at restore.
  ``find_tmpfs_files`` lists them; dump copies them into the image while the tree is frozen and
  restore puts them back (or refuses when a different file is in the way).
* deleted files still open (spawn-pool semaphores in ``/dev/shm``) are handled by CRIU's
  link-remap, which npusnap turns on by default (see criu.CriuOptions): CRIU hard-links each one
  as ``link_remap.N`` next to it and its restore opens that name. Left on the host, those files
  are lost when a ``--leave-running`` dump ends (CRIU deletes them then), do not travel with the
  image to another node, and make a later dump whose ids match fail ("Can't link remap ...: File
  exists"). So dump saves them into the image like tmpfs files (``link_remaps``, ``remap=True``),
  removes them from the host, and restore puts them back only for CRIU's restore.

Read-only /proc inspection here; copying and putting back are in ``save_files``/``put_back``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criuimages, safefs
from npusnap_cli.errors import ImageError, PreflightError
from npusnap_cli.image import digest

# The records themselves (their JSON form and validation) belong to the image model.
from npusnap_cli.image.hostrecords import NOT_DATA as _NOT_DATA
from npusnap_cli.image.hostrecords import ExternalStdio as ExternalStdio
from npusnap_cli.image.hostrecords import HostFile as HostFile
from npusnap_cli.image.hostrecords import HostNode as HostNode
from npusnap_cli.image.hostrecords import check_host_files as check_host_files
from npusnap_cli.image.hostrecords import node_problem as _node_problem
from npusnap_cli.image.hostrecords import on_mounts as _on
from npusnap_cli.image.hostrecords import place_problem as _place_problem
from npusnap_cli.image.hostrecords import split_parent as _split_parent
from npusnap_cli.image.hostrecords import tmpfs_mounts as tmpfs_mounts

# --------------------------------------------------------------------------------------------
# Pipes and terminals
# --------------------------------------------------------------------------------------------


def _fd_links(pid: int) -> dict[int, str]:
    out: dict[int, str] = {}
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(f"{base}/{name}")
        except (OSError, ValueError):
            continue
    return out


def _all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _is_tty(target: str) -> bool:
    return target.startswith("/dev/pts/") or (target.startswith("/dev/tty") and target != "/dev/tty")


def find_external_stdio(tree: Iterable[int]) -> list[ExternalStdio]:
    """Pipes the tree shares with processes outside it, and terminals it has open."""
    pids = set(tree)
    ours = {os.getpid()}
    pipes: dict[str, list[tuple[int, int]]] = {}
    found: list[ExternalStdio] = []
    for pid in sorted(pids):
        for fd, target in sorted(_fd_links(pid).items()):
            if target.startswith("pipe:["):
                pipes.setdefault(target, []).append((pid, fd))
            elif _is_tty(target):
                found.append(ExternalStdio(pid=pid, fd=fd, key=target, kind="tty", peers=()))
    if pipes:
        holders: dict[str, set[int]] = {k: set() for k in pipes}
        for other in _all_pids():
            if other in pids or other in ours:
                continue
            for target in _fd_links(other).values():
                if target in holders:
                    holders[target].add(other)
        for key, users in pipes.items():
            if holders[key]:
                for pid, fd in users:
                    found.append(
                        ExternalStdio(pid=pid, fd=fd, key=key, kind="pipe", peers=tuple(sorted(holders[key])))
                    )
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"


def stray_pipes(found: list[ExternalStdio]) -> list[ExternalStdio]:
    """Pipes to outside the tree on fds other than 0-2: restored without a reader (warned)."""
    return [e for e in found if e.kind == "pipe" and e.fd > 2]


def external_stdio_error(found: list[ExternalStdio], *, shell_job: bool) -> Optional[PreflightError]:
    """The refusal for pipes/terminals the restored job could not use, or None."""
    # Standard input/output/error are used by every job; a stray inherited pipe on another fd
    # (a CI runner's, a shell's) usually is not, so those are only warned about (stray_pipes).
    pipes = [e for e in found if e.kind == "pipe" and e.fd <= 2]
    ttys = [e for e in found if e.kind == "tty" and e.fd <= 2]
    if ttys and not shell_job:
        e = ttys[0]
        return PreflightError(
            f"pid {e.pid} has the terminal {e.key} open (fd {e.fd})",
            why="a job attached to a terminal can only be dumped as a shell job, and is restored "
            "onto the terminal `npusnap restore` runs in",
            fix="rerun with --shell-job, or start the job with its input and output redirected "
            "(`npusnap run -- CMD >>job.log 2>&1 </dev/null`)",
            details={"external_stdio": [x.to_dict() for x in ttys]},
        )
    if pipes:
        e = pipes[0]
        peers = ", ".join(f"{p} ({_comm(p)})" for p in e.peers)
        return PreflightError(
            f"pid {e.pid}'s fd {e.fd} is a pipe to a process outside the dumped tree: {peers}",
            why="CRIU re-creates the pipe at restore but not its other end, so the restored job "
            "dies of SIGPIPE at its next write (as `train.py | tee log` does)",
            fix="redirect the job's output to a file (`>>job.log 2>&1`), or rerun with "
            "--external-pipes and restore with --pipe-to FILE (the restored job writes there)",
            details={"external_stdio": [x.to_dict() for x in pipes]},
        )
    return None


# --------------------------------------------------------------------------------------------
# tmpfs files
# --------------------------------------------------------------------------------------------


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


LOCK_FILE_MAX = 1 << 20  # a lock file is small; a locked database is not ours to copy


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
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(path, "rb") as src, os.fdopen(fd, "wb") as out:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
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


# --------------------------------------------------------------------------------------------
# Directories and FIFOs the image needs on the host
# --------------------------------------------------------------------------------------------
#
# CRIU re-creates a bound unix socket by binding its path again (a stale socket file there is
# replaced), and reopens a FIFO or a file by its path; it creates neither the directories those
# paths live in nor a FIFO's node (criu/sk-unix.c bind_unix_sk, criu/fifo.c). DataLoader workers'
# multiprocessing listeners under /tmp/pymp-*/ are the common case: once the original has exited
# (--leave-running images) or on another node, CRIU's restore fails ("Can't bind ... No such
# file or directory"). The dump records each such directory and FIFO with owner and mode;
# restore creates the missing ones, refusing any that exist with a stranger's owner.


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for target in _fd_links(pid).values():
        if target.startswith("socket:["):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                continue
    return out


def bound_unix_paths(pid: int) -> list[str]:
    """Filesystem paths of the unix sockets ``pid`` holds that are bound (listening or not)."""
    inodes = _socket_inodes(pid)
    if not inodes:
        return []
    paths = []
    try:
        with open(f"/proc/{pid}/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                fields = line.split(None, 7)
                if len(fields) == 8 and int(fields[6]) in inodes:
                    path = fields[7].rstrip("\n")
                    if path.startswith("/"):  # "@...": abstract, no file
                        paths.append(path)
    except (OSError, ValueError):
        pass
    return paths


def _fifos(pid: int) -> list[str]:
    out = []
    for fd, target in _fd_links(pid).items():
        if not target.startswith("/") or target.endswith(" (deleted)"):
            continue
        try:
            if stat.S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode):
                out.append(target)
        except OSError:
            continue
    return out


def _node(path: str, kind: str, why: str) -> Optional[HostNode]:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if (kind == "dir" and not stat.S_ISDIR(st.st_mode)) or (kind == "fifo" and not stat.S_ISFIFO(st.st_mode)):
        return None  # a symlinked component (/var/run) is followed at restore, not recreated
    mode = stat.S_IMODE(st.st_mode)
    return HostNode(path=path, kind=kind, mode=mode, uid=st.st_uid, gid=st.st_gid, why=why)


def find_host_nodes(tree: Iterable[int], files: Iterable[str] = ()) -> list[HostNode]:
    """The directories (every ancestor but /) of the tree's bound unix sockets, FIFOs and of
    ``files`` (the tmpfs files the image carries), and the FIFOs themselves; parents first."""
    wanted: dict[str, tuple[str, str]] = {}  # path -> (kind, why)

    def need(path: str, kind: str, why: str) -> None:
        path = os.path.normpath(path)
        if path.startswith(_NOT_DATA[:3]) or path == "/":
            return
        wanted.setdefault(path, (kind, why))
        parent = os.path.dirname(path)
        while parent != "/":
            wanted.setdefault(parent, ("dir", why))
            parent = os.path.dirname(parent)

    for pid in tree:
        for path in bound_unix_paths(pid):
            need(os.path.dirname(path), "dir", f"unix socket {path} (pid {pid})")
        for path in _fifos(pid):
            need(path, "fifo", f"fifo {path} (pid {pid})")
    for path in files:
        need(os.path.dirname(path), "dir", f"file {path}")
    nodes = [_node(p, kind, why) for p, (kind, why) in wanted.items()]
    return sorted((n for n in nodes if n is not None), key=lambda n: (n.path.count("/"), n.path))


def _open_dir_at(parent: int, name: str) -> int:
    """Open directory ``name`` under the directory fd ``parent`` without following a symlink,
    except one owned by root (/var/run -> /run): nobody else can have planted it."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        if os.lstat(name, dir_fd=parent).st_uid != 0:
            raise
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)


def create_node(node: HostNode) -> bool:
    """Create ``node`` (owner, mode) if missing, walking its path one component at a time from /
    with directory fds (a symlink swapped in on the way is not followed); True if it was made.

    The directories on the way are reached and checked by safefs (root's or the node's owner's,
    writable by others only when sticky)."""
    parent, name = _split_parent(node.path)
    fd = safefs.open_dir(parent, owner=node.uid)
    try:
        try:
            if node.kind == "dir":
                os.mkdir(name, 0o700, dir_fd=fd)
            else:
                os.mkfifo(name, 0o600, dir_fd=fd)
        except FileExistsError:
            return False
        # Created 0700/0600 first: nobody else can open it before owner and mode are set.
        os.chown(name, node.uid, node.gid, dir_fd=fd, follow_symlinks=False)
        os.chmod(name, node.mode, dir_fd=fd)  # not a symlink: we just made it, in a dir we hold
        return True
    finally:
        os.close(fd)


def check_host_nodes(nodes: Iterable[HostNode]) -> list[HostNode]:
    """The nodes restore must create; refuse one in the way (wrong type, or an owner that is
    neither root nor the one at dump: someone else could then read or replace the job's sockets)."""
    todo = []
    for n in nodes:
        try:
            st = os.lstat(n.path)
        except FileNotFoundError:
            todo.append(n)
            continue
        is_kind = stat.S_ISDIR(st.st_mode) if n.kind == "dir" else stat.S_ISFIFO(st.st_mode)
        if stat.S_ISLNK(st.st_mode) and st.st_uid == 0 and n.kind == "dir":
            continue
        if not is_kind:
            raise PreflightError(
                f"{n.path} exists and is not a {'directory' if n.kind == 'dir' else 'fifo'}",
                why=f"the restored job needs it as at dump: {n.why}",
                fix=f"look at it (ls -ld {n.path}); remove it if nothing needs it, then restore again",
                details={"host_node": n.to_dict()},
            )
        if st.st_uid not in (0, n.uid):
            raise PreflightError(
                f"{n.path} belongs to uid {st.st_uid}, not to uid {n.uid} as at dump",
                why=f"the restored job needs it ({n.why}); a {n.kind} of another user there could "
                "intercept or block what the job binds or opens in it",
                fix=f"look at it (ls -ld {n.path}); remove it if it is not the job's, then restore again",
                details={"host_node": n.to_dict(), "uid_now": st.st_uid},
            )
    return todo


def make_host_nodes(
    nodes: list[HostNode], uids: Optional[Iterable[int]] = None, all_nodes: Iterable[HostNode] = ()
) -> list[str]:
    """Create the nodes (parents first); the paths made, for ``remove_host_nodes`` on failure.

    ``uids`` (the users the dumped job ran as): each node is checked again, as one about to be
    created, right before it is made: what restore's preflight saw exist may be gone by now,
    and root must never create a node the image-trust rule refuses."""
    made: list[str] = []
    mounts = tmpfs_mounts()
    context = list(all_nodes) or nodes
    try:
        for n in nodes:
            if uids is not None:
                problem = _node_problem(n, uids, mounts, context, creating=True)
                if problem is not None:
                    remove_host_nodes(made)
                    made = []
                    _refuse_host_files([problem])
            if create_node(n):
                made.append(n.path)
    except OSError as exc:
        remove_host_nodes(made)
        raise PreflightError(
            f"cannot create {exc.filename or 'a directory'} the restored job needs: {exc.strerror}",
            why="CRIU binds the job's unix sockets and opens its FIFOs by path; their directories "
            "must exist first",
            fix="create it by hand with the owner and mode `npusnap inspect IMAGE` shows, then restore again",
        ) from None
    return made


def remove_host_nodes(made: list[str]) -> None:
    """Undo ``make_host_nodes`` after a failed restore: the empty directories and FIFOs it made.

    Each is removed in its directory reached without following a symlink: the node's owner may
    have swapped a directory of the path for a link to one of root's since restore made it."""
    for path in reversed(made):
        parent, name = _split_parent(path)
        try:
            with safefs.dir_fd(parent, check=False) as dfd:
                st = safefs.lstat_at(dfd, name)
                if st is None:
                    continue
                if stat.S_ISFIFO(st.st_mode):
                    os.unlink(name, dir_fd=dfd)
                elif stat.S_ISDIR(st.st_mode):
                    os.rmdir(name, dir_fd=dfd)  # (only if still empty)
        except OSError:
            continue


# --------------------------------------------------------------------------------------------
# Listeners a restore would take from a running process
# --------------------------------------------------------------------------------------------
#
# CRIU binds a restored unix socket at its dumped path and first removes whatever socket file is
# there (criu/sk-unix.c, bind_unix_sk). After the original exited that is its stale file; while
# it still runs (a copy restored beside it: `restore` of a --pid-ns image, `--replicas`) the file
# is the original's live listener, and its clients then reach the copy. A DataLoader worker's
# multiprocessing listener (/tmp/pymp-*/listener-*) is such a socket: its main process fetches
# every batch's shared-memory fd through it, and a copy restored over it made the original fail
# ("Connection reset by peer"). The path is in the process's memory too, so a copy cannot bind
# it elsewhere; with a shared filesystem there is one listener per path.


def image_listeners(criu_dir: Path, skip: Iterable[Optional[str]] = ()) -> list[str]:
    """The filesystem paths the image's listening unix sockets are bound to (``skip``: the agent
    sockets, which a restore binds under a name of its own)."""
    skipped = {s for s in skip if s}
    try:
        sockets = criuimages.unix_sockets(criu_dir)
    except (OSError, criuimages.Undecodable):
        return []
    out = []
    for sk in sockets:
        # Listening streams only; the simulated device's connection is the device plugin's,
        # never bound by CRIU.
        name = sk.name
        if sk.listening_stream and name and name.startswith("/") and name not in skipped and name not in out:
            out.append(name)
    return out


def live_listeners(wanted: Iterable[str]) -> dict[str, tuple[int, str]]:
    """Of ``wanted`` paths, those a live process listens on now (in any network namespace of the
    host): path -> (pid, command name)."""
    want = set(wanted)
    if not want:
        return {}
    seen_ns: set[str] = set()
    found: dict[int, str] = {}  # socket inode -> path
    pids = _all_pids()
    for pid in pids:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        try:
            with open(f"/proc/{pid}/net/unix", encoding="utf-8", errors="replace") as f:
                next(f, None)
                for line in f:
                    fields = line.split(None, 7)
                    if len(fields) == 8 and int(fields[3], 16) & 0x10000:
                        path = fields[7].rstrip("\n")
                        if path in want:
                            found[int(fields[6])] = path
        except (OSError, ValueError):
            continue
    if not found:
        return {}
    out: dict[str, tuple[int, str]] = {}
    for pid in pids:
        for ino in _socket_inodes(pid) & set(found):
            path = found[ino]
            if path not in out and _same_file(path, pid):
                out[path] = (pid, _comm(pid))
    return out


def _same_file(path: str, pid: int) -> bool:
    """Whether ``path`` here is the file ``path`` is for ``pid`` (which may see another /tmp: a
    container's mount namespace)."""
    try:
        here = os.stat(path)
        there = os.stat(f"/proc/{pid}/root{path}")
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def check_listeners_free(criu_dir: Path, agent_sockets: Iterable[Optional[str]]) -> list[str]:
    """Refuse a restore whose CRIU would bind a unix socket over a live process's listener; the
    image's listener paths otherwise."""
    paths = image_listeners(criu_dir, agent_sockets)
    busy = live_listeners(paths)
    if busy:
        path, (pid, comm) = next(iter(busy.items()))
        raise PreflightError(
            f"pid {pid} ({comm}) listens on {path}, which the image's job binds too",
            why="CRIU binds a restored unix socket at its dumped path, replacing the socket file: "
            "the running process's clients would reach the restored copy instead (a DataLoader "
            "worker's multiprocessing listener, usually: the job's original, still running)",
            fix=f"stop pid {pid} (the original: `kill` it) and restore again; a job whose processes "
            "listen on unix socket paths restores once per host at a time, not beside itself",
            details={"busy_listeners": {p: {"pid": q, "comm": c} for p, (q, c) in busy.items()}},
        )
    return paths
