"""Device memory as content-addressed chunks, shared by the images of one job.

An agent writes an NPU process's device memory as one stream (a header, one record per
allocation, then each allocation's bytes: ``contract.DEVMEM_FILE_*``). An image keeps that
stream as *pieces*: the header with the records is one piece, then every allocation is cut into
``CHUNK_BYTES`` pieces from its own start (so an allocation that did not change gives the same
pieces wherever it sits in the stream). Each distinct piece is one read-only file,
``device/chunks/<blake3 of its bytes>``; ``device/devmem-PID.idx`` lists the pieces in order.
Both are files of the manifest with their digests, so ``verify`` checks every chunk and names
one that is missing or altered.

**Sharing.** A piece that an earlier image of the job already holds is not written again: the
new image hard-links that image's chunk file under its own name. The earlier images are the
ones next to the new one (the same parent directory) and ``dump --parent``; a chunk file is
taken only when it is a regular file of the dumping user with no write permission, of the
right size, and the link is checked again once made. Every image thus holds every chunk it
needs by itself: it can be moved, exported (the archive inlines the chunks), verified and
restored alone; removing one image (``rm``, ``--keep-last``) or a dump that dies half-way never
breaks another, because the filesystem counts the names; and there is nothing to collect and
no shared store that another dump could be changing: a chunk's space is freed with the last
image that names it. A link that fails (another filesystem, the source removed meanwhile, the
link limit) makes the dump write the piece itself.

**Incremental saves.** Each agent tracks which pieces the job wrote since each of its last saves
(native/agent/writes.c). An earlier image of the same process's history (its manifest records the
save's id, which the agent still knows) is the *base*: the dump asks the agent for the pieces
written since that save only, and takes the others' digests from the base's index and their
files from the base by link -- neither copied off the device nor hashed again. With
``NPUSNAP_TEST_CHECK_WRITES=1`` the agent copies everything all the same and the dump checks
every piece the tracking called unchanged against the base (a test of the tracking's exactness).

**Restore** assembles the stream again in a memory file (``memfd``) from the chunks, checking
each chunk's digest as it copies it (``Assembly``), and the agent reloads from that.
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import contract
from npusnap_cli.errors import ImageError
from npusnap_cli.image import digest
from npusnap_cli.image.layout import CHUNK_MODE, CHUNKS_SUBDIR, DEVICE_SUBDIR, MANIFEST_NAME, is_temp_name
from npusnap_cli.image.manifest import Manifest, load_manifest
from npusnap_cli.jsontypes import obj

CHUNK_BYTES = contract.DEVMEM_PIECE_BYTES
INDEX_FORMAT = "npusnap-devmem-chunks"
INDEX_VERSION = 1
_MAX_INDEX_BYTES = 64 << 20


def index_rel(pid: int) -> str:
    """The index of NPU process ``pid``'s device memory in an image of the chunk layout."""
    return f"{DEVICE_SUBDIR}/devmem-{pid}.idx"


def chunk_rel(value: str) -> str:
    return f"{CHUNKS_SUBDIR}/{value}"


def is_chunk_rel(rel: str) -> bool:
    return rel.startswith(CHUNKS_SUBDIR + "/")


def is_chunk_layout_rel(rel: str) -> bool:
    """A chunk or an index: restore checks these while it puts the streams together."""
    return is_chunk_rel(rel) or (rel.startswith(DEVICE_SUBDIR + "/devmem-") and rel.endswith(".idx"))


def read_indexes(image: Path, manifest: Manifest) -> dict[int, Index]:
    """pid -> index of each NPU process whose device memory the image keeps as chunks."""
    entries = {f.path: f for f in manifest.files}
    out: dict[int, Index] = {}
    for p in manifest.npu_processes:
        entry = entries.get(index_rel(p.pid))
        if entry is not None:
            out[p.pid] = read_index(image, entry.path, entry.digest, entry.algo)
    return out


def records(view: memoryview) -> list[tuple[int, int, int]]:
    """(address, size, device) of each allocation an agent's stream (or its first piece) lists."""
    hdr = contract.DEVMEM_FILE_HEADER
    rec = contract.DEVMEM_FILE_RECORD
    if len(view) < hdr.size:
        raise ImageError(f"a device-memory stream of {len(view)} bytes is shorter than its header")
    magic, count, _total = hdr.unpack_from(view, 0)
    if magic.rstrip(b"\0") != contract.DEVMEM_FILE_MAGIC or hdr.size + count * rec.size > len(view):
        raise ImageError("a device-memory stream does not start with the agent's header and records")
    out = []
    for i in range(count):
        ptr, size, dev, _kind = rec.unpack_from(view, hdr.size + i * rec.size)
        out.append((ptr, size, dev))
    return out


def pieces_of(size: int) -> int:
    return (size + CHUNK_BYTES - 1) // CHUNK_BYTES


def cut(view: memoryview) -> list[tuple[int, int]]:
    """(offset, size) of each piece of an agent's device-memory stream; ImageError if the stream
    is not one (its header, records and sizes must add up to its length)."""
    hdr = contract.DEVMEM_FILE_HEADER
    rec = contract.DEVMEM_FILE_RECORD
    if len(view) < hdr.size:
        raise ImageError(f"a device-memory stream of {len(view)} bytes is shorter than its header")
    magic, count, _total = hdr.unpack_from(view, 0)
    if magic.rstrip(b"\0") != contract.DEVMEM_FILE_MAGIC:
        raise ImageError("a device-memory stream does not start with the agent's header")
    meta = hdr.size + count * rec.size
    if meta > len(view):
        raise ImageError(f"a device-memory stream lists {count} allocations it does not hold")
    pieces = [(0, meta)]
    off = meta
    for i in range(count):
        _ptr, size, _dev, _kind = rec.unpack_from(view, hdr.size + i * rec.size)
        for start in range(0, size, CHUNK_BYTES):
            n = min(CHUNK_BYTES, size - start)
            pieces.append((off, n))
            off += n
    if off != len(view):
        raise ImageError(f"a device-memory stream holds {len(view)} bytes where its records say {off}")
    return pieces


@dataclass(frozen=True)
class Index:
    """What ``device/devmem-PID.idx`` says: the stream's pieces in order, as (digest, size)."""

    pieces: tuple[tuple[str, int], ...]
    algo: str = digest.DEFAULT

    @property
    def size(self) -> int:
        return sum(n for _d, n in self.pieces)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": INDEX_FORMAT,
                "version": INDEX_VERSION,
                "algo": self.algo,
                "bytes": self.size,
                "chunk_bytes": CHUNK_BYTES,
                "pieces": [[d, n] for d, n in self.pieces],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Index:
        def bad(what: str) -> ImageError:
            return ImageError(
                f"{where} is not a device-memory index: {what}", fix="do not use this image; dump again"
            )

        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(str(exc)) from None
        if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT:
            raise bad("no format line")
        if d.get("version") != INDEX_VERSION:
            raise bad(f"version {d.get('version')!r} (this npusnap reads {INDEX_VERSION})")
        algo = d.get("algo")
        if algo not in digest.ALGORITHMS:
            raise bad(f"unknown digest {algo!r}")
        raw = d.get("pieces")
        if not isinstance(raw, list):
            raise bad("no pieces")
        pieces = []
        for p in raw:
            if (
                not isinstance(p, list)
                or len(p) != 2
                or not digest.is_hex(p[0])
                or not isinstance(p[1], int)
                or isinstance(p[1], bool)
                or not 0 <= p[1] <= max(CHUNK_BYTES, 1 << 40)
            ):
                raise bad(f"a piece {p!r:.80}")
            pieces.append((p[0], p[1]))
        index = cls(tuple(pieces), algo)
        if d.get("bytes") != index.size:
            raise bad("its size does not add up")
        return index


def read_index(image: Path, rel: str, entry_digest: str, algo: str) -> Index:
    """The index at ``rel``, whose bytes must match the manifest's digest (read once, then
    checked: what is parsed is what was checked)."""
    path = image / rel
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_INDEX_BYTES:
            raise ImageError(
                f"refusing {path}: not a regular file of a sane size", fix="do not use this image"
            )
        data = b""
        while len(data) < st.st_size:
            part = os.read(fd, st.st_size - len(data))
            if not part:
                break
            data += part
    finally:
        os.close(fd)
    h = digest.new(algo)
    h.update(data)
    if h.hexdigest() != entry_digest:
        raise ImageError(
            f"{path} does not match its {algo} checksum (file modified)",
            why="the image changed after it was written",
            fix="do not use this image; dump again",
        )
    return Index.from_bytes(data, str(path))


# -- dump -----------------------------------------------------------------------------------------


def _chunk_ok(st: os.stat_result, size: int, uid: int) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o222 and st.st_size == size


def _dir_ok(path: str, uid: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022


class Sharing:
    """The chunk files of the earlier images a new one may link: those in ``final``'s parent
    directory (and ``final`` itself, which ``--force`` replaces) and ``parent``, owned by this
    user in directories nobody else can write. Looked up once, on first use."""

    def __init__(self, final: Path, parent: Optional[Path] = None) -> None:
        self._final = final
        self._parent = parent
        self._where: Optional[dict[str, str]] = None
        self._uid = os.geteuid()

    def images(self) -> list[str]:
        """The earlier images this user's dump may take chunks from."""
        return [
            i
            for i in self._images()
            if _dir_ok(i, self._uid) and _dir_ok(os.path.join(i, CHUNKS_SUBDIR), self._uid)
        ]

    def _images(self) -> Iterable[str]:
        if self._parent is not None:
            yield str(self._parent)
        # Each earlier image must be this user's own (below), wherever its parent is.
        base = str(self._final.parent)
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return
        for name in names:
            if not is_temp_name(name):
                yield os.path.join(base, name)

    def _scan(self) -> dict[str, str]:
        where: dict[str, str] = {}
        for image in self._images():
            chunks = os.path.join(image, CHUNKS_SUBDIR)
            if not (_dir_ok(image, self._uid) and _dir_ok(os.path.join(image, DEVICE_SUBDIR), self._uid)):
                continue
            if not (_dir_ok(chunks, self._uid) and os.path.exists(os.path.join(image, MANIFEST_NAME))):
                continue
            try:
                for name in os.listdir(chunks):
                    if digest.is_hex(name):
                        where.setdefault(name, chunks)
            except OSError:
                continue
        return where

    def link(self, value: str, size: int, dst_dir_fd: int) -> bool:
        """Hard-link an earlier image's chunk ``value`` into the directory ``dst_dir_fd`` under
        the same name; False (nothing left behind) where there is none to take."""
        if self._where is None:
            self._where = self._scan()
        src_dir = self._where.get(value)
        if src_dir is None:
            return False
        src = os.path.join(src_dir, value)
        try:
            if not _chunk_ok(os.lstat(src), size, self._uid):
                return False
            os.link(src, value, dst_dir_fd=dst_dir_fd, follow_symlinks=False)
        except OSError:
            return False
        try:
            # What was linked is whatever the name held at that moment: checked again.
            if _chunk_ok(os.stat(value, dir_fd=dst_dir_fd, follow_symlinks=False), size, self._uid):
                return True
            os.unlink(value, dir_fd=dst_dir_fd)
        except OSError:
            pass
        return False


@dataclass(frozen=True)
class BaseSave:
    """An earlier image of a process, as the base of an incremental save: the save's id (in the
    image's manifest and the agent's lineage), and per allocation its pieces' digests."""

    image: Path
    save_id: str
    pieces: dict[tuple[int, int, int], tuple[str, ...]]  # (address, size, device) -> digests


def save_of(manifest: Manifest, pid: int) -> Optional[dict[str, Any]]:
    """The save a manifest records for NPU process ``pid`` ({"id", "epoch"}), if any."""
    procs = obj(manifest.device_memory.get("processes"))
    save = obj(procs.get(str(pid))).get("save")
    if isinstance(save, dict) and isinstance(save.get("id"), str) and isinstance(save.get("epoch"), int):
        return save
    return None


def find_base(sharing: Sharing, lineage: list[tuple[str, int]]) -> Optional[BaseSave]:
    """The newest earlier image (of those ``sharing`` may link) holding a save of this process's
    ``lineage`` ([save id, epoch] its agent knows), read and checked; None if there is none."""
    known = dict(lineage)
    best: Optional[tuple[int, Path, int, str]] = None
    for name in sharing.images():
        image = Path(name)
        try:
            manifest = load_manifest(image)
        except (ImageError, OSError):
            continue
        for p in manifest.npu_processes:
            save = save_of(manifest, p.pid)
            ours = save is not None and known.get(save["id"]) == save["epoch"]
            if save is not None and ours and (best is None or save["epoch"] > best[0]):
                best = (save["epoch"], image, p.pid, save["id"])
    if best is None:
        return None
    _epoch, image, pid, save_id = best
    try:
        manifest = load_manifest(image)
        entry = next(f for f in manifest.files if f.path == index_rel(pid))
        index = read_index(image, entry.path, entry.digest, entry.algo)
        meta_value, meta_size = index.pieces[0]
        meta = _read_chunk(image, meta_value, meta_size, index.algo)
    except (ImageError, OSError, StopIteration, IndexError):
        return None
    pieces: dict[tuple[int, int, int], tuple[str, ...]] = {}
    k = 1
    for key in records(memoryview(meta)):
        n = pieces_of(key[1])
        pieces[key] = tuple(v for v, _n in index.pieces[k : k + n])
        k += n
    if k != len(index.pieces):
        return None
    return BaseSave(image, save_id, pieces)


def _read_chunk(image: Path, value: str, size: int, algo: str) -> bytes:
    fd = os.open(image / chunk_rel(value), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        data = os.pread(fd, size + 1, 0)
    finally:
        os.close(fd)
    h = digest.new(algo)
    h.update(data)
    if len(data) != size or h.hexdigest() != value:
        raise ImageError(f"{image / chunk_rel(value)} does not match its checksum")
    return data


@dataclass(frozen=True)
class Incremental:
    """What the agent left out of a stream: its pieces in file order (after the first), 1 bit
    each, set where not written since ``base``'s save."""

    base: BaseSave
    unchanged: bytes
    check: bool = False  # the agent copied them all the same: compare

    def left_out(self, k: int) -> bool:
        return bool(k // 8 < len(self.unchanged) and self.unchanged[k // 8] >> (k % 8) & 1)


@dataclass
class ChunkResult:
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # rel -> (size, digest)
    device_total: int = 0  # bytes of device memory the images' streams hold
    device_new: int = 0  # of which written by this dump (the rest linked)


class ChunkWriter:
    """Writes each NPU process's device-memory stream (a memory file its agent filled) into the
    work image as chunks and an index, on a thread of its own; ``finish`` waits for it."""

    def __init__(
        self,
        work: Path,
        sharing: Sharing,
        streams: dict[int, int],
        threads: int = 1,
        incremental: Optional[dict[int, Incremental]] = None,
    ) -> None:
        self._work = work
        self._sharing = sharing
        self._streams = dict(streams)  # pid -> memfd; owned (closed) by this writer
        self._incremental = incremental or {}
        self._threads = max(1, threads)
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self.result = ChunkResult()
        self._thread = threading.Thread(target=self._run, name="npusnap-chunks", daemon=True)

    def start(self) -> ChunkWriter:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            os.makedirs(self._work / CHUNKS_SUBDIR, mode=0o700, exist_ok=True)
            dfd = os.open(
                self._work / CHUNKS_SUBDIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
            try:
                have: dict[str, int] = {}
                with concurrent.futures.ThreadPoolExecutor(self._threads, "npusnap-chunk") as pool:
                    for pid, fd in sorted(self._streams.items()):
                        if self._stop.is_set():
                            return
                        self._one(pid, fd, dfd, have, pool)
            finally:
                os.close(dfd)
        except BaseException as exc:
            self._error = exc
        finally:
            self._close()

    def _one(
        self, pid: int, fd: int, dfd: int, have: dict[str, int], pool: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        size = os.fstat(fd).st_size
        if not size:
            return
        inc = self._incremental.get(pid)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m, memoryview(m) as view:
            pieces = cut(view)
            # The base's digest of each piece the agent left out (None: hash this one).
            known: list[Optional[str]] = [None] * len(pieces)
            if inc is not None:
                k = 0
                for key in records(view):
                    for j in range(pieces_of(key[1])):
                        if inc.left_out(k):
                            base = inc.base.pieces.get(key)
                            if base is None or j >= len(base):
                                raise ImageError(
                                    f"the agent of pid {pid} left out a piece of its allocation at "
                                    f"{key[0]:#x} that the base image {inc.base.image} does not hold",
                                    why="the agent's history and the base image disagree",
                                    fix="dump again (the job was rolled back and runs on)",
                                )
                            known[1 + k] = base[j]
                        k += 1

            def hashed(i: int) -> str:
                off, n = pieces[i]
                h = digest.new()
                with view[off : off + n] as part:
                    h.update(part)
                return str(h.hexdigest())

            check = inc is not None and inc.check
            todo = [i for i, v in enumerate(known) if v is None or check]
            values: list[str] = [v or "" for v in known]
            # Every hash done before anything may raise: no thread still holds a slice of the view.
            for i, value in zip(todo, list(pool.map(hashed, todo))):
                if known[i] is not None and known[i] != value:
                    off, n = pieces[i]
                    raise ImageError(
                        f"write tracking missed a write: pid {pid}'s piece at offset {off} of its "
                        f"stream changed since the base image {inc.base.image if inc else ''} "
                        "although no call of the job was seen writing it",
                        why="an incremental save would have kept the old bytes",
                        fix="report this with the job's calls; dump with NPUSNAP_NO_INCREMENTAL=1 meanwhile",
                    )
                values[i] = value
            for i, ((off, n), value) in enumerate(zip(pieces, values)):
                if self._stop.is_set():
                    return
                self.result.device_total += n
                if value in have:
                    continue
                if not self._sharing.link(value, n, dfd):
                    if known[i] is not None and not check:
                        raise ImageError(
                            f"a piece of pid {pid}'s device memory that did not change is gone from "
                            f"the base image {inc.base.image if inc else ''} (removed during the dump?)",
                            why="an incremental save takes unchanged pieces from its base image",
                            fix="dump again (the job was rolled back and runs on)",
                        )
                    with view[off : off + n] as part:
                        _write_chunk(dfd, value, part)
                    self.result.device_new += n
                have[value] = n
                self.result.files[chunk_rel(value)] = (n, value)
        index = Index(tuple(zip(values, (n for _o, n in pieces))))
        data = index.to_bytes()
        rel = index_rel(pid)
        out = os.open(
            self._work / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            _write_all(out, data)
        finally:
            os.close(out)
        h = digest.new()
        h.update(data)
        self.result.files[rel] = (len(data), str(h.hexdigest()))

    def _close(self) -> None:
        for fd in self._streams.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._streams = {}

    def finish(self) -> ChunkResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.result

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._close()


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_chunk(dfd: int, value: str, data: memoryview) -> None:
    fd = os.open(
        value, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, CHUNK_MODE, dir_fd=dfd
    )
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


# -- restore --------------------------------------------------------------------------------------


class Assembly:
    """The device-memory streams of an image's chunked processes, put together in memory files
    on a thread (each chunk's digest checked as it is copied, unless ``verify`` is off). Has
    ``join`` (the first error, or None) like restore's checksum threads; the agents reload only
    after it."""

    def __init__(self, image: Path, indexes: dict[int, Index], *, verify: bool, threads: int = 1) -> None:
        self.error: Optional[BaseException] = None
        self.done_at: Optional[float] = None
        self._image = image
        self._verify = verify
        self._threads = max(1, threads)
        self._indexes = indexes
        self._stop = threading.Event()
        # Opened now: what happens to the image from here on (removed by a lazy restore) does
        # not matter to the memory files.
        self._dfd = os.open(
            image / CHUNKS_SUBDIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        )
        self.memfds: dict[int, int] = {}
        try:
            for pid, index in indexes.items():
                fd = os.memfd_create(f"npusnap-devmem-{pid}", os.MFD_CLOEXEC)
                self.memfds[pid] = fd
                os.ftruncate(fd, index.size)
        except OSError:
            self.close()
            os.close(self._dfd)
            raise
        self._thread = threading.Thread(target=self._run, name="npusnap-assemble", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with concurrent.futures.ThreadPoolExecutor(self._threads, "npusnap-assemble") as pool:
                for pid, index in sorted(self._indexes.items()):
                    self._one(self.memfds[pid], index, pool)
        except BaseException as exc:
            self.error = exc
        finally:
            os.close(self._dfd)
            self.done_at = time.monotonic()

    def _one(self, fd: int, index: Index, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        if not index.size:
            return
        offsets = []
        off = 0
        for _v, n in index.pieces:
            offsets.append(off)
            off += n
        with mmap.mmap(fd, index.size) as m, memoryview(m) as view:

            def copy(i: int) -> Optional[str]:
                if self._stop.is_set():
                    return "stopped"
                value, n = index.pieces[i]
                start = offsets[i]
                try:
                    cfd = os.open(value, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dfd)
                except OSError as exc:
                    return f"{chunk_rel(value)}: {exc.strerror}"
                try:
                    st = os.fstat(cfd)
                    if not stat.S_ISREG(st.st_mode) or st.st_size != n:
                        return f"{chunk_rel(value)} is not a regular file of {n} bytes"
                    with view[start : start + n] as part:
                        got = os.preadv(cfd, [part], 0) if n else 0
                        if got != n:
                            return f"{chunk_rel(value)} ended after {got} of {n} bytes"
                        if self._verify:
                            h = digest.new(index.algo)
                            h.update(part)
                            if h.hexdigest() != value:
                                return digest.mismatch(chunk_rel(value), index.algo)
                finally:
                    os.close(cfd)
                return None

            problems = [p for p in pool.map(copy, range(len(index.pieces))) if p]
        if problems:
            raise ImageError(
                f"image {self._image}: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                why="a device-memory chunk this image needs is missing or was modified",
                fix="do not use this image; `npusnap verify` names every bad file",
                details={"image": str(self._image), "problems": problems},
            )

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        self._stop.set()

    def join(self) -> Optional[BaseException]:
        self._thread.join()
        return self.error

    def close(self) -> None:
        for fd in self.memfds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.memfds = {}
