"""Any program gets an agent: a C program on the simulated NPU, no Python in it.

`npusnap run` preloads the native agent; `status`, `dump` (also --leave-running) and `restore`
drive it like a Python job, and its output continues exactly where the dump left it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from npusnap_cli import paths
from tests.conftest import requires_root
from tests.integration.agentlib import expected_checksums
from tests.integration.dumplib import Job, agent_state, alive, cli, job_env, wait_until

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
    job = Job(tmp_path, env, [stepper, "--steps", "60", "--interval-ms", "30", "--device", "0"])
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        rc, out, err = cli(env, "status", str(job.pid))
        assert rc == 0, err
        assert agent_state(job.pid) == "RUNNING"

        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--leave-running")
        assert rc == 0, err
        assert out is not None and out["result"]["npu_pids"] == [job.pid]
        assert agent_state(job.pid) == "RUNNING"
        job.wait_lines(len(job.lines()) + 3)
        assert job.reap(30) == 0
        assert_continuous(job)
        assert [s for s, _ in steps_of(job)] == list(range(60))

        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        # The original printed 0..59; the restored copy continues from the dump point to 59.
        steps = [s for s, _ in steps_of(job)]
        restarted = steps.index(59) + 1
        cont = steps[restarted:]
        assert cont and cont[-1] == 59 and cont[0] > 0, cont
        assert cont == list(range(cont[0], 60))
        expected = expected_checksums(59)
        for step, checksum in steps_of(job)[restarted:]:
            assert checksum == expected[step]
    finally:
        job.cleanup()


def test_c_program_dump_kills_and_restore_continues(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "50", "--interval-ms", "30", "--device", "1"])
    img = tmp_path / "img"
    try:
        job.wait_lines(6)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, err
        job.reap()
        dumped = len(steps_of(job))
        assert 5 <= dumped < 50
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert [s for s, _ in steps_of(job)] == list(range(50))
        assert_continuous(job)
        assert "npusnap-agent" not in job.text() or "FAILED" not in job.text(), job.text()[-1000:]
    finally:
        job.cleanup()


def test_run_preloads_the_agent_into_any_program(tmp_path: Path) -> None:
    from npusnap_cli.agent import launch, native

    env = launch.agent_environment({"PATH": os.environ["PATH"], "LD_PRELOAD": "/x/libother.so"})
    lib = native.library_path(include_mapped=False)
    assert env["LD_PRELOAD"] == f"{lib} /x/libother.so" and env["NPUSNAP_AGENT"] == "1"
