"""The criu binary: found (``find_criu``), checked (``CriuCheck``: `criu check`), and what it can
do on this kernel."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Optional

from npusnap_cli import paths
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
    """The version a criu binary reports (``criu --version`` prints ``Version: 4.2.1``)."""
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
    """The criu binary to use: ``NPUSNAP_CRIU``, /usr/local, then the system's; must be 4.0+.
    ``NPUSNAP_CRIU``, when set, is the only one: one it cannot run is an error, not a reason to
    take another."""
    env = os.environ.get("NPUSNAP_CRIU")
    if env:
        version = criu_version(env) if os.access(env, os.X_OK) else None
        if version and parse_version(version) >= CRIU_MIN_VERSION:
            return CriuBinary(path=env, version=version)
        raise PreflightError(
            f"NPUSNAP_CRIU={env} is not a CRIU 4.0 or newer that runs here"
            + (f" (it is {version})" if version else ""),
            why="when NPUSNAP_CRIU is set, npusnap uses that CRIU and no other",
            fix="point NPUSNAP_CRIU at a criu binary of version 4.0 or newer, or unset it",
            details={"npusnap_criu": env, "version": version},
        )
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
            fix=(
                "run ./scripts/setup.sh as root (it builds CRIU 4.2.1 from source), "
                if paths.is_checkout()
                else "install CRIU 4.0 or newer (4.2+ on kernels 6.16 and newer) from the distribution or "
                "from source, "
            )
            + "or set NPUSNAP_CRIU=/path/to/criu",
        )
    listing = ", ".join(f"{p} ({v or 'unknown version'})" for p, v in found)
    raise PreflightError(
        f"CRIU is too old: {listing}",
        why="CRIU before 4.0 fails on recent kernels (e.g. 'vdso: Unexpected rt vDSO area bounds')",
        fix="run ./scripts/setup.sh as root to build and install CRIU 4.2.1 under /usr/local"
        if paths.is_checkout()
        else "install CRIU 4.0 or newer (4.2+ on kernels 6.16 and newer), or set NPUSNAP_CRIU=/path/to/criu",
    )


def run_criu_check(binary: CriuBinary, timeout: float = 60) -> tuple[bool, str]:
    """Run ``criu check``; return (passed, its output). Needs root to be meaningful."""
    return CriuCheck(binary).result(timeout)


class CriuCheck:
    """``criu check`` started now and read later, so that a command does other work while it
    runs (tens of milliseconds). ``result`` waits for it; ``cancel`` kills it if it is not wanted."""

    def __init__(self, binary: CriuBinary) -> None:
        self.binary = binary
        self.error: Optional[str] = None
        self.proc: Optional[subprocess.Popen[str]] = None
        try:
            # Its own session: a Ctrl-C meant for the command must not fail the check instead.
            self.proc = subprocess.Popen(
                [binary.path, "check"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            self.error = f"could not run {binary.path}: {exc}"

    def result(self, timeout: float = 60) -> tuple[bool, str]:
        """(passed, its output)."""
        if self.proc is None:
            return False, self.error or "criu check did not start"
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            return False, f"`{self.binary.path} check` did not finish within {timeout:.0f}s"
        return self.proc.returncode == 0, (out or "").strip()

    def cancel(self, timeout: float = 5) -> None:
        """The answer is not wanted (the command failed before it): let the check end on its own
        (it takes a tenth of a second), killing it only if it does not. Killing criu alone would
        leave the helpers it forks holding its output pipe open, and this wait with them."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()

    def _kill(self) -> None:
        """Kill criu check with every process it forked (its own session: one process group)."""
        assert self.proc is not None
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def preload() -> None:
    """Import pycriu (protobuf and CRIU's image descriptors: tens of milliseconds) ahead of the CRIU step,
    from a thread while the command waits for something else. A failure is left for the step
    itself to report."""
    try:
        import pycriu  # noqa: F401
    except Exception:
        pass


def pycriu_version() -> Optional[str]:
    """The installed pycriu's version, or None when pycriu cannot be imported."""
    try:
        import pycriu
    except Exception:
        return None
    version = getattr(pycriu, "__version__", None)
    return str(version) if version else "unknown"


# --------------------------------------------------------------------------------------------
# What this CRIU can do on this kernel
# --------------------------------------------------------------------------------------------

INET_SOCKETS_MIN_VERSION = (4, 2)


def kernel_refuses_inet_passcred() -> bool:
    """True on kernels (6.16+) that refuse getsockopt(SO_PASSCRED) on a TCP/UDP socket."""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED)
    except OSError as exc:
        return exc.errno == errno.EOPNOTSUPP
    return False


def inet_sockets_supported(binary: CriuBinary) -> bool:
    """Can this CRIU dump TCP/UDP sockets here? CRIU < 4.2 fails on every one on 6.16+ kernels."""
    return binary.version_tuple >= INET_SOCKETS_MIN_VERSION or not kernel_refuses_inet_passcred()
