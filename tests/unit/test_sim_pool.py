"""The simulated device keeps the memory of a process that is gone for the next Restore (like a
device's fixed memory) without ever letting bytes cross from one process to another: a Restore's
allocation is poisoned in full, a fresh allocation is always fresh zeroed memory, and memory a
live process may still map is never kept."""

from __future__ import annotations

import mmap
import os
import subprocess

import pytest

from npusnap_cli.sim import daemon as daemon_mod
from npusnap_cli.sim import wire
from npusnap_cli.sim.daemon import Daemon, start_time

MiB = 1 << 20
REAL_MEMORY_TO_SPARE = daemon_mod._memory_to_spare  # before the fixture below replaces it


def _dead_owner() -> tuple[int, int]:
    p = subprocess.Popen(["true"])
    p.wait()
    return (p.pid, 1)  # reaped: no such process


def _daemon() -> Daemon:
    return Daemon("/nonexistent/sim.sock", devices=1, capacity=16 * MiB, bandwidth_mbps=None)


def _kept(d: Daemon) -> int:
    return int(d.status()["devices"][0]["kept_for_restore"])


@pytest.fixture(autouse=True)
def _memory_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this machine's memory: the host's spare memory is tested on its own below."""
    monkeypatch.setattr(daemon_mod, "_memory_to_spare", lambda size: True)


def test_restore_reuses_a_dead_process_memory_poisoned_and_fresh_allocations_never_do() -> None:
    d = _daemon()
    dead = _dead_owner()
    me = (os.getpid(), start_time(os.getpid()) or 0)
    assert d.op_claim(dead, 0) == 0
    status, addr = d.op_alloc(dead, 0, MiB, None)
    assert status == 0
    os.pwrite(d.devices[0].allocs[addr].fd, b"secret!!" * (MiB // 8), 0)
    d._free_owner(dead)
    assert _kept(d) == MiB and d.status()["devices"][0]["used"] == 0

    assert d.op_claim(me, 0) == 0
    status, fresh = d.op_alloc(me, 0, MiB, None)
    assert status == 0 and os.pread(d.devices[0].allocs[fresh].fd, MiB, 0) == bytes(MiB)
    assert _kept(d) == MiB  # a fresh allocation never takes kept memory

    status, restored = d.op_alloc(me, 0, MiB, addr, poison=True)
    assert status == 0 and restored == addr
    assert os.pread(d.devices[0].allocs[addr].fd, MiB, 0) == wire.POISON * (MiB // 4)
    assert _kept(d) == 0

    # Kept memory goes back after POOL_TTL_S.
    d._free_owner(me)  # this process maps no device memory: its memory is kept
    assert _kept(d) == 2 * MiB
    d._expire_pool(older_than=0)
    assert _kept(d) == 0


def test_memory_a_live_process_may_still_map_is_never_kept() -> None:
    d = _daemon()
    me = (os.getpid(), start_time(os.getpid()) or 0)
    assert d.op_claim(me, 0) == 0
    assert d.op_alloc(me, 0, MiB, None)[0] == 0
    fd = os.memfd_create("npusim-dev0-test")
    os.ftruncate(fd, 4096)
    with mmap.mmap(fd, 4096):  # as the simulated runtime maps an allocation
        d._free_owner(me)
    os.close(fd)
    assert _kept(d) == 0 and d.status()["devices"][0]["used"] == 0


def test_nothing_is_kept_when_the_host_has_no_memory_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_mod, "_memory_to_spare", lambda size: False)
    d = _daemon()
    dead = _dead_owner()
    assert d.op_claim(dead, 0) == 0
    assert d.op_alloc(dead, 0, MiB, None)[0] == 0
    d._free_owner(dead)
    assert _kept(d) == 0


def test_spare_memory_leaves_a_fifth_of_the_host() -> None:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    floor = max(2 << 30, info["MemTotal"] // 5)
    assert not REAL_MEMORY_TO_SPARE(1 << 60)
    # MemAvailable moves between two reads: only a clear margin either way is asserted.
    if info["MemAvailable"] - floor > 1 << 30:
        assert REAL_MEMORY_TO_SPARE(MiB)
    elif info["MemAvailable"] - floor < -(1 << 30):
        assert not REAL_MEMORY_TO_SPARE(MiB)
