"""Writing files as root where a user can also write, without following that user's symlinks.

restore puts a job's tmpfs files back under directories the job's user owns (``/dev/shm/u/``),
and export, import and ``--pidfile`` write into directories an operator named. A path string
handed to ``open()`` is resolved by the kernel at the moment of the call: a user who swaps a
directory of it for a symlink between our check and our write makes root write wherever they
chose. Every write of that kind goes through this module instead:

* the directory is reached from ``/`` one component at a time, each opened relative to the
  previous one's fd with ``openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH)`` where the kernel has
  it (5.6+), else ``O_NOFOLLOW | O_DIRECTORY``: a symlink anywhere fails the walk (ELOOP);
* each directory walked is checked (``fstat`` of the fd we hold, so it cannot change under the
  check): owned by root or by the user the file is for, and writable by others only when sticky
  (``/tmp``, ``/dev/shm``);
* the file is created in the directory fd with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random
  name, written, and renamed onto its name within that same directory fd.

``TRUSTED_PREFIX_DIRS``: an operator's own path may pass through symlinks that root set up (a
distribution's ``/var/run -> /run``); ``follow_root_links=True`` follows a symlink only when it
and the directory holding it are root's. A symlink a user could have made is never followed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from typing import Optional

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x01, 0x02, 0x04, 0x08
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc: Optional[ctypes.CDLL] = None
_openat2_works: Optional[bool] = None


def _openat2(dir_fd: int, name: str, flags: int) -> Optional[int]:
    """openat2 with RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH; None where the kernel lacks it."""
    global _libc, _openat2_works
    if _SYS_OPENAT2 is None or _openat2_works is False:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    how = _OpenHow(flags, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dir_fd),
        ctypes.c_char_p(os.fsencode(name)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM) and _openat2_works is None:
            _openat2_works = False  # (EPERM: a seccomp filter refusing it)
            return None
        raise OSError(err, os.strerror(err), name)
    _openat2_works = True
    return int(fd)


def open_component(dir_fd: int, name: str, flags: int = _DIR_FLAGS) -> int:
    """Open one name of ``dir_fd`` without following a symlink (ELOOP/ENOTDIR if it is one)."""
    if not name or "/" in name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not a single path component", name)
    try:
        fd = _openat2(dir_fd, name, flags)
        if fd is not None:
            return fd
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except PermissionError:
        if flags != _DIR_FLAGS:
            raise
    # A directory the caller may pass through but not list (mode 711): an O_PATH fd still walks,
    # fstats and serves as the dirfd of the *at calls.
    fd = _openat2(dir_fd, name, _PATH_FLAGS)
    if fd is not None:
        return fd
    return os.open(name, _PATH_FLAGS, dir_fd=dir_fd)


class UnsafePath(OSError):
    """A path root must not write through: a symlink, or a directory another user controls."""


def _components(path: str) -> list[str]:
    if not path.startswith("/"):
        path = os.path.abspath(path)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePath(errno.EINVAL, "'..' in a path root writes to", path)
    return parts


def check_dir(st: os.stat_result, where: str, owner: Optional[int]) -> None:
    """A directory root may write in for ``owner``: root's or ``owner``'s, and writable by
    nobody else unless sticky (then others cannot rename or remove what we create)."""
    allowed = {0} if owner is None else {0, owner}
    if st.st_uid not in allowed:
        raise UnsafePath(
            errno.EPERM, f"the directory is owned by uid {st.st_uid}, not by root or the file's owner", where
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(errno.EPERM, "the directory is writable by others and not sticky", where)


def open_dir(
    path: str,
    *,
    owner: Optional[int] = None,
    create: bool = False,
    create_uid: int = -1,
    create_gid: int = -1,
    create_mode: int = 0o755,
    follow_root_links: bool = False,
    check: bool = True,
) -> int:
    """An fd of directory ``path``, reached from ``/`` without following a user's symlink.

    ``owner``: the user the write is for (each directory must be root's or theirs);
    ``create``: make missing directories (owned by ``create_uid``:``create_gid``, ``create_mode``);
    ``check=False``: only refuse symlinks (an operator's own output directory)."""
    fd = os.open("/", _DIR_FLAGS)
    walked = "/"
    try:
        links = 0
        todo = _components(path)
        while todo:
            name = todo.pop(0)
            here = os.path.join(walked, name)
            try:
                nfd = open_component(fd, name)
            except FileNotFoundError:
                if not create:
                    raise
                made = True
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    made = False
                nfd = open_component(fd, name)
                if made:
                    os.fchown(nfd, create_uid, create_gid)
                    os.fchmod(nfd, create_mode)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
                    raise
                target = _root_link(fd, name) if follow_root_links else None
                if target is None or links > 8:
                    raise UnsafePath(
                        errno.ELOOP,
                        "a symbolic link (or not a directory) where a directory was expected",
                        here,
                    ) from None
                links += 1
                os.close(fd)
                fd = os.open("/", _DIR_FLAGS)
                walked = "/"
                todo = _components(os.path.normpath(os.path.join(os.path.dirname(here), target))) + todo
                continue
            st = os.fstat(nfd)
            if check:
                try:
                    check_dir(st, here, owner)
                except UnsafePath:
                    os.close(nfd)
                    raise
            os.close(fd)
            fd, walked = nfd, here
        return fd
    except BaseException:
        os.close(fd)
        raise


def _root_link(dir_fd: int, name: str) -> Optional[str]:
    """The target of the symlink ``name`` in ``dir_fd`` if root made it in a root-only place."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        dst = os.fstat(dir_fd)
    except OSError:
        return None
    if not stat.S_ISLNK(st.st_mode) or st.st_uid != 0 or dst.st_uid != 0:
        return None
    if dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    return os.readlink(name, dir_fd=dir_fd)


@contextlib.contextmanager
def dir_fd(path: str, **kw: object) -> Iterator[int]:
    fd = open_dir(path, **kw)  # type: ignore[arg-type]
    try:
        yield fd
    finally:
        os.close(fd)


def create_temp(dfd: int, name: str, mode: int = 0o600) -> tuple[int, str]:
    """A new file next to ``name`` in ``dfd`` (O_CREAT | O_EXCL | O_NOFOLLOW, a random name that
    nobody could have planted): (fd, its name)."""
    for _ in range(16):
        tmp = f".{name}.npusnap-{secrets.token_hex(6)}"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd
            )
        except FileExistsError:
            continue
        return fd, tmp
    raise OSError(errno.EEXIST, "could not create a temporary file", name)


def lstat_at(dfd: int, name: str) -> Optional[os.stat_result]:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_read_at(dfd: int, name: str) -> int:
    """Open an existing regular file of ``dfd`` to read it, never a symlink or a FIFO."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(errno.EINVAL, "not a regular file", name)
    return fd


def fresh_file(dfd: int, name: str, mode: int = 0o600) -> None:
    """Make ``name`` in ``dfd`` a new, empty file of ours for another program that opens it by
    name, following links and truncating (CRIU's log and statistics). What is there already is
    removed only if it is a regular file of ours with a single link (the last run's log); a
    symlink, a hard link (it would make that program overwrite the other file) or another user's
    file is left alone and refused."""
    st = lstat_at(dfd, name)
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(errno.EPERM, "not a regular file (a symbolic link?)", name)
        if st.st_nlink != 1:
            raise UnsafePath(errno.EPERM, f"a hard link ({st.st_nlink} names of one file)", name)
        if st.st_uid != os.geteuid():
            raise UnsafePath(errno.EPERM, f"owned by uid {st.st_uid}", name)
        os.unlink(name, dir_fd=dfd)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    os.close(fd)


def open_append(path: str, mode: int = 0o600, owners: Optional[Iterable[int]] = None) -> int:
    """Open ``path`` to append (created if missing) in its directory reached without following a
    user's symlink; the file itself is never a symlink (O_NOFOLLOW, whatever the kernel's
    protected_symlinks says), never becomes our controlling terminal (O_NOCTTY), and must be a
    regular file with one link (a hard link to another file would make root append there) owned
    by one of ``owners`` (default: this user; a file another user planted in a shared directory
    would hand them what we write)."""
    allowed = {os.geteuid()} if owners is None else set(owners)
    parent, name = os.path.split(os.path.abspath(path))
    with dir_fd(parent, check=False, follow_root_links=True) as dfd:
        flags = (
            os.O_WRONLY
            | os.O_APPEND
            | os.O_CREAT
            | os.O_NOFOLLOW
            | os.O_NOCTTY
            | os.O_NONBLOCK
            | os.O_CLOEXEC
        )
        fd = os.open(name, flags, mode, dir_fd=dfd)
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        problem = "not a regular file with a single link"
    elif st.st_uid not in allowed:
        problem = f"owned by uid {st.st_uid}, not by uid {' or '.join(map(str, sorted(allowed)))}"
    if problem is not None:
        os.close(fd)
        raise UnsafePath(errno.EPERM, problem, path)
    # (O_NONBLOCK was only for the open: a FIFO planted at the name must not block us)
    os.set_blocking(fd, True)
    return fd


def write_file(
    path: str,
    data_chunks: Iterator[bytes],
    *,
    mode: int = 0o600,
    uid: int = -1,
    gid: int = -1,
    owner: Optional[int] = None,
    create_dirs: bool = False,
    replace: bool = True,
    follow_root_links: bool = False,
    check: bool = True,
    fsync: bool = False,
) -> None:
    """Write ``path`` atomically (temporary name, then rename) in a directory reached safely.

    The mode is applied with fchmod after fchown, setuid and setgid never: root never makes a
    set-id file from data it was handed."""
    parent, name = os.path.split(os.path.abspath(path))
    with dir_fd(
        parent,
        owner=owner,
        create=create_dirs,
        create_uid=uid if create_dirs else -1,
        create_gid=gid if create_dirs else -1,
        follow_root_links=follow_root_links,
        check=check,
    ) as dfd:
        fd, tmp = create_temp(dfd, name)
        try:
            with os.fdopen(fd, "wb", closefd=True) as out:
                for chunk in data_chunks:
                    out.write(chunk)
                out.flush()
                if uid != -1 or gid != -1:
                    os.fchown(out.fileno(), uid, gid)
                os.fchmod(out.fileno(), mode & 0o1777)
                if fsync:
                    os.fsync(out.fileno())
            if replace:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                os.unlink(tmp, dir_fd=dfd)
            if fsync:
                with contextlib.suppress(OSError):  # EBADF: a directory reached by O_PATH only
                    os.fsync(dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
