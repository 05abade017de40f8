"""The simulated NPU computes: streams, events, kernels, VMM, and the runtime's lock over them.

Each test runs one scenario of a small C program (sim_helpers/compute_probe.c, built here against
the fake CANN tree) with kernels of the simulated device's binary format (sim_helpers/
sim_kernels.c, native/npusim/npusim_kernel.h), in a real process on the session's daemon, and
asserts on what it printed. The behaviour is the runtime's (docs/simulator.md cites the source).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from npusnap_cli import paths
from npusnap_cli.host.procfs import is_alive as alive
from tests.conftest import plugin_dir_with, requires_root
from tests.integration.sim_helpers import wait_for

pytestmark = pytest.mark.integration

HELPERS = Path(__file__).parent / "sim_helpers"
AICORE_EXCEPTION = 507015
STREAM_SYNC_TIMEOUT = 507046
# Hccl: libhccl.so (docs/simulator.md); Msprof: libprofapi.so (runtime src/dfx/msprof/collector/
# dvvp/profapi); the error manager's C entry point and its C++ reader (runtime
# src/dfx/error_manager/error_manager.h, pkg_inc/base/err_mgr.h).
REAL_PREFIXES = ("acl", "rt", "hal", "drv", "Hccl", "Msprof")
REAL_NAMES = ("ReportInnerErrMsgForC", "_ZN13error_message21GetErrMgrErrorMessageEv")


def tree(name: str) -> Path:
    return paths.sim_cann_dir() / name


@pytest.fixture(scope="module")
def built(sim_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The probe (linked against the default tree; LD_LIBRARY_PATH picks the tree at run time)
    and the kernel binary."""
    out = tmp_path_factory.mktemp("compute")
    inc = paths.native_src_dir() / "npusim"
    lib = tree("cann") / "lib64"
    kernels = out / "sim_kernels.so"
    probe = out / "compute_probe"
    src = str(HELPERS / "sim_kernels.c")
    cc = ["cc", "-O1", "-Wall", "-fPIC", "-shared", f"-I{inc}"]
    subprocess.run([*cc, "-o", str(kernels), src], check=True)
    subprocess.run(
        [
            "cc",
            "-O1",
            "-Wall",
            "-pthread",
            "-o",
            str(probe),
            str(HELPERS / "compute_probe.c"),
            f"-L{lib}",
            "-lacl_rt",
            "-lruntime",
            "-lascend_hal",
        ],
        check=True,
    )
    return {"probe": probe, "kernels": kernels}


def run(
    built: dict[str, Path],
    sim_env: dict[str, str],
    scenario: str,
    tree_name: str = "cann",
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    home = tree(tree_name)
    env = dict(sim_env, ASCEND_HOME_PATH=str(home), LD_LIBRARY_PATH=str(home / "lib64"))
    env.update(extra or {})
    p = subprocess.run(
        [str(built["probe"]), scenario, str(built["kernels"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    got: dict[str, str] = {}
    for line in p.stdout.splitlines():
        key, _, value = line.partition(" ")
        got[key] = value
    assert got.get("done") == "1", p.stdout + p.stderr
    return got


def num(got: dict[str, str], key: str) -> float:
    return float(got[key])


def test_kernels_run_asynchronously_and_a_copy_sees_partial_results(
    built: dict[str, Path], sim_env: dict[str, str]
) -> None:
    got = run(built, sim_env, "async")
    assert got["launch_rc"] == "0"
    assert num(got, "launch_ms") < 100  # the host returns before an 800 ms kernel ends
    assert got["query_rc"] == "0" and got["query_mid"] == "1"  # ACL_STREAM_STATUS_NOT_READY
    assert got["copy_mid_rc"] == "0"
    assert 1 <= int(got["partial_chunks"]) < 8  # seen part-way through its 8 chunks
    assert got["sync_rc"] == "0" and num(got, "sync_ms") >= 700
    assert got["query_end"] == "0" and got["full_chunks"] == "8"
    assert got["destroy_rc"] == "0"


def test_a_stream_runs_its_tasks_in_order(built: dict[str, Path], sim_env: dict[str, str]) -> None:
    got = run(built, sim_env, "order")
    assert got["sync_rc"] == "0" and got["first"] == "3" and got["last"] == "3"
    assert got["device_sync_rc"] == "0"
    assert got["default_first"] == "23" and got["default_last"] == "23"
    assert got["h2d_first"] == "1" and got["h2d_last"] == str((1 << 16) - 1 + 1)
    # host callbacks need a subscribed thread calling aclrtProcessReport (callback.cpp)
    assert got["callback_unsubscribed_rc"] == "107011"
    assert got["subscribe_rc"] == "0" and got["callback_rc"] == "0" and got["reports_run"] == "1"
    assert got["callback_calls"] == "1" and got["callback_word"] == "101"
    assert got["unsubscribe_rc"] == "0" and got["report_timeout_rc"] == "507012"
    assert got["after_callback_word"] == "1101"
    assert got["mallochost_rc"] == "0" and got["hostbuf_word"] == "1101" and got["freehost_rc"] == "0"
    assert got["devcount_rc"] == "0" and got["devcount"] == "2"
    assert got["meminfo_rc"] == "0" and int(got["meminfo_total"]) == 1 << 30
    assert 0 < int(got["meminfo_free"]) < 1 << 30


def test_events_order_streams_and_time_them(built: dict[str, Path], sim_env: dict[str, str]) -> None:
    got = run(built, sim_env, "events")
    # another stream ran beside the 400 ms kernel: done while the other two were not
    assert got["s3_sync_rc"] == "0" and num(got, "s3_sync_ms") < 400
    assert got["e2_status_mid"] == "0"  # ACL_EVENT_RECORDED_STATUS_NOT_READY
    assert got["event_sync_rc"] == "0" and got["e2_status_end"] == "1"
    # the second stream's add waited for the first stream's fill (5 + 1 everywhere)
    assert got["first"] == "6" and got["last"] == "6"
    assert got["elapsed_rc"] == "0" and 350 <= num(got, "elapsed_ms") < 2000
    assert got["destroy_rc"] == "0"


def test_lock_gates_launches_not_synchronize_nor_the_driver(
    built: dict[str, Path], sim_env: dict[str, str]
) -> None:
    got = run(built, sim_env, "lock")
    assert got["lock_rc"] == "0" and got["state"] == "1"
    # work queued before Lock kept running: synchronize passes while LOCKED and sees it done
    assert got["sync_locked_rc"] == "0" and got["device_sync_locked_rc"] == "0"
    assert got["getdev_locked_rc"] == "0"
    assert got["drv_d2h_locked_rc"] == "0" and got["filled_chunks_locked"] == "4"
    assert got["drv_h2d_locked_rc"] == "0" and got["drv_roundtrip_locked"] == "1"
    # another thread's launch waited at the gate, then went through after Unlock
    assert got["bg_done_while_locked"] == "0"
    assert got["unlock_rc"] == "0" and got["bg_rc"] == "0"
    assert got["after_unlock_word0"] == str(0xC0DE0000 + 100)


def test_vmm_reserve_map_compute_unmap_release(built: dict[str, Path], sim_env: dict[str, str]) -> None:
    got = run(built, sim_env, "vmm")
    for key in ("reserve_rc", "phys1_rc", "phys2_rc", "map1_rc", "map2_rc", "h2d_rc", "kernel_sync_rc"):
        assert got[key] == "0", key
    assert got["d2h_rc"] == "0"
    assert got["granularity_rc"] == "0" and got["granularity"] == str(2 << 20)
    assert int(got["va_hex"], 16) >= 0x6000 << 32  # a reserved range, not a plain allocation
    assert got["map_overlap_rc"] == "107000"
    assert got["values_ok"] == "1"  # copies and a kernel across the two physical pieces
    half = (2 << 20) // 4
    assert got["drv_locked_rc"] == "0" and got["drv_locked_words"] == f"{half - 1 + 7} {half + 7}"
    assert got["release_mapped_rc"] == "107000"  # still mapped
    assert got["free_mapped_rc"] == "107000"
    assert got["unmap2_rc"] == "0"
    assert got["hole_kernel_sync_rc"] == str(AICORE_EXCEPTION)
    assert got["hole_copy_rc"] == "107000"
    assert got["mapped_kernel_sync_rc"] == "0"
    for key in ("unmap1_rc", "free1_rc", "free2_rc", "release_rc"):
        assert got[key] == "0", key


def test_vmm_memory_keeps_its_address_across_backup_and_restore(
    built: dict[str, Path], sim_env: dict[str, str]
) -> None:
    got = run(built, sim_env, "vmm_restore")
    assert got["before"] == "5"
    assert got["lock_rc"] == got["backup_rc"] == got["restore_rc"] == "0"
    assert got["drv_after_restore_rc"] == "0" and got["after_restore"] == "deadbeef"
    assert got["unlock_rc"] == "0" and got["kernel_after_rc"] == "0" and got["after_kernel"] == "9"


def test_a_kernel_fault_fails_the_next_synchronize(built: dict[str, Path], sim_env: dict[str, str]) -> None:
    got = run(built, sim_env, "fault")
    assert got["fault_sync_rc"] == str(AICORE_EXCEPTION)
    assert got["next_sync_rc"] == "0"  # reported once
    assert got["bad_ptr_sync_rc"] == str(AICORE_EXCEPTION)
    assert got["past_end_sync_rc"] == str(AICORE_EXCEPTION)
    assert got["timeout_rc"] == str(STREAM_SYNC_TIMEOUT)
    assert got["after_timeout_rc"] == "0"


def test_callbacks_run_callback_major(built: dict[str, Path], sim_env: dict[str, str]) -> None:
    """snapshot_callback_manager.cc InvokeCallbacks: each callback over every open device."""
    got = run(built, sim_env, "callbacks")
    assert got["order"].split() == ["A0", "A1", "B0", "B1"]


def test_backup_without_an_open_device_is_context_null_and_stays_locked(
    built: dict[str, Path], sim_env: dict[str, str]
) -> None:
    got = run(built, sim_env, "nodevice")
    assert got["lock_rc"] == "0"
    assert got["backup_rc"] == "107002"
    assert got["state"] == "1"
    assert got["unlock_rc"] == "0"


def test_a_chip_without_snapshot_support_checks_the_feature_first(
    built: dict[str, Path], sim_env: dict[str, str]
) -> None:
    got = run(built, sim_env, "nosnap", extra={"NPUSIM_SOC_VERSION": "Ascend310P3"})
    for key in ("register_rc", "unregister_rc", "getstate_rc", "getstate_null_rc", "lock_rc"):
        assert got[key] == "207000", key
    ok = run(built, sim_env, "nosnap", extra={"NPUSIM_SOC_VERSION": "Ascend910_9391"})
    assert ok["register_rc"] == "0" and ok["getstate_null_rc"] == "107000"


def test_driver_flow_without_the_feature_runs_pre_callbacks_then_refuses(
    built: dict[str, Path], sim_env: dict[str, str]
) -> None:
    """The cann-9.2 tree with a driver lacking FEATURE_SVM_PROCESS_DEVICE_MEM_SNAPSHOT (the
    session's daemon): BACKUP_PRE / RESTORE_PRE run, then 207000, and no fallback."""
    got = run(built, sim_env, "driverflow", tree_name="cann-9.2")
    assert got["backup_args_rc"] == "207000" and got["backup_pre_calls"] == "1"
    assert got["state_after_backup_args"] == "1"
    assert got["backup_null_rc"] == "0"  # the legacy flow
    assert got["restore_args_rc"] == "207000" and got["restore_pre_calls"] == "1"
    assert got["state_after_restore_args"] == "2"
    assert got["restore_null_rc"] == "0" and got["unlock_rc"] == "0"


def exported(lib: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return [f[2] for f in (ln.split() for ln in out.stdout.splitlines()) if len(f) == 3]


def test_strict_tree_exports_real_names_only(built: dict[str, Path], sim_env: dict[str, str]) -> None:
    libs = sorted((tree("cann-strict") / "lib64").glob("*.so"))
    assert [p.name for p in libs] == [
        "libacl_op_compiler.so",  # what torch_npu's libraries need besides (native/npusim/Makefile)
        "libacl_rt.so",
        "libacl_tdt_channel.so",  # empty: a soname only
        "libascend_hal.so",
        "libascendcl.so",
        "liberror_manager.so",
        "libge_runner.so",  # empty
        "libgraph.so",  # empty
        "libhccl.so",  # and libopapi.so: the operators and collectives (native/npusim/ops)
        "libopapi.so",
        "libprofapi.so",
        "libruntime.so",
    ]
    empty = {"libacl_tdt_channel.so", "libge_runner.so", "libgraph.so"}
    for lib in libs:
        names = exported(lib)
        assert bool(names) == (lib.name not in empty), lib
        bad = [n for n in names if not n.startswith(REAL_PREFIXES) and n not in REAL_NAMES]
        assert bad == [], f"{lib.name}: {bad}"
    # each layer exports its own names: acl* above, rt* in the runtime, hal*/drv* in the driver
    strict = tree("cann-strict") / "lib64"
    assert all(n.startswith("acl") for n in exported(strict / "libacl_rt.so"))
    assert all(n.startswith("rt") for n in exported(strict / "libruntime.so"))
    assert all(re.match(r"(hal|drv)", n) for n in exported(strict / "libascend_hal.so"))
    # the default tree's one helper beyond them, which the strict tree lacks
    assert "npusimGetOpenDevices" in exported(tree("cann") / "lib64" / "libacl_rt.so")
    # and a program runs on the strict tree
    got = run(built, sim_env, "order", tree_name="cann-strict")
    assert got["first"] == "3"


def test_the_layers_call_each_other_through_the_dynamic_linker() -> None:
    """Each layer needs the next (DT_NEEDED) and leaves its names undefined, to be bound at load
    time: an LD_PRELOAD or dlsym interposer at any layer sees the calls."""
    lib = tree("cann") / "lib64"

    def undefined(name: str) -> set[str]:
        cmd = ["nm", "-D", "--undefined-only", str(lib / name)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        return {ln.split()[-1] for ln in out.stdout.splitlines() if ln.strip()}

    def needed(name: str) -> str:
        return subprocess.run(["readelf", "-d", str(lib / name)], capture_output=True, text=True).stdout

    assert "libruntime.so" in needed("libacl_rt.so") and "libruntime.so" in needed("libascendcl.so")
    assert "libascend_hal.so" in needed("libruntime.so")
    rt_calls = {"rtMalloc", "rtMemcpy", "rtsLaunchKernelWithHostArgs", "rtStreamSynchronize"}
    assert rt_calls <= undefined("libacl_rt.so")
    assert {"halMemAlloc", "drvMemcpy", "halMemMap", "halProcessResBackup"} <= undefined("libruntime.so")
    assert os.path.exists(lib / "libascend_hal.so")


@requires_root
def test_a_job_computing_on_streams_survives_criu(
    built: dict[str, Path], sim_env: dict[str, str], tmp_path: Path
) -> None:
    """Lock + Backup, CRIU dump (with the device plugin), restore, Restore + Unlock: the restored
    job's stream thread, stream and event work again. Its device word is poisoned by Restore, as
    CANN's legacy flow keeps addresses, not contents: the next step reads poison + 1."""
    from tests.integration.test_sim_criu import criu, memfd_vmas

    status, out, img = tmp_path / "status", tmp_path / "out", tmp_path / "img"
    img.mkdir()
    home = tree("cann")
    env = dict(sim_env, ASCEND_HOME_PATH=str(home), LD_LIBRARY_PATH=str(home / "lib64"))
    env.update(SNAP_STATUS=str(status), SNAP_STEPS="40")
    with open(out, "wb") as o:
        proc = subprocess.Popen(
            [str(built["probe"]), "loop", str(built["kernels"])],
            env=env,
            stdout=o,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=tmp_path,
        )
    pid = proc.pid
    try:
        assert wait_for(lambda: len(read(out)) >= 5), read(out)
        os.kill(pid, signal.SIGUSR1)
        assert wait_for(lambda: "backup 0" in read(status)), read(status)
        stopped_at = len(read(out))
        plugins = str(plugin_dir_with(tmp_path, "npusim_plugin.so"))
        dump = criu("dump", "-t", str(pid), "-D", str(img), "-o", "dump.log", "-v4", "-L", plugins)
        assert dump.returncode == 0, (img / "dump.log").read_text()[-3000:]
        proc.wait(10)
        assert memfd_vmas(img, pid) == []  # Backup dropped every device mapping
        restore = criu("restore", "-D", str(img), "-d", "-o", "restore.log", "-v4", "-L", plugins)
        assert restore.returncode == 0, (img / "restore.log").read_text()[-3000:]
        os.kill(pid, signal.SIGUSR2)
        assert wait_for(lambda: "unlock 0" in read(status)), read(status)
        assert wait_for(lambda: not alive(pid), 30), "restored job did not finish"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    steps = [ln.split() for ln in read(out) if ln.startswith("step ")]
    assert len(steps) == 40, read(out)
    assert all(s[2] == "0" and s[3] == "0" for s in steps), steps  # every synchronize passed
    values = [int(s[4]) for s in steps]
    assert values[:stopped_at] == list(range(1, stopped_at + 1))
    assert values[stopped_at] == 0xDEADBEEF + 1
    assert values[stopped_at:] == [0xDEADBEEF + 1 + i for i in range(40 - stopped_at)]


def read(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
