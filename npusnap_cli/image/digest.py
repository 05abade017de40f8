"""The checksums of an image's files: which hash, and the one place that computes them.

Every file an image lists carries a digest, and a signed manifest carries those digests: a
digest must therefore be a cryptographic hash (collision and second-preimage resistant), not
only an error-detecting code, or a signature would vouch for whatever collides with it.

New images use **BLAKE3** (the ``blake3`` package: bindings to the reference Rust crate, with
its SIMD code), a 256-bit cryptographic hash with the same guarantees as sha256 that hashes
several times faster on one core than sha256 (``bench/run.py`` measures both; figures in
docs/benchmarks.md), so that hashing a device-memory file keeps up with the agent
writing it and restore's verification is not what the job waits for. Images
made before list sha256 digests; both are read and checked, each file by the algorithm its
manifest entry names.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import mmap
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Mapping, Optional

from npusnap_cli.errors import ImageError

# What new images use; ALGORITHMS: what a manifest may name (the manifest's key for a digest).
DEFAULT = "blake3"
ALGORITHMS = ("blake3", "sha256")
HEX_LEN = 64  # both are 256-bit digests

_CHUNK = 4 << 20

ProgressFn = Callable[[int], None]


def new(algo: str = DEFAULT, threads: int = 1) -> Any:
    """A hasher (``update``, ``hexdigest``) for ``algo``; both release the GIL while they hash.
    ``threads`` > 1: BLAKE3 hashes each large ``update`` on that many threads (its tree makes the
    digest the same); sha256 has one."""
    if algo == "blake3":
        import blake3

        return blake3.blake3(max_threads=max(1, threads))
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algo!r} (known: {', '.join(ALGORITHMS)})")


def is_hex(value: object) -> bool:
    return isinstance(value, str) and len(value) == HEX_LEN and all(c in "0123456789abcdef" for c in value)


def of_file(path: Path, algo: str = DEFAULT, progress: Optional[ProgressFn] = None) -> str:
    """The digest of a regular file, never following a symlink (an image is not trusted)."""
    h = new(algo)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"refusing {path}: not a regular file", fix="do not use this image; dump again")
        if mappable(st):
            update_mapped(h, fd, 0, st.st_size, progress)
        else:
            while True:
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    break
                h.update(chunk)
                if progress is not None:
                    progress(len(chunk))
    finally:
        os.close(fd)
    return str(h.hexdigest())


def mappable(st: os.stat_result) -> bool:
    """Whether a file may be hashed from a mapping: one that nobody but this user can write (a
    file truncated under a mapping kills the reader with SIGBUS), and not empty."""
    return st.st_size > 0 and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def update_mapped(h: Any, fd: int, start: int, end: int, progress: Optional[ProgressFn] = None) -> None:
    """Feed ``[start, end)`` of ``fd`` to ``h`` from a read-only mapping of it: the hasher reads
    the page cache in place, without the copy a read makes."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, end - base, prot=mmap.PROT_READ, offset=base) as m, memoryview(m) as view:
        for off in range(start - base, end - base, _CHUNK):
            stop = min(off + _CHUNK, end - base)
            with view[off:stop] as piece:
                h.update(piece)
            if progress is not None:
                progress(stop - off)


def of_files(files: list[tuple[Path, str]], progress: Optional[ProgressFn] = None) -> list[str]:
    """The digest of each (path, algorithm), several files at a time: an image holds one pages
    file per process of the tree (eight NPU ranks make eight large files)."""
    if len(files) <= 1:
        return [of_file(p, a, progress) for p, a in files]
    lock = threading.Lock()

    def locked(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    workers = min(len(files), usable_cores(), 8)
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=workers, thread_name_prefix="npusnap-hash"
    ) as pool:
        return list(pool.map(lambda pa: of_file(pa[0], pa[1], locked), files))


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a cpuset or taskset may leave fewer than
    the machine has)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mismatch(path: str, algo: str) -> str:
    """The problem line of a file whose bytes are not the ones its manifest entry vouches for."""
    return f"{path} does not match its {algo} checksum (file modified)"


def from_entry(d: Mapping[str, Any], where: str) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest entry, which names its digest by its algorithm's
    key ("blake3": ..., or "sha256": ... in images made before); exactly one must be there."""
    keys = [a for a in ALGORITHMS if a in d]
    if len(keys) != 1 or not isinstance(d[keys[0]], str):
        raise ImageError(
            f"manifest field {where} needs exactly one digest ({' or '.join(ALGORITHMS)}) as a string",
            why="the manifest was written by another tool or edited by hand",
            fix="use an image written by this npusnap version, or dump again",
        )
    return keys[0], str(d[keys[0]])
