"""``verify``: whether an image directory may be trusted and is complete.

The trust checks (imagetrust.py), the manifest against the files (nothing missing, nothing
unlisted, every size) and against CRIU's process tree (``check_process_tree``), the host files it
would write (hostrecords.py) and every file's checksum (digest.py). A dump runs the same checks
on its image before it reports success (``publish(check=...)``). Archives are verified as they
stream (archive.py), job images rank by rank (job.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criuimages
from npusnap_cli.errors import ImageError
from npusnap_cli.image import digest, hostrecords, imagetrust
from npusnap_cli.image.layout import CRIU_SUBDIR, checksummed_files, criu_dir, temp_siblings
from npusnap_cli.image.manifest import FileEntry, Manifest, ProgressFn, parse_manifest, read_manifest_bytes


@dataclass(frozen=True)
class VerifyResult:
    image: str
    manifest: Manifest
    files_checked: int
    bytes_checked: int
    checksums: bool
    signed: bool = False  # the signature was required and is valid
    leftovers: tuple[str, ...] = ()  # work directories / set-aside images of interrupted dumps

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "ok": True,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "checksums": self.checksums,
            "signed": self.signed,
            "leftovers": list(self.leftovers),
        }


def verification_error(image: Path, problems: list[str]) -> ImageError:
    """The error of an image whose files are not what its manifest lists (problems[0] named)."""
    return ImageError(
        f"image {image} failed verification: {problems[0]}",
        why="the image is truncated, was modified after the dump, or the disk is corrupt",
        fix="do not restore it; dump the process again (or copy the image again from its source)",
        details={"problems": problems},
    )


def read_pstree(criu: Path) -> Optional[list[criuimages.TreeEntry]]:
    """The processes of CRIU's ``pstree.img`` in the images directory ``criu`` (pids of the
    tree's own pid namespace for a `run --pid-ns` job): those CRIU dumped and will restore,
    zombies included. None when it has none."""
    path = criu / "pstree.img"
    try:
        return criuimages.pstree(criu)
    except PermissionError:
        raise  # not a damaged image: the CLI says which permission (or root) is missing
    except (OSError, criuimages.Undecodable) as exc:
        raise ImageError(
            f"cannot read {path}: {exc}",
            why="CRIU's process tree image is damaged",
            fix="do not use this image; dump again",
        ) from None


def check_process_tree(image: Path, manifest: Manifest) -> list[int]:
    """Every pid and thread id CRIU will recreate, from the image's ``pstree.img`` (CRIU restores
    threads with their ids too), once its processes are the manifest's: those of its pid
    namespace for a `run --pid-ns` image, and zombies included. An image without ``pstree.img``
    (not a CRIU dump: the checks of the files then say so) gives the manifest's pids."""
    entries = read_pstree(criu_dir(image))
    if entries is None:
        return sorted(p.pid for p in manifest.processes)
    pids = {e.pid for e in entries}
    ids = sorted(pids | {t for e in entries for t in e.threads})
    listed = {*manifest.pid_ns.values()} if manifest.pid_ns else {p.pid for p in manifest.processes}
    if pids != listed:
        raise ImageError(
            f"the manifest's processes {sorted(listed)} are not the image's {sorted(pids)}",
            why="the manifest was edited, or belongs to another image",
            fix="do not use this image; dump again",
            details={"manifest_pids": sorted(listed), "criu_pids": sorted(pids)},
        )
    return ids


def verify(
    image: Path,
    *,
    checksums: bool = True,
    progress: Optional[ProgressFn] = None,
    require_signature: Optional[Path] = None,
    unpublished: bool = False,
) -> VerifyResult:
    """Check that ``image`` may be trusted and is complete (docs/image-format.md, "Trust model"):
    a real directory of regular files owned by this user or root and writable by nobody else,
    the manifest against its schema and against the files, the signature (with
    ``require_signature``) and, unless ``checksums=False``, every file's checksum.

    ``unpublished``: ``image`` is a dump's work directory, checked before it takes its name.
    Raises ImageError naming the first problem (all problems are in ``details``).
    """
    data = read_manifest_bytes(image, unpublished=unpublished)
    manifest = parse_manifest(image, data)
    imagetrust.check_tree(image)
    imagetrust.check_ownership(image)
    imagetrust.check_manifest(manifest)
    if require_signature is not None:
        imagetrust.check_signature(image, data, require_signature)
    problems: list[str] = []
    if not criu_dir(image).is_dir():
        problems.append(f"{CRIU_SUBDIR}/ is missing")
        raise verification_error(image, problems)
    check_process_tree(image, manifest)
    if not manifest.files:
        problems.append("the manifest lists no files")
    listed = {f.path for f in manifest.files}
    by_path = {f.path: f for f in manifest.files}
    problems += hostrecords.check_host_files(
        manifest.host_files, {p.uid for p in manifest.processes}, manifest.host_nodes
    )
    for hf in manifest.host_files:
        entry = by_path.get(hf.rel)
        if entry is None or (entry.algo, entry.digest, entry.size) != (hf.algo, hf.digest, hf.size):
            problems.append(f"host file {hf.path} does not match its copy {hf.rel} in the manifest")
    for rel in checksummed_files(image):
        if rel not in listed:
            problems.append(f"unexpected file {rel} (not in the manifest)")
    present: list[FileEntry] = []
    for entry in manifest.files:
        full = image / entry.path
        if not full.is_file():
            problems.append(f"{entry.path} is missing")
            continue
        size = full.stat().st_size
        if size != entry.size:
            problems.append(f"{entry.path} has {size} bytes, the manifest says {entry.size}")
            continue
        present.append(entry)
    good = present
    if checksums:
        digests = digest.of_files([(image / e.path, e.algo) for e in present], progress)
        good = [e for e, d in zip(present, digests) if d == e.digest]
        problems += [digest.mismatch(e.path, e.algo) for e, d in zip(present, digests) if d != e.digest]
    checked = len(good)
    nbytes = sum(e.size for e in good)
    if problems:
        raise verification_error(image, problems)
    return VerifyResult(
        image=str(image),
        manifest=manifest,
        files_checked=checked,
        bytes_checked=nbytes,
        checksums=checksums,
        signed=require_signature is not None,
        leftovers=() if unpublished else tuple(str(p) for p in temp_siblings(image)),
    )
