"""The simulated NPU's device daemon: owns device memory and device occupancy for the whole host.

Run as ``python -m npusnap_sim.daemon --socket PATH --devices N --capacity BYTES``. Processes
using the simulated runtime (native/npusim) connect over a unix socket; the daemon identifies each
by (pid, start time) read through SO_PEERCRED and /proc at connect time — CRIU restores the same
pid, so the pid alone would let a restored copy inherit the dead original's device.

Device memory is one memfd per allocation, owned by the daemon, so freeing really returns memory.
Its bytes never cross the socket: OP_MAP passes the allocation's memfd to the runtime (SCM_RIGHTS),
which copies to and from a mapping of it at memory speed (paced to --bandwidth-mbps when given);
the daemon itself writes only the poison pattern of a Restore. Like a device's fixed memory, the
memory of a process that is gone is kept for a while (POOL_TTL_S, at most the device's capacity
and POOL_MAX_FILES allocations, and only while the host keeps a fifth of its memory available:
the oldest goes back as soon as it does not) and given to the next Restore of an allocation of
the same size. It is poisoned as soon as it is kept, on a thread of its own (the
poisoner), so that such a Restore finds it poisoned already: a device's Restore writes no host
memory, and the simulator's poison is its own cost (docs/benchmarks.md), kept off the Restore
where it can be. A Restore that comes first waits
for it. Poisoning happens outside the daemon's lock: the other processes' requests go on meanwhile.
Fresh allocations always get fresh, zeroed memory, and memory a live process may still map is
never kept; no allocation is answered before it is poisoned in full.
Devices are shared between processes, as on an Ascend device (up to MAX_OWNERS): only the
*exclusive* claim that the runtime's Restore makes needs the device free of other live processes.
A process's connection is its device handle (as /dev/davinci_manager is the real runtime's): the
runtime keeps it open from its first claim until it exits, across Lock and Backup, so CRIU needs
the simulated device's plugin (npusim_plugin.so) to dump it; a CRIU-restored process comes with a
new connection, made by that plugin, over which its Restore re-claims its devices. When the last
device connection of a process ends, the daemon frees that process's devices and memory. A reaper
thread also frees those of owners that died; a claim re-checks the other holders synchronously so
a freshly restored process never waits for the reaper.
Which devices a process sees is decided as the driver decides it: the driver numbers the devices
whose node (/dev/davinciN) a process's mount namespace holds, in physical order, from 0 (driver
src/sdk_driver/pbl/uda/uda_access.c: uda_init_ns_node_dev opens each node in the process's
context; devdrv_manager_container_logical_id_to_physical_id). The simulator's nodes are the files
``davinciN`` of ``paths.sim_dev_dir(socket)`` (``<socket>.dev``), one per device, made at start;
a container of the simulated NPU is a mount namespace in which that directory holds only its
devices' nodes.
The logical ids travel on the wire; the daemon turns them into devices through the caller's view.
The daemon is the simulated node's driver, which npusnap itself never reaches on a real node: a
connection from npusnap's own CLI (any command but the stand-ins' `sim` and `demo`) is refused,
logged and listed in the status (``refused_npusnap``), and the test suite fails on any such entry
(tests/conftest.py). Jobs, CRIU's restore of a device handle and qualify's probe program use the
device as any program does, through the simulated runtime.
Standard library only.
"""

from __future__ import annotations

import argparse
import bisect
import errno
import json
import os
import queue
import resource
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from npusnap_cli import paths
from npusnap_cli.host import procfs
from npusnap_sim import wire

Owner = Tuple[int, int]  # (pid, start time in clock ticks, /proc/PID/stat field 22)
GiB = 1 << 30
POISON_CHUNK = 64 << 20
MAX_OWNERS = 63  # user processes an A2/A3 device takes
# How long the memory of a process that is gone waits for a Restore to reuse it. A restore follows
# its dump after whatever the operator (or a benchmark warming memory for the restore, see
# docs/benchmarks.md) does in between; memory pressure gives it back sooner (_expire_pool).
POOL_TTL_S = 60.0
# And at most this many allocations a device (each is an open memfd of the daemon's): a job of many
# small allocations must not leave the daemon a thousand files; the oldest go first.
POOL_MAX_FILES = 128
KEPT_POISON_WAIT_S = 10.0  # a Restore waits this (plus 2 s per GiB) for the poisoner, then poisons


def start_time(pid: int) -> Optional[int]:
    """Field 22 of /proc/PID/stat, or None if the process is gone (or a zombie)."""
    st = procfs.stat(pid)
    if st is None or st.state in ("Z", "X"):
        return None
    return st.start_time


def alive(owner: Owner) -> bool:
    return start_time(owner[0]) == owner[1]


# npusnap's commands that are the stand-ins' own, and so may talk to the simulated node.
STAND_IN_COMMANDS = ("sim", "demo")
REFUSALS_FILE_ENV = "NPUSIM_REFUSALS_FILE"


def npusnap_command(argv: List[str]) -> Optional[str]:
    """The command of an npusnap CLI process with this command line ("" if none is given), or
    None when the process is not npusnap's CLI: ``npusnap ...``, ``python [options] PATH/npusnap
    ...`` (a console script run through its interpreter), ``python [options] -m npusnap_cli ...``.
    A job, CRIU, or a program of npusnap's run by a script path of its own is not."""
    if not argv:
        return None
    rest: Optional[List[str]] = None
    if os.path.basename(argv[0]) == "npusnap":
        rest = argv[1:]
    elif os.path.basename(argv[0]).startswith("python"):
        i = 1
        while i < len(argv) and argv[i].startswith("-"):
            if argv[i] == "-mnpusnap_cli" or (argv[i] == "-m" and argv[i + 1 : i + 2] == ["npusnap_cli"]):
                rest = argv[i + (1 if argv[i] != "-m" else 2) :]
                break
            if argv[i] in ("-m", "-c") or argv[i].startswith(("-m", "-c")):
                return None  # another module or a command string
            i += 2 if argv[i] in ("-X", "-W") else 1
        else:
            if i < len(argv) and os.path.basename(argv[i]) == "npusnap":
                rest = argv[i + 1 :]
    if rest is None:
        return None
    return next((a for a in rest if not a.startswith("-")), "")


def _cmdline(pid: int) -> List[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


@dataclass
class Allocation:
    addr: int
    size: int
    owner: Owner
    fd: int  # the memfd holding the bytes; OP_MAP sends a duplicate of it (the daemon maps none)


@dataclass
class Kept:
    """The memory of a process that is gone, kept for a Restore's poisoned allocation of its size."""

    size: int
    fd: int
    freed_at: float
    poisoned: threading.Event = field(default_factory=threading.Event)
    ok: bool = False  # the poisoner filled it in full (else whoever takes it poisons it)
    expired: bool = False  # dropped from the pool before the poisoner came to it


@dataclass
class PoisonJob:
    """An allocation to fill with the poison pattern outside the daemon's lock, through a duplicate
    of its memfd (a FREE meanwhile cannot close it under the writes), before it is answered."""

    fd: int
    size: int
    kept: Optional[Kept] = None

    def run(self) -> None:
        try:
            # Kept memory: the poisoner has it (or had it); wait for it, for a slow host's pace.
            deadline_s = KEPT_POISON_WAIT_S + self.size / GiB * 2.0
            if self.kept is not None and self.kept.poisoned.wait(deadline_s) and self.kept.ok:
                return
            _fill_poison(self.fd, self.size)
        finally:
            os.close(self.fd)


@dataclass
class Device:
    id: int
    capacity: int
    owners: List[Owner] = field(default_factory=list)  # processes that opened it, in claim order
    used: int = 0
    allocs: Dict[int, Allocation] = field(default_factory=dict)
    addrs: List[int] = field(default_factory=list)  # sorted keys of allocs
    # bump pointer per address range (device memory addresses are those of the logical id the
    # process used: a process sees the same addresses whichever device its id reaches)
    next_addr: Dict[int, int] = field(default_factory=dict)
    # memory of processes that are gone, for a Restore's poisoned allocation
    pool: List[Kept] = field(default_factory=list)


def span_base(addr: int) -> int:
    """The start of the address range (one per logical device id) holding ``addr``."""
    return wire.ADDR_BASE + (addr - wire.ADDR_BASE) // wire.ADDR_SPAN * wire.ADDR_SPAN


class Daemon:
    def __init__(
        self,
        sock_path: str,
        devices: int,
        capacity: int,
        bandwidth_mbps: Optional[float],
        keep_contents: bool = False,
        driver_snapshot: bool = False,
        driver_version: int = 1,
        faults: int = 0,
    ) -> None:
        self.sock_path = sock_path
        # NPUSIM_NODE_FAULT's bits (wire.FAULTS): the node misbehaves as a real one might; 0 normally.
        self.faults = faults
        # The name of the memfds of device memory, which /proc/PID/maps shows as /memfd:NAME: the
        # simulator's stand-in for the driver's /dev/svm0 mappings. The fault "mapname" is a
        # driver that maps device memory through another node (a renamed SVM device, a driver
        # that maps it anonymously): npusnap's classifier (host/devmaps.py) does not know it.
        self.map_name = "npusim-hbm" if faults & wire.CONFIG_FAULT_MAPNAME else "npusim-dev"
        # The driver feature that the driver-backed flow (args != NULL) needs; off by default, as
        # on every released driver. Its version is what Restore compares with Backup's.
        self.driver_snapshot = driver_snapshot
        self.driver_version = driver_version
        # False (the default) is what CANN does: Restore gives allocations back at the same
        # addresses, filled with the poison pattern. True models a future driver that keeps them.
        self.keep_contents = keep_contents
        self.devices = [Device(i, capacity) for i in range(devices)]
        self.bandwidth_mbps = bandwidth_mbps
        self.lock = threading.Lock()
        self._poison_queue: queue.Queue[Tuple[Kept, int]] = queue.Queue()
        self._poisoner: Optional[threading.Thread] = None
        self.clients = 0
        self.refused_npusnap: List[Dict[str, Any]] = []  # npusnap's CLI processes that connected
        self.device_conns: Dict[Owner, int] = {}  # open connections that claimed a device
        self.started = time.time()
        self.stopping = threading.Event()
        self.listener: Optional[socket.socket] = None
        self.dev_dir = paths.sim_dev_dir(sock_path)
        try:
            self.own_mnt_ns: Optional[int] = os.stat("/proc/self/ns/mnt").st_ino
        except OSError:
            self.own_mnt_ns = None
        # owner -> the devices it sees, by logical id (computed at its first request, as the
        # driver computes a namespace's devices when it first opens one)
        self.views: Dict[Owner, List[int]] = {}

    # -- bookkeeping (self.lock held) ---------------------------------------------------------
    def _free_owner(self, owner: Owner, dev: Optional[Device] = None) -> None:
        reusable: Optional[bool] = None
        for d in [dev] if dev else self.devices:
            for addr in [a for a, al in d.allocs.items() if al.owner == owner]:
                if reusable is None:
                    reusable = not _maps_device_memory(owner[0], self.map_name)
                self._drop(d, addr, keep=reusable)
            if owner in d.owners:
                d.owners.remove(owner)

    def _drop(self, dev: Device, addr: int, keep: bool = False) -> None:
        al = dev.allocs.pop(addr)
        dev.addrs.remove(addr)
        dev.used -= al.size
        if keep and al.size <= dev.capacity and _memory_to_spare(al.size):
            # The newest is the likeliest to be restored next (a dump ends its process last):
            # older kept memory makes room for it.
            while dev.pool and (
                sum(k.size for k in dev.pool) + al.size > dev.capacity or len(dev.pool) >= POOL_MAX_FILES
            ):
                self._expire(dev, dev.pool[0])
            kept = Kept(al.size, al.fd, time.monotonic())
            dev.pool.append(kept)
            self._poison_later(kept)
            return
        # The memory goes back once every runtime that mapped the memfd has unmapped it too.
        os.close(al.fd)

    def _poison_later(self, kept: Kept) -> None:
        """Hand kept memory to the poisoner thread (started on first use), through a duplicate of
        its memfd: the pool may close its own meanwhile (expiry)."""
        self._poison_queue.put((kept, os.dup(kept.fd)))
        if self._poisoner is None:
            self._poisoner = threading.Thread(target=self._poison_kept, name="poisoner", daemon=True)
            self._poisoner.start()

    def _poison_kept(self) -> None:
        while True:
            kept, fd = self._poison_queue.get()
            try:
                if not kept.expired:
                    _fill_poison(fd, kept.size)
                    kept.ok = True
            except OSError as exc:
                log(f"could not poison {kept.size} bytes of kept device memory ({exc}): a Restore will")
            finally:
                os.close(fd)
                kept.poisoned.set()

    def _expire_pool(self, older_than: float = POOL_TTL_S) -> None:
        """Give back kept memory older than ``older_than``, and the oldest first while the host has
        no memory to spare (the jobs and the next dump come before a faster Restore)."""
        now = time.monotonic()
        for d in self.devices:
            for entry in [k for k in d.pool if now - k.freed_at >= older_than]:
                self._expire(d, entry)
        while True:
            kept = [(k.freed_at, i, d, k) for d in self.devices for i, k in enumerate(d.pool)]
            if not kept or _memory_to_spare(0):
                return
            _, _, dev, oldest = min(kept, key=lambda t: (t[0], t[1]))
            self._expire(dev, oldest)

    def _expire(self, dev: Device, entry: Kept) -> None:
        dev.pool.remove(entry)
        entry.expired = True
        os.close(entry.fd)

    def _from_pool(self, dev: Device, size: int) -> Optional[Kept]:
        """Kept memory of exactly ``size`` bytes (poisoned, or being poisoned), or None."""
        for entry in dev.pool:
            if entry.size == size:
                dev.pool.remove(entry)
                return entry
        return None

    def _reap_ns(self) -> None:
        for owner in [o for o in self.views if not alive(o)]:
            del self.views[owner]

    def _reap(self) -> None:
        owners = {o for d in self.devices for o in d.owners} | {
            al.owner for d in self.devices for al in d.allocs.values()
        }
        for owner in owners:
            if not alive(owner):
                log(f"owner pid {owner[0]} (start {owner[1]}) is gone: freeing its devices and memory")
                self._free_owner(owner)

    def view(self, owner: Owner) -> List[int]:
        """The devices ``owner`` sees, by logical id: those whose node its mount namespace holds,
        in physical order (all of them in the daemon's own mount namespace)."""
        seen = self.views.get(owner)
        if seen is not None:
            return seen
        pid = owner[0]
        try:
            same = os.stat(f"/proc/{pid}/ns/mnt").st_ino == self.own_mnt_ns
        except OSError:
            same = True  # gone already: nothing it asks for will be kept
        if same:
            seen = list(range(len(self.devices)))
        else:
            # /proc/PID/root resolves the path in the process's own mount namespace, as the
            # driver's open of the node from the process's context does.
            root = f"/proc/{pid}/root{self.dev_dir}"
            seen = [d.id for d in self.devices if os.path.exists(f"{root}/davinci{d.id}")]
        self.views[owner] = seen
        return seen

    def _phys(self, owner: Owner, dev_id: int) -> int:
        """The device behind logical id ``dev_id`` for ``owner`` (-1: it sees no such device)."""
        seen = self.view(owner)
        return seen[dev_id] if 0 <= dev_id < len(seen) else -1

    def _device_of(self, addr: int, owner: Owner) -> Optional[Device]:
        idx = (addr - wire.ADDR_BASE) // wire.ADDR_SPAN if addr >= wire.ADDR_BASE else -1
        idx = self._phys(owner, idx) if idx >= 0 else -1
        return self.devices[idx] if 0 <= idx < len(self.devices) else None

    def _find(self, owner: Owner, addr: int, n: int) -> Optional[Tuple[Allocation, int]]:
        """The caller's allocation holding [addr, addr+n), and the offset of addr in it."""
        dev = self._device_of(addr, owner)
        if dev is None:
            return None
        i = bisect.bisect_right(dev.addrs, addr) - 1
        if i < 0:
            return None
        al = dev.allocs[dev.addrs[i]]
        off = addr - al.addr
        if al.owner != owner or n < 0 or off + n > al.size:
            return None
        return al, off

    def _place(self, dev: Device, size: int, base: int) -> int:
        """An address in [base, base + ADDR_SPAN) for a new allocation: bump pointer, first fit
        once the range is used up."""
        end = base + wire.ADDR_SPAN
        nxt = dev.next_addr.get(base, base)
        if nxt + size <= end:
            return nxt
        prev = base
        for a in dev.addrs[bisect.bisect_left(dev.addrs, base) : bisect.bisect_left(dev.addrs, end)]:
            if a - prev >= size:
                return prev
            prev = _align(a + dev.allocs[a].size)
        return prev if end - prev >= size else -1

    def _insert(self, dev: Device, addr: int, size: int, owner: Owner, reuse: bool = False) -> Optional[Kept]:
        """``reuse``: the caller poisons every byte before anyone maps it (a Restore), so memory
        from the pool will do; that memory is returned."""
        kept = self._from_pool(dev, size) if reuse else None
        if kept is not None:
            fd = kept.fd
        else:
            # Named after the device only, as a real device's mapping is named after its node
            # (/dev/svm0) whatever it holds: a memfd from the pool serves other addresses later
            # (a Restore), and a restored process must see its mappings under their old names.
            fd = os.memfd_create(f"{self.map_name}{dev.id}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
        dev.allocs[addr] = Allocation(addr, size, owner, fd)
        bisect.insort(dev.addrs, addr)
        dev.used += size
        base = span_base(addr)
        dev.next_addr[base] = max(dev.next_addr.get(base, base), _align(addr + size))
        return kept

    def _overlaps(self, dev: Device, addr: int, size: int) -> bool:
        i = bisect.bisect_right(dev.addrs, addr + size - 1)
        if i == 0:
            return False
        prev = dev.allocs[dev.addrs[i - 1]]
        return prev.addr + prev.size > addr

    # -- operations -----------------------------------------------------------------------------
    def op_claim(self, owner: Owner, dev_id: int, exclusive: bool = False) -> int:
        """Open the device for ``owner``; ``exclusive`` (Restore) needs no other live process on it."""
        if not 0 <= dev_id < len(self.devices):
            return -errno.ENODEV
        dev = self.devices[dev_id]
        for other in [o for o in dev.owners if o != owner]:
            if not alive(other):
                log(f"device {dev_id}: owner pid {other[0]} is gone: freeing it")
                self._free_owner(other, dev)
        others = [o for o in dev.owners if o != owner]
        if exclusive and others:
            return -errno.EBUSY
        if owner not in dev.owners:
            if len(dev.owners) >= MAX_OWNERS:
                return -errno.EBUSY
            dev.owners.append(owner)
        return 0

    def op_alloc(
        self, owner: Owner, dev_id: int, size: int, at: Optional[int], poison: bool = False
    ) -> Tuple[int, int]:
        """Allocate (``at``: at that address; ``poison``: filled with the poison pattern, as CANN's
        Restore gives it back). The daemon calls ``alloc_locked`` under its lock and runs the poison
        after; this does both (the tests' way in)."""
        status, addr, job = self.alloc_locked(owner, dev_id, size, at, poison)
        if job is not None:
            job.run()
        return status, addr

    def alloc_locked(
        self, owner: Owner, dev_id: int, size: int, at: Optional[int], poison: bool = False
    ) -> Tuple[int, int, Optional[PoisonJob]]:
        """The allocation, and the poison its caller must run (outside the lock) before answering."""
        status, addr, kept = self._alloc(owner, dev_id, size, at, reuse=poison)
        if status != 0 or not poison:
            return status, addr, None
        return status, addr, PoisonJob(os.dup(self.devices[dev_id].allocs[addr].fd), size, kept)

    def _alloc(
        self, owner: Owner, dev_id: int, size: int, at: Optional[int], reuse: bool = False
    ) -> Tuple[int, int, Optional[Kept]]:
        if not 0 <= dev_id < len(self.devices):
            return -errno.ENODEV, 0, None
        dev = self.devices[dev_id]
        if owner not in dev.owners:
            return -errno.EPERM, 0, None
        if size <= 0:
            return -errno.EINVAL, 0, None
        if at is not None:
            existing = dev.allocs.get(at)
            if existing and existing.owner == owner and existing.size == size:
                return 0, at, None  # Restore in the same process (rollback): the memory is still there
            if self._device_of(at, owner) is not dev or at + size > span_base(at) + wire.ADDR_SPAN:
                return -errno.EINVAL, 0, None
            if self._overlaps(dev, at, size):
                return -errno.EEXIST, 0, None
        if dev.used + size > dev.capacity:
            return -errno.ENOMEM, 0, None
        seen = self.view(owner)
        if at is None and dev_id not in seen:
            return -errno.ENODEV, 0, None
        addr = (
            at
            if at is not None
            else self._place(dev, size, wire.ADDR_BASE + seen.index(dev_id) * wire.ADDR_SPAN)
        )
        if addr < 0:
            return -errno.ENOMEM, 0, None
        try:
            kept = self._insert(dev, addr, size, owner, reuse=reuse)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                log(
                    "out of file descriptors (one memfd per allocation): "
                    f"{sum(len(d.allocs) for d in self.devices)} allocations; raise the daemon's "
                    "open-file limit (ulimit -n) to allow more"
                )
            return -errno.ENOMEM, 0, None
        except ValueError:
            return -errno.ENOMEM, 0, None
        return 0, addr, kept

    def status(self) -> Dict[str, Any]:
        owners: Dict[Owner, Dict[str, Any]] = {}
        devs = []
        for d in self.devices:
            for al in d.allocs.values():
                o = owners.setdefault(al.owner, {"pid": al.owner[0], "start_time": al.owner[1], "bytes": 0})
                o["bytes"] += al.size
            for who in d.owners:
                owners.setdefault(who, {"pid": who[0], "start_time": who[1], "bytes": 0})
            devs.append(
                {
                    "id": d.id,
                    "capacity": d.capacity,
                    "used": d.used,
                    "allocations": len(d.allocs),
                    # memory of processes that are gone, kept for a Restore (POOL_TTL_S)
                    "kept_for_restore": sum(k.size for k in d.pool),
                    # "owner": the first process that opened it (kept for older readers)
                    "owner": None
                    if not d.owners
                    else {"pid": d.owners[0][0], "start_time": d.owners[0][1], "alive": alive(d.owners[0])},
                    "owners": [{"pid": o[0], "start_time": o[1], "alive": alive(o)} for o in d.owners],
                }
            )
        for key, o in owners.items():
            o["alive"] = alive(key)
            o["devices"] = [d.id for d in self.devices if key in d.owners]
            o["device_connections"] = self.device_conns.get(key, 0)
            # its devices by logical id (the view of its mount namespace's device nodes)
            o["visible_devices"] = list(self.views.get(key, []))
        return {
            "simulated": True,
            "daemon_pid": os.getpid(),
            "socket": self.sock_path,
            "uptime_s": round(time.time() - self.started, 3),
            "bandwidth_mbps": self.bandwidth_mbps,
            "keep_contents": self.keep_contents,
            "driver_snapshot": self.driver_snapshot,
            "driver_version": self.driver_version,
            "faults": sorted(n for n, bit in wire.FAULTS.items() if self.faults & bit),
            "clients": self.clients,
            "refused_npusnap": list(self.refused_npusnap),
            "devices": devs,
            "device_nodes": self.dev_dir,
            "owners": list(owners.values()),
            "bytes_used": sum(d.used for d in self.devices),
        }

    # -- connections ----------------------------------------------------------------------------
    def serve_client(self, conn: socket.socket) -> None:
        with self.lock:
            self.clients += 1
        device_conn: Optional[Owner] = None
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid = struct.unpack("3i", creds)[0]
            argv = _cmdline(pid)
            command = npusnap_command(argv)
            if command is not None and command not in STAND_IN_COMMANDS:
                log(
                    f"REFUSED a connection of npusnap itself (pid {pid}: {' '.join(argv)}): "
                    "on a node, npusnap never reaches the driver"
                )
                self._refused({"pid": pid, "cmdline": argv, "at": time.time(), "socket": self.sock_path})
                return
            st = start_time(pid)
            owner: Owner = (pid, st if st is not None else -1)
            with self.lock:
                self.view(owner)
            while True:
                try:
                    hdr = wire.recv_exact(conn, wire.REQ.size)
                except (ConnectionError, OSError):
                    return
                op, dev, a, b, n = wire.REQ.unpack(hdr)
                if op == wire.OP_CLAIM and device_conn is None:
                    device_conn = owner  # this connection is the process's device handle
                    with self.lock:
                        self.device_conns[owner] = self.device_conns.get(owner, 0) + 1
                if not self.handle(conn, owner, op, dev, a, b, n):
                    return
        finally:
            with self.lock:
                self.clients -= 1
                if device_conn is not None:
                    self._device_conn_closed(device_conn)
            conn.close()

    def _refused(self, entry: Dict[str, Any]) -> None:
        """Keep a refused connection of npusnap's for the status, and for the test suite in the
        file NPUSIM_REFUSALS_FILE names (one JSON line each): a refusal npusnap swallowed still
        fails the test that caused it."""
        with self.lock:
            self.refused_npusnap = [*self.refused_npusnap[-99:], entry]  # the last 100
        path = os.environ.get(REFUSALS_FILE_ENV)
        if path:
            try:
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                fd = os.open(path, flags, 0o600)
                try:
                    os.write(fd, (json.dumps(entry) + "\n").encode())
                finally:
                    os.close(fd)
            except OSError as exc:
                log(f"could not record the refusal in {path}: {exc}")

    def _device_conn_closed(self, owner: Owner) -> None:
        """A device connection ended (self.lock held): its process exited or closed the handle,
        so once none is left the process's devices and memory are freed."""
        left = self.device_conns.get(owner, 0) - 1
        if left > 0:
            self.device_conns[owner] = left
            return
        self.device_conns.pop(owner, None)
        held = any(owner in d.owners for d in self.devices) or any(
            al.owner == owner for d in self.devices for al in d.allocs.values()
        )
        if held:
            log(f"pid {owner[0]} (start {owner[1]}) closed its device connection: freeing it all")
            self._free_owner(owner)

    def reply(self, conn: socket.socket, status: int, value: int = 0, payload: bytes = b"") -> None:
        conn.sendall(wire.RESP.pack(status, 0, value, len(payload)) + payload)

    def handle(self, conn: socket.socket, owner: Owner, op: int, dev: int, a: int, b: int, n: int) -> bool:
        """Serve one request; False ends the connection."""
        if op == wire.OP_MAP:
            with self.lock:
                found = self._find(owner, a, n)
                # A duplicate, so that a FREE racing with this answer cannot close what is sent.
                if found is None:
                    fd, meta = -1, b""
                else:
                    fd = os.dup(found[0].fd)
                    meta = wire.MAP.pack(found[0].addr, found[0].size, self.bandwidth_mbps or 0.0)
            if fd < 0:
                self.reply(conn, -errno.EINVAL)
                return True
            try:
                socket.send_fds(conn, [wire.RESP.pack(0, 0, 0, len(meta)) + meta], [fd])
            finally:
                os.close(fd)
            return True
        if op == wire.OP_STATUS:
            with self.lock:
                doc = self.status()
                doc["caller_devices"] = self.view(owner)  # the driver's device count for the caller
            self.reply(conn, 0, 0, json.dumps(doc).encode())
            return True
        if op == wire.OP_SHUTDOWN:
            self.reply(conn, 0)
            self.stopping.set()
            self.close_listener()
            return False
        if dev >= 0 and op != wire.OP_HAS:
            with self.lock:
                dev = self._phys(owner, dev)
        if op == wire.OP_ALLOC_AT and b & wire.ALLOC_POISON:
            # A Restore's allocation: poisoned outside the lock, answered once poisoned in full.
            with self.lock:
                status, value, job = self.alloc_locked(owner, dev, n, a, poison=True)
            if job is not None:
                job.run()
            self.reply(conn, status, value)
            return True
        with self.lock:
            status, value = self.simple_op(owner, op, dev, a, b, n)
        self.reply(conn, status, value)
        return True

    def simple_op(self, owner: Owner, op: int, dev: int, a: int, b: int, n: int) -> Tuple[int, int]:
        if op == wire.OP_CLAIM:
            return self.op_claim(owner, dev, exclusive=bool(b & wire.CLAIM_EXCLUSIVE)), 0
        if op == wire.OP_RELEASE:
            if 0 <= dev < len(self.devices):
                self._free_owner(owner, self.devices[dev])
                return 0, 0
            return -errno.ENODEV, 0
        if op == wire.OP_ALLOC:
            return self.op_alloc(owner, dev, n, None)
        if op == wire.OP_ALLOC_AT:
            return self.op_alloc(owner, dev, n, a, poison=bool(b & wire.ALLOC_POISON))
        if op == wire.OP_CONFIG:
            value = wire.CONFIG_KEEP_CONTENTS if self.keep_contents else 0
            if self.driver_snapshot:
                value |= wire.CONFIG_DRIVER_SNAPSHOT
            return 0, value | self.faults | (self.driver_version << 16)
        if op == wire.OP_FREE:
            d = self._device_of(a, owner)
            al = d.allocs.get(a) if d else None
            if d is None or al is None or al.owner != owner:
                return -errno.EINVAL, 0
            self._drop(d, a)
            return 0, 0
        if op == wire.OP_HAS:
            d = self._device_of(a, owner)
            al = d.allocs.get(a) if d else None
            ok = (
                d is not None
                and d.id == self._phys(owner, dev)
                and al is not None
                and al.owner == owner
                and al.size == n
            )
            return (0 if ok else -errno.ENOENT), 0
        return -errno.EOPNOTSUPP, 0

    def make_device_nodes(self) -> None:
        """One node (an empty file) per device in dev_dir, and no other: the host's /dev/davinciN."""
        os.makedirs(self.dev_dir, mode=0o755, exist_ok=True)
        names = {f"davinci{d.id}" for d in self.devices}
        for name in os.listdir(self.dev_dir):
            if name.startswith("davinci") and name not in names:
                os.unlink(os.path.join(self.dev_dir, name))
        for name in names:
            with open(os.path.join(self.dev_dir, name), "a"):
                pass

    def reaper(self, interval: float) -> None:
        while not self.stopping.wait(interval):
            with self.lock:
                self._reap()
                self._reap_ns()
                self._expire_pool()

    def close_listener(self) -> None:
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _on_signal(self, signum: int, frame: object) -> None:
        del signum, frame
        self.stopping.set()
        self.close_listener()

    def serve(self) -> int:
        parent = os.path.dirname(self.sock_path)
        if parent:
            os.makedirs(parent, mode=0o755, exist_ok=True)
        if os.path.exists(self.sock_path):
            try:
                wire.query_status(self.sock_path, timeout=2.0)
            except (OSError, ConnectionError, ValueError):
                os.unlink(self.sock_path)  # stale socket of a dead daemon
            else:
                log(f"another npusim daemon already serves {self.sock_path}")
                return 1
        _raise_fd_limit()
        self.make_device_nodes()
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind(self.sock_path)
        lst.listen(128)
        self.listener = lst
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        threading.Thread(target=self.reaper, args=(0.5,), name="reaper", daemon=True).start()
        caps = ", ".join(f"{d.capacity} B" for d in self.devices)
        mode = (
            "KEEP-CONTENTS (not CANN's behaviour)"
            if self.keep_contents
            else "contents lost at Restore, as CANN"
        )
        log(
            f"npusim daemon pid {os.getpid()} serving {self.sock_path}: "
            f"{len(self.devices)} devices ({caps}); {mode}"
        )
        try:
            while not self.stopping.is_set():
                try:
                    conn, _ = lst.accept()
                except OSError:
                    if self.stopping.is_set():
                        break
                    continue
                threading.Thread(target=self.serve_client, args=(conn,), daemon=True).start()
        finally:
            lst.close()
            try:
                os.unlink(self.sock_path)
            except OSError:
                pass
            log("npusim daemon stopped")
        return 0


def _raise_fd_limit() -> None:
    """Every allocation holds a memfd: take the hard open-file limit, not the (often 1024) soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):
            pass  # the soft limit stays; allocations beyond it fail with ENOMEM and a log line


def _memory_to_spare(size: int) -> bool:
    """Whether the host can keep ``size`` more bytes for a Restore and still have a fifth of its
    memory (at least 2 GiB) available: kept memory must not starve the jobs or the next dump."""
    try:
        with open("/proc/meminfo", "rb") as f:
            info = {ln.split(b":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.count(b":") == 1}
    except (OSError, ValueError, IndexError):
        return False
    total, avail = info.get(b"MemTotal", 0), info.get(b"MemAvailable", 0)
    return avail - size >= max(2 * GiB, total // 5)


def _maps_device_memory(pid: int, map_name: str = "npusim-dev") -> bool:
    """Whether ``pid`` may still map a device allocation (then its memfds are never reused). A
    process that exited has released its mappings before its device connection closes (the kernel
    drops a process's memory before its files), so its /proc maps are empty or gone."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            needle = b"memfd:" + map_name.encode()
            return any(needle in line for line in f)
    except OSError:
        return False


_poison_cache: List[memoryview] = []


def _poison_block(n: int) -> memoryview:
    """At least ``n`` bytes of the pattern, built once and grown only when a larger one is needed:
    building a 64 MiB block for each small kept allocation held the GIL for the whole pool's worth
    of blocks (a job with a thousand allocations kept a core busy for minutes, status unanswered)."""
    if not _poison_cache or len(_poison_cache[0]) < n:
        words = -(-max(n, 1 << 20) // len(wire.POISON))
        _poison_cache[:] = [memoryview(wire.POISON * words)]
    return _poison_cache[0]


def _fill_poison(fd: int, size: int) -> None:
    """Fill ``size`` bytes of a device allocation's memfd with 0xDEADBEEF words (a partial word at
    the end is cut). Written into the memfd: the kernel allocates its pages as it writes, without
    the page fault per page that filling a mapping of it takes, and no faster from two threads (the
    kernel's page allocation is the limit; docs/benchmarks.md)."""
    block = _poison_block(min(size, POISON_CHUNK))
    for off in range(0, size, POISON_CHUNK):
        n = min(POISON_CHUNK, size - off)
        done = 0
        while done < n:
            done += os.pwrite(fd, block[done:n], off + done)


def _align(x: int) -> int:
    return (x + wire.ALIGN - 1) // wire.ALIGN * wire.ALIGN


def log(msg: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} npusim: {msg}\n")
    sys.stderr.flush()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m npusnap_sim.daemon", description=__doc__)
    ap.add_argument("--socket", default=str(paths.sim_socket_path()), help="unix socket path to listen on")
    ap.add_argument("--devices", type=int, default=2, help="number of simulated devices (default 2)")
    ap.add_argument(
        "--capacity", type=int, default=4 * GiB, help="bytes of memory per device (default 4 GiB)"
    )
    ap.add_argument(
        "--bandwidth-mbps",
        type=float,
        default=None,
        help="pace device copies to this many megabytes per second, a model of the link (default: "
        "memory speed)",
    )
    ap.add_argument(
        "--keep-contents",
        action="store_true",
        help="Restore brings back the contents of allocations (NOT what CANN does: its Restore keeps "
        "addresses only; off by default, never used by the demo)",
    )
    ap.add_argument(
        "--driver-snapshot",
        action="store_true",
        help="the driver supports the driver-backed snapshot flow (args != NULL; off by default)",
    )
    ap.add_argument("--driver-version", type=int, default=1, help="the driver's version (default 1)")
    args = ap.parse_args(argv)
    if args.devices < 1 or args.devices > 64 or args.capacity < 1:
        ap.error("--devices must be 1..64 and --capacity positive")
    try:
        faults = wire.node_faults(os.environ.get(wire.NODE_FAULT_ENV, ""))
    except ValueError as exc:
        ap.error(str(exc))
    if faults:
        log(
            f"node fault: {os.environ[wire.NODE_FAULT_ENV]} "
            "(this node breaks npusnap's assumptions on purpose)"
        )
    return Daemon(
        args.socket,
        args.devices,
        args.capacity,
        args.bandwidth_mbps,
        args.keep_contents,
        args.driver_snapshot,
        args.driver_version,
        faults,
    ).serve()


if __name__ == "__main__":
    raise SystemExit(main())
