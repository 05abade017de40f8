"""The CRIU boundary: finding and checking the criu binary, and (below) dump/restore via pycriu.

This is the only module that imports pycriu. pycriu raises exceptions that carry only an errno;
the reason is in CRIU's log file, so every call here sets a log file and failures are turned into
``CriuError`` with the log's relevant lines (see ``log_tail``).

Note (criu-here.md): ``pycriu.criu().check()`` over RPC returns an error with errno 0 on these
machines while ``criu check`` on the command line is fine, so the preflight runs the binary.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from npusnap_cli.errors import PreflightError

CRIU_MIN_VERSION = (4, 0)
# Where setup.sh installs CRIU built from source; searched before $PATH so that a too-old
# distribution criu (Debian 12 ships 3.17, which fails on recent kernels) does not win.
CRIU_SEARCH_PATHS = ("/usr/local/sbin/criu", "/usr/local/bin/criu", "/usr/sbin/criu", "/usr/bin/criu")


@dataclass(frozen=True)
class CriuBinary:
    path: str
    version: str

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return parse_version(self.version)


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def criu_version(path: str) -> Optional[str]:
    """The version a criu binary reports (``criu --version`` prints ``Version: 4.1.1``)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^Version:\s*(\S+)", out, re.MULTILINE)
    return m.group(1) if m else None


def _candidates() -> list[str]:
    seen: list[str] = []
    env = os.environ.get("NPUSNAP_CRIU")
    for path in [env, *CRIU_SEARCH_PATHS, shutil.which("criu")]:
        if path and path not in seen and os.access(path, os.X_OK):
            seen.append(path)
    return seen


def find_criu() -> CriuBinary:
    """The criu binary to use: ``NPUSNAP_CRIU``, /usr/local, then the system's; must be 4.0+."""
    found: list[tuple[str, Optional[str]]] = []
    for path in _candidates():
        version = criu_version(path)
        found.append((path, version))
        if version and parse_version(version) >= CRIU_MIN_VERSION:
            return CriuBinary(path=path, version=version)
    if not found:
        raise PreflightError(
            "CRIU is not installed",
            why="npusnap saves and restores the host side of a process with CRIU 4.0 or newer",
            fix="run ./scripts/setup.sh as root (it builds CRIU 4.1.1 from source), "
            "or set NPUSNAP_CRIU=/path/to/criu",
        )
    listing = ", ".join(f"{p} ({v or 'unknown version'})" for p, v in found)
    raise PreflightError(
        f"CRIU is too old: {listing}",
        why="CRIU before 4.0 fails on recent kernels (e.g. 'vdso: Unexpected rt vDSO area bounds')",
        fix="run ./scripts/setup.sh as root to build and install CRIU 4.1.1 under /usr/local",
    )


def run_criu_check(binary: CriuBinary, timeout: float = 60) -> tuple[bool, str]:
    """Run ``criu check``; return (passed, its output). Needs root to be meaningful."""
    try:
        proc = subprocess.run([binary.path, "check"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"`{binary.path} check` did not finish within {timeout:.0f}s"
    except OSError as exc:
        return False, f"could not run {binary.path}: {exc}"
    text = (proc.stdout + proc.stderr).strip()
    return proc.returncode == 0, text


def pycriu_version() -> Optional[str]:
    """The installed pycriu's version, or None when pycriu cannot be imported."""
    try:
        import pycriu
    except Exception:
        return None
    version = getattr(pycriu, "__version__", None)
    return str(version) if version else "unknown"
