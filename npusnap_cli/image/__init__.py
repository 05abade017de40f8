"""Images on disk: the one model of what a path given to inspect, verify or restore is.

``from npusnap_cli import image`` and then ``image.open(path)``: this facade holds the image
protocol and ``open``, nothing else. opened.py defines them: ``open`` says which kind of image a
path is, as one class per kind of the ``Image`` protocol (``DirectoryImage``, ``JobImage``,
``ArchiveImage``, ``ContainerImage``, ``K8sJobImage``; their union ``OpenedImage``, their ``Kind``;
``KINDS``, in the order they are tried; a ``latest`` pointer followed), each with ``verify`` (one
``Verified`` result) and ``refuse_restore``.

Every other name is imported from the module that owns it (``from npusnap_cli.image import
layout`` and then ``layout.criu_dir``, ``from npusnap_cli.image.manifest import Manifest``):

* layout.py      every name inside an image, the work/set-aside names around it, stale-temp recovery
* manifest.py    ``npusnap.json``: schema, validation, reading and writing
* hostrecords.py the host files, pipes and host nodes a manifest records, and their checks
* publishing.py  checksums, fsync and the atomic rename that makes a work directory an image
* integrity.py   ``verify``: trust, structure, sizes and checksums of an image directory
* job.py         job images (``npusnap-job.json``, one image per rank)

and digest.py, streamhash.py, devchunks.py, imagetrust.py, imagestore.py, archive.py,
containers.py, k8sjob.py, criudetail.py. No module under image/ imports this facade, and nothing
under image/ imports host/, pipelines/ or commands/.
"""

from __future__ import annotations

from npusnap_cli.image.opened import (
    KINDS,
    ArchiveImage,
    ContainerImage,
    DirectoryImage,
    Image,
    JobImage,
    K8sJobImage,
    Kind,
    OpenedImage,
    Verified,
)
from npusnap_cli.image.opened import open_image as open  # image.open(path): reads best in the commands

__all__ = [
    "KINDS",
    "ArchiveImage",
    "ContainerImage",
    "DirectoryImage",
    "Image",
    "JobImage",
    "K8sJobImage",
    "Kind",
    "OpenedImage",
    "Verified",
    "open",
]
