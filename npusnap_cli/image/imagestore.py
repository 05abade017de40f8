"""A directory of images: list them, keep the newest N, and a stable ``latest`` pointer.

An operator's periodic snapshot loop dumps into ``/snaps/<time>`` and wants the last few kept;
a crash-restore script wants the newest image that is whole. This module answers both:

* ``list_images(parent)``: every image directory and archive directly under ``parent``, newest
  first (by the manifest's ``created_at``), each with its size, pids and whether it is valid;
* ``rotate(parent, keep_last)``: removes the oldest images beyond the newest ``keep_last``, and
  only images it can prove are this user's own dumps: a directory (not a symlink) owned by the
  invoking user whose device and inode ``record_own`` noted in npusnap's state directory (root's:
  ``/var/lib/npusnap``, which only root can write) when a dump published it. A manifest proves
  nothing: in a shared directory anyone can write one, dated in the future, beside root's
  images to make them look old. Never a file, an archive, a work area of a running dump, an
  image another user (or npusnap before this record existed) made. An image is first renamed
  to a hidden name, then removed, so it never appears half-deleted;
* ``update_latest(image)``: the symlink ``<parent>/latest`` -> the image's name, replaced
  atomically (a new symlink renamed over the old one), so a reader sees the old or the new one.

Core module: never prints.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli import paths, safefs
from npusnap_cli.errors import ImageError, UsageError
from npusnap_cli.image import archive, integrity, layout
from npusnap_cli.image.manifest import Manifest, load_manifest
from npusnap_cli.jsontypes import JSONObject, JSONValue, as_record, req_float, req_int, req_str

LATEST = "latest"


@dataclass(frozen=True)
class ImageInfo:
    path: str
    kind: str  # "directory" | "archive"
    created_at: Optional[str]
    size_bytes: int
    root_pid: Optional[int]
    pids: tuple[int, ...]
    npu_pids: tuple[int, ...]
    valid: bool
    checked: str  # "checksums" | "sizes" | "manifest"
    problem: Optional[str]
    latest: bool = False

    def to_dict(self) -> JSONObject:
        return {
            "path": self.path,
            "kind": self.kind,
            "created_at": self.created_at,
            "size_bytes": self.size_bytes,
            "root_pid": self.root_pid,
            "pids": list(self.pids),
            "npu_pids": list(self.npu_pids),
            "valid": self.valid,
            "checked": self.checked,
            "problem": self.problem,
            "latest": self.latest,
        }


def _sort_key(info: ImageInfo) -> tuple[float, str]:
    return (_epoch(info.created_at), info.path)


def _epoch(created_at: Optional[str]) -> float:
    if not created_at:
        return 0.0
    try:
        return _dt.datetime.fromisoformat(created_at).timestamp()
    except ValueError:
        return 0.0


def _is_candidate_dir(path: Path) -> bool:
    return (
        path.is_dir()
        and not path.is_symlink()
        and not layout.is_temp_name(path.name)
        and layout.manifest_path(path).is_file()
    )


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return layout.tree_size(path)


def describe(path: Path, *, checksums: bool = True, quick: bool = False) -> ImageInfo:
    """One image (directory or archive) and whether it is valid.

    ``quick``: only parse the manifest (and, for a directory, check files and sizes without
    hashing); otherwise every file's checksum too (``checksums=False`` stops at sizes).
    """
    kind = "archive" if archive.is_archive(path) else "directory"
    manifest: Optional[Manifest] = None
    problem: Optional[str] = None
    checked = (
        "manifest" if quick and kind == "archive" else ("checksums" if checksums and not quick else "sizes")
    )
    try:
        if kind == "archive":
            manifest = archive.load_manifest(path)
            if not quick:
                archive.verify(path, checksums=checksums)
        else:
            manifest = load_manifest(path)
            integrity.verify(path, checksums=checksums and not quick)
    except ImageError as err:
        problem = err.message
    except OSError as exc:
        problem = f"cannot read it: {exc}"
    return ImageInfo(
        path=str(path),
        kind=kind,
        created_at=manifest.created_at if manifest else None,
        size_bytes=_size(path),
        root_pid=manifest.root_pid if manifest else None,
        pids=tuple(p.pid for p in manifest.processes) if manifest else (),
        npu_pids=tuple(p.pid for p in manifest.npu_processes) if manifest else (),
        valid=problem is None,
        checked=checked,
        problem=problem,
    )


def list_images(parent: Path, *, checksums: bool = True, quick: bool = False) -> list[ImageInfo]:
    """Images directly under ``parent`` (directories with a manifest, and archives), newest first."""
    if not parent.is_dir():
        raise UsageError(
            f"{parent} is not a directory",
            fix="pass the directory that holds your images (the parent of each image directory)",
        )
    target = latest_target(parent)
    found = []
    for entry in sorted(parent.iterdir()):
        if _is_candidate_dir(entry) or (entry.is_file() and archive.is_archive(entry)):
            info = describe(entry, checksums=checksums, quick=quick)
            if target is not None and entry.resolve() == target:
                info = ImageInfo(**{**info.__dict__, "latest": True})
            found.append(info)
    return sorted(found, key=_sort_key, reverse=True)


# --------------------------------------------------------------------------------------------
# Rotation and the latest pointer
# --------------------------------------------------------------------------------------------


OWN_IMAGES = "images.jsonl"  # in paths.state_dir(): the images this user's dumps published
_OWN_KEEP = 5000  # records kept; rotate drops those of images that are gone


def _own_registry() -> Optional[Path]:
    """The record of our own images, if its directory can be trusted: reached without a symlink,
    every directory on the way root's or ours and writable by nobody else (unless sticky), the
    state directory itself ours and private. None otherwise: then nothing is provably ours."""
    directory = paths.state_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with safefs.dir_fd(str(directory), owner=os.geteuid(), follow_root_links=True) as dfd:
            st = os.fstat(dfd)
    except OSError:
        return None
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    return directory / OWN_IMAGES


@dataclass(frozen=True)
class _Identity:
    """What identifies an image directory: its real path, device, inode and owner."""

    path: str
    dev: int
    ino: int
    uid: int


@dataclass(frozen=True)
class _OwnRecord:
    """A line of the record of this user's published images: an identity and when."""

    ident: _Identity
    time: float

    def to_json(self) -> JSONObject:
        i = self.ident
        return {"path": i.path, "dev": i.dev, "ino": i.ino, "uid": i.uid, "time": self.time}

    @classmethod
    def from_json(cls, value: JSONValue) -> _OwnRecord:
        d = as_record(value)
        ident = _Identity(req_str(d, "path"), req_int(d, "dev"), req_int(d, "ino"), req_int(d, "uid"))
        return cls(ident, req_float(d, "time"))


def _identity(path: Path) -> Optional[_Identity]:
    """What identifies the image directory ``path``: its real path, device, inode and owner."""
    try:
        st = os.lstat(path)
        real = os.path.join(os.path.realpath(path.parent), path.name)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return _Identity(real, st.st_dev, st.st_ino, st.st_uid)


def record_own(image: Path) -> bool:
    """Note that this user's dump published ``image`` (after its rename into place); False when
    it could not be noted (then ``rotate`` will never remove it: the safe side)."""
    registry = _own_registry()
    ident = _identity(image)
    if registry is None or ident is None:
        return False
    try:
        fd = safefs.open_append(str(registry))
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(_OwnRecord(ident, time.time()).to_json(), sort_keys=True) + "\n")
    except OSError:
        return False
    return True


def _own_records() -> list[_OwnRecord]:
    registry = _own_registry()
    if registry is None:
        return []
    try:
        with safefs.dir_fd(str(registry.parent), owner=os.geteuid()) as dfd:
            fd = safefs.open_read_at(dfd, registry.name)
        with os.fdopen(fd, "r", errors="replace") as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return []
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):  # not JSON, or not the record (ShapeError): skipped
            out.append(_OwnRecord.from_json(json.loads(line)))
    return out


def _prune_own(records: list[_OwnRecord]) -> None:
    """Rewrite the record without images that are gone (or are not the ones recorded)."""
    registry = _own_registry()
    if registry is None:
        return
    alive = [r for r in records if _identity(Path(r.ident.path)) == r.ident]
    if len(alive) == len(records) and len(records) <= _OWN_KEEP:
        return
    data = "".join(json.dumps(r.to_json(), sort_keys=True) + "\n" for r in alive[-_OWN_KEEP:]).encode()
    with contextlib.suppress(OSError):
        safefs.write_file(str(registry), iter([data]), mode=0o600, owner=os.geteuid(), follow_root_links=True)


def _own_images(parent: Path, records: list[_OwnRecord]) -> list[tuple[float, Path]]:
    """(publish time, path) of every image directly under ``parent`` that is provably ours:
    recorded by ``record_own``, still the same directory (device, inode), owned by this user."""
    mine = {r.ident.path: r for r in records}
    out = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        if layout.is_temp_name(entry.name):
            continue
        ident = _identity(entry)
        if ident is None or ident.uid != os.geteuid():
            continue
        found = mine.get(ident.path)
        if found is None or found.ident != ident:
            continue  # not an image our dump published here: never touched
        if not layout.manifest_path(entry).is_file():
            continue
        out.append((found.time, entry))
    return sorted(out, key=lambda t: (t[0], t[1].name), reverse=True)


def rotate(parent: Path, keep_last: int, *, keep: Optional[Path] = None) -> list[str]:
    """Remove the oldest complete images under ``parent`` beyond the newest ``keep_last``.

    ``keep`` (the image just written) is never removed, whatever the clocks say, and counts as
    one of the ``keep_last``. Returns the removed paths.
    """
    if keep_last < 1:
        raise UsageError("--keep-last must be at least 1", fix="e.g. --keep-last 3")
    records = _own_records()
    images = _own_images(parent, records)
    mine = keep.resolve() if keep is not None else None
    # The image just written counts among the N, and is kept whatever the clocks say.
    kept = sum(1 for _, path in images if path.resolve() == mine)
    removed = []
    target = latest_target(parent)
    for _, path in images:
        if path.resolve() == mine:
            continue
        if kept < keep_last:
            kept += 1
            continue
        if target is not None and path.resolve() == target:
            continue  # whatever `latest` names stays until the pointer moves
        hidden = path.with_name(f".{path.name}{layout.OLD_MARKER}{os.getpid()}")
        try:
            os.rename(path, hidden)
        except OSError:
            continue
        layout.remove_tree(hidden)
        removed.append(str(path))
    _prune_own(records)
    return removed


def latest_target(parent: Path) -> Optional[Path]:
    link = parent / LATEST
    if not link.is_symlink():
        return None
    with contextlib.suppress(OSError):
        return link.resolve(strict=True)
    return None


def update_latest(image: Path) -> str:
    """Point ``<parent>/latest`` at ``image`` (a relative symlink, replaced atomically)."""
    parent = image.parent
    link = parent / LATEST
    if link.exists() and not link.is_symlink():
        raise UsageError(
            f"{link} exists and is not a symlink: not replacing it",
            why="npusnap keeps `latest` as a symlink to the newest image",
            fix=f"move {link} away, or dump without --latest",
        )
    with contextlib.suppress(FileNotFoundError):
        owner = os.lstat(link).st_uid
        if owner != os.geteuid():
            # In a shared directory that name may be another user's: replacing it is removing
            # their file, and it was never our pointer.
            raise UsageError(
                f"{link} belongs to uid {owner}: not replacing it",
                why="npusnap replaces only a `latest` it made itself",
                fix=f"look at it (ls -l {link}); remove it if it is not wanted, or dump without --latest",
            )
    # A new name nobody could have planted (symlink() fails on an existing one): never an unlink
    # of whatever a user put at a predictable name.
    for _ in range(16):
        tmp = parent / f".{LATEST}.npusnap-tmp-{secrets.token_hex(6)}"
        try:
            os.symlink(image.name, tmp)
            break
        except FileExistsError:
            continue
    else:
        raise UsageError(f"cannot make a temporary name for {link}", fix=f"look at {parent}")
    try:
        os.replace(tmp, link)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return str(link)
