"""What the report says about the machine and the versions it ran on."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

from npusnap_cli import __version__, paths
from npusnap_cli import acl as acl_mod
from npusnap_cli import criu as criu_mod

# --------------------------------------------------------------------------------------------
# Machine and versions
# --------------------------------------------------------------------------------------------


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def machine_info(work: Path) -> dict[str, str]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in read_text("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    pretty = next(
        (
            ln.split("=", 1)[1].strip('"')
            for ln in read_text("/etc/os-release").splitlines()
            if ln.startswith("PRETTY_NAME=")
        ),
        "unknown",
    )
    debian = read_text("/etc/debian_version").strip()
    fs = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        fs = subprocess.run(
            ["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", str(work)],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    disk = fs.split()[0] if fs.split() else ""
    rota = (
        read_text(f"/sys/block/{Path(disk).name}/queue/rotational").strip()
        if disk.startswith("/dev/")
        else ""
    )
    model = (
        read_text(f"/sys/block/{Path(disk).name}/device/model").strip() if disk.startswith("/dev/") else ""
    )
    kind = {"0": "reports non-rotational", "1": "reports rotational"}.get(rota, "type unknown")
    virt = " (virtio disk of a VM)" if Path(disk).name.startswith("vd") else ""
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "ram": f"{(mem_total() or 0) / (1 << 30):.1f} GiB",
        "kernel": platform.release(),
        "os": f"{pretty} (debian_version {debian})" if debian else pretty,
        "image_fs": f"{fs}; {kind}{virt}" + (f", model {model}" if model else ""),
        "image_dir": str(work.parent),
        "free page reporting": free_page_reporting(),
    }


def versions(criu: criu_mod.CriuBinary) -> dict[str, str]:
    cann = acl_mod.find_cann(str(paths.sim_cann_home()))
    return {
        "npusnap": __version__,
        "criu": f"{criu.version} ({criu.path})",
        "CRIU kernel probe cache": kerndat_cache(criu.path),
        "pycriu": criu_mod.pycriu_version() or "not installed",
        "python": f"{platform.python_version()} ({sys.executable})",
        "cann": f"{cann.version} ({'simulated NPU, ' if cann.simulated else ''}{cann.home})",
    }


def _meminfo(key: str) -> Optional[int]:
    for line in read_text("/proc/meminfo").splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return None


def mem_available() -> Optional[int]:
    return _meminfo("MemAvailable")


def mem_free() -> Optional[int]:
    return _meminfo("MemFree")


def mem_total() -> Optional[int]:
    return _meminfo("MemTotal")


def _fstype(path: str, exact: bool = False) -> str:
    """The filesystem type at ``path`` (``exact``: only where ``path`` is itself a mount point)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ["findmnt", "-n", "-o", "FSTYPE", *([] if exact else ["-T"]), path],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    return ""


KDAT_DIR = "/run/npusnap-criu"  # scripts/setup.sh: where CRIU keeps kerndat where /run is no tmpfs


def kerndat_cache(criu_path: str) -> str:
    """Whether CRIU keeps its kernel probe (kerndat) between runs: as root only on a tmpfs, in
    /run or, built by scripts/setup.sh where /run is none, in KDAT_DIR."""
    run = _fstype("/run")
    if run == "tmpfs":
        return "on (/run/criu.kdat: /run is a tmpfs)"
    try:
        built_for_dir = f"{KDAT_DIR}/criu.kdat".encode() in Path(criu_path).read_bytes()
    except OSError:
        built_for_dir = False
    if built_for_dir and _fstype(KDAT_DIR, exact=True) == "tmpfs":
        return f"on ({KDAT_DIR}/criu.kdat, a tmpfs scripts/setup.sh mounts: /run is {run or 'no tmpfs'} here)"
    return (
        f"off: /run is {run or 'no tmpfs'}, so every CRIU run probes the kernel again (0.15 s of a "
        "dump's frozen time here, under the dump's writeback)"
    )


def free_page_reporting() -> str:
    """Whether a virtio balloon reports freed guest pages to the host (feature bit 5)."""
    found = sorted(Path("/sys/bus/virtio/drivers/virtio_balloon").glob("virtio*/features"))
    if not found:
        return "no virtio balloon"
    bits = read_text(str(found[0])).strip()
    on = len(bits) > 5 and bits[5] == "1"
    return (
        "on (virtio-balloon VIRTIO_BALLOON_F_REPORTING)" if on else "off (virtio balloon without reporting)"
    )
