"""Host preflight: can this machine dump and restore NPU processes? (`npusnap check`)

Each check yields a ``CheckItem`` with a status, what was found and, for problems, how to fix
it. ``ready`` is true when nothing blocks dump and restore. The dump/restore pipelines reuse the
individual checks (``check_criu`` etc.) for their own preflight.

The modules: items.py (``CheckItem``, ``CheckReport``), criucheck.py (CRIU), privileges.py,
plugins.py (the CRIU plugins for the device handles), checks.py (CANN, session, runtime directory,
debris; ``run_checks``), fds.py (descriptors CRIU cannot dump).
"""

from __future__ import annotations

from npusnap_cli.host.preflight.checks import check_debris, check_session, run_checks
from npusnap_cli.host.preflight.criucheck import lazy_pages_item
from npusnap_cli.host.preflight.fds import (
    _torch_store_threads,
    criu_has_libbpf,
    find_undumpable_fds,
    undumpable_fds_error,
)
from npusnap_cli.host.preflight.items import INFO, OK, PROBLEM, WARNING
from npusnap_cli.host.preflight.plugins import check_npu_plugin, check_npu_plugin_abi, find_npu_plugin
from npusnap_cli.host.preflight.privileges import (
    CAP_SYS_RESOURCE,
    check_privileges,
    effective_capabilities,
    other_user_problem,
    require_privileges,
)

__all__ = [
    "CAP_SYS_RESOURCE",
    "INFO",
    "OK",
    "PROBLEM",
    "WARNING",
    "_torch_store_threads",
    "check_debris",
    "check_npu_plugin",
    "check_npu_plugin_abi",
    "check_privileges",
    "check_session",
    "criu_has_libbpf",
    "effective_capabilities",
    "find_npu_plugin",
    "find_undumpable_fds",
    "lazy_pages_item",
    "other_user_problem",
    "require_privileges",
    "run_checks",
    "undumpable_fds_error",
]
