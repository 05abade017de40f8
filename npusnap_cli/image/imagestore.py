"""A directory of images: list them, keep the newest N, and a stable ``latest`` pointer.

An operator's periodic snapshot loop dumps into ``/snaps/<time>`` and wants the last few kept;
a crash-restore script wants the newest image that is whole. This module answers both:

* ``list_images(parent)``: every image directory and archive directly under ``parent``, newest
  first (by the manifest's ``created_at``), each with its size, pids and whether it is valid;
* ``rotate(parent, keep_last)``: removes the oldest *complete npusnap images* beyond the newest
  ``keep_last``. Only what it can identify is touched: a directory (not a symlink) whose
  ``npusnap.json`` parses as a manifest, never a file, an archive, a work area of a running dump
  or anything else. An image is first renamed to a hidden name, then removed, so it never
  appears half-deleted;
* ``update_latest(image)``: the symlink ``<parent>/latest`` -> the image's name, replaced
  atomically (a new symlink renamed over the old one), so a reader sees the old or the new one.

Core module: never prints.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from npusnap_cli.errors import ImageError, UsageError
from npusnap_cli.image import archive, integrity, layout
from npusnap_cli.image.manifest import Manifest, load_manifest

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

    def to_dict(self) -> dict[str, Any]:
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


def _complete_images(parent: Path) -> list[tuple[float, Path]]:
    """(created_at, path) of every complete image directory under ``parent``."""
    out = []
    for entry in parent.iterdir():
        if not _is_candidate_dir(entry):
            continue
        try:
            manifest = load_manifest(entry)
        except ImageError:
            continue  # not something we can identify as a complete image: never touched
        out.append((_epoch(manifest.created_at), entry))
    return sorted(out, key=lambda t: (t[0], t[1].name), reverse=True)


def rotate(parent: Path, keep_last: int, *, keep: Optional[Path] = None) -> list[str]:
    """Remove the oldest complete images under ``parent`` beyond the newest ``keep_last``.

    ``keep`` (the image just written) is never removed, whatever the clocks say, and counts as
    one of the ``keep_last``. Returns the removed paths.
    """
    if keep_last < 1:
        raise UsageError("--keep-last must be at least 1", fix="e.g. --keep-last 3")
    images = _complete_images(parent)
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
    tmp = parent / f".{LATEST}.npusnap-tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(image.name, tmp)
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
