"""The simulated device keeps the memory of a process that is gone for the next Restore (like a
device's fixed memory) without ever letting bytes cross from one process to another: a Restore's
allocation is poisoned in full, a fresh allocation is always fresh zeroed memory, and memory a
live process may still map is never kept."""

from __future__ import annotations

import mmap
import os
import subprocess

import pytest

from npusnap_sim import daemon as daemon_mod
from npusnap_sim import wire
from npusnap_sim.daemon import Daemon, start_time

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


def test_kept_memory_goes_back_oldest_first_once_the_host_has_none_to_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = Daemon("/nonexistent/sim.sock", devices=1, capacity=64 * MiB, bandwidth_mbps=None)
    for size in (MiB, 2 * MiB):  # two processes gone, the 1 MiB one first
        dead = _dead_owner()
        assert d.op_claim(dead, 0) == 0
        assert d.op_alloc(dead, 0, size, None)[0] == 0
        d._free_owner(dead)
    assert _kept(d) == 3 * MiB
    d._expire_pool()  # young, and memory to spare: kept
    assert _kept(d) == 3 * MiB
    spare = iter([False, True])  # short of memory until the oldest went back
    monkeypatch.setattr(daemon_mod, "_memory_to_spare", lambda size: next(spare))
    d._expire_pool()
    assert _kept(d) == 2 * MiB and [k.size for k in d.devices[0].pool] == [2 * MiB]


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


def test_kept_memory_is_poisoned_in_the_background_before_any_restore() -> None:
    """A Restore then finds it poisoned already (a device's Restore writes no host memory)."""
    d = _daemon()
    dead = _dead_owner()
    assert d.op_claim(dead, 0) == 0
    status, addr = d.op_alloc(dead, 0, MiB, None)
    assert status == 0
    os.pwrite(d.devices[0].allocs[addr].fd, b"secret!!" * (MiB // 8), 0)
    d._free_owner(dead)
    (kept,) = d.devices[0].pool
    assert kept.poisoned.wait(10) and kept.ok
    assert os.pread(kept.fd, MiB, 0) == wire.POISON * (MiB // 4)


def test_a_restore_is_poisoned_outside_the_lock_and_answered_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other processes' requests go on while a Restore's memory is poisoned; the Restore's answer
    comes only once every byte is poisoned."""
    d = _daemon()
    me = (os.getpid(), start_time(os.getpid()) or 0)
    assert d.op_claim(me, 0) == 0
    events: list[str] = []
    real = daemon_mod._fill_poison

    def fill(fd: int, size: int) -> None:
        events.append("poison, lock " + ("held" if d.lock.locked() else "free"))
        real(fd, size)

    class Conn:
        def sendall(self, data: bytes) -> None:
            events.append("answer")

    monkeypatch.setattr(daemon_mod, "_fill_poison", fill)
    addr = wire.ADDR_BASE + 8 * MiB
    assert d.handle(Conn(), me, wire.OP_ALLOC_AT, 0, addr, wire.ALLOC_POISON, MiB)  # type: ignore[arg-type]
    assert events == ["poison, lock free", "answer"]
    assert os.pread(d.devices[0].allocs[addr].fd, MiB, 0) == wire.POISON * (MiB // 4)


def test_the_newest_memory_of_a_gone_process_is_kept_in_place_of_older() -> None:
    d = _daemon()  # 16 MiB
    for _ in range(3):
        dead = _dead_owner()
        assert d.op_claim(dead, 0) == 0
        assert d.op_alloc(dead, 0, 6 * MiB, None)[0] == 0
        d._free_owner(dead)
    assert [k.size for k in d.devices[0].pool] == [6 * MiB, 6 * MiB]
    assert d.devices[0].pool[0].freed_at <= d.devices[0].pool[1].freed_at
    dead = _dead_owner()
    assert d.op_claim(dead, 0) == 0
    assert d.op_alloc(dead, 0, 16 * MiB, None)[0] == 0
    d._free_owner(dead)
    assert [k.size for k in d.devices[0].pool] == [16 * MiB]


def test_at_most_pool_max_files_allocations_are_kept_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job of many small allocations leaves the daemon a bounded number of open files."""
    monkeypatch.setattr(daemon_mod, "POOL_MAX_FILES", 8)
    d = _daemon()
    dead = _dead_owner()
    assert d.op_claim(dead, 0) == 0
    sizes = [4096 * (k + 1) for k in range(20)]
    for size in sizes:
        assert d.op_alloc(dead, 0, size, None)[0] == 0
    d._free_owner(dead)
    pool = d.devices[0].pool
    assert len(pool) == 8 and sorted(k.size for k in pool) == sorted(sizes)[-8:]
    assert _kept(d) == sum(sorted(sizes)[-8:])
