"""Any program gets an agent: a C program on the simulated NPU, no Python in it.

`npusnap run` preloads the native agent; `status`, `dump` (also --leave-running) and `restore`
drive it like a Python job, and its output continues exactly where the dump left it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from npusnap_cli import paths
from npusnap_cli.host import procfs
from tests.conftest import requires_root
from tests.integration.agentlib import expected_checksums
from tests.integration.dumplib import NPUSNAP, Job, agent_state, alive, cli, job_env, wait_until

pytestmark = [pytest.mark.integration, requires_root]
SOURCE = Path(__file__).resolve().parents[1] / "data" / "npu_stepper.c"


@pytest.fixture(scope="module")
def stepper(tmp_path_factory: pytest.TempPathFactory, sim_env: dict[str, str]) -> str:
    """The C program, linked to the simulator's libacl_rt.so."""
    out = tmp_path_factory.mktemp("cprog") / "npu_stepper"
    lib64 = paths.sim_cann_home() / "lib64"
    subprocess.run(
        ["cc", "-O1", "-Wall", "-Werror", "-o", str(out), str(SOURCE), f"-L{lib64}", "-lacl_rt"],
        check=True,
        timeout=120,
    )
    return str(out)


def steps_of(job: Job) -> list[tuple[int, int]]:
    out = []
    for line in job.lines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step":
            out.append((int(parts[1]), int(parts[3])))
    return out


def assert_continuous(job: Job) -> None:
    steps = steps_of(job)
    assert steps, job.text()[-500:]
    numbers = [s for s, _ in steps]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), f"steps skipped/repeated: {numbers}"
    expected = expected_checksums(numbers[-1])
    for step, checksum in steps:
        assert checksum == expected[step], f"step {step}: checksum {checksum} != {expected[step]}"


def test_c_program_dump_and_restore(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "200", "--interval-ms", "30", "--device", "0"])
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        rc, out, err = cli(env, "status", str(job.pid))
        assert rc == 0, err
        assert agent_state(job.pid) == "RUNNING"

        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["npu_pids"] == [job.pid]
        assert agent_state(job.pid) == "RUNNING"
        job.wait_lines(len(job.lines()) + 3)
        assert job.reap(30) == 0
        assert_continuous(job)
        assert [s for s, _ in steps_of(job)] == list(range(200))

        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        # The original printed 0..199; the restored copy continues from the dump point to 199.
        steps = [s for s, _ in steps_of(job)]
        restarted = steps.index(199) + 1
        cont = steps[restarted:]
        assert cont and cont[-1] == 199 and cont[0] > 0, cont
        assert cont == list(range(cont[0], 200))
        expected = expected_checksums(199)
        for step, checksum in steps_of(job)[restarted:]:
            assert checksum == expected[step]
    finally:
        job.cleanup()


def test_c_program_dump_kills_and_restore_continues(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "200", "--interval-ms", "30", "--device", "1"])
    img = tmp_path / "img"
    try:
        job.wait_lines(6)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, err
        job.reap()
        dumped = len(steps_of(job))
        assert 5 <= dumped < 200
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert [s for s, _ in steps_of(job)] == list(range(200))
        assert_continuous(job)
        assert "npusnap-agent" not in job.text(), "the agent wrote into the job's output"
        log = runtime_dir / f"{job.pid}.log"
        assert "FAILED" not in (log.read_text() if log.exists() else ""), log.read_text()
    finally:
        job.cleanup()


def test_run_preloads_the_agent_into_any_program(tmp_path: Path) -> None:
    from npusnap_cli.agent import launch, native

    env = launch.agent_environment({"PATH": os.environ["PATH"], "LD_PRELOAD": "/x/libother.so"})
    lib = native.library_path(include_mapped=False)
    assert env["LD_PRELOAD"] == f"{lib} /x/libother.so" and env["NPUSNAP_AGENT"] == "1"


def test_attach_to_a_running_c_program_then_dump_and_restore(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Started plainly (no agent), the C program gets one from `npusnap attach`; the time it was
    stopped is measured and short. An attached agent neither sees the program's device allocations
    nor holds its device calls (no interposition), so npusnap cannot keep its device memory: the
    dump says so explicitly (--device-memory discard; the default refusal is the next test's),
    restore wants --accept-lost-device-memory, and the restored job runs on from the dump point,
    its device contents not claimed to be continuous (the simulator poisons them at Restore)."""
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed (apt install gdb)")
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "200", "--interval-ms", "30", "--device", "0"], agent=False)
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        assert not (runtime_dir / f"{job.pid}.sock").exists()
        rc, out, err = cli(env, "attach", str(job.pid), "--timeout", "10", timeout=60)
        assert rc == 0, (out or {}).get("error")
        res = out["result"] if out else {}
        assert res["method"] == "gdb-native" and res["safe_point"].startswith("syscall:")
        assert res["hello"]["agent"] == "native" and res["hello"]["python"] is None
        assert 0 < res["stopped_s"] < 2.0, res
        rc, _, err = cli(env, "attach", str(job.pid), timeout=60)
        assert rc == 0, err  # a second attach finds the agent there

        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--device-memory", "discard")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["device_memory"]["continuity"] == "lost"
        job.reap()
        dumped = [s for s, _ in steps_of(job)]
        assert 5 <= len(dumped) < 200 and dumped == list(range(len(dumped)))
        assert_continuous(job)  # up to the dump point

        rc, out, err = cli(env, "restore", str(img))
        assert rc == 3, (out or {}).get("error") or err  # lost device memory: not without consent
        assert not alive(job.pid)
        rc, out, err = cli(env, "restore", str(img), "--accept-lost-device-memory")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["device_memory_lost"] is True
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        # The job runs again from where it was dumped, to the end; its numbers after the dump
        # point are computed on device memory that did not survive, so they are not checked.
        assert [s for s, _ in steps_of(job)] == list(range(200))
    finally:
        job.cleanup()


def test_dump_attaches_to_a_plain_c_program_and_reports_the_stop(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """`dump` attaches an agent itself. That agent cannot see the program's device memory (it
    registers none here), so the default --device-memory preserve refuses (exit 4, nothing
    locked); an explicit --device-memory discard dumps, and the original, left running, keeps
    its memory and finishes."""
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed (apt install gdb)")
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "200", "--interval-ms", "30", "--device", "1"], agent=False)
    try:
        job.wait_lines(5)
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running")
        assert rc == 4, (out or {}).get("error") or err
        error = (out or {}).get("error") or {}
        assert "device memory" in error.get("message", ""), error
        assert error["details"]["untracked_pids"] == [job.pid], error
        assert agent_state(job.pid) == "RUNNING"  # nothing was locked
        assert not (tmp_path / "img").exists()

        rc, out, err = cli(
            env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running", "--device-memory", "discard"
        )
        assert rc == 0, (out or {}).get("error") or err
        res = out["result"] if out else {}
        assert res["device_memory"]["continuity"] == "lost"
        assert job.reap(30) == 0
        assert [s for s, _ in steps_of(job)] == list(range(200))
        assert_continuous(job)
    finally:
        job.cleanup()


FINALIZER = r"""
#include <stdint.h>
extern int32_t aclInit(const char *);
extern int32_t aclFinalize(void);
int init_and_finalize(void) {
    int32_t rc = aclInit(0);
    if (rc != 0) return 1000000 + rc;
    return aclFinalize();
}
"""


def test_finalize_reaches_the_front_end_of_the_library_that_called_it(
    tmp_path: Path, sim_env: dict[str, str], runtime_dir: Path
) -> None:
    """A library loaded RTLD_LOCAL (torch_npu's, by Python) calls aclInit and aclFinalize of its own
    libascendcl.so; under `npusnap run` the agent's aclFinalize must reach that same front-end (each
    front-end keeps its own aclInit state), or the job sees ACL_ERROR_UNINITIALIZE at exit."""
    src = tmp_path / "fin.c"
    src.write_text(FINALIZER)
    so = tmp_path / "libfin.so"
    lib64 = paths.sim_cann_home() / "lib64"
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            "-o",
            str(so),
            str(src),
            f"-L{lib64}",
            "-lascendcl",
            f"-Wl,-rpath,{lib64}",
        ],
        check=True,
        timeout=120,
    )
    # The other front-end loaded too, as torch_npu's libopapi.so and libhccl.so bring libacl_rt.so.
    prog = (
        "import ctypes, os\n"
        f"ctypes.CDLL({str(lib64 / 'libacl_rt.so')!r}, mode=os.RTLD_LOCAL)\n"
        f"lib = ctypes.CDLL({str(so)!r}, mode=os.RTLD_LOCAL)\n"
        "print('rc', lib.init_and_finalize())\n"
    )
    env = job_env(sim_env, runtime_dir)
    out = subprocess.run(
        [NPUSNAP, "run", "--", sys.executable, "-c", prog],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["rc", "0"], out.stdout + out.stderr


def _child_of(job: Job) -> int:
    for line in job.text().splitlines():
        if line.startswith("child stopped "):
            return int(line.split()[2])
    raise AssertionError(f"no stopped child in the output: {job.text()[-300:]}")


def test_a_stopped_child_that_owns_no_device_is_dumped_and_restored_stopped(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A child stopped by SIGSTOP (as a shell stops a job) runs no agent code; it was forked after
    the parent opened its device, so it owns none (its agent's record says so, and /proc agrees).
    The dump leaves it out of the NPU processes and CRIU keeps it stopped: after a --leave-running
    dump, and after a restore, it is still stopped and never ran (it would print "continued"),
    while the parent's steps continue exactly."""
    env = job_env(sim_env, runtime_dir)
    job = Job(
        tmp_path,
        env,
        [stepper, "--steps", "150", "--interval-ms", "30", "--device", "0", "--stopped-child", "1"],
    )
    img_running, img = tmp_path / "img-running", tmp_path / "img"
    try:
        job.wait_lines(5)
        child = _child_of(job)
        assert procfs.state(child) == "T"
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")

        # status, freeze and thaw see the same: the child is left alone, not asked (it cannot answer)
        rc, out, err = cli(env, "status", str(job.pid))
        assert rc == 0 and out is not None, err
        entries = {e["pid"]: e for e in out["result"]["processes"]}
        assert entries[child]["without_device_state"] is True and entries[child]["agent_error"] is None
        assert entries[job.pid]["without_device_state"] is False
        assert not [h for h in out["result"]["hints"] if str(child) in h]
        rc, out, err = cli(env, "freeze", str(job.pid))
        assert rc == 0, (out or {}).get("error") or err
        rc, out, err = cli(env, "thaw", str(job.pid))
        assert rc == 0, (out or {}).get("error") or err
        assert procfs.state(child) == "T" and agent_state(job.pid) == "RUNNING"

        rc, out, err = cli(env, "dump", str(job.pid), str(img_running), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["npu_pids"] == [job.pid]
        assert procfs.state(child) == "T" and agent_state(job.pid) == "RUNNING"

        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        assert not alive(child)
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: procfs.state(child) == "T", 10, "the restored child, stopped")
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert [s for s, _ in steps_of(job)] == list(range(150))
        assert_continuous(job)
        assert "child continued" not in job.text()
    finally:
        job.cleanup()


def test_a_stopped_process_that_opened_a_device_is_refused_untouched(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A stopped process that opened a device cannot be asked for its device state: the dump
    refuses (exit 11) before anything is touched, and the process stays stopped."""
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "0", "--interval-ms", "30", "--device", "1"])
    try:
        job.wait_lines(3)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        os.kill(job.pid, signal.SIGSTOP)
        wait_until(lambda: procfs.state(job.pid) == "T", 10, "the job, stopped")
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"))
        assert rc == 11, (out or {}).get("error") or err
        assert procfs.state(job.pid) == "T" and not (tmp_path / "img" / "npusnap.json").exists()
        os.kill(job.pid, signal.SIGCONT)
        n = len(job.lines())
        job.wait_lines(n + 3)
        assert agent_state(job.pid) == "RUNNING"
    finally:
        job.cleanup()
