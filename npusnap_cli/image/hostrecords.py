"""The host records an image carries in its manifest, and whether this host may take them.

``host_files`` (tmpfs files and CRIU's link-remap files, copied under ``hostfiles/``),
``external_stdio`` (pipes and terminals to outside the tree) and ``host_nodes`` (directories and
FIFOs the restored tree needs) are written by dump and read back by verify, import and restore.
This module owns their records: the fields, their JSON form and its validation (a crafted
manifest must not make root write a set-id file or outside data). ``check_host_files`` checks them
against this host: restore writes each host file as root, so each must be where its owner could
have made it. Finding these resources on a live tree and putting them back is host/hostres/'s.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

from npusnap_cli import contract, safefs
from npusnap_cli.errors import ImageError
from npusnap_cli.image import digest
from npusnap_cli.jsontypes import (
    JSONObject,
    JSONValue,
    ShapeError,
    int_list,
    opt_str,
    req_bool,
    req_int,
    req_str,
)

# Pseudo or kernel filesystems whose "files" are not data to save.
NOT_DATA = ("/proc/", "/sys/", "/dev/pts/", contract.AGENT_SOCKET_ROOT_DIR)


_DEFAULT_ALGO = digest.DEFAULT  # (a field named digest hides the module in class bodies)


@dataclass(frozen=True)
class ExternalStdio:
    """An fd of the tree that is a pipe or terminal shared with a process outside the tree."""

    pid: int
    fd: int
    key: str  # CRIU's name for it: "pipe:[INODE]" or the tty path
    kind: str  # "pipe" | "tty"
    peers: tuple[int, ...]  # pids outside the tree that hold it (empty for a tty)

    def to_dict(self) -> JSONObject:
        return {"pid": self.pid, "fd": self.fd, "key": self.key, "kind": self.kind, "peers": list(self.peers)}

    @classmethod
    def from_dict(cls, d: Mapping[str, JSONValue]) -> ExternalStdio:
        try:
            return cls(
                pid=req_int(d, "pid"),
                fd=req_int(d, "fd"),
                key=req_str(d, "key"),
                kind=req_str(d, "kind"),
                peers=int_list(d, "peers", optional=True),
            )
        except ShapeError as exc:
            raise ImageError(f"bad external_stdio entry in the manifest: {exc}", fix="dump again") from None


@dataclass(frozen=True)
class HostFile:
    """A host file the image carries under ``hostfiles/``: a tmpfs file the tree had open or
    mapped, or (``remap``) CRIU's link-remap file of a deleted file it had open."""

    path: str  # absolute path on the host
    size: int
    mode: int
    uid: int
    gid: int
    digest: str  # hex, of the algorithm ``algo`` (digest.py)
    # CRIU's link-remap file of a deleted file the tree had open: on the host only during restore
    remap: bool = False
    algo: str = _DEFAULT_ALGO

    @property
    def rel(self) -> str:
        """Where its copy lives inside the image."""
        return "hostfiles" + self.path

    def to_dict(self) -> JSONObject:
        d: JSONObject = {
            "path": self.path,
            "size": self.size,
            "mode": self.mode,
            "uid": self.uid,
            "gid": self.gid,
            self.algo: self.digest,
        }
        if self.remap:
            d["remap"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, JSONValue]) -> HostFile:
        algo, value = digest.from_entry(d, "host_files")
        try:
            f = cls(
                path=req_str(d, "path"),
                size=req_int(d, "size"),
                mode=req_int(d, "mode"),
                uid=req_int(d, "uid"),
                gid=req_int(d, "gid"),
                digest=value,
                algo=algo,
                remap="remap" in d and req_bool(d, "remap"),
            )
        except ShapeError as exc:
            raise ImageError(f"bad host_files entry in the manifest: {exc}", fix="dump again") from None
        norm = os.path.normpath(f.path)
        if not f.path.startswith("/") or norm != f.path or ".." in f.path.split("/"):
            raise ImageError(f"bad host_files path in the manifest: {f.path!r}", fix="dump again")
        if f.path.startswith(NOT_DATA) or f.path.startswith("//"):
            raise ImageError(f"bad host_files path in the manifest: {f.path!r} (not data)", fix="dump again")
        if f.mode & ~0o1777 or f.mode < 0:
            raise ImageError(
                f"host_files entry {f.path} asks for mode {f.mode:o} (set-user/group-id or not a permission)",
                why="a dump records tmpfs files and CRIU's link-remap files, never a set-id program: "
                "the image was crafted or edited",
                fix="do not restore this image",
            )
        return f


@dataclass(frozen=True)
class HostNode:
    """A directory or FIFO on the host that the restored tree needs to exist."""

    path: str
    kind: str  # "dir" | "fifo"
    mode: int
    uid: int
    gid: int
    why: str  # what of the tree needs it: "unix socket /tmp/pymp-x/listener-y", "fifo", ...

    def to_dict(self) -> JSONObject:
        return {
            "path": self.path,
            "kind": self.kind,
            "mode": self.mode,
            "uid": self.uid,
            "gid": self.gid,
            "why": self.why,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, JSONValue]) -> HostNode:
        try:
            n = cls(
                path=req_str(d, "path"),
                kind=req_str(d, "kind"),
                mode=req_int(d, "mode"),
                uid=req_int(d, "uid"),
                gid=req_int(d, "gid"),
                why=opt_str(d, "why") or "",
            )
        except ShapeError as exc:
            raise ImageError(f"bad host_nodes entry in the manifest: {exc}", fix="dump again") from None
        if n.kind not in ("dir", "fifo") or not 0 <= n.mode <= 0o7777:
            raise ImageError(f"bad host_nodes entry in the manifest: {d!r}", fix="dump again")
        if not n.path.startswith("/") or os.path.normpath(n.path) != n.path or n.path == "/":
            raise ImageError(f"bad host_nodes path in the manifest: {n.path!r}", fix="dump again")
        return n


def tmpfs_mounts() -> list[str]:
    """Mount points of tmpfs filesystems, longest first."""
    points: list[str] = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype = right.split()[0] if right else ""
                fields = left.split()
                if fstype == "tmpfs" and len(fields) > 4:
                    points.append(fields[4].replace("\\040", " "))
    except OSError:
        return []
    return sorted(set(points), key=len, reverse=True)


def on_mounts(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def split_parent(path: str) -> tuple[str, str]:
    parent, name = os.path.split(path)
    return parent or "/", name


def check_host_files(
    files: Iterable[HostFile], uids: Iterable[int], nodes: Iterable[HostNode] = ()
) -> list[str]:
    """What is wrong with an image's host files and host nodes (dump, verify, import, restore):
    root writes each file and creates each missing node for the job, so each must be where its
    owner could have made it (``place_problem``: tmpfs, or a directory of theirs or a sticky one)
    and belong to a user the dumped job ran as (root's only for a root job); a node that restore
    would create may be world-writable only on tmpfs (``node_problem``). The manifest's parser
    already refused set-id file modes and paths outside data."""
    allowed = set(uids)
    files = list(files)
    nodes = list(nodes)
    mounts = tmpfs_mounts() if files or nodes else []
    problems = [p for f in files if (p := place_problem(f, mounts, nodes)) is not None]
    problems += [
        f"host file {f.path} is owned by uid {f.uid}, which no process of the dumped job ran as"
        for f in files
        if f.uid not in allowed
    ]
    problems += [p for n in nodes if (p := node_problem(n, allowed, mounts, nodes)) is not None]
    return problems


def _exists_as(n: HostNode) -> bool:
    """``n`` is on this host already as restore needs it (so restore creates nothing there): the
    same kind, root's or its owner's. A root-owned symlink to a directory (/var/run) counts."""
    parent, name = split_parent(n.path)
    try:
        with safefs.dir_fd(parent, check=False, follow_root_links=True) as dfd:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if n.kind == "dir" and stat.S_ISLNK(st.st_mode) and st.st_uid == 0:
                return True
    except OSError:
        return False
    is_kind = stat.S_ISDIR(st.st_mode) if n.kind == "dir" else stat.S_ISFIFO(st.st_mode)
    return is_kind and st.st_uid in (0, n.uid)


def node_problem(
    n: HostNode,
    uids: Iterable[int],
    mounts: list[str],
    nodes: Iterable[HostNode] = (),
    *,
    creating: bool = False,
) -> Optional[str]:
    """What is wrong with a host node restore would create as root (``creating``: it is about to,
    so whether it exists now does not matter): the same rules as a host file's, since an
    image's manifest is the user's word, not the dump's. Its owner must be a user the job ran as;
    it must be where that owner could have made it; no set-id bits (a set-group-id directory of a
    group the user is not in hands that group to whatever is made in it); world-writable only on
    tmpfs (a dump records a job's /dev/shm and tmpfs /tmp; a world-writable directory elsewhere is
    a place any user could plant files in for root's tools). A node that exists already as
    restore needs it is not created and passes."""
    if not creating and _exists_as(n):
        return None
    what = "directory" if n.kind == "dir" else "fifo"
    if n.uid < 0 or n.uid not in set(uids):  # (-1 would leave it root's: chown's "unchanged")
        return f"host {what} {n.path} is owned by uid {n.uid}, which no process of the dumped job ran as"
    if n.mode & 0o6000:
        return f"host {what} {n.path} asks for mode {n.mode:o} (set-user/group-id)"
    tmpfs = on_mounts(n.path, mounts)
    if n.mode & stat.S_IWOTH and not tmpfs:
        return f"host {what} {n.path} asks for mode {n.mode:o} (world-writable) and is not on a tmpfs mount"
    if tmpfs:
        return None
    if _place_ok(n.path, n.uid, nodes):
        return None
    return (
        f"host {what} {n.path} is not on a tmpfs mount of this host, and uid {n.uid} could not have "
        "created it there itself"
    )


# A file the image carries from outside tmpfs is one the job held a lock on (``--file-locks``): a
# lock file is small; a locked database is not ours to copy, nor to read as root (in_place).
LOCK_FILE_MAX = 1 << 20


def place_problem(f: HostFile, mounts: list[str], nodes: Iterable[HostNode] = ()) -> Optional[str]:
    """Where a host file may be written as root: on a tmpfs mount of this host (a job's shared
    memory, its /tmp), or elsewhere (a lock file the job held, ``--file-locks``) only where its
    owner could have created it (``_place_ok``). Never through a symlink. A file that is on this
    host already as the image has it (``in_place``) is not written at all, wherever it is: a lock
    file in a directory only root may write passes while it stays there (as after a dump, whose
    original is killed and cannot remove it)."""
    if on_mounts(f.path, mounts) or _place_ok(f.path, f.uid, nodes):
        return None
    if not f.remap and in_place(f):
        return None
    return (
        f"host file {f.path} is not on a tmpfs mount of this host, uid {f.uid} could not have "
        "created it there itself, and it is not there as the image has it: restore will not write "
        f"it there as root (if the image is yours, put its copy, {f.rel} in the image, back there "
        f"as uid {f.uid}'s, and restore again)"
    )


def in_place(f: HostFile) -> bool:
    """``f`` is on this host as the image has it, so restore writes nothing there: a regular
    file reached without following a symlink, owned by its uid, of its size and, when the record
    has a digest, of its contents. A dump's preflight plans its records before copying them (no
    digest: the job holds the file then). A file someone holds a lease on is compared by its
    metadata alone: opening it would break the lease (even with O_NONBLOCK, fcntl(2)), which the
    job would see."""
    if f.size > LOCK_FILE_MAX:
        return False
    parent, name = split_parent(f.path)
    try:
        with safefs.dir_fd(parent, check=False) as dfd:
            st = safefs.lstat_at(dfd, name)
            if st is None or not stat.S_ISREG(st.st_mode) or (st.st_uid, st.st_size) != (f.uid, f.size):
                return False
            if not f.digest or lease_holders(st) != []:  # (None: cannot tell; do not risk it)
                return True
            fd = safefs.open_read_at(dfd, name)
    except OSError:  # (safefs.UnsafePath too)
        return False
    with os.fdopen(fd, "rb") as src:
        h = digest.new(f.algo)
        h.update(src.read(LOCK_FILE_MAX + 1))
        return bool(h.hexdigest() == f.digest)


def lease_holders(st: os.stat_result) -> Optional[list[int]]:
    """The pids holding a lease on the file ``st`` (/proc/locks: "1: LEASE ACTIVE WRITE PID
    MAJ:MIN:INO ..."), or None when that cannot be told."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            rows = [fs for fs in map(str.split, locks) if len(fs) > 5 and fs[1] == "LEASE" and fs[5] == key]
        return [int(fs[4]) for fs in rows]
    except (OSError, ValueError):
        return None


def _place_ok(path: str, uid: int, nodes: Iterable[HostNode]) -> bool:
    """``uid`` could have made ``path`` itself: its existing parent is one of theirs (not root's)
    they may write, or a sticky directory anyone may write (/var/tmp). Directories the image
    itself makes for the job (``nodes``, HostNode of the same owner) count as the place they are
    made in."""
    parent, _ = split_parent(path)
    # (private ones: a shared directory such as /tmp is where the rule itself looks)
    made = {n.path for n in nodes if n.kind == "dir" and n.uid == uid and not n.mode & 0o6022}
    while parent in made and parent != "/":
        parent, _ = split_parent(parent)
    try:
        with safefs.dir_fd(parent, check=False) as dfd:
            st = os.fstat(dfd)
    except OSError:
        return False
    shared = st.st_mode & (stat.S_ISVTX | stat.S_IWOTH) == stat.S_ISVTX | stat.S_IWOTH
    theirs = uid != 0 and st.st_uid == uid and st.st_mode & stat.S_IWUSR
    return bool(shared or theirs)
