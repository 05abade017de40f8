"""The restore pipeline: verify the image, CRIU restore (detached), then Restore + Unlock each NPU process.

design.md §4, in order:

1. verify, before anything is touched: manifest schema, checksums (unless ``verify=False``),
   the same CRIU and CANN as at dump time, every pid of the image free, every device free
   (the host's NPU users found in /proc, and their agents asked which devices they hold);
2. pre-create the agent socket directories (0700): CRIU restores a listening socket only if
   its directory exists;
3. CRIU restore through pycriu, detached: the tree is reparented to init, not to npusnap;
4. per NPU process, in parallel: connect to its agent, Restore, run the post-restore hooks,
   Unlock. A process whose step fails stays locked (never half-running) and the error names
   the pid, the step, and how to go on (`npusnap status PID`, `npusnap thaw PID`).

With ``lazy`` (``restore --lazy``) step 3 is CRIU's lazy restore and the page files' checksums
run while the job already computes; lazypages.py supervises that phase until every page is in.
The device-memory files (``device/``) are hashed on a thread of their own that runs on into step
4: each agent Restores meanwhile and Unlocks (which loads them into the device) only after they
matched; a mismatch kills the tree with its device memory never loaded (docs/image-format.md).

The steps (``STEPS``, run by pipelines/engine.py) share a ``RestoreState``; the job restore
(jobsnap/) runs the same steps once per rank, with barriers between them. ``preflight`` is the
one call that checks an image before anything is touched: restore, ``restore --dry-run``
(restorecheck.py) and the job restore all use it.

Core module: returns a frozen dataclass, never prints.

The modules, in the order they build on one another: options.py (what the restore is asked and
answers), checks.py (``CHECKS``, ``preflight``), tree.py (CRIU's options, --pipe-to, the watch
after the resume), verify.py (the checksums alongside), state.py (``RestoreState``), agents.py
(Restore + Unlock of the NPU processes), steps.py (``STEPS``, ``restore``).
"""

from __future__ import annotations

from npusnap_cli.pipelines.restore.agents import rebuild_communicators
from npusnap_cli.pipelines.restore.checks import (
    CHECKS,
    ZOMBIE_WAIT_S,
    Check,
    Preflight,
    _group_ids_in_use,
    check_devices_free,
    check_pids_free,
    device_users,
    image_thread_ids,
    preflight,
    prepare_sockets,
)
from npusnap_cli.pipelines.restore.options import RestoreCallbacks, RestoreOptions
from npusnap_cli.pipelines.restore.state import Checked, RestoreState
from npusnap_cli.pipelines.restore.steps import (
    CRIU_RESTORE,
    DEVICE_VIEW,
    HOST_NODES,
    LAZY_DAEMON,
    OPEN_FILES,
    PID_NS_VIEW,
    PREFLIGHT,
    PUT_BACK,
    RELEASE,
    STEPS,
    STOP_GUARD,
    VERIFY,
    restore,
    settle,
)
from npusnap_cli.pipelines.restore.tree import become_subreaper

__all__ = [
    "CHECKS",
    "CRIU_RESTORE",
    "DEVICE_VIEW",
    "HOST_NODES",
    "LAZY_DAEMON",
    "OPEN_FILES",
    "PID_NS_VIEW",
    "PREFLIGHT",
    "PUT_BACK",
    "RELEASE",
    "STEPS",
    "STOP_GUARD",
    "VERIFY",
    "ZOMBIE_WAIT_S",
    "Check",
    "Checked",
    "Preflight",
    "RestoreCallbacks",
    "RestoreOptions",
    "RestoreState",
    "_group_ids_in_use",
    "become_subreaper",
    "check_devices_free",
    "check_pids_free",
    "device_users",
    "image_thread_ids",
    "preflight",
    "prepare_sockets",
    "rebuild_communicators",
    "restore",
    "settle",
]
