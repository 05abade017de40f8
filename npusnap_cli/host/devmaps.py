"""NPU device memory as /proc shows it: what a real node offers without asking the device.

On an Ascend node the driver maps a process's device memory through its SVM device: the
runtime's allocations live in ``VM_PFNMAP|VM_IO`` mappings of ``/dev/svm0`` (older drivers:
``/dev/devmm_svm``), and Huawei's CRIU plugin rewrites ``/dev/davinci_manager`` mappings
(cann-snapshot-api.md, "CRIU and the NPU plugin"). The simulated NPU maps each allocation's memfd,
named ``npusim-dev<N>`` (the device only), which /proc shows as ``/memfd:npusim-dev...``: its stand-in for
those device mappings (the daemon owns the memory, the process maps it, as the driver's SVM does).

What this tells: whether a process has NPU device memory mapped at all, and how many bytes of
mappings. It does not tell which device, nor how much of an SVM span is allocated (the real driver
maps ahead of use). npusnap uses it as the independent signal that a process has device memory,
against which an agent that did not see every allocation is refused (pipelines/dump/devmemory.py),
and to find other processes using the NPU before a restore (pipelines/restore/checks.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from npusnap_cli import contract

# Paths of device-memory mappings in /proc/PID/maps (the real driver's devices, and the simulated
# NPU's memfds: its stand-in for them), and of the device files a process using the NPU holds
# open (the driver opens these; /dev/davinciN is only stat()-ed). The CRIU plugin reads the same.
DEVICE_MAPPING_PREFIXES = contract.DEVICE_MAPPING_PREFIXES
DEVICE_FILE_PREFIXES = contract.DEVICE_FILE_PREFIXES
PROC = "/proc"  # the functions' ``proc``: tests read recorded or derived inputs from elsewhere


@dataclass(frozen=True)
class DeviceMemory:
    mappings: int  # device-memory mappings in /proc/PID/maps
    bytes: int  # their total size (an SVM span on hardware: mapped, not necessarily allocated)

    @property
    def present(self) -> bool:
        return self.mappings > 0


def device_memory(pid: int, proc: str = PROC) -> Optional[DeviceMemory]:
    """The process's device-memory mappings, or None if its maps cannot be read."""
    count = size = 0
    try:
        with open(f"{proc}/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or not parts[5].strip().startswith(DEVICE_MAPPING_PREFIXES):
                    continue
                lo, _, hi = parts[0].partition("-")
                count += 1
                size += int(hi, 16) - int(lo, 16)
    except (OSError, ValueError):
        return None
    return DeviceMemory(mappings=count, bytes=size)


def npu_users(exclude: frozenset[int] = frozenset()) -> list[int]:
    """Live processes of this host (this pid namespace) that have NPU device memory mapped or an
    NPU device file open, sorted; those in ``exclude`` and unreadable ones are left out."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in exclude or pid == os.getpid():
            continue
        dm = device_memory(pid)
        if (dm is not None and dm.present) or device_files(pid):
            out.append(pid)
    return sorted(out)


def device_files(pid: int, proc: str = PROC) -> Optional[list[str]]:
    """The NPU device files ``pid`` has open (sorted, each once), or None if its descriptors
    cannot be read."""
    try:
        fds = os.listdir(f"{proc}/{pid}/fd")
    except OSError:
        return None
    found = set()
    for fd in fds:
        try:
            target = os.readlink(f"{proc}/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(DEVICE_FILE_PREFIXES):
            found.add(target)
    return sorted(found)
