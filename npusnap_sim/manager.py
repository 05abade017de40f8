"""Build, start, stop and query the simulated NPU (the daemon and its fake CANN tree).

Used by ``npusnap sim``, the demo and the test fixtures. ``start`` is idempotent and safe when
several callers race (an flock on a lock file next to the socket; a live daemon is detected by
talking to it, never by a pid file). The daemon runs detached, logging next to its socket.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from npusnap_cli import paths
from npusnap_cli.errors import PreflightError
from npusnap_cli.host import procfs
from npusnap_sim import wire

GiB = 1 << 30
DEFAULT_DEVICES = 2
DEFAULT_CAPACITY = 4 * GiB
START_TIMEOUT_S = 15.0
LOG_NAME = "npusim.log"

CANN_OUTPUTS = (
    Path("lib64") / "libascend_hal.so",
    Path("lib64") / "libruntime.so",
    Path("lib64") / "libacl_rt.so",
    Path("lib64") / "libascendcl.so",
    Path("lib64") / "libacl_op_compiler.so",
    Path("share") / "info" / "runtime" / "version.info",
    Path("share") / "info" / "ascend_toolkit_install.info",
    Path("set_env.sh"),
)


def _sources() -> Iterator[Path]:
    src = paths.native_src_dir()
    yield src / "Makefile"
    for sub in ("npusim", "agent", "include/npusnap"):
        if (src / sub).is_dir():
            yield from (p for p in (src / sub).iterdir() if p.is_file())


def needs_build() -> bool:
    home = paths.sim_cann_home()
    outs = [home / p for p in CANN_OUTPUTS] + [paths.build_dir() / "agent" / "libnpusnap_agent.so"]
    if not all(p.exists() for p in outs):
        return True
    oldest = min(p.stat().st_mtime for p in outs)
    return any(s.stat().st_mtime > oldest for s in _sources())


def ensure_built() -> Path:
    """Build the simulator (``make -C native``) if its outputs are missing or older than the sources.

    Returns the fake CANN home.
    """
    home = paths.sim_cann_home()
    if not paths.native_src_dir().joinpath("npusim").is_dir():
        if all((home / p).exists() for p in CANN_OUTPUTS):
            return home  # an installed package without sources, built beforehand
        raise PreflightError(
            "the simulated NPU is not built and its sources are missing",
            why=f"neither {home} nor {paths.native_src_dir() / 'npusim'} exists",
            fix="run ./scripts/setup.sh from a source checkout",
        )
    if needs_build():
        proc = subprocess.run(
            ["make", "-C", str(paths.native_src_dir()), f"BUILD={paths.build_dir()}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise PreflightError(
                "building the simulated NPU failed",
                why=f"make -C native exited with {proc.returncode}",
                fix="install a C compiler and make (apt-get install build-essential), then rerun",
                details={"make output": proc.stdout.splitlines()[-20:]},
            )
    return home


def socket_path() -> Path:
    return paths.sim_socket_path()


def log_path() -> Path:
    return socket_path().parent / LOG_NAME


def env() -> Dict[str, str]:
    """The variables a program needs to use the simulated NPU (like sourcing set_env.sh)."""
    home = paths.sim_cann_home()
    arch = os.uname().machine
    libdirs = [str(home / "lib64"), str(home / f"{arch}-linux" / "lib64")]
    old = os.environ.get("LD_LIBRARY_PATH", "")
    kept = [p for p in old.split(":") if p and p not in libdirs]
    return {
        "ASCEND_HOME_PATH": str(home),
        # torch_npu refuses to import without it when ASCEND_HOME_PATH is set (as set_env.sh sets it)
        "ASCEND_OPP_PATH": str(home / "opp"),
        "LD_LIBRARY_PATH": ":".join(libdirs + kept),
        "NPUSIM_SOCKET": str(socket_path()),
    }


def status() -> Dict[str, Any]:
    """``{"running": bool, "socket", "log", ...daemon status document when running}``."""
    sock = socket_path()
    base: Dict[str, Any] = {"running": False, "socket": str(sock), "log": str(log_path())}
    try:
        doc = wire.query_status(str(sock), timeout=5.0)
    except (OSError, ConnectionError, ValueError):
        return base
    base.update(doc)
    base["running"] = True
    return base


def _lock(sock: Path) -> int:
    sock.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(str(sock) + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def start(
    devices: int = DEFAULT_DEVICES,
    capacity_bytes: int = DEFAULT_CAPACITY,
    bandwidth_mbps: Optional[float] = None,
    keep_contents: bool = False,
    driver_snapshot: bool = False,
    driver_version: int = 1,
    fault: Optional[str] = None,
) -> Dict[str, Any]:
    """Build if needed and start the daemon unless one already answers. Returns its status plus
    ``started`` (False when one was already running; its configuration is then left as it is).

    ``keep_contents`` makes Restore bring back allocation contents, which CANN's Restore does not
    do: only for experiments with a future driver; the demo, tests and benchmarks never use it.
    ``fault``: the daemon's NPUSIM_NODE_FAULT (None: this process's, if set), a node that breaks
    one of npusnap's assumptions on purpose (docs/simulator.md, "Faults of the node")."""
    if devices < 1 or devices > 64:
        raise PreflightError(f"--devices must be between 1 and 64, not {devices}", fix="pick 1..64")
    if capacity_bytes < 1:
        raise PreflightError("--capacity must be positive", fix="e.g. --capacity 4GiB")
    ensure_built()
    sock = socket_path()
    lock_fd = _lock(sock)
    try:
        current = status()
        if current["running"]:
            current["started"] = False
            return current
        log = log_path()
        cmd = [sys.executable, "-m", "npusnap_sim.daemon", "--socket", str(sock)]
        cmd += ["--devices", str(devices), "--capacity", str(capacity_bytes)]
        if bandwidth_mbps:
            cmd += ["--bandwidth-mbps", str(bandwidth_mbps)]
        if keep_contents:
            cmd += ["--keep-contents"]
        if driver_snapshot:
            cmd += ["--driver-snapshot"]
        if driver_version != 1:
            cmd += ["--driver-version", str(driver_version)]
        child_env = dict(os.environ)
        if fault is not None:
            child_env[wire.NODE_FAULT_ENV] = fault
        pkg_parent = str(Path(__file__).resolve().parent.parent)  # holds npusnap_sim and npusnap_cli
        child_env["PYTHONPATH"] = pkg_parent + (
            ":" + child_env["PYTHONPATH"] if child_env.get("PYTHONPATH") else ""
        )
        with open(log, "ab") as logf:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,  # detached: survives the CLI and its terminal
                close_fds=True,
                env=child_env,
                cwd="/",
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            current = status()
            if current["running"]:
                current["started"] = True
                return current
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = log.read_text(errors="replace").splitlines()[-10:] if log.exists() else []
        if proc.poll() is None:
            proc.kill()
        raise PreflightError(
            "the simulated NPU daemon did not start",
            why=f"no answer on {sock} within {START_TIMEOUT_S:.0f} s",
            fix=f"read {log}; remove a stale {sock} if nothing runs there",
            details={"log": str(log), "log tail": tail},
        )
    finally:
        os.close(lock_fd)


def stop(timeout_s: float = 10.0) -> bool:
    """Stop the daemon; True if one was running. Device memory of live processes is lost."""
    sock = socket_path()
    lock_fd = _lock(sock)
    try:
        current = status()
        if not current["running"]:
            return False
        pid = int(current["daemon_pid"])
        try:
            with wire.connect(str(sock), 5.0) as s:
                wire.request(s, wire.OP_SHUTDOWN)
        except (OSError, ConnectionError):
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not procfs.is_alive(pid):
                return True
            time.sleep(0.05)
        os.kill(pid, 15)
        time.sleep(0.5)
        if procfs.is_alive(pid):
            raise PreflightError(
                f"the simulated NPU daemon (pid {pid}) did not stop",
                fix=f"kill {pid}",
            )
        return True
    finally:
        os.close(lock_fd)
