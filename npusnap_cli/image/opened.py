"""What a path given to ``inspect``, ``verify`` or ``restore`` is: one answer, in one place.

A path names one of five kinds of image, told apart by what is in it (never by its name alone).
Each kind is a class of the ``Image`` protocol, and ``KINDS`` lists them in the order
``open_image`` tries them:

* ``K8sJobImage`` (``k8s-job``): a directory written by ``npusnap k8s checkpoint``
  (``npusnap-k8s-job.json`` and one container checkpoint archive per member; k8sjob.py reads it);
* ``ArchiveImage`` (``archive``): a file written by ``npusnap export`` (zstd or a plain tar, its
  first member ``NAME/npusnap.json``; archive.py reads it in place, nothing is unpacked);
* ``ContainerImage`` (``container``): a checkpoint written through npusnap's CRIU plugin by
  podman, CRI-O, containerd or ``criu dump`` (its directory or export archive, containers.py);
* ``JobImage`` (``job``): a job image (``npusnap-job.json``, one image per rank, job.py);
* ``DirectoryImage`` (``directory``): an image directory written by ``npusnap dump`` or
  ``npusnap import``; the kind of last resort, whose manifest read says what is wrong with a
  path that is no image at all.

A ``latest`` pointer (``dump --latest``) is followed once, here, for the two kinds that are
directories of npusnap's (``job``, ``directory``): every later step uses the one real path, so
that what was verified is what is restored. ``open_image`` reads the kind's manifest, so a path
that is none of these (missing, not an image, a damaged manifest) fails here with the
ImageError (exit code 8) that names the problem.

Every kind answers the same calls: ``verify`` (one result type, ``Verified``), ``verify_bytes``
(for a progress bar) and ``refuse_restore`` (the command that does restore a kind ``npusnap
restore`` does not take). ``inspect`` renders each kind its own way (commands/inspect.py, one
renderer per kind in a table keyed by the class).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Optional, Protocol, Union

from npusnap_cli.errors import ImageError, NpusnapError, UsageError
from npusnap_cli.image import archive, containers, integrity, job, k8sjob, layout
from npusnap_cli.image.containers import PluginCheckpoint
from npusnap_cli.image.job import JobManifest
from npusnap_cli.image.manifest import Manifest, load_manifest
from npusnap_cli.jsontypes import JSONObject
from npusnap_cli.units import human_bytes

ProgressFn = Callable[[int], None]


class Kind(str, enum.Enum):
    DIRECTORY = "directory"
    JOB = "job"
    ARCHIVE = "archive"
    CONTAINER = "container"
    K8S_JOB = "k8s-job"


@dataclass(frozen=True)
class Verified:
    """What ``verify`` found, for every kind alike (each raises ImageError on a mismatch).

    ``summary`` is the line ``npusnap verify`` prints, ``record`` its ``--json`` result (each
    kind's own fields), ``leftovers`` what interrupted dumps left beside a directory image,
    ``notes`` the host files a restore writes. ``on_stdout``: the summary is data (a script
    reads it) rather than a message.
    """

    summary: str
    record: JSONObject
    leftovers: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    on_stdout: bool = False


def _what_matched(checksums: bool, signed: bool = False) -> str:
    what = "sizes and checksums" if checksums else "sizes (checksums skipped)"
    return what + (", signature" if signed else "")


class Image(Protocol):
    """An image as ``open_image`` found it. ``path`` is where every later step reads it: for
    ``directory`` and ``job`` the real path (a ``latest`` pointer followed, absolute), for the
    other kinds the path as given; ``pointer`` the ``latest`` pointer it was reached through."""

    kind: ClassVar[Kind]
    what: ClassVar[str]

    @property
    def path(self) -> Path: ...

    @property
    def given(self) -> Path: ...

    @property
    def pointer(self) -> Optional[Path]: ...

    @classmethod
    def detect(cls, given: Path, seen: Seen) -> Optional[OpenedImage]:
        """This kind's image at ``given``, its manifest read; None if ``given`` is not of it."""
        ...

    def verify_bytes(self) -> int:
        """The bytes ``verify`` reads, for a progress bar (0: no bar)."""
        ...

    def verify(
        self,
        *,
        checksums: bool = True,
        require_signature: Optional[Path] = None,
        progress: Optional[ProgressFn] = None,
    ) -> Verified:
        """Check the image; ImageError naming the first problem."""
        ...

    def refuse_restore(self) -> None:
        """Raise, with the command that does restore it, if ``npusnap restore`` does not take it."""
        ...


def _not_signed(image: Image, require_signature: Optional[Path]) -> None:
    """A kind that carries no signature of npusnap's refuses ``--require-signature``: a check
    that was asked for is never skipped in silence."""
    if require_signature is not None:
        raise UsageError(
            f"{image.given} is {image.what}, which `dump --sign` does not sign",
            fix="--require-signature checks image directories and job images; verify this one without it",
        )


def _follow(given: Path, seen: Seen) -> tuple[Path, Optional[Path]]:
    """The real path of an npusnap directory (a ``latest`` pointer followed once, for every kind
    tried), and the pointer it was reached through, if any."""
    if seen.followed is None:
        final = layout.follow_pointer(given)
        seen.followed = (final, given if final != Path(os.path.abspath(given)) else None)
    return seen.followed


@dataclass(frozen=True)
class DirectoryImage:
    kind: ClassVar[Kind] = Kind.DIRECTORY
    what: ClassVar[str] = "an image directory"
    path: Path
    given: Path
    manifest: Manifest
    pointer: Optional[Path] = None

    @classmethod
    def detect(cls, given: Path, seen: Seen) -> Optional[OpenedImage]:
        final, pointer = _follow(given, seen)
        return cls(final, given, load_manifest(final), pointer=pointer)

    def verify_bytes(self) -> int:
        return sum(f.size for f in self.manifest.files)

    def verify(
        self,
        *,
        checksums: bool = True,
        require_signature: Optional[Path] = None,
        progress: Optional[ProgressFn] = None,
    ) -> Verified:
        result = integrity.verify(
            self.path, checksums=checksums, progress=progress, require_signature=require_signature
        )
        return _verified_manifest(self.path, result)

    def refuse_restore(self) -> None:
        return None


def _verified_manifest(path: Path, result: integrity.VerifyResult) -> Verified:
    """An image directory's or archive's result."""
    return Verified(
        summary=(
            f"{path}: valid: {result.files_checked} files, {human_bytes(result.bytes_checked)}: "
            f"{_what_matched(result.checksums, result.signed)} match"
        ),
        record=result.to_dict(),
        leftovers=result.leftovers,
        notes=tuple(
            f"host file {hf.path} ({human_bytes(hf.size)}, {hf.uid}:{hf.gid}, {hf.mode:04o}): "
            "restore writes it"
            for hf in result.manifest.host_files
        ),
        on_stdout=True,
    )


@dataclass(frozen=True)
class ArchiveImage:
    kind: ClassVar[Kind] = Kind.ARCHIVE
    what: ClassVar[str] = "an image archive"
    path: Path
    given: Path
    manifest: Manifest
    pointer: Optional[Path] = None

    @classmethod
    def detect(cls, given: Path, seen: Seen) -> Optional[OpenedImage]:
        if not archive.is_archive(given):
            return None
        try:
            return cls(given, given, archive.load_manifest(given))
        except NpusnapError as err:
            seen.archive_error = err  # perhaps an engine's export archive; if not, this says why
            return None

    def verify_bytes(self) -> int:
        return sum(f.size for f in self.manifest.files)

    def verify(
        self,
        *,
        checksums: bool = True,
        require_signature: Optional[Path] = None,
        progress: Optional[ProgressFn] = None,
    ) -> Verified:
        _not_signed(self, require_signature)
        if progress is None:
            return _verified_manifest(self.path, archive.verify(self.path, checksums=checksums))
        return _verified_manifest(
            self.path, archive.verify(self.path, checksums=checksums, progress=progress)
        )

    def refuse_restore(self) -> None:
        raise ImageError(
            f"{self.given} is an image archive (`npusnap export`), not an image directory",
            why="restore runs CRIU on an image directory; an archive is unpacked and verified first",
            fix=f"npusnap restore --import {self.given} DIR (DIR: a new directory to unpack it into)",
        )


@dataclass(frozen=True)
class JobImage:
    kind: ClassVar[Kind] = Kind.JOB
    what: ClassVar[str] = "a job image"
    path: Path
    given: Path
    job: JobManifest
    pointer: Optional[Path] = None

    @classmethod
    def detect(cls, given: Path, seen: Seen) -> Optional[OpenedImage]:
        final, pointer = _follow(given, seen)
        if not job.is_job_image(final):
            return None
        return cls(final, given, job.load_job_manifest(final), pointer=pointer)

    def verify_bytes(self) -> int:
        return 0

    def verify(
        self,
        *,
        checksums: bool = True,
        require_signature: Optional[Path] = None,
        progress: Optional[ProgressFn] = None,
    ) -> Verified:
        _job, result = job.verify_job(self.path, checksums=checksums, require_signature=require_signature)
        files = sum(r.files_checked for r in result.ranks)
        nbytes = sum(r.bytes_checked for r in result.ranks)
        return Verified(
            summary=(
                f"{self.path}: job of {len(result.ranks)} ranks, every rank's manifest as recorded; "
                f"{files} files, {human_bytes(nbytes)}: {_what_matched(checksums)} match"
            ),
            record=result.to_dict(),
        )

    def refuse_restore(self) -> None:
        return None


@dataclass(frozen=True)
class ContainerImage:
    kind: ClassVar[Kind] = Kind.CONTAINER
    what: ClassVar[str] = "a container checkpoint"
    path: Path
    given: Path
    container: PluginCheckpoint
    pointer: Optional[Path] = None

    @classmethod
    def detect(cls, given: Path, seen: Seen) -> Optional[OpenedImage]:
        if not layout.manifest_path(given).exists():
            ckpt = containers.find(given)
            if ckpt is not None:
                return cls(given, given, ckpt)
        if seen.archive_error is not None:
            raise seen.archive_error
        return None

    def verify_bytes(self) -> int:
        return 0

    def verify(
        self,
        *,
        checksums: bool = True,
        require_signature: Optional[Path] = None,
        progress: Optional[ProgressFn] = None,
    ) -> Verified:
        _not_signed(self, require_signature)
        checked = containers.verify(self.container, checksums=checksums)
        return Verified(
            summary=(
                f"{self.path}: container checkpoint, {checked.files_checked} image files, "
                f"{human_bytes(checked.bytes_checked)}: {_what_matched(checked.checksums)} match the "
                "plugin's record"
            ),
            record=checked.to_dict(),
        )

    def refuse_restore(self) -> None:
        raise ImageError(
            f"{self.given} is a container checkpoint (written through npusnap's CRIU plugin), "
            "not an npusnap image",
            why="a container is restored by its engine, which runs the plugin again at restore",
            fix="restore it with the engine that made it (`podman container restore`, or the "
            "kubelet's restore); `npusnap inspect` and `npusnap verify` read it",
        )


@dataclass(frozen=True)
class K8sJobImage:
    kind: ClassVar[Kind] = Kind.K8S_JOB
    what: ClassVar[str] = "a Kubernetes job checkpoint"
    path: Path
    given: Path
    pointer: Optional[Path] = None

    @classmethod
    def detect(cls, given: Path, seen: Seen) -> Optional[OpenedImage]:
        if (given / layout.K8S_JOB_MANIFEST).is_file():
            return cls(given, given)
        return None

    def verify_bytes(self) -> int:
        return 0

    def verify(
        self,
        *,
        checksums: bool = True,
        require_signature: Optional[Path] = None,
        progress: Optional[ProgressFn] = None,
    ) -> Verified:
        _not_signed(self, require_signature)
        # Always with checksums: a member archive is checked against the sha256 the job recorded.
        res = k8sjob.verify_job(self.path)
        return Verified(
            summary=f"{self.path}: job checkpoint, {res['members']} archives match the job manifest",
            record=res,
        )

    def refuse_restore(self) -> None:
        raise ImageError(
            f"{self.given} is a Kubernetes job checkpoint (`npusnap k8s checkpoint`), not an npusnap image",
            why="its members are container checkpoints, restored by their container engine",
            fix=f"npusnap k8s restore {self.given}",
        )


OpenedImage = Union["DirectoryImage", "ArchiveImage", "JobImage", "ContainerImage", "K8sJobImage"]


class Seen:
    """What the kinds tried before found, for the ones after: a zstd file that is no npusnap
    archive may be an engine's export archive (the container kind, tried next); if it is not
    that either, the archive reader's error is the answer."""

    def __init__(self) -> None:
        self.archive_error: Optional[NpusnapError] = None
        self.followed: Optional[tuple[Path, Optional[Path]]] = None


# The kinds in the order open_image tries them (each class's ``detect``). The order matters where
# two kinds could match: a podman export archive is zstd-compressed like an npusnap archive, so an
# archive is npusnap's only if its first member is a manifest; a directory with an
# ``npusnap.json`` is npusnap's even if a plugin state file is in it too. A new kind goes after
# every kind that would also accept its paths and is more specific, before every kind whose test
# it would also pass; DirectoryImage, which takes any path, stays last.
KINDS: tuple[type[Image], ...] = (K8sJobImage, ArchiveImage, ContainerImage, JobImage, DirectoryImage)


def open_image(path: Path) -> OpenedImage:
    """What ``path`` is (see the module docstring), with its manifest read; ImageError if none."""
    given = Path(path)
    seen = Seen()
    for kind in KINDS:
        found = kind.detect(given, seen)
        if found is not None:
            return found
    raise AssertionError("DirectoryImage.detect answers every path")  # pragma: no cover
