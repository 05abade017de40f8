"""Which physical NPU devices the processes of this node hold: the one occupancy model that
`restore --dry-run`, restore and `status` read.

A process names its devices by the ids its program passed to the runtime (an agent's hello says
which). Those are not the node's devices: the runtime maps them through ASCEND_RT_VISIBLE_DEVICES
(read once at its init), and the driver numbers the devices whose node (/dev/davinciN, or the
simulator's ``davinciN`` files) the process's mount namespace holds, from 0 in physical order
(driver src/sdk_driver/pbl/uda/uda_access.c, devdrv_manager_container_logical_id_to_physical_id).
A copy restored into a container (`restore --device-map 0=1`) says "device 0" and holds device 1;
comparing program ids across processes therefore reports free devices as taken and taken ones as
free. Everything here is in physical ids and host pids (the namespace pid only beside them).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from npusnap_cli import acl, paths, replies
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import NpusnapError
from npusnap_cli.host import devmaps

_NODE = re.compile(r"^davinci(\d+)$")


@dataclass(frozen=True)
class DeviceUse:
    """One NPU process of this node and the physical devices it holds."""

    pid: int  # host pid: the one to act on
    ns_pid: Optional[int]  # its pid inside its own pid namespace, when that differs
    devices: Optional[tuple[int, ...]]  # physical ids; None: it cannot say (no agent)
    program_devices: tuple[int, ...] = ()  # the ids its program uses, as its agent said

    def who(self) -> str:
        """``pid 1234`` (``pid 1234 (1 in its namespace)``): what a message names."""
        return f"pid {self.pid}" + (f" ({self.ns_pid} in its pid namespace)" if self.ns_pid else "")


def node_dir(simulated: bool) -> str:
    """Where this node's device nodes are: the simulated NPU's ``davinciN`` files, or /dev."""
    if simulated:
        return paths.sim_dev_dir(str(paths.sim_socket_path()))
    return "/dev"


def _nodes(directory: str) -> Optional[list[int]]:
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    return sorted(int(m.group(1)) for m in map(_NODE.match, names) if m)


def node_devices(simulated: bool) -> Optional[list[int]]:
    """The physical devices of this node (their nodes in the host's view), None if unknown."""
    return _nodes(node_dir(simulated))


def driver_view(pid: int, simulated: bool) -> Optional[list[int]]:
    """The physical devices ``pid`` sees, in the driver's order (its id i is the list's i-th);
    None when its view cannot be read (then its ids are taken as the node's)."""
    # /proc/PID/root resolves the path in the process's own mount namespace, as the driver's
    # open of the node from the process's context does.
    seen = _nodes(f"/proc/{pid}/root{node_dir(simulated)}")
    return seen if seen else None


def visible_list(value: Optional[str]) -> Optional[list[int]]:
    """ASCEND_RT_VISIBLE_DEVICES as the runtime reads it (a comma list of driver ids), or None."""
    if not value:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        return None


def physical(program_ids: list[int], view: Optional[list[int]], visible: Optional[list[int]]) -> list[int]:
    """The physical devices behind a program's device ids: through the runtime's visible list,
    then the driver's view. An id that reaches no device stays as it is (the runtime refuses it
    anyway)."""
    out = []
    for d in program_ids:
        driver_id = visible[d] if visible is not None and 0 <= d < len(visible) else d
        out.append(view[driver_id] if view is not None and 0 <= driver_id < len(view) else driver_id)
    return out


def ns_pid(pid: int) -> Optional[int]:
    """``pid``'s pid inside its own (innermost) pid namespace, None if that is the same."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    ids = [int(x) for x in line.split()[1:]]
                    return ids[-1] if len(ids) > 1 and ids[-1] != pid else None
    except (OSError, ValueError):
        pass
    return None


def of_hello(pid: int, hello: replies.HelloReply, simulated: Optional[bool] = None) -> DeviceUse:
    """What the agent's hello of ``pid`` says, in physical devices (``simulated`` None: as the
    CANN installation the process loaded says)."""
    acl_info = hello.acl
    if simulated is None:
        library = acl_info.library
        simulated = bool(library) and acl.read_version_info(acl.home_of_library(str(library)))[1]
    ids = list(acl_info.devices or acl_info.callback_devices)
    devices = physical(ids, driver_view(pid, simulated), visible_list(acl_info.visible_devices))
    return DeviceUse(pid, ns_pid(pid), tuple(devices), tuple(ids))


def device_users(
    cann_home: Optional[str], simulated: bool, exclude: frozenset[int] = frozenset()
) -> list[DeviceUse]:
    """Every NPU process of this node (but ``exclude``) with the physical devices its agent says
    it holds; jobs of another CANN installation than ``cann_home`` are left out (on the simulator
    each tree is a node of its own). One without an agent, or whose agent does not answer, has
    ``devices`` None: the driver maps one SVM span for all devices and /dev/davinciN is never
    held open, so /proc cannot tell."""
    out = []
    for pid in devmaps.npu_users(exclude=exclude):
        library = acl.loaded_acl_library(pid)
        if (
            cann_home
            and library
            and os.path.realpath(acl.home_of_library(library)) != os.path.realpath(cann_home)
        ):
            continue
        use = DeviceUse(pid, ns_pid(pid), None)
        if paths.find_agent_socket(pid) is not None:
            try:
                with AgentClient(pid, timeout=2.0, connect_retry_s=0.2) as client:
                    use = of_hello(pid, client.hello(), simulated)
            except NpusnapError:
                pass
        out.append(use)
    return out


def image_devices(manifest: Any, device_map: tuple[tuple[int, int], ...] = ()) -> dict[int, int]:
    """Physical device -> the image's (host) pid that a restore of ``manifest`` claims it for.

    With ``device_map`` the copy lives in a container that holds the mapped devices (see
    host/pidns.py); without, in the host's view, through the list the runtime kept in memory."""
    moved = dict(device_map)
    simulated = bool(manifest.versions.cann_simulated)
    host_view = None if moved else node_devices(simulated)
    out: dict[int, int] = {}
    for p in manifest.npu_processes:
        ids = [int(d) for d in (p.devices or ())]
        if moved:
            devices = [moved.get(d, d) for d in ids]
        else:
            devices = physical(ids, host_view, visible_list(p.visible_devices))
        for d in devices:
            out.setdefault(d, p.pid)
    return out
