"""Directories and FIFOs the image needs on the host: recorded at dump, created at restore."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from typing import Optional

from npusnap_cli import safefs
from npusnap_cli.errors import PreflightError
from npusnap_cli.host.hostres.files import _refuse_host_files
from npusnap_cli.host.hostres.procfds import _fd_links
from npusnap_cli.image.hostrecords import NOT_DATA as _NOT_DATA
from npusnap_cli.image.hostrecords import HostNode, tmpfs_mounts
from npusnap_cli.image.hostrecords import node_problem as _node_problem
from npusnap_cli.image.hostrecords import split_parent as _split_parent

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
