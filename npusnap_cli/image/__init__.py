"""Images on disk: the one model of what a path given to inspect, verify or restore is.

``from npusnap_cli import image`` and then ``image.X``: this facade re-exports the names the rest
of npusnap uses; each lives in the module that owns it:

* layout.py      every name inside an image, the work/set-aside names around it, stale-temp recovery
* manifest.py    ``npusnap.json``: schema, validation, reading and writing
* hostrecords.py the host files, pipes and host nodes a manifest records, and their checks
* publishing.py  checksums, fsync and the atomic rename that makes a work directory an image
* integrity.py   ``verify``: trust, structure, sizes and checksums of an image directory
* job.py         job images (``npusnap-job.json``, one image per rank)
* opened.py      ``open``: which kind of image a path is, as one class per kind of the ``Image``
                 protocol (``KINDS``, in the order they are tried; a ``latest`` pointer followed),
                 each with ``verify`` (one ``Verified`` result) and ``refuse_restore``

and digest.py, streamhash.py, imagetrust.py, imagestore.py, archive.py, containers.py,
k8sjob.py, criudetail.py. Nothing under image/ imports host/, pipelines/ or commands/.
"""

from __future__ import annotations

from npusnap_cli.image import digest
from npusnap_cli.image.integrity import (
    VerifyResult,
    check_process_tree,
    read_pstree,
    verification_error,
    verify,
)
from npusnap_cli.image.layout import (
    CHECKSUMMED_SUBDIRS,
    CRIU_SUBDIR,
    DEVICE_SUBDIR,
    DIR_MODE,
    DUMP_LOG,
    FAILED_LOGS_SUFFIX,
    FILE_MODE,
    HOSTFILES_SUBDIR,
    LOGS_SUBDIR,
    MANIFEST_NAME,
    OLD_MARKER,
    RESTORE_LOG,
    TMP_MARKER,
    Leftover,
    check_dump_target,
    create_temp_image,
    criu_dir,
    device_memory_rel,
    dir_is_empty,
    failed_logs_dir,
    follow_pointer,
    free_bytes,
    is_temp_name,
    leftovers_hint,
    logs_dir,
    manifest_path,
    remove_stale_temps,
    remove_tree,
    temp_siblings,
    tree_size,
)
from npusnap_cli.image.manifest import (
    SCHEMA_VERSION,
    SELF_HASH_KEY,
    ByteCounts,
    FileEntry,
    HostInfo,
    Manifest,
    ProcessEntry,
    ProgressFn,
    Timings,
    Versions,
    _self_hash,
    load_manifest,
    now_iso,
    open_device_memory_files,
    read_manifest_bytes,
    write_manifest,
)
from npusnap_cli.image.opened import (
    ArchiveImage,
    ContainerImage,
    DirectoryImage,
    Image,
    JobImage,
    K8sJobImage,
    Kind,
    OpenedImage,
    Verified,
    open_image,
)
from npusnap_cli.image.publishing import (
    crash_point,
    file_entries,
    fsync_tree,
    publish,
    rename_exchange,
    seal_modes,
    stop_point,
)

# `image.open(path)`: the name the commands read best; the module's own name avoids the builtin.
open = open_image

__all__ = [
    "CHECKSUMMED_SUBDIRS",
    "CRIU_SUBDIR",
    "DEVICE_SUBDIR",
    "DIR_MODE",
    "DUMP_LOG",
    "FAILED_LOGS_SUFFIX",
    "FILE_MODE",
    "HOSTFILES_SUBDIR",
    "LOGS_SUBDIR",
    "MANIFEST_NAME",
    "OLD_MARKER",
    "RESTORE_LOG",
    "SCHEMA_VERSION",
    "SELF_HASH_KEY",
    "TMP_MARKER",
    "ArchiveImage",
    "ByteCounts",
    "ContainerImage",
    "DirectoryImage",
    "FileEntry",
    "HostInfo",
    "Image",
    "JobImage",
    "K8sJobImage",
    "Kind",
    "Leftover",
    "Manifest",
    "OpenedImage",
    "ProcessEntry",
    "ProgressFn",
    "Timings",
    "Verified",
    "VerifyResult",
    "Versions",
    "_self_hash",
    "check_dump_target",
    "check_process_tree",
    "crash_point",
    "create_temp_image",
    "criu_dir",
    "device_memory_rel",
    "digest",
    "dir_is_empty",
    "failed_logs_dir",
    "file_entries",
    "follow_pointer",
    "free_bytes",
    "fsync_tree",
    "is_temp_name",
    "leftovers_hint",
    "load_manifest",
    "logs_dir",
    "manifest_path",
    "now_iso",
    "open",
    "open_device_memory_files",
    "open_image",
    "publish",
    "read_manifest_bytes",
    "read_pstree",
    "remove_stale_temps",
    "remove_tree",
    "rename_exchange",
    "seal_modes",
    "stop_point",
    "temp_siblings",
    "tree_size",
    "verification_error",
    "verify",
    "write_manifest",
]
