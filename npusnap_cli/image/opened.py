"""What a path given to ``inspect``, ``verify`` or ``restore`` is: one answer, in one place.

A path names one of five kinds of image, told apart by what is in it (never by its name alone):

* ``k8s-job``: a directory written by ``npusnap k8s checkpoint`` (``npusnap-k8s-job.json`` and
  one container checkpoint archive per member; k8s/jobcheckpoint.py reads it);
* ``archive``: a file written by ``npusnap export`` (zstd or a plain tar, its first member
  ``NAME/npusnap.json``; archive.py reads it in place, nothing is unpacked);
* ``container``: a checkpoint written through npusnap's CRIU plugin by podman, CRI-O, containerd
  or ``criu dump`` (its directory or export archive, containers.py);
* ``job``: a job image (``npusnap-job.json``, one image per rank, job.py);
* ``directory``: an image directory written by ``npusnap dump`` or ``npusnap import``.

A ``latest`` pointer (``dump --latest``) is followed once, here, for the two kinds that are
directories of npusnap's (``job``, ``directory``): every later step uses the one real path, so
that what was verified is what is restored. ``open_image`` reads the kind's manifest, so a path
that is none of these (missing, not an image, a damaged manifest) fails here with the
ImageError (exit code 8) that names the problem.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli.errors import ImageError, NpusnapError
from npusnap_cli.image import archive, containers, job, layout
from npusnap_cli.image.containers import PluginCheckpoint
from npusnap_cli.image.job import JobManifest
from npusnap_cli.image.manifest import Manifest, load_manifest


class Kind(str, enum.Enum):
    DIRECTORY = "directory"
    JOB = "job"
    ARCHIVE = "archive"
    CONTAINER = "container"
    K8S_JOB = "k8s-job"


_WHAT = {
    Kind.DIRECTORY: "an image directory",
    Kind.JOB: "a job image",
    Kind.ARCHIVE: "an image archive",
    Kind.CONTAINER: "a container checkpoint",
    Kind.K8S_JOB: "a Kubernetes job checkpoint",
}


@dataclass(frozen=True)
class OpenedImage:
    """An image as ``open_image`` found it: its kind, where to read it, and its manifest.

    ``path`` is where every later step reads it: for ``directory`` and ``job`` the real path (a
    ``latest`` pointer followed, absolute), for the other kinds the path as given. ``manifest``
    is set for ``directory`` and ``archive``, ``job`` (the job manifest) for ``job``,
    ``container`` (the plugin's record) for ``container``; a ``k8s-job`` carries only its path.
    """

    kind: Kind
    path: Path
    given: Path
    manifest: Optional[Manifest] = None
    job: Optional[JobManifest] = None
    container: Optional[PluginCheckpoint] = None
    pointer: Optional[Path] = None  # the `latest` pointer it was reached through, if any

    def require_manifest(self) -> Manifest:
        """The manifest of a ``directory`` or ``archive`` image."""
        if self.manifest is None:
            raise self._not("an npusnap image directory or archive")
        return self.manifest

    def require_job(self) -> JobManifest:
        """The job manifest of a ``job`` image."""
        if self.job is None:
            raise self._not("a job image")
        return self.job

    def require_container(self) -> PluginCheckpoint:
        """The plugin's record of a ``container`` checkpoint."""
        if self.container is None:
            raise self._not("a container checkpoint")
        return self.container

    def _not(self, what: str) -> ImageError:
        return ImageError(
            f"{self.given} is not {what}: it is {_WHAT[self.kind]}",
            fix="`npusnap inspect` shows what it is; pass the kind of image this command takes",
        )

    def require_restorable(self) -> None:
        """Refuse, with the command that does restore it, a kind ``npusnap restore`` does not take."""
        if self.kind is Kind.ARCHIVE:
            raise ImageError(
                f"{self.given} is an image archive (`npusnap export`), not an image directory",
                why="restore runs CRIU on an image directory; an archive is unpacked and verified first",
                fix=f"npusnap restore --import {self.given} DIR (DIR: a new directory to unpack it into)",
            )
        if self.kind is Kind.CONTAINER:
            raise ImageError(
                f"{self.given} is a container checkpoint (written through npusnap's CRIU plugin), "
                "not an npusnap image",
                why="a container is restored by its engine, which runs the plugin again at restore",
                fix="restore it with the engine that made it (`podman container restore`, or the "
                "kubelet's restore); `npusnap inspect` and `npusnap verify` read it",
            )
        if self.kind is Kind.K8S_JOB:
            raise ImageError(
                f"{self.given} is a Kubernetes job checkpoint (`npusnap k8s checkpoint`), "
                "not an npusnap image",
                why="its members are container checkpoints, restored by their container engine",
                fix=f"npusnap k8s restore {self.given}",
            )


def open_image(path: Path) -> OpenedImage:
    """What ``path`` is (see the module docstring), with its manifest read; ImageError if none.

    The order matters where two kinds could match: a podman export archive is zstd-compressed
    like an npusnap archive, so an archive is npusnap's only if its first member is a manifest;
    a directory with an ``npusnap.json`` is npusnap's even if a plugin state file is in it too.
    """
    given = Path(path)
    if (given / layout.K8S_JOB_MANIFEST).is_file():
        return OpenedImage(Kind.K8S_JOB, given, given)
    archive_error: Optional[NpusnapError] = None
    if archive.is_archive(given):
        try:
            return OpenedImage(Kind.ARCHIVE, given, given, manifest=archive.load_manifest(given))
        except NpusnapError as err:
            archive_error = err  # perhaps an engine's export archive; if not, this says why
    if not layout.manifest_path(given).exists():
        ckpt = containers.find(given)
        if ckpt is not None:
            return OpenedImage(Kind.CONTAINER, given, given, container=ckpt)
    if archive_error is not None:
        raise archive_error
    final = layout.follow_pointer(given)
    pointer = given if final != Path(os.path.abspath(given)) else None
    if job.is_job_image(final):
        return OpenedImage(Kind.JOB, final, given, job=job.load_job_manifest(final), pointer=pointer)
    return OpenedImage(Kind.DIRECTORY, final, given, manifest=load_manifest(final), pointer=pointer)
