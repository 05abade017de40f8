"""The simulated CANN runtime, exercised through ctypes in real processes against a real daemon.

Checks the behaviour npusnap depends on (shared/npusim-spec.md, shared/cann-snapshot-api.md):
state machine and error codes, argument checks, blocking of device calls while locked, callbacks,
addresses (kept) and contents (lost, as CANN's legacy flow) across Backup/Restore/Unlock,
occupancy, owner death, fault injection.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from npusnap_sim import wire
from tests.integration.sim_helpers import Driver, wait_for

pytestmark = pytest.mark.integration

RUNNING, LOCKED, BACKED_UP = 0, 1, 2
MiB = 1 << 20


@pytest.fixture
def make_driver(sim_env: dict[str, str]) -> Iterator[Callable[..., Driver]]:
    drivers: list[Driver] = []

    def make(extra_env: dict[str, str] | None = None, stderr: Path | None = None) -> Driver:
        d = Driver(sim_env, extra_env, stderr)
        drivers.append(d)
        return d

    yield make
    for d in drivers:
        d.close()


def daemon_status(sim_env: dict[str, str]) -> dict[str, Any]:
    return wire.query_status(sim_env["NPUSIM_SOCKET"])


def state(d: Driver) -> int:
    return int(d.call("state")["state"])


def socket_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def test_state_machine_transitions_and_wrong_state_codes(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0
    assert state(d) == RUNNING
    assert d.rc("unlock") == 507907
    assert d.rc("backup") == 507908
    assert d.rc("restore") == 507909
    assert d.rc("lock") == 0 and state(d) == LOCKED
    assert d.rc("lock") == 507906
    assert d.rc("restore") == 507909 and state(d) == LOCKED
    assert d.rc("backup") == 0 and state(d) == BACKED_UP
    assert d.rc("backup") == 507908 and d.rc("lock") == 507906 and state(d) == BACKED_UP
    assert d.rc("restore") == 0 and state(d) == LOCKED
    assert d.rc("unlock") == 0 and state(d) == RUNNING
    # leave-running: Unlock straight from BACKED_UP
    assert d.rc("lock") == 0 and d.rc("backup") == 0
    assert d.rc("unlock") == 0 and state(d) == RUNNING
    # a repeated Backup after Restore is legal (the last one wins)
    assert [d.rc(c) for c in ("lock", "backup", "restore", "backup", "unlock")] == [0, 0, 0, 0, 0]
    assert d.rc("state_null") == 107000


@pytest.mark.parametrize("op", ["lock", "backup", "restore", "unlock"])
def test_pid_must_be_self_and_reserve_null(make_driver: Callable[..., Driver], op: str) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0
    if op in ("backup", "unlock"):
        assert d.rc("lock") == 0
    if op == "restore":
        assert d.rc("lock") == 0 and d.rc("backup") == 0
    before = state(d)
    assert d.rc("raw", op, 1, False) == 100000
    assert d.rc("raw", op, 0, True) == 100000
    assert state(d) == before
    assert d.rc("raw", op, 0, False) == 0


def test_device_calls_on_other_threads_block_until_unlock(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0
    addr = d.call("malloc", 4096)["addr"]
    assert d.rc("lock") == 0
    d.call("bg", "m", "malloc", 4096)
    d.call("bg", "c", "read", addr, 4096)
    time.sleep(0.3)
    assert d.call("bgwait", "m", 0.2)["done"] is False
    assert d.call("bgwait", "c", 0.0)["done"] is False
    # queries, synchronize and the snapshot calls themselves do not block
    assert state(d) == LOCKED
    assert d.rc("sync") == 0
    assert d.call("getdev")["dev"] == 0
    assert d.rc("backup") == 0
    assert d.call("bgwait", "m", 0.2)["done"] is False
    assert d.rc("unlock") == 0
    m = d.call("bgwait", "m", 5.0)
    c = d.call("bgwait", "c", 5.0)
    assert m["done"] and m["result"]["rc"] == 0 and m["result"]["addr"] not in (0, addr)
    assert c["done"] and c["result"]["rc"] == 0


def test_lock_neither_waits_for_nor_fails_on_calls_in_flight(make_driver: Callable[..., Driver]) -> None:
    """As CANN: a call past its entry check runs to completion; Lock does not wait for it."""
    # 2 MB/s makes a 2 MiB copy take ~1 s: an in-flight device call.
    d = make_driver({"NPUSIM_COPY_MBPS": "2"})
    assert d.rc("set", 0) == 0
    addr = d.call("malloc", 2 * MiB)["addr"]
    d.call("bg", "r", "read", addr, 2 * MiB)
    time.sleep(0.2)
    t0 = time.monotonic()
    assert d.rc("lock") == 0
    assert time.monotonic() - t0 < 0.5  # did not wait for the copy
    assert state(d) == LOCKED
    assert d.call("bgwait", "r", 5.0)["result"]["rc"] == 0  # completed while LOCKED, not failed
    d.call("bg", "m", "malloc", 4096)  # made after Lock: waits, never fails
    assert d.call("bgwait", "m", 0.3)["done"] is False
    assert d.rc("unlock") == 0
    assert d.call("bgwait", "m", 5.0)["result"]["rc"] == 0


def test_lock_times_out_on_a_background_thread_and_goes_back_to_running(
    make_driver: Callable[..., Driver],
) -> None:
    """A registered background thread that never parks: Lock polls it for the wait (60 s in CANN,
    NPUSIM_LOCK_WAIT_MS here), then returns 507905 and the state is RUNNING again. Calls made
    meanwhile wait and then go through."""
    d = make_driver({"NPUSIM_FAULT_LOCK_TIMEOUT": "1", "NPUSIM_LOCK_WAIT_MS": "600"})
    assert d.rc("set", 0) == 0
    d.call("bg", "l", "lock")
    time.sleep(0.2)
    assert state(d) == LOCKED  # while it polls
    d.call("bg", "m", "malloc", 4096)
    assert d.call("bgwait", "m", 0.1)["done"] is False
    t0 = time.monotonic()
    assert d.call("bgwait", "l", 5.0)["result"]["rc"] == 507905
    assert time.monotonic() - t0 > 0.2
    assert state(d) == RUNNING
    assert d.call("bgwait", "m", 5.0)["result"]["rc"] == 0


def test_callbacks_run_per_stage_and_device(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0 and d.rc("set", 1) == 0
    for stage in range(6):
        assert d.rc("register", stage, 0) == 0
    assert d.rc("register_twice", 3) == 507913
    assert d.rc("register", 6, 0) == 107000
    assert d.rc("register", -1, 0) == 107000
    assert d.rc("register_null", 0) == 107000
    for op in ("lock", "backup", "restore", "unlock"):
        assert d.rc(op) == 0
    calls = d.call("calls")["calls"]
    # As in CANN: BACKUP_POST and RESTORE_POST run before the state changes, UNLOCK_POST after.
    assert calls == [
        [0, 0, RUNNING],
        [0, 1, RUNNING],
        [1, 0, LOCKED],
        [1, 1, LOCKED],
        [2, 0, LOCKED],
        [2, 1, LOCKED],
        [3, 0, BACKED_UP],
        [3, 1, BACKED_UP],
        [4, 0, BACKED_UP],
        [4, 1, BACKED_UP],
        [5, 0, RUNNING],
        [5, 1, RUNNING],
    ]
    # LOCK_PRE runs before Lock's state check: also when Lock then fails.
    assert d.rc("lock") == 0
    n = len(d.call("calls")["calls"])
    assert d.rc("lock") == 507906
    assert d.call("calls")["calls"][n:] == [[0, 0, LOCKED], [0, 1, LOCKED]]
    assert d.rc("unlock") == 0
    assert d.rc("unregister", 0) == 0
    assert d.rc("unregister", 0) == 107000  # no longer registered
    assert d.rc("register", 0, 7) == 0  # a failing LOCK_PRE callback aborts the lock
    assert d.rc("lock") == 507912
    assert state(d) == RUNNING


def test_no_fixed_limit_on_callbacks(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0
    for _ in range(40):  # beyond 32: a fixed-size callback table would stop there
        assert d.rc("register_new", 5) == 0
    assert d.rc("lock") == 0 and d.rc("unlock") == 0
    assert len([c for c in d.call("calls")["calls"] if c[0] == 5]) == 40


def test_failing_backup_pre_callback_keeps_the_process_locked(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0
    assert d.rc("register", 1, 1) == 0
    assert d.rc("lock") == 0
    assert d.rc("backup") == 507912
    assert state(d) == LOCKED
    assert d.rc("unlock") == 0 and state(d) == RUNNING


POISON_HEAD = "efbeadde" * 4  # 0xDEADBEEF words, little-endian


def test_addresses_survive_restore_but_contents_do_not(
    make_driver: Callable[..., Driver],
) -> None:
    """As CANN's legacy flow: Restore gives every allocation back at its address, poisoned."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    a = d.call("malloc", 3 * MiB + 17)["addr"]
    b = d.call("malloc", 4096)["addr"]
    assert a >= wire.ADDR_BASE and b >= wire.ADDR_BASE  # device addresses, not host ones
    crc_a = d.call("fill", a, 3 * MiB + 17, "a")["crc"]
    d.call("fill", b, 4096, "b")
    socks = socket_fds(d.pid)
    assert d.rc("lock") == 0 and d.rc("backup") == 0
    # The daemon connection is the device handle: kept across Backup, as CANN keeps /dev/davinci*
    assert socket_fds(d.pid) == socks
    assert d.rc("restore") == 0 and d.rc("unlock") == 0
    assert socket_fds(d.pid) == socks
    got_a = d.call("read", a, 3 * MiB + 17)
    assert got_a["rc"] == 0 and got_a["head"] == POISON_HEAD and got_a["crc"] != crc_a
    assert d.call("read", b, 4096)["head"] == POISON_HEAD
    # The pointers stay valid: writes, partial reads and device-to-device copies work on them.
    crc_a = d.call("fill", a, 3 * MiB + 17, "a2")["crc"]
    assert d.call("read", a, 3 * MiB + 17)["crc"] == crc_a
    # Unlock straight from BACKED_UP (the original keeps running after a dump) keeps the bytes.
    assert d.rc("lock") == 0 and d.rc("backup") == 0 and d.rc("unlock") == 0
    assert d.call("read", a, 3 * MiB + 17)["crc"] == crc_a
    assert d.rc("d2d", b, a, 4096) == 0
    assert d.call("read", b, 4096)["crc"] == d.call("read", a, 4096)["crc"]
    c = d.call("malloc", 4096)["addr"]
    assert c not in (a, b) and not (a <= c < a + 3 * MiB + 17)


def device_mappings(pid: int) -> list[str]:
    """The lines of /proc/PID/maps that map simulated device memory (the daemon's memfds)."""
    with open(f"/proc/{pid}/maps") as f:
        return [ln for ln in f if "memfd:npusim-dev" in ln]


def test_device_memory_is_shared_memory_mapped_until_backup(
    make_driver: Callable[..., Driver], sim_env: dict[str, str]
) -> None:
    """Copies go through a mapping of the daemon's memfd, never through the socket. The mapping
    stays while LOCKED (the driver layer has no lock: drvMemcpy works then), and Backup drops it
    (it must not reach a CRIU image, as a real device mapping does not); the copies of Backup and
    Restore map for their own duration only."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    a = d.call("malloc", 2 * MiB)["addr"]
    crc = d.call("fill", a, 2 * MiB, "shm")["crc"]
    assert d.call("read", a, 2 * MiB)["crc"] == crc
    assert len(device_mappings(d.pid)) == 1
    assert d.rc("lock") == 0
    assert len(device_mappings(d.pid)) == 1
    assert d.rc("backup") == 0 and device_mappings(d.pid) == []
    assert d.rc("unlock") == 0
    assert d.call("read", a, 2 * MiB)["crc"] == crc  # Unlock without Restore keeps the bytes
    assert len(device_mappings(d.pid)) == 1
    assert d.rc("free", a) == 0 and device_mappings(d.pid) == []
    # The bytes go through the mapping only: byte-streaming operations are refused, not a second path.
    with wire.connect(sim_env["NPUSIM_SOCKET"]) as s:
        for op in (6, 7, 8):
            assert wire.request(s, op, 0, a, 0, 16)[0] == -errno.EOPNOTSUPP


def test_restore_without_criu_poisons_the_same_process_too(make_driver: Callable[..., Driver]) -> None:
    """Restore in the very process that backed up (no CRIU in between) also loses the contents."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    a = d.call("malloc", 4096)["addr"]
    crc = d.call("fill", a, 4096, "x")["crc"]
    assert d.rc("lock") == 0 and d.rc("backup") == 0 and d.rc("restore") == 0 and d.rc("unlock") == 0
    got = d.call("read", a, 4096)
    assert got["head"] == POISON_HEAD and got["crc"] != crc


def test_both_front_ends_share_one_runtime_state(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0
    assert d.rc("lock") == 0
    assert d.rc("ascendcl", "lock") == 507906
    assert d.rc("ascendcl", "unlock") == 0
    assert state(d) == RUNNING


def test_devices_are_shared_and_a_dead_owner_is_freed(
    make_driver: Callable[..., Driver], sim_env: dict[str, str]
) -> None:
    a = make_driver()
    b = make_driver()
    assert a.rc("set", 0) == 0
    addr = a.call("malloc", 8 * MiB)["addr"]
    assert a.call("fill", addr, 8 * MiB, "dead")["rc"] == 0
    # Shared, as an Ascend device: another process opens it and allocates, each its own memory.
    assert b.rc("set", 0) == 0
    other = b.call("malloc", 4096)["addr"]
    assert other != addr and b.call("read", addr, 16)["rc"] == 107000  # not b's memory
    assert b.rc("reset", 0) == 0
    assert b.rc("set", 1) == 0
    assert sorted(b.call("devices")["devices"]) == [1]
    dev0 = daemon_status(sim_env)["devices"][0]
    assert dev0["owner"]["pid"] == a.pid and dev0["used"] >= 8 * MiB
    assert [o["pid"] for o in dev0["owners"]] == [a.pid]
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait()
    # the reaper frees the dead owner's memory on its own ...
    assert wait_for(lambda: daemon_status(sim_env)["devices"][0]["owner"] is None, 5.0)
    assert daemon_status(sim_env)["devices"][0]["used"] == 0
    # ... and the device can be claimed again
    assert b.rc("set", 0) == 0
    assert sorted(b.call("devices")["devices"]) == [0, 1]
    assert b.rc("reset", 0) == 0 and b.rc("reset", 1) == 0
    assert b.call("devices")["devices"] == []


def test_visible_devices_map_user_ids_onto_the_driver_s(
    make_driver: Callable[..., Driver], sim_env: dict[str, str]
) -> None:
    """ASCEND_RT_VISIBLE_DEVICES as the runtime reads it (runtime.cc GetVisibleDevices): user id
    0 of "1" is device 1 (its memory is there, aclrtGetDevice still says 0); a list that does
    not ascend, repeats or names nothing the driver has leaves no device."""
    d = make_driver({"ASCEND_RT_VISIBLE_DEVICES": "1"})
    assert d.call("count") == {"rc": 0, "count": 1}
    assert d.rc("set", 1) == 107001  # past the list
    assert d.rc("set", 0) == 0 and d.call("getdev")["dev"] == 0
    assert d.call("malloc", 4 * MiB)["rc"] == 0
    devs = {x["id"]: x for x in daemon_status(sim_env)["devices"]}
    assert [o["pid"] for o in devs[1]["owners"]] == [d.pid] and devs[1]["used"] >= 4 * MiB
    assert d.pid not in [o["pid"] for o in devs[0]["owners"]]
    assert d.rc("lock") == 0 and d.rc("backup") == 0 and d.rc("restore") == 0 and d.rc("unlock") == 0
    assert d.call("devices")["devices"] == [0]  # the runtime's own view stays in user ids
    # "1,5": 5 is no device of the driver's, so the list ends before it
    assert make_driver({"ASCEND_RT_VISIBLE_DEVICES": "1,5"}).call("count") == {"rc": 0, "count": 1}
    for bad in ("1,0", "0,0", "7", "x"):
        e = make_driver({"ASCEND_RT_VISIBLE_DEVICES": bad})
        assert e.call("count")["rc"] == 207004, bad
        assert e.rc("set", 0) == 107001, bad


def test_the_device_connection_is_kept_across_backup_and_its_end_frees_the_device(
    make_driver: Callable[..., Driver], sim_env: dict[str, str]
) -> None:
    """The daemon connection is the process's device handle (as /dev/davinci_manager is CANN's):
    open across Lock and Backup (CRIU needs npusim_plugin.so for it), and when it ends the daemon
    frees the process's devices and memory without waiting for its reaper."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    addr = d.call("malloc", MiB)["addr"]
    crc = d.call("fill", addr, MiB, "kept")["crc"]
    assert d.rc("lock") == 0 and d.rc("backup") == 0

    def owner() -> dict[str, Any]:
        return next(o for o in daemon_status(sim_env)["owners"] if o["pid"] == d.pid)

    held = owner()
    assert held["device_connections"] == 1 and held["devices"] == [0] and held["bytes"] >= MiB
    assert d.rc("unlock") == 0  # from BACKED_UP, over the kept connection
    assert d.call("read", addr, MiB)["crc"] == crc
    log = Path(sim_env["NPUSIM_SOCKET"]).with_name("npusim.log")
    pid = d.pid
    os.kill(pid, signal.SIGKILL)
    d.proc.wait()
    assert wait_for(lambda: all(o["pid"] != pid for o in daemon_status(sim_env)["owners"]), 5.0)
    assert f"pid {pid} (start " in log.read_text() and "closed its device connection" in log.read_text()


def test_errors_of_ordinary_calls(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.call("malloc", 16)["rc"] == 100001  # before aclrtSetDevice
    assert d.call("getdev")["rc"] == 107002
    assert d.rc("sync") == 100001
    assert d.rc("init") == 0 and d.rc("init") == 100002
    # the simulator has devices 0 and 1; api_error.cc SetDevice: RT_ERROR_DEVICE_ID for both
    assert d.rc("set", 2) == 107001
    assert d.rc("set", -1) == 107001
    assert d.rc("set", 0) == 0
    assert d.call("malloc", 0)["rc"] == 107000
    assert d.call("malloc", 2 << 30)["rc"] == 207001  # more than the 1 GiB capacity
    a = d.call("malloc", 4096)["addr"]
    assert d.rc("free", a + 8) == 107000
    assert d.call("read", a, 8192)["rc"] == 107000  # past the end of the allocation
    assert d.call("read", a + 4000, 96)["rc"] == 0
    assert d.rc("memcpy", a, 16, a, 32, 3) == 107000  # count > destMax
    assert d.rc("memcpy", a, 16, a, 16, 4) == 107000  # unknown kind
    assert d.call("read", 0x1234_0000, 16)["rc"] == 107000  # not a device pointer
    v = d.call("version")
    assert v["rc"] == 0 and v["version"] == "9.1.0"
    assert d.rc("free", a) == 0 and d.rc("free", a) == 107000
    assert d.rc("finalize") == 0
    # CANN's aclFinalize resets no device (acl's aclFinalizeInternal); a reset does, or the exit.
    assert d.call("devices")["devices"] == [0]
    assert d.rc("reset", 0) == 0
    assert d.call("devices")["devices"] == []


def test_exit_while_locked_is_force_unlocked(make_driver: Callable[..., Driver], tmp_path: Path) -> None:
    d = make_driver(stderr=tmp_path / "err")
    assert d.rc("set", 0) == 0
    assert d.rc("lock") == 0 and d.rc("backup") == 0
    d.send("exit", 0)
    assert d.proc.wait(10) == 0
    assert "force-unlocked" in (tmp_path / "err").read_text()


@pytest.mark.parametrize(
    ("var", "scenario"),
    [
        ("NPUSIM_FAULT_LOCK_TIMEOUT", [("lock", 507905, RUNNING)]),
        (
            "NPUSIM_FAULT_BACKUP_CODE",
            [("lock", 0, LOCKED), ("backup", 207000, LOCKED), ("unlock", 0, RUNNING)],
        ),
        ("NPUSIM_FAULT_BACKUP", [("lock", 0, LOCKED), ("backup", 507908, LOCKED), ("unlock", 0, RUNNING)]),
        (
            "NPUSIM_FAULT_RESTORE",
            [
                ("lock", 0, LOCKED),
                ("backup", 0, BACKED_UP),
                ("restore", 507909, BACKED_UP),
                ("unlock", 0, RUNNING),
            ],
        ),
        ("NPUSIM_FAULT_UNLOCK", [("lock", 0, LOCKED), ("unlock", 507907, LOCKED)]),
    ],
)
def test_fault_switches_from_the_environment(
    make_driver: Callable[..., Driver], var: str, scenario: list[tuple[str, int, int]]
) -> None:
    d = make_driver({var: "207000" if var.endswith("_CODE") else "1", "NPUSIM_LOCK_WAIT_MS": "100"})
    assert d.rc("set", 0) == 0
    for op, rc, st in scenario:
        assert (d.rc(op), state(d)) == (rc, st), op


def test_fault_file_toggles_faults_in_a_running_process(
    make_driver: Callable[..., Driver], tmp_path: Path
) -> None:
    faults = tmp_path / "faults"
    faults.write_text("NPUSIM_FAULT_LOCK_TIMEOUT=1\nNPUSIM_LOCK_WAIT_MS=100\n")
    d = make_driver({"NPUSIM_FAULT_FILE": str(faults)})
    assert d.rc("set", 0) == 0
    assert d.rc("lock") == 507905
    faults.write_text("NPUSIM_FAULT_LOCK_TIMEOUT=0\nNPUSIM_FAULT_UNLOCK = 1\n")
    assert d.rc("lock") == 0
    assert d.rc("unlock") == 507907
    faults.write_text("")
    assert d.rc("unlock") == 0 and state(d) == RUNNING


def test_backup_hang_and_slow_copies(make_driver: Callable[..., Driver], tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("NPUSIM_BACKUP_HANG_MS=400\n")
    d = make_driver({"NPUSIM_FAULT_FILE": str(faults)})
    assert d.rc("set", 0) == 0
    a = d.call("malloc", 4 * MiB)["addr"]
    t0 = time.monotonic()
    assert d.call("read", a, 4 * MiB)["rc"] == 0
    fast = time.monotonic() - t0
    assert d.rc("lock") == 0
    t0 = time.monotonic()
    assert d.rc("backup") == 0
    assert time.monotonic() - t0 >= 0.4
    assert d.rc("unlock") == 0
    slow = make_driver({"NPUSIM_COPY_MBPS": "10"})
    assert slow.rc("set", 1) == 0
    b = slow.call("malloc", 4 * MiB)["addr"]
    t0 = time.monotonic()
    assert slow.call("read", b, 4 * MiB)["rc"] == 0
    took = time.monotonic() - t0
    assert took >= 0.35 and took > fast  # 4 MiB at 10 MB/s is ~0.42 s


def test_restore_needs_the_device_free_of_other_processes(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    other = make_driver()
    assert d.rc("set", 1) == 0
    assert d.rc("lock") == 0 and d.rc("backup") == 0
    assert other.rc("set", 1) == 0  # sharing is fine while backed up
    assert d.rc("restore") == 507909 and state(d) == BACKED_UP
    other.close()
    assert d.rc("restore") == 0 and d.rc("unlock") == 0


def test_a_chip_without_snapshot_support(make_driver: Callable[..., Driver]) -> None:
    d = make_driver({"NPUSIM_NO_SNAPSHOT": "1"})
    assert d.rc("set", 0) == 0
    assert d.call("state_rc")["rc"] == 207000
    for op in ("lock", "backup", "restore", "unlock"):
        assert d.rc(op) == 207000
    # the feature is checked first: Register and Unregister too (api_c_snapshot.cc)
    assert d.rc("register", 0, 0) == 207000
    assert d.rc("unregister", 0) == 207000
    a = d.call("malloc", 4096)["addr"]  # ordinary device work is unaffected
    assert d.call("fill", a, 4096, "x")["rc"] == 0


def test_the_zero_argument_abi_of_cann_9_0(sim_env: dict[str, str]) -> None:
    """The 9.0 tree declares the snapshot functions without arguments: whatever a caller passes in
    the registers is ignored (npusnap calls every version as f(getpid(), NULL))."""
    from npusnap_cli import paths

    home = paths.build_dir() / paths.SIM_CANN_TREES["9.0"]
    d = Driver(sim_env, {"ASCEND_HOME_PATH": str(home), "LD_LIBRARY_PATH": str(home / "lib64")})
    try:
        assert d.call("version")["version"] == "9.0.0"
        assert d.rc("set", 0) == 0
        assert d.rc("raw", "lock", 1, True) == 0  # another pid and a non-NULL pointer: ignored
        assert d.rc("raw", "backup", 7, False) == 0
        assert d.rc("raw", "unlock", 0, True) == 0
        assert state(d) == RUNNING
    finally:
        d.close()
