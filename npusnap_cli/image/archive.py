"""Image archives: one file (tar, zstd-compressed with every core) to copy, store and import.

``npusnap export DIR FILE`` writes ``FILE`` (by convention ``NAME.tar.zst``); ``npusnap import
FILE DIR`` turns it back into an image directory. ``inspect`` and ``verify`` read archives
directly, without extracting them.

Layout of the tar stream (POSIX pax), in this order, all under one top directory named after the
image::

    NAME/npusnap.json      first, so that reading the manifest needs only the archive's start
    NAME/criu/... (hostfiles/..., device/...)  every file the manifest lists, in its order

``logs/`` is not exported (restore writes a new one). Modes are 0700/0600 and owners root: an
image holds the processes' memory. Every file is hashed while it is written (export) or read
(verify, import) and compared with the manifest, so a corrupt image is never exported and a
corrupt archive never becomes an image. Import refuses anything but plain files and directories
under the top directory (no links, no devices, no absolute or ``..`` paths).

Core module: raises ImageError/UsageError, never prints.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Optional

from npusnap_cli import safefs
from npusnap_cli.errors import (
    NO_SPACE_ERRNOS,
    ImageError,
    NpusnapError,
    UsageError,
    no_space,
    no_space_cause,
)
from npusnap_cli.image import digest, hostrecords, integrity, layout, publishing
from npusnap_cli.image.manifest import Manifest
from npusnap_cli.jsontypes import JSONObject

SUFFIX = ".tar.zst"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DEFAULT_LEVEL = 3  # zstd's default: ~memory speed with all cores; images are mostly pages
_CHUNK = 1 << 20

ProgressFn = Any  # Callable[[int], None]


def _no_progress(_n: int) -> None:
    pass


# `export --compress`: zstd (the default), or none for a plain tar (already compressed data, a
# store that compresses by itself, or the fastest export when the disk is not the bottleneck).
COMPRESSIONS = ("zstd", "none")
SUFFIXES = {"zstd": SUFFIX, "none": ".tar"}


def _plain_tar_of_ours(path: Path) -> bool:
    """An uncompressed tar whose first member is an image's manifest (export writes it first),
    so that another tool's tar (a container checkpoint) is never taken for an npusnap archive."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            first = tar.next()
    except (OSError, tarfile.TarError, EOFError):
        return False
    return first is not None and first.isfile() and first.name.endswith("/" + layout.MANIFEST_NAME)


def _compression(path: Path) -> Optional[str]:
    """``"zstd"`` or ``"none"`` for an npusnap archive, None for anything else."""
    try:
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            if f.read(4) == ZSTD_MAGIC:
                return "zstd"
    except OSError:
        return None
    return "none" if _plain_tar_of_ours(path) else None


def is_archive(path: Path) -> bool:
    """A regular file written by `npusnap export`: zstd data, or a plain tar of an image."""
    return _compression(path) is not None


def default_name(image: Path, compress: str = "zstd") -> str:
    return image.name + SUFFIXES[compress]


@dataclass(frozen=True)
class ArchiveResult:
    image: str
    archive: str
    files: int
    bytes_in: int
    bytes_out: int
    seconds: float

    def to_dict(self) -> JSONObject:
        return {
            "image": self.image,
            "archive": self.archive,
            "files": self.files,
            "image_bytes": self.bytes_in,
            "archive_bytes": self.bytes_out,
            "ratio": round(self.bytes_out / self.bytes_in, 4) if self.bytes_in else None,
            "seconds": round(self.seconds, 3),
        }


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


class _HashingReader(io.RawIOBase):
    """Reads a file, hashing and counting what passes through."""

    def __init__(self, f: IO[bytes], progress: ProgressFn, algo: str) -> None:
        self._f = f
        self.sha = digest.new(algo)
        self.size = 0
        self._progress = progress

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha.update(data)
        self.size += len(data)
        if data:
            self._progress(len(data))
        return data


def _tarinfo(name: str, *, size: int = 0, directory: bool = False, mtime: float = 0.0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = layout.DIR_MODE if directory else layout.FILE_MODE
    info.size = 0 if directory else size
    info.mtime = int(mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _check_destination(dest: Path, force: bool) -> None:
    if dest.exists() and not force:
        raise UsageError(
            f"{dest} exists", why="npusnap never overwrites a file without being told to", fix="pass --force"
        )
    if dest.exists() and not dest.is_file():
        raise UsageError(f"{dest} exists and is not a file", fix="choose another path for the archive")
    if not dest.parent.is_dir():
        raise UsageError(f"{dest.parent} does not exist", fix=f"create it: mkdir -p {dest.parent}")


def export(
    image: Path,
    dest: Path,
    *,
    level: int = DEFAULT_LEVEL,
    threads: int = -1,
    force: bool = False,
    progress: ProgressFn = _no_progress,
    compress: str = "zstd",
) -> ArchiveResult:
    """Write ``image`` into the archive ``dest`` (atomically: a temporary sibling, then rename);
    ``compress``: "zstd" (at ``level``) or "none" (a plain tar)."""
    import zstandard

    if compress not in COMPRESSIONS:
        raise UsageError(
            f"--compress {compress!r} is not a compression npusnap writes",
            fix=f"choose one of: {', '.join(COMPRESSIONS)}",
        )

    start = time.monotonic()
    image = layout.follow_pointer(image)
    _check_destination(dest, force)
    # Structure and sizes first; the checksums are checked while the files stream out.
    result = integrity.verify(image, checksums=False)
    manifest = result.manifest
    top = image.resolve().name
    cctx = zstandard.ZstdCompressor(level=level, threads=threads)
    bytes_in = 0
    # A random O_EXCL name in the destination's directory, reached without following a user's
    # symlink: a name planted there beforehand can neither receive the image nor be truncated.
    try:
        dfd = safefs.open_dir(str(dest.parent.absolute()), check=False, follow_root_links=True)
    except safefs.UnsafePath as exc:
        raise UsageError(
            f"cannot write the archive into {dest.parent}: {exc.filename}: {exc.strerror}",
            why="npusnap never writes through a symbolic link a user could have made",
            fix="pass a path without such a link",
        ) from None
    try:
        fd, tmp = safefs.create_temp(dfd, dest.name, layout.FILE_MODE)
        try:
            with (
                os.fdopen(fd, "wb") as fh,
                _writer(cctx, fh, compress) as zw,
                tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
            ):
                mpath = layout.manifest_path(image)
                data = mpath.read_bytes()
                tar.addfile(_tarinfo(f"{top}/{layout.MANIFEST_NAME}", size=len(data)), io.BytesIO(data))
                tar.addfile(_tarinfo(f"{top}/{layout.CRIU_SUBDIR}", directory=True))
                made = {f"{top}/{layout.CRIU_SUBDIR}"}
                for entry in manifest.files:
                    for parent in reversed(PurePosixPath(entry.path).parents[:-1]):
                        name = f"{top}/{parent.as_posix()}"
                        if name not in made:
                            tar.addfile(_tarinfo(name, directory=True))
                            made.add(name)
                    full = image / entry.path
                    with open(full, "rb") as f:
                        reader = _HashingReader(f, progress, entry.algo)
                        info = _tarinfo(f"{top}/{entry.path}", size=entry.size, mtime=full.stat().st_mtime)
                        tar.addfile(info, reader)
                    if reader.sha.hexdigest() != entry.digest or reader.size != entry.size:
                        raise img_problem(image, digest.mismatch(entry.path, entry.algo))
                    bytes_in += entry.size
                if compress == "zstd":
                    zw.flush(zstandard.FLUSH_FRAME)
                fh.flush()
                os.fsync(fh.fileno())
            os.rename(tmp, dest.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    except OSError as exc:
        raise disk_error(exc, f"writing the archive {dest}", dest.parent) from None
    except Exception as exc:
        # zstandard reports a write that failed in its flush as its own ZstdError
        cause = no_space_cause(exc)
        if cause is None:
            raise
        raise disk_error(cause, f"writing the archive {dest}", dest.parent) from None
    finally:
        os.close(dfd)
    return ArchiveResult(
        image=str(image),
        archive=str(dest),
        files=len(manifest.files),
        bytes_in=bytes_in,
        bytes_out=dest.stat().st_size,
        seconds=time.monotonic() - start,
    )


def _writer(cctx: Any, fh: IO[bytes], compress: str) -> Any:
    """Where the tar stream goes: zstd's writer, or the file itself."""
    return cctx.stream_writer(fh, closefd=False) if compress == "zstd" else _Uncompressed(fh)


class _Uncompressed:
    """The file itself, with the context-manager face of zstd's stream writer (`--compress
    none`); leaving it does not close the file, as ``closefd=False`` does not."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh

    def write(self, data: bytes) -> int:
        return self._fh.write(data)

    def __enter__(self) -> _Uncompressed:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.flush()


def disk_error(exc: OSError, what: str, where: Path) -> NpusnapError:
    """An OSError of a write as the error to report: a full disk is a preflight problem (3) with
    its fix, any other failure of the image's files an image error (8); never a traceback."""
    if exc.errno in NO_SPACE_ERRNOS:
        return no_space(
            what,
            where,
            cause=exc.strerror,
            fix=f"free space in {where} (see `df -h {where}`), or write elsewhere; then run the "
            "command again (what was written so far was removed)",
            details={"errno": exc.errno, "path": exc.filename},
        )
    return ImageError(
        f"{what} failed: {exc.strerror or exc}",
        why="the filesystem refused a write",
        fix=f"check {where} (permissions, mount) and run the command again",
        details={"errno": exc.errno, "path": exc.filename},
    )


def img_problem(where: Path, problem: str) -> ImageError:
    return ImageError(
        f"image {where} failed verification: {problem}",
        why="the image is truncated, was modified after the dump, or the disk is corrupt",
        fix="do not use it; take an older image (`npusnap list DIR`) or dump again",
        details={"problems": [problem]},
    )


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _members(archive: Path) -> Iterator[Iterator[tuple[tarfile.TarInfo, Optional[IO[bytes]]]]]:
    """Stream the archive's members (each file object valid until the next member)."""
    import zstandard

    if not archive.exists():
        raise ImageError(f"no archive at {archive}", fix="check the path")
    compression = _compression(archive)
    if compression is None:
        raise ImageError(
            f"{archive} is not an npusnap archive (neither zstd data nor a tar of an image)",
            fix="pass a file written by `npusnap export`, or an image directory",
        )
    with (
        open(archive, "rb") as fh,
        (
            zstandard.ZstdDecompressor().stream_reader(fh)
            if compression == "zstd"
            else contextlib.nullcontext(fh)
        ) as zr,
    ):
        try:
            tar = tarfile.open(fileobj=zr, mode="r|")  # noqa: SIM115 - closed with the file below
        except (tarfile.TarError, zstandard.ZstdError) as exc:
            raise _corrupt(archive, str(exc)) from None

        def gen() -> Iterator[tuple[tarfile.TarInfo, Optional[IO[bytes]]]]:
            try:
                for member in tar:
                    yield member, tar.extractfile(member) if member.isfile() else None
            except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
                raise _corrupt(archive, str(exc)) from None

        yield gen()


def _corrupt(archive: Path, why: str) -> ImageError:
    return ImageError(
        f"archive {archive} is corrupt or truncated: {why}",
        why="the copy was interrupted, or the file was modified",
        fix="copy it again from its source, or use an older archive (`npusnap list DIR`)",
    )


def _split(archive: Path, name: str, top: Optional[str]) -> tuple[str, str]:
    """(top, relative path) of a member, refusing anything outside one top directory."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise _corrupt(archive, f"member {name!r} has an unsafe path")
    if top is not None and p.parts[0] != top:
        raise _corrupt(archive, f"member {name!r} is outside the image directory {top}/")
    return p.parts[0], PurePosixPath(*p.parts[1:]).as_posix() if len(p.parts) > 1 else ""


def _read_manifest(
    archive: Path, member: tarfile.TarInfo, f: Optional[IO[bytes]]
) -> tuple[str, str, Manifest]:
    """(top directory, the manifest's exact text, the manifest) from the archive's first member."""
    top, rel = _split(archive, member.name, None)
    if rel != layout.MANIFEST_NAME or f is None:
        raise ImageError(
            f"{archive} is not an npusnap image archive: it does not start with {layout.MANIFEST_NAME}",
            fix="pass a file written by `npusnap export`",
        )
    if member.size > 64 << 20:
        raise _corrupt(archive, f"{layout.MANIFEST_NAME} is implausibly large ({member.size} bytes)")
    try:
        text = f.read().decode("utf-8")
    except UnicodeDecodeError:
        raise _corrupt(archive, f"{layout.MANIFEST_NAME} is not UTF-8 text") from None
    return top, text, Manifest.from_json(text)


def load_manifest(archive: Path) -> Manifest:
    """The manifest of an archive: reads only the archive's first member."""
    with _members(archive) as members:
        first = next(members, None)
        if first is None:
            raise _corrupt(archive, "it is empty")
        return _read_manifest(archive, *first)[2]


def _walk(
    archive: Path,
    *,
    checksums: bool,
    progress: ProgressFn,
    dest: Optional[Path] = None,
) -> integrity.VerifyResult:
    """Read the whole archive, check it against its manifest, and extract it into ``dest``."""
    problems: list[str] = []
    seen: dict[str, tuple[int, str]] = {}
    with _members(archive) as members:
        first = next(members, None)
        if first is None:
            raise _corrupt(archive, "it is empty")
        top, text, manifest = _read_manifest(archive, *first)
        if dest is not None:
            # The exact bytes: re-serialising could change what a digest or signature covers.
            fd = os.open(layout.manifest_path(dest), os.O_WRONLY | os.O_CREAT | os.O_EXCL, layout.FILE_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as mf:
                mf.write(text)
        listed = {f.path: f for f in manifest.files}
        for member, f in members:
            _, rel = _split(archive, member.name, top)
            if member.isdir():
                if rel.split("/", 1)[0] not in layout.CHECKSUMMED_SUBDIRS:
                    raise _corrupt(archive, f"unexpected directory {member.name!r}")
                if dest is not None:
                    (dest / rel).mkdir(mode=layout.DIR_MODE, parents=True, exist_ok=True)
                continue
            if not member.isfile() or f is None:
                raise _corrupt(archive, f"member {member.name!r} is not a regular file (links are refused)")
            if rel not in listed:
                problems.append(f"unexpected file {rel} (not in the manifest)")
                continue
            sha = digest.new(listed[rel].algo)
            size = 0
            out: Optional[IO[bytes]] = None
            if dest is not None:
                target = dest / rel
                target.parent.mkdir(mode=layout.DIR_MODE, parents=True, exist_ok=True)
                out = os.fdopen(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, layout.FILE_MODE), "wb")
            try:
                while True:
                    chunk = f.read(_CHUNK)
                    if not chunk:
                        break
                    if checksums or dest is not None:
                        sha.update(chunk)
                    if out is not None:
                        out.write(chunk)
                    size += len(chunk)
                    progress(len(chunk))
            finally:
                if out is not None:
                    out.close()
            seen[rel] = (size, sha.hexdigest())
    good = 0
    nbytes = 0
    for entry in manifest.files:
        if entry.path not in seen:
            problems.append(f"{entry.path} is missing")
            continue
        size, found = seen[entry.path]
        if size != entry.size:
            problems.append(f"{entry.path} has {size} bytes, the manifest says {entry.size}")
        elif (checksums or dest is not None) and found != entry.digest:
            problems.append(digest.mismatch(entry.path, entry.algo))
        else:
            good += 1
            nbytes += size
    if not manifest.files:
        problems.append("the manifest lists no files")
    problems += hostrecords.check_host_files(
        manifest.host_files, {p.uid for p in manifest.processes}, manifest.host_nodes
    )
    if problems:
        raise ImageError(
            f"archive {archive} failed verification: {problems[0]}",
            why="the archive is truncated, was modified, or its image was",
            fix="do not use it; copy it again or take an older one (`npusnap list DIR`)",
            details={"problems": problems},
        )
    return integrity.VerifyResult(
        image=str(archive),
        manifest=manifest,
        files_checked=good,
        bytes_checked=nbytes,
        checksums=checksums or dest is not None,
    )


def verify(
    archive: Path, *, checksums: bool = True, progress: ProgressFn = _no_progress
) -> integrity.VerifyResult:
    """Check an archive against its manifest without extracting it."""
    return _walk(archive, checksums=checksums, progress=progress)


@dataclass(frozen=True)
class ImportResult:
    archive: str
    image: str
    files: int
    image_bytes: int
    seconds: float

    def to_dict(self) -> JSONObject:
        return {
            "archive": self.archive,
            "image": self.image,
            "files": self.files,
            "image_bytes": self.image_bytes,
            "seconds": round(self.seconds, 3),
        }


def import_archive(
    archive: Path, final: Path, *, force: bool = False, progress: ProgressFn = _no_progress
) -> ImportResult:
    """Extract ``archive`` into the new image directory ``final``, verified, atomically."""
    start = time.monotonic()
    if not is_archive(archive):
        load_manifest(archive)  # raises the precise error (missing, not zstd)
    layout.check_dump_target(final, force=force)
    layout.remove_stale_temps(final)
    try:
        tmp = layout.create_temp_image(final)
    except OSError as exc:
        raise disk_error(exc, f"creating the image's work directory next to {final}", final.parent) from None
    try:
        result = _walk(archive, checksums=True, progress=progress, dest=tmp)
        publishing.fsync_tree(tmp)
        if final.exists() and force and not layout.dir_is_empty(final):
            old = final.with_name(f".{final.name}{layout.OLD_MARKER}{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            layout.remove_tree(old)
        else:
            os.rename(tmp, final)
    except OSError as exc:
        layout.remove_tree(tmp)
        raise disk_error(exc, f"importing {archive} into {final}", final.parent) from None
    except BaseException as exc:
        layout.remove_tree(tmp)
        cause = no_space_cause(exc) if not isinstance(exc, NpusnapError) else None
        if cause is not None:
            raise disk_error(cause, f"importing {archive} into {final}", final.parent) from None
        raise
    return ImportResult(
        archive=str(archive),
        image=str(final),
        files=result.files_checked,
        image_bytes=result.bytes_checked,
        seconds=time.monotonic() - start,
    )
