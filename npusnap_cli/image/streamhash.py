"""Checksums computed while CRIU writes the image, so that hashing leaves the dump's critical path.

CRIU writes each image file front to back and never goes back into it (page files are appended
page pipe by page pipe; the small images are written once). A follower thread therefore hashes
every file's new bytes shortly after CRIU wrote them — in place in the page cache, through a
read-only mapping, on the core CRIU is not using — with a hasher per file (digest.DEFAULT). When
CRIU is done, ``finish``
reads whatever is left and returns each file's size and digest; the dump then only hashes files
the follower could not vouch for (one that shrank, or that it never saw).

Having hashed a range, the follower also asks the kernel to start writing it to disk
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait): the disk then works while the
agents and CRIU are still writing, instead of all at once in publish's fsync, which is left with
the tail, so that publishing does not wait for the disk (docs/benchmarks.md, "Measurements behind
design choices").

The agents' device-memory files are not written front to back (several threads each write a chunk
at its place), so they are not hashed this way: ``FileHasher`` hashes them once written, on one
core alongside CRIU where cores are to spare, on every core once CRIU is done
(pipelines/dump/devmemory.py). While the agents write, ``WritebackFollower`` starts the disk on
them. Their space is reserved first (``reserve``): writeback into a file whose blocks are still
being allocated stalls the agents' writes, inside the job's frozen window.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from npusnap_cli.image import digest

# Hash at most this much from one file per round, so that every file keeps up.
_ROUND = 64 << 20

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_FALLOC_FL_KEEP_SIZE = 1  # <linux/falloc.h>
_libc: Any = None  # ctypes' libc once loaded; False where it lacks sync_file_range or fallocate


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset + length)`` of ``fd`` to disk without waiting for it (a
    later fsync waits for what is still in flight; length 0: to the end of the file). Best
    effort: a filesystem or libc without sync_file_range only leaves all of the writing to that
    fsync."""
    libc = _load_libc()
    if libc is not False:
        libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def reserve(fd: int, length: int) -> None:
    """Allocate ``length`` bytes of disk for ``fd`` without changing its size (FALLOC_FL_KEEP_SIZE),
    so that writes and writeback into it need no block allocation. OSError(ENOSPC/EDQUOT) when the
    disk has not that much; a filesystem that cannot reserve leaves the writes to allocate."""
    libc = _load_libc()
    if libc is False or length <= 0:
        return
    if libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, length) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(err, os.strerror(err))


def _files_under(root: Path) -> Iterator[Path]:
    """Every file under ``root`` (the image's work directory: no symlinks are followed)."""
    for dirpath, _dirs, names in os.walk(root):
        for name in sorted(names):
            yield Path(dirpath) / name


def _open_file(path: Path) -> Optional[int]:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


class _Follow:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: Optional[int] = None
        self.offset = 0
        self.hash: Any = digest.new()
        self.broken = False

    def pump(self, limit: int) -> int:
        """Hash up to ``limit`` new bytes; return how many were read."""
        if self.broken:
            return 0
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            size = os.fstat(self.fd).st_size
        except OSError:
            self.broken = True
            return 0
        if size < self.offset:  # truncated: our digest no longer describes it
            self.broken = True
            return 0
        start = self.offset
        end = min(size, start + limit)
        if end <= start:
            return 0
        try:
            # The writers only append (see the module docstring), so the range stays mapped.
            digest.update_mapped(self.hash, self.fd, start, end)
        except (OSError, ValueError):  # not a mappable file after all: publish hashes it instead
            self.broken = True
            return 0
        self.offset = end
        done = end - start
        if done:
            start_writeback(self.fd, start, done)
        return done

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class StreamHasher:
    """Follows every file under ``root`` while something writes them; see the module docstring."""

    def __init__(self, root: Path, interval_s: float = 0.02) -> None:
        self.root = root
        self.interval_s = interval_s
        self._files: dict[str, _Follow] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="npusnap-streamhash", daemon=True)
        self.bytes_hashed = 0

    def start(self) -> StreamHasher:
        self._thread.start()
        return self

    def _scan(self) -> None:
        for full in _files_under(self.root):
            rel = full.relative_to(self.root).as_posix()
            if rel not in self._files:
                self._files[rel] = _Follow(full)

    def _round(self) -> int:
        self._scan()
        n = 0
        for f in list(self._files.values()):
            n += f.pump(_ROUND)
        self.bytes_hashed += n
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._round() == 0:
                self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """Stop following (the writer failed); close every file."""
        self._stop.set()
        self._thread.join()
        for f in self._files.values():
            f.close()

    def finish(self) -> dict[str, tuple[int, str]]:
        """The writer is done: hash what is left; {relative path: (size, digest)} of every file
        whose digest covers all of it."""
        self._stop.set()
        self._thread.join()
        while self._round():
            pass
        out: dict[str, tuple[int, str]] = {}
        for rel, f in self._files.items():
            try:
                size = os.lstat(f.path).st_size
            except OSError:
                size = -1
            if not f.broken and size == f.offset:
                out[rel] = (size, f.hash.hexdigest())
            f.close()
        return out


class WritebackFollower:
    """Starts the disk writing files under ``root`` while something writes them, in any order:
    every round asks for writeback of each whole file (cheap for pages already clean)."""

    def __init__(self, root: Path, interval_s: float = 0.02) -> None:
        self.root = root
        self.interval_s = interval_s
        self._fds: dict[Path, int] = {}
        self._stop = threading.Event()
        self._last_round = False
        self._thread = threading.Thread(target=self._run, name="npusnap-writeback", daemon=True)

    def start(self) -> WritebackFollower:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._round()
        if self._last_round:
            self._round()

    def _round(self) -> None:
        for path in _files_under(self.root):
            fd = self._fds.get(path)
            if fd is None and (fd := _open_file(path)) is None:
                continue
            self._fds[path] = fd
            start_writeback(fd, 0, 0)

    def _close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def finish(self) -> None:
        """The writers are done: one last round starts the disk on what they wrote since the last,
        on this thread, without waiting. That request may block a while (the disk is busy), and
        the hashing must not wait behind it; ``stop`` later joins."""
        self._last_round = True
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._close()


class FileHasher:
    """Hashes complete files on a thread while the dump goes on; ``finish`` returns {path relative
    to ``root``: (size, digest)}. One core while CRIU runs (the other stays with CRIU, inside the
    job's frozen window). Every core from ``boost`` on, once CRIU is done and the job stays stopped
    (a job left running has its cores back): on one core, the hash of a large device-memory file
    finishes well after the disk has written it."""

    # A file half hashed on one core is hashed again from the start on every core only while what
    # is done is less than half of what is left: two threads hash almost twice as fast, less the
    # core the disk's writeback takes.
    RESTART_FRACTION = 0.5

    def __init__(self, root: Path) -> None:
        self.root = root
        self._out: dict[str, tuple[int, str]] = {}
        self._boost = threading.Event()
        self._thread = threading.Thread(target=self._run, name="npusnap-filehash", daemon=True)

    def start(self) -> FileHasher:
        self._thread.start()
        return self

    def boost(self) -> None:
        """CRIU is done: hash on every core from now on."""
        self._boost.set()

    def _threads(self) -> int:
        return digest.usable_cores() if self._boost.is_set() else 1

    def _run(self) -> None:
        for full in list(_files_under(self.root)):
            try:
                size, value = self._hash(full)
            except Exception:  # publish hashes what is missing here, and reports what fails
                continue
            self._out[full.relative_to(self.root).as_posix()] = (size, value)

    def _hash(self, full: Path) -> tuple[int, str]:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not digest.mappable(st):
                return st.st_size, digest.of_file(full)
            threads = self._threads()
            h, done = digest.new(threads=threads), 0
            while done < st.st_size:
                if threads == 1 and self._boost.is_set():
                    threads = self._threads()
                    if threads > 1 and done < (st.st_size - done) * self.RESTART_FRACTION:
                        h, done = digest.new(threads=threads), 0
                end = min(st.st_size, done + _ROUND)
                digest.update_mapped(h, fd, done, end)
                done = end
            return st.st_size, str(h.hexdigest())
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._thread.join()

    def finish(self) -> dict[str, tuple[int, str]]:
        self.stop()
        return dict(self._out)
