"""Publishing an image: every file's checksum, everything fsynced, then one atomic rename.

An image is built in a temporary sibling (layout.create_temp_image), its files hashed into the
manifest while a second thread flushes them, fsynced (files, then directories) and renamed into
place only when complete, so a crash never leaves a directory that looks like a finished image.
``NPUSNAP_TEST_CRASH_AT`` (``crash_point``) lets the tests kill npusnap at each step.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Optional

from npusnap_cli.errors import UsageError
from npusnap_cli.image import digest, imagetrust
from npusnap_cli.image.layout import (
    CHUNK_MODE,
    CHUNKS_SUBDIR,
    DIR_MODE,
    FILE_MODE,
    OLD_MARKER,
    checksummed_files,
    dir_is_empty,
    remove_tree,
)
from npusnap_cli.image.manifest import FileEntry, Manifest, ProgressFn, write_manifest


def file_entries(
    image: Path,
    progress: Optional[ProgressFn] = None,
    known: Optional[Mapping[str, tuple[int, str]]] = None,
) -> tuple[FileEntry, ...]:
    """Digest (digest.DEFAULT) and size of every checksummed file, while a second thread flushes
    them to disk.

    Hashing reads the files back from the page cache (CPU) while fsync waits on the disk, so
    running the two side by side hides most of one behind the other; ``publish`` then finds the
    files already clean. An fsync error (ENOSPC, EIO) is raised here, after the hashing.
    ``known``: {relative path: (size, digest)} already computed while the files were written
    (streamhash.py); a file whose size still matches is not read again.
    """
    rels = checksummed_files(image)
    seal_modes(image)
    flush_errors: list[OSError] = []

    def flush() -> None:
        try:
            for rel in rels:
                _fsync_path(image / rel)
        except OSError as exc:
            flush_errors.append(exc)

    flusher = threading.Thread(target=flush, name="npusnap-fsync", daemon=True)
    flusher.start()
    try:
        fulls = [image / rel for rel in rels]
        sizes = [f.stat().st_size for f in fulls]
        have = dict(known or {})
        todo = [i for i, (r, n) in enumerate(zip(rels, sizes)) if have.get(r, (-1, ""))[0] != n]
        fresh = dict(zip(todo, digest.of_files([(fulls[i], digest.DEFAULT) for i in todo], progress)))
        if progress is not None:
            progress(sum(n for i, n in enumerate(sizes) if i not in fresh))
        digests = [fresh[i] if i in fresh else have[r][1] for i, r in enumerate(rels)]
        entries = [FileEntry(path=r, size=n, digest=d) for r, n, d in zip(rels, sizes, digests)]
    finally:
        flusher.join()
    if flush_errors:
        raise flush_errors[0]
    return tuple(entries)


def seal_modes(image: Path) -> None:
    """Every file of the image 0600 (device-memory chunks 0400) and every directory 0700,
    whatever mode CRIU created them with: they hold the processes' memory. Walks directory fds,
    never following a symlink."""
    os.chmod(image, DIR_MODE, follow_symlinks=False)
    chunks = os.path.join(str(image), CHUNKS_SUBDIR)
    for root, dirs, files, root_fd in os.fwalk(image, follow_symlinks=False):
        file_mode = CHUNK_MODE if root == chunks else FILE_MODE
        for name in dirs + files:
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(name, DIR_MODE, dir_fd=root_fd)
            elif stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != file_mode:
                os.chmod(name, file_mode, dir_fd=root_fd)


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, then the parent (for the rename)."""
    for cur, dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(cur) / name)
        for name in dirs:
            _fsync_path(Path(cur) / name, directory=True)
    _fsync_path(root, directory=True)


def crash_point(name: str) -> None:
    """Test hook: ``NPUSNAP_TEST_CRASH_AT=name`` SIGKILLs this process here, so that the tests can
    check what a crash at each step of publishing leaves behind. Unset in normal use."""
    if os.environ.get("NPUSNAP_TEST_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def stop_point(name: str) -> None:
    """Test hook: ``NPUSNAP_TEST_STOP_AT=name`` stops this process here (SIGSTOP) until a SIGCONT,
    so that the tests can check what a command paused at that step (past a lease) reports."""
    if os.environ.get("NPUSNAP_TEST_STOP_AT") == name:
        os.kill(os.getpid(), signal.SIGSTOP)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def rename_exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically with renameat2(RENAME_EXCHANGE); False where the kernel,
    the C library or the filesystem cannot (the caller falls back to two renames)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(
    tmp: Path,
    final: Path,
    manifest: Manifest,
    *,
    force: bool = False,
    sign_key: Optional[Path] = None,
    check: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write the manifest into ``tmp``, fsync everything, run ``check(tmp)`` (the dump's
    verification of the complete image: an error it raises leaves ``tmp`` unpublished and any
    old image at ``final`` untouched) and rename ``tmp`` to ``final``.

    ``final`` may be missing or an empty directory (rename(2) replaces an empty directory
    atomically). A non-empty ``final`` is replaced only with ``force``: with renameat2's
    RENAME_EXCHANGE the new and old image swap places in one step, and the old one (now under
    the work directory's name) is removed; where the kernel cannot exchange, the old image is
    renamed aside first, and a crash between the two renames leaves it where the next dump puts
    it back. At no instant is there a directory named ``final`` that is not a complete image.
    """
    data = write_manifest(tmp, manifest)
    if sign_key is not None:
        imagetrust.write_signature(tmp, data, sign_key)
    fsync_tree(tmp)
    if check is not None:
        check(tmp)
    crash_point("publish:before-rename")
    if final.exists() and not dir_is_empty(final):
        if not force:
            raise UsageError(
                f"{final} appeared and is not empty",
                why="something wrote into the target directory during the dump",
                fix="dump into a new directory, or pass --force to replace it",
            )
        if rename_exchange(tmp, final):
            _fsync_path(final.parent, directory=True)
            crash_point("publish:after-exchange")
            remove_tree(tmp)  # the old image, under the work directory's name
            return final
        old = final.parent / f".{final.name}{OLD_MARKER}{os.getpid()}"
        os.rename(final, old)
        crash_point("publish:between-renames")
        os.rename(tmp, final)
        _fsync_path(final.parent, directory=True)
        remove_tree(old)
        return final
    os.rename(tmp, final)
    _fsync_path(final.parent, directory=True)
    return final
