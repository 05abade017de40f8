"""Host resources of a process tree that a plain CRIU image does not carry safely.

CRIU saves a tree's memory, fds and sockets, but three kinds of things a real job holds break
it, some only after a restore that said "ok" (criu-here.md, November 2026):

* **pipes and terminals to a process outside the tree** (``train.py | tee log``): CRIU dumps
  the pipe and re-creates it at restore with no reader, and the job dies of SIGPIPE a moment
  later. ``find_external_stdio`` finds them so that dump can refuse (or record them, for restore
  to hand the job a new fd through CRIU's ``--inherit-fd``).
* **files on tmpfs** (``/dev/shm`` segments of ``multiprocessing.shared_memory``, a tmpfs
  ``/tmp``): CRIU records only their path; the bytes must be there, unchanged, at restore.
  ``find_tmpfs_files`` lists them; dump copies them into the image while the tree is frozen and
  restore puts them back (or refuses when a different file is in the way).
* deleted files still open (spawn-pool semaphores in ``/dev/shm``) are handled by CRIU's
  link-remap, which npusnap turns on by default (see criu.CriuOptions): CRIU hard-links each one
  as ``link_remap.N`` next to it and its restore opens that name. Left on the host, those files
  are lost when a ``--leave-running`` dump ends (CRIU deletes them then), do not travel with the
  image to another node, and make a later dump whose ids match fail ("Can't link remap ...: File
  exists"). So dump saves them into the image like tmpfs files (``link_remaps``, ``remap=True``),
  removes them from the host, and restore puts them back only for CRIU's restore.

Read-only /proc inspection here; copying and putting back are in ``save_files``/``put_back``.

The modules: procfds.py (the descriptors /proc shows), stdio.py (pipes and terminals), files.py
(tmpfs, locked and link-remap files), nodes.py (directories and FIFOs), listeners.py (unix
listeners a restore would take).
"""

from __future__ import annotations

from npusnap_cli.host.hostres.files import (
    absent,
    check_put_back,
    drop_remaps,
    find_locked_files,
    find_tmpfs_files,
    leases_unreadable,
    link_remaps,
    planned_files,
    put_back,
    remove_copies,
    save_files,
)
from npusnap_cli.host.hostres.listeners import check_listeners_free, image_listeners, live_listeners
from npusnap_cli.host.hostres.nodes import (
    _fifos,
    bound_unix_paths,
    check_host_nodes,
    find_host_nodes,
    make_host_nodes,
    remove_host_nodes,
)
from npusnap_cli.host.hostres.stdio import external_stdio_error, find_external_stdio, stray_pipes

# The records themselves (their JSON form and validation) belong to the image model.
from npusnap_cli.image.hostrecords import ExternalStdio, HostFile, HostNode, check_host_files, tmpfs_mounts

__all__ = [
    "ExternalStdio",
    "HostFile",
    "HostNode",
    "_fifos",
    "absent",
    "bound_unix_paths",
    "check_host_files",
    "check_host_nodes",
    "check_listeners_free",
    "check_put_back",
    "drop_remaps",
    "external_stdio_error",
    "find_external_stdio",
    "find_host_nodes",
    "find_locked_files",
    "find_tmpfs_files",
    "image_listeners",
    "leases_unreadable",
    "link_remaps",
    "live_listeners",
    "make_host_nodes",
    "planned_files",
    "put_back",
    "remove_copies",
    "remove_host_nodes",
    "save_files",
    "stray_pipes",
    "tmpfs_mounts",
]
