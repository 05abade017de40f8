"""The image directory's layout: every name inside an image, the work and set-aside names around it.

Every name inside an image is a constant here, and nowhere else::

    DIR/                  mode 0700: it holds the processes' memory, i.e. their secrets
      npusnap.json        the manifest (manifest.py)
      criu/               CRIU's image files (pages, core, fdinfo, ...)
      hostfiles/          copies of tmpfs files the tree had open or mapped (/dev/shm ...), by path
      device/             devmem-PID.bin: the device memory npusnap kept for NPU process PID;
                          or devmem-PID.idx listing its pieces in chunks/ (devchunks.py)
      logs/               CRIU's dump/restore logs and stats (not checksummed: restore writes here)

An image is built in a temporary sibling (``.DIR.npusnap-tmp-PID-*``) and renamed into place only
when complete (publishing.py); ``dump --force`` sets the image it replaces aside as
``.DIR.npusnap-old-PID``. This module names those siblings, finds the ones a dead run left and
removes (or puts back) them, always through directory fds that never follow a symlink.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli import contract
from npusnap_cli.errors import ImageError, UsageError

MANIFEST_NAME = "npusnap.json"
CRIU_SUBDIR = "criu"
LOGS_SUBDIR = "logs"
HOSTFILES_SUBDIR = "hostfiles"
DEVICE_SUBDIR = contract.DEVMEM_FILE_SUBDIR
# The subdirectories whose files the manifest lists with their checksums (never logs/).
CHECKSUMMED_SUBDIRS = (CRIU_SUBDIR, HOSTFILES_SUBDIR, DEVICE_SUBDIR)
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
DIR_MODE = 0o700
FILE_MODE = 0o600
# Device-memory chunks (devchunks.py): one file per distinct piece, shared by hard links between
# the images of one job, so never writable: nothing writes through one.
CHUNKS_SUBDIR = f"{DEVICE_SUBDIR}/chunks"
CHUNK_MODE = 0o400
TMP_MARKER = ".npusnap-tmp-"
OLD_MARKER = ".npusnap-old-"
FAILED_LOGS_SUFFIX = ".failed-logs"
# A directory written by `npusnap k8s checkpoint` (k8s/jobcheckpoint.py): this manifest and one
# container checkpoint archive per member.
K8S_JOB_MANIFEST = "npusnap-k8s-job.json"


def manifest_path(image: Path) -> Path:
    return image / MANIFEST_NAME


def criu_dir(image: Path) -> Path:
    return image / CRIU_SUBDIR


def logs_dir(image: Path) -> Path:
    return image / LOGS_SUBDIR


def is_temp_name(name: str) -> bool:
    return TMP_MARKER in name or OLD_MARKER in name


def temp_siblings(final: Path) -> list[Path]:
    """Leftover work areas (``.NAME.npusnap-tmp-*``) and set-aside images (``.NAME.npusnap-old-*``)
    next to ``final``, from this or an interrupted earlier run. Only names are read: nothing here
    opens, stats through or follows an entry.
    """
    parent = final.parent
    prefixes = (f".{final.name}{TMP_MARKER}", f".{final.name}{OLD_MARKER}")
    try:
        return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes))
    except OSError:
        return []


def create_temp_image(final: Path) -> Path:
    """Create the work area ``.<name>.npusnap-tmp-XXXX`` next to ``final`` (0700, with subdirs).

    Next to it, not in /tmp: the final rename must stay within one filesystem to be atomic.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    # Our pid is in the name so that a later dump can tell a dead run's leftovers from a live one.
    prefix = f".{final.name}{TMP_MARKER}{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=str(final.parent)))
    os.chmod(tmp, DIR_MODE)  # mkdtemp makes 0700 already; be explicit, it holds secrets
    criu_dir(tmp).mkdir(mode=DIR_MODE)
    logs_dir(tmp).mkdir(mode=DIR_MODE)
    return tmp


@dataclass(frozen=True)
class Leftover:
    """What the cleanup did with one leftover sibling of an image: ``action`` is ``removed``,
    ``recovered`` (a set-aside old image put back as DIR), ``kept`` (its dump still runs) or
    ``refused`` (not provably ours: a symlink, a FIFO, another user's); ``message`` says it."""

    path: Path
    action: str
    message: str


def _owner_pid(final: Path, name: str) -> Optional[int]:
    for marker in (TMP_MARKER, OLD_MARKER):
        prefix = f".{final.name}{marker}"
        if name.startswith(prefix):
            text = name[len(prefix) :].split("-", 1)[0]
            return int(text) if text.isdigit() else None
    return None


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "a special file"


def _open_dir_nofollow(name: str, dir_fd: Optional[int] = None) -> int:
    # O_NONBLOCK: should the name be swapped for a FIFO between our lstat and this open, open()
    # must not wait for a writer; O_DIRECTORY then fails it with ENOTDIR.
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    return os.open(name, flags, dir_fd=dir_fd)


def _open_parent(path: Path) -> int:
    """The directory the user named (it may be reached through a symlink, e.g. /var/run); what
    is looked at *inside* it is never followed."""
    return os.open(str(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)


def _rmtree_at(parent_fd: int, name: str, expect: os.stat_result) -> None:
    """Remove the directory ``name`` of ``parent_fd`` and everything in it, never following a
    symlink (every step is relative to a directory fd opened with O_NOFOLLOW), after checking
    that it is still the directory ``expect`` describes. Raises OSError.
    """
    fd = _open_dir_nofollow(name, parent_fd)
    try:
        if not os.path.samestat(os.fstat(fd), expect):
            raise OSError(errno.ESTALE, f"{name} was replaced while it was being removed")
        for _root, dirs, files, root_fd in os.fwalk(".", dir_fd=fd, topdown=False, follow_symlinks=False):
            for entry in dirs + files:
                st = os.stat(entry, dir_fd=root_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.rmdir(entry, dir_fd=root_fd)
                else:
                    os.unlink(entry, dir_fd=root_fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _provably_ours(st: os.stat_result) -> Optional[str]:
    """Why an entry is not a directory this user created (None: it may be ours)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"it is {kind_of(st.st_mode)}, not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by uid {os.geteuid()}"
    return None


def remove_stale_temps(final: Path) -> list[Leftover]:
    """Clean up what dumps of ``final`` that are gone (killed, crashed) left next to it.

    Only a real directory (lstat: no symlink, no FIFO) owned by this user whose dump process is
    gone is touched, through directory fds that never follow a symlink. A set-aside old image
    (``--force`` interrupted between its two renames) is put back as ``final`` when ``final`` is
    missing, and removed when ``final`` is there. Anything else is refused and reported.
    """
    out: list[Leftover] = []
    try:
        parent_fd = _open_parent(final.parent)
    except OSError:
        return out
    try:
        for path in temp_siblings(final):
            name = path.name
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as exc:
                out.append(Leftover(path, "refused", f"left {path} alone: cannot lstat it ({exc.strerror})"))
                continue
            why = _provably_ours(st)
            if why is not None:
                out.append(
                    Leftover(
                        path,
                        "refused",
                        f"left {path} alone: it is named like an npusnap work directory but {why}; "
                        f"remove it yourself if it is not someone's (ls -ld {path})",
                    )
                )
                continue
            pid = _owner_pid(final, name)
            if pid is None or os.path.exists(f"/proc/{pid}"):
                out.append(
                    Leftover(path, "kept", f"kept {path}: the dump that made it (pid {pid}) still runs")
                )
                continue
            if OLD_MARKER in name and not os.path.lexists(final):
                has_manifest = os.path.lexists(path / MANIFEST_NAME)
                if has_manifest:
                    try:
                        os.rename(name, final.name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                        os.fsync(parent_fd)
                    except OSError as exc:
                        out.append(
                            Leftover(
                                path,
                                "refused",
                                f"could not put the set-aside image {path} back as {final}: {exc.strerror}",
                            )
                        )
                    else:
                        out.append(
                            Leftover(
                                path,
                                "recovered",
                                f"put {path} back as {final}: an earlier `dump --force` was killed "
                                "before its new image was in place",
                            )
                        )
                    continue
            try:
                _rmtree_at(parent_fd, name, st)
            except OSError as exc:
                out.append(Leftover(path, "refused", f"could not remove {path}: {exc.strerror or exc}"))
                continue
            if os.path.lexists(path):
                out.append(Leftover(path, "refused", f"could not remove {path}: it is still there"))
                continue
            what = "set-aside old image" if OLD_MARKER in name else "work directory"
            out.append(
                Leftover(
                    path, "removed", f"removed {path}, the {what} of an earlier dump that did not finish"
                )
            )
    finally:
        os.close(parent_fd)
    return out


def leftovers_hint(final: Path) -> str:
    """A sentence naming leftovers of interrupted dumps next to ``final`` (empty if none)."""
    found = temp_siblings(final)
    if not found:
        return ""
    names = ", ".join(str(p) for p in found[:3])
    return (
        f"; leftovers of an interrupted dump are next to it: {names} "
        f"(the next `npusnap dump` to {final} cleans them up)"
    )


def dir_is_empty(path: Path) -> bool:
    return not any(path.iterdir())


def tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def checksummed_files(image: Path) -> list[str]:
    """Relative paths of the files covered by checksums: everything under CHECKSUMMED_SUBDIRS."""
    out: list[str] = []
    for base in (image / d for d in CHECKSUMMED_SUBDIRS):
        for root, _dirs, files in os.walk(base):
            for name in files:
                full = Path(root) / name
                out.append(full.relative_to(image).as_posix())
    return sorted(out)


def device_memory_rel(pid: int) -> str:
    """Where the agent of NPU process ``pid`` wrote its copy of the device memory (in the image)."""
    return f"{DEVICE_SUBDIR}/{contract.DEVMEM_FILE_PATTERN.format(pid=pid)}"


def remove_tree(path: Path) -> None:
    """Remove a partial image this run made; never raises (the caller is handling a failure).

    It walks through directory fds without following symlinks, and never changes a mode: a
    chmod of a parent to get past an error would be one a planted name could aim elsewhere.
    """
    try:
        parent_fd = _open_parent(path.parent)
    except OSError:
        return
    try:
        st = os.stat(path.name, dir_fd=parent_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            _rmtree_at(parent_fd, path.name, st)
    except OSError:
        pass
    finally:
        os.close(parent_fd)


def failed_logs_dir(final: Path) -> Path:
    """Where a failed run's logs are kept: beside the image it was writing, named after it
    (``IMG.failed-logs``), so that an operator finds them where the image should have been."""
    return final.parent / f"{final.name}{FAILED_LOGS_SUFFIX}"


def final_of(tmp: Path) -> Optional[Path]:
    """The image a work directory (``.NAME.npusnap-tmp-*``) was being built for, or None."""
    name = tmp.name
    if name.startswith(".") and TMP_MARKER in name:
        return tmp.parent / name[1 : name.index(TMP_MARKER)]
    return None


def follow_pointer(path: Path) -> Path:
    """The image a pointer names: ``latest`` (dump --latest) is a symlink to the newest image.

    Resolved once, where a command takes its argument, so that every later step uses the one real
    path (what was verified is what is restored); a symlink met anywhere later is refused.
    """
    p = Path(os.path.abspath(path))
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def check_image_dir(image: Path, *, unpublished: bool = False) -> None:
    """Refuse what cannot be an image directory: missing, a symlink, not a directory, a work name
    (``unpublished``: the dump's own check of its work directory before it takes its name)."""
    try:
        st = os.lstat(image)
    except OSError:
        raise ImageError(
            f"no image at {image}{leftovers_hint(image)}",
            why="the directory does not exist",
            fix="check the path; `npusnap dump PID DIR` writes an image",
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise ImageError(
            f"refusing {image}: it is a symbolic link",
            why="an image is used only through its real path, so that what was verified is what is restored",
            fix=f"pass its real path: $(realpath {image})",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ImageError(f"{image} is not a directory", fix="pass the image directory that dump created")
    if is_temp_name(image.name) and not unpublished:
        raise ImageError(
            f"{image} is not an image: it is the work directory of a dump that did not finish",
            why="dump builds an image under a hidden work name and renames it to DIR only when it is "
            "complete; a directory still under that name was never published",
            fix="dump again; the next `npusnap dump` to the same DIR removes it",
        )


def check_dump_target(final: Path, *, force: bool) -> None:
    """DIR must be new or an empty directory (or anything, with ``force``), in a writable place."""
    if is_temp_name(final.name):
        raise UsageError(
            f"{final.name} is named like an npusnap work directory ({TMP_MARKER}, {OLD_MARKER})",
            why="such names are never images: verify refuses them, later dumps clean them up",
            fix="choose another name for the image",
        )
    if final.is_symlink():
        # The image is renamed into place at the end: onto a symlink that fails (ENOTDIR) after
        # all the work, and a link another user planted must not choose where root's image goes.
        raise UsageError(
            f"{final} is a symbolic link",
            why="npusnap writes a new directory at that name and never through a symbolic link",
            fix=f"name the directory itself ({os.path.realpath(final)}), or choose a new path",
        )
    if final.exists():
        if not final.is_dir():
            raise UsageError(
                f"{final} exists and is not a directory",
                why="dump writes a directory",
                fix="choose a new path for the image",
            )
        if not force and not dir_is_empty(final):
            raise UsageError(
                f"{final} exists and is not empty",
                why="npusnap never overwrites a directory without being told to",
                fix="choose a new directory, or pass --force to replace its content",
            )
    parent = final.parent
    probe: Path = parent
    while not probe.exists():
        probe = probe.parent
    # DIR itself too when it exists: an empty read-only mount point under a writable parent
    # would otherwise pass here and fail later as "0 B free".
    for where in ([final] if final.is_dir() else []) + [probe]:
        with contextlib.suppress(OSError):
            if os.statvfs(where).f_flag & os.ST_RDONLY:
                raise UsageError(
                    f"cannot write the image to {final}: {where} is on a read-only filesystem (EROFS)",
                    fix="choose a directory on a writable filesystem, or remount it read-write",
                )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(
            f"cannot write the image next to {final}: {probe} is not writable",
            fix="choose a directory you can write to",
        )


def free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize
