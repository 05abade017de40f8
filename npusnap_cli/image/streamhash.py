"""Checksums computed while CRIU writes the image, so that hashing leaves the dump's critical path.

CRIU writes each image file front to back and never goes back into it (page files are appended
page pipe by page pipe; the small images are written once). A follower thread therefore reads
every file's new bytes shortly after CRIU wrote them — from the page cache, on the core CRIU is
not using — and feeds them to a hasher per file (digest.DEFAULT). When CRIU is done, ``finish``
reads whatever is left and returns each file's size and digest; the dump then only hashes files
the follower could not vouch for (one that shrank, or that it never saw).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional

from npusnap_cli.image import digest

_CHUNK = 4 << 20
# Read at most this much from one file per round, so that every file keeps up.
_ROUND = 64 << 20


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
        done = 0
        while self.offset < size and done < limit:
            want = min(_CHUNK, size - self.offset, limit - done)
            data = os.pread(self.fd, want, self.offset)
            if not data:
                break
            self.hash.update(data)
            self.offset += len(data)
            done += len(data)
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
        for dirpath, _dirs, names in os.walk(self.root):
            for name in names:
                full = Path(dirpath) / name
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
