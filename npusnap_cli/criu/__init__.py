"""The CRIU boundary: finding and checking the criu binary, and dump/restore via pycriu.

This is the only module that drives CRIU through pycriu (criuimages.py reads its image files).
pycriu raises exceptions that carry only an errno; the reason is in CRIU's log file, so every call
here sets a log file and failures are turned into ``CriuError`` with the log's relevant lines (see
``log_tail``).

Note (criu-here.md): ``pycriu.criu().check()`` over RPC returns an error with errno 0 on these
machines while ``criu check`` on the command line is fine, so the preflight runs the binary.

The modules, in the order they build on one another: binary.py (find and check CRIU), options.py
(``CriuOptions``), results.py (what a run answers, CRIU's statistics), failures.py (what CRIU's
log says when it failed), session.py (``dump`` and ``restore`` through a ``criu swrk`` of ours),
lazy.py (``LazyPagesDaemon``).
"""

from __future__ import annotations

from npusnap_cli.criu.binary import (
    CriuBinary,
    CriuCheck,
    find_criu,
    inet_sockets_supported,
    kernel_refuses_inet_passcred,
    preload,
    pycriu_version,
    run_criu_check,
)
from npusnap_cli.criu.failures import _criu_error, _known_failure, first_error, log_excerpt
from npusnap_cli.criu.lazy import LAZY_FEATURE, LAZY_SOCKET, LazyPagesDaemon, lazy_pages_supported
from npusnap_cli.criu.options import (
    NETWORK_LOCKS,
    CriuOptions,
    CriuOptionsRecord,
    default_network_lock,
    has_nftables,
)
from npusnap_cli.criu.results import STATS_DUMP_FILE, DumpResult, RestoreResult, load_stats, read_dump_stats
from npusnap_cli.criu.session import (
    PASSTHROUGH_CONFIG,
    SWRK_STARTED,
    _write_passthrough,
    dump,
    open_work_dir,
    restore,
)

__all__ = [
    "LAZY_FEATURE",
    "LAZY_SOCKET",
    "NETWORK_LOCKS",
    "PASSTHROUGH_CONFIG",
    "STATS_DUMP_FILE",
    "SWRK_STARTED",
    "CriuBinary",
    "CriuCheck",
    "CriuOptions",
    "CriuOptionsRecord",
    "DumpResult",
    "LazyPagesDaemon",
    "RestoreResult",
    "_criu_error",
    "_known_failure",
    "_write_passthrough",
    "default_network_lock",
    "dump",
    "find_criu",
    "first_error",
    "has_nftables",
    "inet_sockets_supported",
    "kernel_refuses_inet_passcred",
    "lazy_pages_supported",
    "load_stats",
    "log_excerpt",
    "open_work_dir",
    "preload",
    "pycriu_version",
    "read_dump_stats",
    "restore",
    "run_criu_check",
]
