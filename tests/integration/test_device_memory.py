"""npusnap keeps the job's device memory: libnpusnap_agent.so (native/agent/devmem.c) on the
truthful simulator, whose Restore, like CANN's, keeps addresses but not contents.

Through plain ctypes (the acl_driver child, with and without LD_PRELOAD) and through a C program
linked against libacl_rt.so; then the CLI's refusal to dump device memory it cannot see.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest

from npusnap_cli.agent.launch import agent_library
from npusnap_cli.errors import ExitCode
from tests.conftest import REPO, requires_root
from tests.integration.agentlib import Sim, Workload, start_agent_workload
from tests.integration.dumplib import agent_state, cli, job_env, wait_until
from tests.integration.sim_helpers import Driver

pytestmark = pytest.mark.integration

POISON_HEAD = "efbeadde" * 4
LOCKED_STATE, BACKED_UP_STATE = 1, 2
MiB = 1 << 20


@pytest.fixture
def make_driver(sim_env: dict[str, str]) -> Iterator[Callable[..., Driver]]:
    drivers: list[Driver] = []

    def make(preload: bool = True, **extra: str) -> Driver:
        env = dict(extra, NPUSNAP_AGENT_LIB=str(agent_library()))
        if preload:
            env["LD_PRELOAD"] = str(agent_library())
        d = Driver(sim_env, env)
        drivers.append(d)
        return d

    yield make
    for d in drivers:
        d.close()


def snapshot_cycle(d: Driver) -> None:
    for op in ("lock", "backup", "restore", "unlock"):
        assert d.rc(op) == 0, op


def kept_cycle(
    d: Driver, save: tuple[object, ...] = ("dm_save", 5000), reload: tuple[object, ...] = ("dm_reload",)
) -> None:
    """What the agent does: Lock, drain and copy (the runtime's lock holds the job), Backup,
    Restore, write back while still LOCKED, Unlock, drop the copies."""
    assert d.rc("lock") == 0
    r = d.call(*save)
    assert r["rc"] == 0, r
    assert d.rc("backup") == 0 and d.rc("restore") == 0
    r = d.call(*reload)
    assert r["rc"] == 0, r
    assert d.rc("unlock") == 0
    assert d.call("dm_finish")["rc"] == 0


def test_ctypes_allocations_are_tracked_saved_and_reloaded(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 1) == 0
    a = d.call("malloc", 2 * MiB + 5)["addr"]
    b = d.call("malloc", 4096)["addr"]
    crc_a = d.call("fill", a, 2 * MiB + 5, "a")["crc"]
    crc_b = d.call("fill", b, 4096, "b")["crc"]
    info = d.call("dm_info")
    assert info["interposed"] == 1 and info["allocations"] == 2 and info["bytes"] == 2 * MiB + 5 + 4096
    assert d.rc("free", b) == 0
    assert d.call("dm_info")["allocations"] == 1  # aclrtFree is seen too
    b = d.call("malloc", 4096)["addr"]
    crc_b = d.call("fill", b, 4096, "b")["crc"]

    # Bare runtime calls: the contents are lost, as on CANN.
    snapshot_cycle(d)
    assert d.call("read", a, 4096)["head"] == POISON_HEAD
    crc_a = d.call("fill", a, 2 * MiB + 5, "a")["crc"]
    crc_b = d.call("fill", b, 4096, "b")["crc"]

    # With npusnap's copy, taken while LOCKED with the driver's copy: the same pointers hold
    # the same bytes afterwards.
    assert d.rc("lock") == 0
    save = d.call("dm_save", 5000)
    assert save["rc"] == 0, save
    info = d.call("dm_info")
    assert info["saved"] == 1 and info["gate_closed"] == 0 and info["saved_bytes"] == 2 * MiB + 5 + 4096
    assert d.rc("backup") == 0 and d.rc("restore") == 0
    assert d.call("dm_reload")["rc"] == 0
    assert d.rc("unlock") == 0
    assert d.call("dm_finish")["rc"] == 0
    assert d.call("read", a, 2 * MiB + 5)["crc"] == crc_a
    assert d.call("read", b, 4096)["crc"] == crc_b
    info = d.call("dm_info")
    assert info["saved"] == 0 and info["gate_closed"] == 0 and info["saved_bytes"] == 0


def test_the_copy_in_a_file_and_a_file_that_does_not_match(
    make_driver: Callable[..., Driver], tmp_path: Path
) -> None:
    """npusnap_devmem_save_fd writes the copies into a file (header, records, bytes) and holds
    nothing in host memory; reload_fd writes them back, and refuses a file whose records do not
    match the process (another process's, or an older one)."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    a = d.call("malloc", 3 * MiB + 7)["addr"]
    b = d.call("malloc", 4096)["addr"]
    crc_a = d.call("fill", a, 3 * MiB + 7, "a")["crc"]
    crc_b = d.call("fill", b, 4096, "b")["crc"]
    path = tmp_path / "devmem.bin"
    assert d.rc("lock") == 0
    save = d.call("dm_save_file", str(path), 5000)
    assert save["rc"] == 0, save
    assert save["written"] == path.stat().st_size > 3 * MiB + 4096
    info = d.call("dm_info")
    assert info["saved"] == 1 and info["in_file"] == 1 and info["saved_bytes"] == 3 * MiB + 7 + 4096
    assert d.rc("backup") == 0 and d.rc("restore") == 0  # the contents are gone (poisoned), still LOCKED
    # The in-memory reload has nothing to write back: it says so instead of succeeding.
    r = d.call("dm_reload")
    assert r["rc"] != 0 and "file" in r["message"], r
    # Another process's file (other addresses and sizes) is refused, nothing is written.
    other = make_driver()
    assert other.rc("set", 0) == 0
    other.call("malloc", 8192)
    other_path = tmp_path / "other.bin"
    assert other.call("dm_save_file", str(other_path), 5000)["rc"] == 0
    other.call("dm_finish")
    r = d.call("dm_reload_file", str(other_path))
    assert r["rc"] != 0 and "allocations" in r["message"], r
    # A truncated file is refused too.
    cut = tmp_path / "cut.bin"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    r = d.call("dm_reload_file", str(cut))
    assert r["rc"] != 0 and "its records need" in r["message"], r  # checked before anything is mapped
    assert d.call("dm_reload_file", str(path))["rc"] == 0
    assert d.rc("unlock") == 0
    d.call("dm_finish")
    assert d.call("read", a, 3 * MiB + 7)["crc"] == crc_a
    assert d.call("read", b, 4096)["crc"] == crc_b
    assert d.call("dm_info")["in_file"] == 0


@requires_root
def test_file_save_of_many_chunks_on_several_threads_and_a_failed_write(
    make_driver: Callable[..., Driver], tmp_path: Path
) -> None:
    """The agent copies device memory to and from the file a chunk at a time on several threads
    (devmem_save.c's xfer_run): allocations of odd sizes across chunk boundaries come back byte for
    byte; a write that fails (the disk is full) fails the save with its cause and leaves the
    job's device memory as it was."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    sizes = [37 * MiB + 5, 4 * MiB, 1, 16 * MiB - 3]
    addrs = [d.call("malloc", n)["addr"] for n in sizes]
    crcs = [d.call("fill", a, n, f"x{i}")["crc"] for i, (a, n) in enumerate(zip(addrs, sizes))]
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        assert d.rc("lock") == 0
        r = d.call("dm_save_file", str(small / "devmem.bin"), 5000)
        assert d.rc("unlock") == 0  # what the agent does after a failed save
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert r["rc"] != 0 and "cannot write the device-memory file: No space left on device" in r["message"], r
    assert d.call("dm_info")["saved"] == 0
    assert [d.call("read", a, n)["crc"] for a, n in zip(addrs, sizes)] == crcs

    path = tmp_path / "devmem.bin"
    assert d.rc("lock") == 0
    save = d.call("dm_save_file", str(path), 5000)
    assert save["rc"] == 0 and save["written"] == path.stat().st_size == 32 + 24 * 4 + sum(sizes), save
    assert d.rc("backup") == 0 and d.rc("restore") == 0  # the contents are gone (poisoned)
    assert d.call("dm_reload_file", str(path))["rc"] == 0
    assert d.rc("unlock") == 0
    d.call("dm_finish")
    assert [d.call("read", a, n)["crc"] for a, n in zip(addrs, sizes)] == crcs


def test_one_process_on_two_devices(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 0) == 0
    a = d.call("malloc", 8192)["addr"]
    assert d.rc("set", 1) == 0
    b = d.call("malloc", 8192)["addr"]
    crc_a = d.call("fill", a, 8192, "on device 0")["crc"]
    crc_b = d.call("fill", b, 8192, "on device 1")["crc"]
    assert d.rc("lock") == 0
    assert d.call("dm_save", 5000)["rc"] == 0
    assert d.call("dm_info")["saved_bytes"] == 16384
    assert d.rc("backup") == 0 and d.rc("restore") == 0
    assert d.call("dm_reload")["rc"] == 0
    assert d.rc("unlock") == 0
    d.call("dm_finish")
    assert d.call("read", a, 8192)["crc"] == crc_a
    assert d.call("read", b, 8192)["crc"] == crc_b


def test_a_device_set_twice_keeps_its_memory_until_the_second_reset(
    make_driver: Callable[..., Driver],
) -> None:
    """CANN counts aclrtSetDevice calls and releases a device when aclrtResetDevice brings the
    count to 0 (torch_npu sets the device in each of its threads): one reset of two leaves the
    device open with its memory, and npusnap still keeps that memory; the second releases it.
    aclrtResetDeviceForce releases it at once (CANN's reference for both)."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    assert d.rc("set", 0) == 0
    a = d.call("malloc", 8192)["addr"]
    crc = d.call("fill", a, 8192, "kept")["crc"]
    assert d.rc("reset", 0) == 0
    assert d.call("getdev") == {"rc": 0, "dev": 0}
    assert d.call("read", a, 8192)["crc"] == crc
    assert d.call("dm_info")["allocations"] == 1
    kept_cycle(d)
    assert d.call("read", a, 8192)["crc"] == crc
    assert d.rc("reset", 0) == 0
    assert d.call("getdev")["rc"] != 0  # released: no current device
    assert d.call("dm_info")["allocations"] == 0
    # aclrtResetDeviceForce releases whatever the count; a second one finds nothing to release.
    assert d.rc("set", 0) == 0 and d.rc("set", 0) == 0
    assert d.rc("reset_force", 0) == 0
    assert d.call("getdev")["rc"] != 0
    assert d.rc("reset_force", 0) != 0


def test_a_set_racing_the_last_reset_keeps_the_device_and_its_memory_consistent(
    make_driver: Callable[..., Driver],
) -> None:
    """A thread's aclrtSetDevice racing another thread's last aclrtResetDevice (torch_npu's
    threads against its exit): CANN's set waits for the release to finish and opens the device
    afresh, or comes first and keeps it. Either way the setter has its context at once, and
    npusnap keeps the old allocation exactly when the device still holds it."""
    d = make_driver()
    outcomes = set()
    for i in range(40):
        assert d.rc("set", 0) == 0
        a = d.call("malloc", 4096)["addr"]
        crc = d.call("fill", a, 4096, f"race {i}")["crc"]
        # Even rounds race within a few hundred microseconds; odd ones let the set lead by
        # milliseconds, so that both orders are seen on a busy machine too.
        race = d.call("race_set_reset", 0, (i % 8) * 40 if i % 2 == 0 else -2500 * (i % 8))
        assert (race["set"], race["ctx"], race["reset"]) == (0, 0, 0), (i, race)
        kept = d.call("dm_info")["allocations"]
        read = d.call("read", a, 4096)
        if kept:
            assert kept == 1 and read == {**read, "rc": 0, "crc": crc}, (i, read)
        else:
            assert read["rc"] != 0, (i, read)  # released with the device, and untracked
        outcomes.add(bool(kept))
        assert d.rc("reset", 0) == 0  # the setter's count: the device is released now
        assert d.call("getdev")["rc"] != 0
        assert d.call("dm_info")["allocations"] == 0
    assert True in outcomes, "the set never came first: the race was not run"


def test_the_runtimes_lock_holds_the_job_until_the_memory_is_back(make_driver: Callable[..., Driver]) -> None:
    """No gate of npusnap's: the runtime's own lock holds another thread's device calls from Lock
    to Unlock, npusnap copies and writes back with the driver's copy meanwhile, so the thread's
    read, made while LOCKED, sees the bytes of before the snapshot, never the poison."""
    d = make_driver()
    assert d.rc("set", 1) == 0
    a = d.call("malloc", 4096)["addr"]
    crc = d.call("fill", a, 4096, "x")["crc"]
    assert d.rc("lock") == 0
    d.call("bg", "r", "read", a, 4096)
    d.call("bg", "m", "malloc", 4096)
    assert d.call("bgwait", "r", 0.5)["done"] is False  # held by the runtime
    assert d.call("dm_save", 5000)["rc"] == 0  # the driver's copy is not held
    assert d.rc("backup") == 0 and d.rc("restore") == 0
    assert d.call("dm_reload")["rc"] == 0
    assert d.call("bgwait", "r", 0.3)["done"] is False  # still LOCKED: still held
    assert d.call("getdev")["dev"] == 1  # queries are not held
    assert d.rc("unlock") == 0
    d.call("dm_finish")
    assert d.call("bgwait", "r", 5)["result"]["crc"] == crc
    assert d.call("bgwait", "m", 5)["result"]["rc"] == 0


def test_save_drains_the_device_at_most_the_timeout(make_driver: Callable[..., Driver]) -> None:
    """A copy queued on a stream before Lock is finished by the drain before the bytes are read;
    a device that does not finish its queued work within the timeout fails the save (the agent
    then unlocks and the job runs on)."""
    d = make_driver(NPUSIM_COPY_MBPS="2")  # a 4 MiB copy takes about 2 s
    assert d.rc("set", 1) == 0
    a = d.call("malloc", 4 * MiB)["addr"]
    d.call("bg", "slow", "fill", a, 4 * MiB, "s")
    time.sleep(0.5)  # the thread is inside the copy now (the whole copy takes about 2 s)
    assert d.call("bgwait", "slow", 0)["done"] is False
    assert d.rc("lock") == 0  # a call past the runtime's entry check runs on
    save = d.call("dm_save", 200)
    assert save["rc"] == -110 and "still running" in save["message"], save  # -ETIMEDOUT
    assert d.call("dm_info")["saved"] == 0
    assert d.rc("unlock") == 0
    crc = d.call("bgwait", "slow", 10)["result"]["crc"]
    # Once nothing is in flight, the same save waits for nothing, and has the whole fill.
    assert d.rc("lock") == 0
    assert d.call("dm_save", 200, timeout=30)["rc"] == 0
    assert d.rc("backup") == 0 and d.rc("restore") == 0
    assert d.call("dm_reload", timeout=30)["rc"] == 0
    assert d.rc("unlock") == 0
    d.call("dm_finish")
    assert d.call("read", a, 4 * MiB, timeout=30)["crc"] == crc


def test_vmm_ranges_are_tracked_saved_and_reloaded(make_driver: Callable[..., Driver]) -> None:
    """An expandable segment (aclrtReserveMemAddress + aclrtMallocPhysical + aclrtMapMem, as
    torch_npu's caching allocator): the driver-layer tracking sees the mapped range; CANN's
    Restore gives the mapping back at its address without its contents (the assumption the
    simulator follows, docs/device-memory.md), and npusnap's copy brings the bytes back."""
    d = make_driver()
    assert d.rc("set", 0) == 0
    v = d.call("vmm_alloc", 2 * MiB, 0)
    assert v["rc"] == 0, v
    a = d.call("malloc", 4096)["addr"]
    crc_v = d.call("fill", v["addr"], 2 * MiB, "segment")["crc"]
    crc_a = d.call("fill", a, 4096, "plain")["crc"]
    info = d.call("dm_info")
    assert info["vmm_bytes"] == 2 * MiB and info["bytes"] == 2 * MiB + 4096, info
    assert info["reserved_bytes"] >= 2 * MiB
    snapshot_cycle(d)
    assert d.call("read", v["addr"], 4096)["head"] == POISON_HEAD  # the mapping came back, its bytes not
    crc_v = d.call("fill", v["addr"], 2 * MiB, "segment")["crc"]
    crc_a = d.call("fill", a, 4096, "plain")["crc"]
    kept_cycle(d)
    assert d.call("read", v["addr"], 2 * MiB)["crc"] == crc_v
    assert d.call("read", a, 4096)["crc"] == crc_a


def test_excluded_and_registered_buffers(make_driver: Callable[..., Driver]) -> None:
    d = make_driver()
    assert d.rc("set", 1) == 0
    keep = d.call("malloc", 8192)["addr"]
    scratch = d.call("malloc", 8192)["addr"]
    crc = d.call("fill", keep, 8192, "k")["crc"]
    d.call("fill", scratch, 8192, "s")
    assert d.rc("dm_exclude", scratch, 8192) == 0
    info = d.call("dm_info")
    assert info["excluded_bytes"] == 8192
    kept_cycle(d)
    assert d.call("read", keep, 8192)["crc"] == crc
    assert d.call("read", scratch, 8192)["head"] == POISON_HEAD  # declared as needing no copy


def test_without_preload_only_registered_buffers_are_kept(make_driver: Callable[..., Driver]) -> None:
    """An agent in a process not started by `npusnap run` sees nothing by itself."""
    d = make_driver(preload=False)
    assert d.rc("set", 1) == 0
    a = d.call("malloc", 4096)["addr"]
    b = d.call("malloc", 4096)["addr"]
    crc_a = d.call("fill", a, 4096, "a")["crc"]
    d.call("fill", b, 4096, "b")
    info = d.call("dm_info")
    assert info["interposed"] == 0 and info["allocations"] == 0
    assert d.rc("dm_register", a, 4096) == 0
    assert d.call("dm_info")["allocations"] == 1
    kept_cycle(d)
    assert d.call("read", a, 4096)["crc"] == crc_a
    assert d.call("read", b, 4096)["head"] == POISON_HEAD


C_PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include "npusnap/devmem.h"
int aclInit(const char *); int aclrtSetDevice(int32_t); int aclrtMalloc(void **, size_t, int);
int aclrtMemcpy(void *, size_t, const void *, size_t, int);
int aclrtSnapShotProcessLock(int, void *); int aclrtSnapShotProcessBackup(int, void *);
int aclrtSnapShotProcessRestore(int, void *); int aclrtSnapShotProcessUnlock(int, void *);
int main(int argc, char **argv) {
    int use = argc > 1;
    void *d = NULL;
    char buf[64] = "linked against libacl_rt", out[64] = {0}, err[256] = "";
    if (aclInit(NULL) || aclrtSetDevice(1) || aclrtMalloc(&d, 64, 0) || aclrtMemcpy(d, 64, buf, 64, 1))
        return 2;
    void (*info)(npusnap_devmem_info *) = dlsym(RTLD_DEFAULT, "npusnap_devmem_get_info");
    int (*save)(int, char *, size_t) = dlsym(RTLD_DEFAULT, "npusnap_devmem_save");
    int (*reload)(char *, size_t) = dlsym(RTLD_DEFAULT, "npusnap_devmem_reload");
    void (*finish)(void) = dlsym(RTLD_DEFAULT, "npusnap_devmem_finish");
    npusnap_devmem_info i = {0};
    if (info) info(&i);
    printf("tracked %llu interposed %d\n", (unsigned long long)i.allocations, i.interposed);
    int p = getpid();
    if (aclrtSnapShotProcessLock(p, NULL)) return 4;
    if (use && save(1000, err, sizeof err)) return 3;
    if (aclrtSnapShotProcessBackup(p, NULL) || aclrtSnapShotProcessRestore(p, NULL)) return 4;
    if (use && reload(err, sizeof err)) return 5;
    if (aclrtSnapShotProcessUnlock(p, NULL)) return 4;
    if (use) finish();
    if (aclrtMemcpy(out, 64, d, 64, 2)) return 6;
    printf("%s\n", strcmp(out, buf) == 0 ? "same" : "lost");
    return 0;
}
"""


def test_a_c_program_linked_to_libacl_rt(sim_env: dict[str, str], tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src, exe = tmp_path / "prog.c", tmp_path / "prog"
    src.write_text(C_PROGRAM)
    lib64 = Path(sim_env["ASCEND_HOME_PATH"]) / "lib64"
    include = str(REPO / "native" / "include")
    argv = [cc, "-I", include, "-o", str(exe), str(src), f"-L{lib64}", "-lacl_rt", "-ldl"]
    subprocess.run(argv, check=True)

    def run(preload: bool, *args: str) -> list[str]:
        env = dict(sim_env)
        if preload:
            env["LD_PRELOAD"] = str(agent_library())
        done = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, (done.returncode, done.stderr)
        return done.stdout.split("\n")[:2]

    assert run(False) == ["tracked 0 interposed 0", "lost"]  # CANN's Restore alone
    assert run(True, "use") == ["tracked 1 interposed 1", "same"]


@requires_root
def test_dump_refuses_device_memory_it_cannot_see(
    sim: Sim, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    """agent.start() without `npusnap run`: the default dump refuses before locking anything;
    `--device-memory app` is the user's explicit choice and goes through."""
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads, WL_DEVICE=str(sim.device()))
    w.wait_steps(3)
    env = job_env(sim_env, runtime_dir)
    img = tmp_path / "img"
    rc, out, err = cli(env, "dump", str(w.pid), str(img), "--leave-running")
    assert rc == ExitCode.TARGET, err
    assert out is not None
    error = out["error"]
    assert "does not know their device memory" in error["message"]
    assert "CANN's Restore" in error["why"]
    assert "npusnap run" in error["fix"] and "register_buffer" in error["fix"]
    assert error["details"]["untracked_pids"] == [w.pid]
    assert not img.exists()
    assert agent_state(w.pid) == "RUNNING"
    w.wait_steps(3)

    rc, out, err = cli(env, "dump", str(w.pid), str(img), "--leave-running", "--device-memory", "app")
    assert rc == 0, err
    assert out is not None and out["result"]["device_memory"]["continuity"] == "application"
    assert agent_state(w.pid) == "RUNNING"
    wait_until(lambda: len(w.steps()) > 0, 5)
    w.wait_steps(3)
    w.assert_correct()  # leave-running: nothing was restored, nothing was lost


@requires_root
@pytest.mark.parametrize("cann", ["9.0", "9.1", "strict"])
def test_npusnap_round_trip_on_both_snapshot_abis(
    cann: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """CANN 8.5/9.0 declare Lock/Backup/Restore/Unlock without arguments, 9.1+ as (pid, args):
    npusnap drives both the same way, and the job continues exactly (device memory kept).
    ``strict``: the 9.1 tree whose libraries export real CANN and driver names only (the
    simulator's daemon refuses npusnap in every test: tests/integration/test_sim_guard.py)."""
    from npusnap_cli import paths
    from tests.integration.dumplib import PY, TRAIN, TRAIN_ARGS, Job, alive, reference

    home = paths.build_dir() / paths.SIM_CANN_TREES.get(cann, f"cann-{cann}")
    env = job_env(sim_env, runtime_dir)
    env.update(ASCEND_HOME_PATH=str(home), LD_LIBRARY_PATH=str(home / "lib64"), NPUSIM_CANN=cann)
    args = ["--steps", "40", *TRAIN_ARGS, "--device", "1", "--seed", "5"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["versions"]["cann"] == (
            "9.1.0" if cann == "strict" else f"{cann}.0"
        )
        job.reap()
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["device_memory"] == "npusnap"
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert job.lines() == ref
    finally:
        job.cleanup()


@requires_root
def test_device_memory_goes_to_its_own_image_file(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The agent writes its copy of the device memory into the image's device/ files (an index
    and its chunks, listed with their checksums), not into the process's memory: CRIU's pages
    are smaller by that much than with the copy held in the process (NPUSNAP_DEVMEM_IN_PROCESS=1),
    and both images
    restore a job whose checksums over its device memory go on unchanged. A changed byte in the
    file is refused before anything runs."""
    import json

    from tests.integration.dumplib import PY, Job, alive

    mib = 24
    bigalloc = str(REPO / "npusnap_workloads" / "bigalloc.py")
    argv = [PY, bigalloc, "--device-mib", str(mib), "--host-mib", "1", "--interval", "0.05", "--seed", "3"]
    env = job_env(sim_env, runtime_dir)

    def ticks(job: Job) -> list[str]:
        return [ln.split(" checksum ")[1] for ln in job.text().splitlines() if ln.startswith("tick ")]

    pages = {}
    for mode in ("file", "in-process"):
        (tmp_path / mode).mkdir()
        job = Job(tmp_path / mode, env, argv)
        image = tmp_path / mode / "img"
        try:
            wait_until(lambda j=job: len(ticks(j)) >= 3, 60, "bigalloc's first ticks")
            denv = dict(env, NPUSNAP_DEVMEM_IN_PROCESS="1" if mode == "in-process" else "0")
            rc, out, err = cli(denv, "dump", str(job.pid), str(image))
            assert rc == 0, (out or {}).get("error") or err
            listed = {f["path"]: f for f in json.loads((image / "npusnap.json").read_text())["files"]}
            rel = f"device/devmem-{job.pid}.idx"  # and its pieces in device/chunks (devchunks.py)
            if mode == "file":
                chunks = [f for p, f in listed.items() if p.startswith("device/chunks/")]
                assert rel in listed and sum(f["size"] for f in chunks) >= mib << 20, sorted(listed)
                assert (image / rel).stat().st_mode & 0o777 == 0o600
                assert {(image / f["path"]).stat().st_mode & 0o777 for f in chunks} == {0o400}
            else:
                assert not (image / "device").exists()
            pages[mode] = sum(f.stat().st_size for f in (image / "criu").glob("pages-*.img"))
            before = set(ticks(job))
            job.reap()
            rc, out, err = cli(env, "restore", str(image))
            assert rc == 0, (out or {}).get("error") or err
            job.restored_pid = out["result"]["root_pid"]
            n = len(ticks(job))
            wait_until(lambda j=job, n=n: len(ticks(j)) >= n + 3, 30, "ticks after the restore")
            # bigalloc's checksum covers its host memory and its device memory's first and last MiB.
            assert set(ticks(job)) == before, "the restored job's memory differs"
            assert alive(job.restored_pid)
        finally:
            job.cleanup()
    assert pages["in-process"] - pages["file"] >= (mib - 2) << 20, pages

    # A changed byte in the device memory: its checksum is checked while the device state is
    # restored, before the agent may load it; the tree is killed with its device memory unloaded.
    image = tmp_path / "file" / "img"
    dev = max((image / "device" / "chunks").iterdir(), key=lambda p: p.stat().st_size)
    dev.chmod(0o600)
    data = bytearray(dev.read_bytes())
    data[-1] ^= 0xFF
    dev.write_bytes(bytes(data))
    rc, out, err = cli(env, "restore", str(image))
    assert rc == ExitCode.IMAGE and out is not None, (rc, out, err)
    error = out["error"]
    assert dev.name in error["message"] and "killed before its device memory was loaded" in error["message"]
    for pid in error["details"]["killed_before_device_memory"]:
        wait_until(lambda p=pid: not alive(p), 10, f"pid {pid} to be gone")


# -- the driver-backed flow (args != NULL), on the simulator's CANN 9.2 stand-in -----------------


def _cann(version: str) -> dict[str, str]:
    from npusnap_cli import paths

    home = paths.build_dir() / paths.SIM_CANN_TREES[version]
    return {"ASCEND_HOME_PATH": str(home), "LD_LIBRARY_PATH": str(home / "lib64"), "NPUSIM_CANN": version}


class _Daemon:
    """A private simulator daemon (its own socket) with the driver feature on or off."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="npusim-drv-"))
        self.sock = str(self.dir / "npusim.sock")

    def _with_socket(self, fn: Callable[[], object]) -> object:
        from npusnap_sim import manager  # noqa: F401 - resolved through NPUSIM_SOCKET

        saved = os.environ.get("NPUSIM_SOCKET")
        os.environ["NPUSIM_SOCKET"] = self.sock
        try:
            return fn()
        finally:
            if saved is None:
                os.environ.pop("NPUSIM_SOCKET", None)
            else:
                os.environ["NPUSIM_SOCKET"] = saved

    def start(self, driver_snapshot: bool, driver_version: int = 1) -> dict[str, str]:
        from npusnap_sim import manager

        self._with_socket(
            lambda: manager.start(
                devices=2,
                capacity_bytes=1 << 28,
                driver_snapshot=driver_snapshot,
                driver_version=driver_version,
            )
        )
        env = dict(os.environ, NPUSIM_SOCKET=self.sock)
        env.update(_cann("9.2"))
        return env

    def stop(self) -> None:
        from npusnap_sim import manager

        self._with_socket(manager.stop)


@pytest.fixture
def private_daemon() -> Iterator[_Daemon]:
    d = _Daemon()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


def test_driver_flow_without_the_driver_feature_is_not_supported(sim_env: dict[str, str]) -> None:
    """The session daemon's driver lacks the feature: args != NULL is "not supported", with no
    fallback; NULL args is the legacy flow (contents lost)."""
    d = Driver(sim_env, _cann("9.2"))
    try:
        assert d.rc("set", 1) == 0
        a = d.call("malloc", 4096)["addr"]
        d.call("fill", a, 4096, "x")
        assert d.rc("lock") == 0
        assert d.rc("flags", "backup", 2) == 100000  # flags are 0 or 1
        assert d.rc("flags", "backup", 1) == 207000
        assert d.call("state_rc")["state"] == LOCKED_STATE  # no fallback happened
        assert d.rc("backup") == 0 and d.rc("restore") == 0 and d.rc("unlock") == 0
        assert d.call("read", a, 4096)["head"] == POISON_HEAD
    finally:
        d.close()


def test_driver_flow_keeps_memory_and_checks_versions(private_daemon: _Daemon) -> None:
    env = private_daemon.start(driver_snapshot=True)
    d = Driver(env)
    try:
        assert d.rc("set", 0) == 0
        a = d.call("malloc", 64 * 1024)["addr"]
        crc = d.call("fill", a, 64 * 1024, "x")["crc"]
        assert d.rc("lock") == 0 and d.rc("flags", "backup", 0) == 0
        assert d.rc("flags", "restore", 0) == 0 and d.rc("unlock") == 0
        assert d.call("read", a, 64 * 1024)["crc"] == crc  # the driver kept it
        # A driver of another version between Backup and Restore: Restore refuses.
        assert d.rc("lock") == 0 and d.rc("flags", "backup", 1) == 0
        private_daemon.stop()
        private_daemon.start(driver_snapshot=True, driver_version=2)
        assert d.rc("flags", "restore", 1) == 507909
        assert d.call("state_rc")["state"] == BACKED_UP_STATE
    finally:
        d.close()


@requires_root
@pytest.mark.parametrize("feature", [True, False], ids=["driver-flow", "driver-flow-unsupported"])
def test_npusnap_prefers_the_driver_flow_and_falls_back(
    feature: bool, private_daemon: _Daemon, runtime_dir: Path, tmp_path: Path
) -> None:
    from tests.integration.dumplib import PY, TRAIN, TRAIN_ARGS, Job, alive, reference

    env = private_daemon.start(driver_snapshot=feature)
    env.update(job_env(env, runtime_dir))
    args = ["--steps", "40", *TRAIN_ARGS, "--device", "0", "--seed", "9"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        proc = out["result"]["device_memory"]["processes"][str(job.pid)]
        if feature:
            assert proc["flow"] == "driver" and proc["saved_bytes"] == 0  # no copy of npusnap's
        else:
            assert proc["flow"] == "legacy" and "207000" in proc["fallback"]
            assert proc["saved_bytes"] >= 65536
        job.reap()
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert job.lines() == ref
    finally:
        job.cleanup()


VMM_TARGET = r"""
import ctypes, os, sys, time
sys.path.insert(0, os.environ["REPO"])
from tests.integration.sim_helpers import acl_driver as d  # the same ctypes declarations
assert d.lib.aclInit(None) in (0, 100002)
assert d.lib.aclrtSetDevice(0) == 0
r = d.run(["vmm_alloc", 2 << 20, 0])  # an expandable segment, as torch_npu's caching allocator
assert r["rc"] == 0, r
assert d.run(["fill", r["addr"], 2 << 20, "weights"])["rc"] == 0
print("ready", os.getpid(), flush=True)
while True:
    time.sleep(0.2)
"""


@requires_root
def test_attached_job_with_vmm_memory_is_refused_without_the_simulators_daemon(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A job that allocated through VMM (reserve + physical + map) before an agent was attached:
    the agent saw none of it, and npusnap, which the simulator's daemon refuses (as in every
    test), still finds the device memory in /proc/PID/maps and refuses to
    call the dump continuous; nothing is locked."""
    script = tmp_path / "vmm_target.py"
    script.write_text(VMM_TARGET)
    env = job_env(sim_env, runtime_dir, REPO=str(REPO))
    out_path = tmp_path / "out.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script)], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(lambda: b"ready" in out_path.read_bytes(), 20, "the VMM job")
        rc, res, err = cli(env, "attach", str(proc.pid))
        assert rc == 0, (res or {}).get("error") or err
        img = tmp_path / "img"
        rc, res, err = cli(env, "dump", str(proc.pid), str(img), "--leave-running")
        assert rc == ExitCode.TARGET, (res or {}).get("error") or err
        assert res is not None
        error = res["error"]
        assert "does not know their device memory" in error["message"], error
        assert error["details"]["untracked_pids"] == [proc.pid]
        record = error["details"]["device_memory"][str(proc.pid)]
        assert record["interposed"] is False and record["device_mappings"] > 0, record
        assert not img.exists()
        assert agent_state(proc.pid) == "RUNNING"
        assert "npusnap may not talk" not in err
    finally:
        proc.kill()
        proc.wait()
