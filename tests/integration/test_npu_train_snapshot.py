"""A torch_npu-shaped job (npu_train.py: expandable segments, aclnn operators on streams, HCCL)
dumped at an arbitrary moment and restored: its output continues exactly as an uninterrupted run's.

The job never idles: every step queues a batch copy on a copy stream and a chain of asynchronous
kernels on a compute stream (with two ranks, an all-reduce too), so a dump lands mid-kernel,
mid-all-reduce or with copies queued. npusnap's agent Locks (the runtime then holds every launch),
drains the devices with a bounded synchronize, copies the VMM-backed memory with drvMemcpy,
Backs up; after the restore it writes the memory back before Unlock. The strict variant runs
on the simulated tree that exports real CANN names only, with npusnap forbidden to talk to the
simulator's daemon.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import time
from pathlib import Path

import pytest

from npusnap_cli import paths
from npusnap_workloads import script_path
from tests.conftest import requires_root
from tests.integration.dumplib import PY, REPO, Job, alive, cli, job_env, wait_until

pytestmark = [pytest.mark.integration, requires_root]

JOB = str(script_path("npu_train"))
FAST = {"NPUSIM_KERNEL_BLOCK_US": "0", "HCCL_EXEC_TIMEOUT": "60", "HCCL_CONNECT_TIMEOUT": "60"}
ARGS = ["--hidden", "16", "--interval", "0.03"]


def _env(sim_env: dict[str, str], runtime_dir: Path, strict: bool) -> dict[str, str]:
    env = job_env(sim_env, runtime_dir, **FAST)
    if strict:
        home = paths.sim_cann_dir() / "cann-strict"
        env.update(ASCEND_HOME_PATH=str(home), LD_LIBRARY_PATH=str(home / "lib64"))
    return env


def _reference(env: dict[str, str], args: list[str]) -> list[str]:
    fast = [a if a != "0.03" else "0" for a in args]
    done = subprocess.run([PY, JOB, *fast], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def _round_trip(job: Job, env: dict[str, str], img: Path, after_lines: int, ranks: int) -> None:
    wait_until(lambda: len(job.lines()) >= after_lines * ranks, 60, f"{after_lines} steps per rank")
    time.sleep(random.uniform(0, 0.05))  # somewhere inside a step: kernels, copies, an all-reduce queued
    rc, out, err = cli(env, "dump", str(job.pid), str(img), timeout=180)
    assert rc == 0, (out or {}).get("error") or err
    assert out is not None
    record = out["result"]["device_memory"]
    assert record["continuity"] == "npusnap", record
    assert any(p.get("vmm_bytes") for p in record["processes"].values()), record  # expandable segments
    job.reap(30)
    rc, out, err = cli(env, "restore", str(img), timeout=180)
    assert rc == 0, (out or {}).get("error") or err
    assert out is not None and out["result"]["device_memory"] == "npusnap"
    job.restored_pid = out["result"]["root_pid"]
    wait_until(lambda: not alive(job.restored_pid), 180, "the restored job to finish")


@pytest.mark.parametrize("mode", ["sim", "strict-no-daemon", "busy"])
def test_one_rank_continues_exactly(
    mode: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """``busy``: no pause between steps and kernels that take visible time (200 us a block):
    the dump lands with kernels running and copies queued, every time."""
    env = _env(sim_env, runtime_dir, mode == "strict-no-daemon")
    args = ["--steps", "150", *ARGS]
    if mode == "busy":
        env["NPUSIM_KERNEL_BLOCK_US"] = "200"
        args = ["--steps", "60", "--hidden", "16", "--interval", "0"]
    ref = _reference(env, args)
    job = Job(tmp_path, env, [PY, JOB, *args])
    try:
        _round_trip(job, env, tmp_path / "img", 6, 1)
        assert [ln for ln in job.lines() if ln.startswith("step")] == ref
    finally:
        job.cleanup()


@pytest.mark.parametrize("busy", [False, True], ids=["paced", "busy"])
def test_two_ranks_continue_exactly(
    busy: bool, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Two ranks on devices 0 and 1 under a launcher, all-reducing every step: dumped together
    (the communicator is rebuilt after the restore), each rank's lines are the reference's.
    ``busy``: no pause between steps and slow kernels, so that the locks land mid-step, often
    with an all-reduce queued on one rank and not yet launched on the other."""
    env = _env(sim_env, runtime_dir, False)
    args = ["--steps", "100", *ARGS, "--ranks", "2"]
    if busy:
        env["NPUSIM_KERNEL_BLOCK_US"] = "200"
        args = ["--steps", "60", "--hidden", "16", "--interval", "0", "--ranks", "2"]
    ref = _reference(env, args)
    job = Job(tmp_path, env, [PY, JOB, *args])
    try:
        _round_trip(job, env, tmp_path / "img", 5, 2)
        for r in (0, 1):
            mine = [ln for ln in job.lines() if ln.startswith(f"[rank {r}]")]
            assert mine == [ln for ln in ref if ln.startswith(f"[rank {r}]")], r
    finally:
        job.cleanup()


def test_a_job_that_started_its_own_agent(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """The agent library preloaded (as in a container image) and started by the job itself with
    agent.start(), not by `npusnap run`: tracking is complete from the start, so the dump is
    continuous; --leave-running first, then a dump and restore."""
    from npusnap_cli.agent.launch import agent_library

    env = _env(sim_env, runtime_dir, False)
    env.update(LD_PRELOAD=str(agent_library()), PYTHONPATH=str(REPO))
    args = ["--steps", "150", *ARGS]
    ref = _reference(job_env(sim_env, runtime_dir, **FAST), args)
    starter = (
        "import runpy, sys; import npusnap_cli.agent as a; a.start(); "
        f"sys.argv = [{JOB!r}, *sys.argv[1:]]; runpy.run_path({JOB!r}, run_name='__main__')"
    )
    job = Job(tmp_path, env, [PY, "-c", starter, *args], agent=False)
    job.marker = "npusnap_cli.agent"
    try:
        wait_until(lambda: len(job.lines()) >= 4, 60, "4 steps")
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "kept"), "--leave-running", timeout=180)
        assert rc == 0, (out or {}).get("error") or err
        _round_trip(job, env, tmp_path / "img", 10, 1)
        assert [ln for ln in job.lines() if ln.startswith("step")] == ref
    finally:
        job.cleanup()


def test_a_collective_waiting_for_a_stopped_rank_fails_the_dump_not_the_job(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Rank 0's all-reduce waits for rank 1, which is stopped: CANN's Backup would synchronize
    forever. npusnap's drain after Lock gives up at --drain-timeout, the dump fails (exit 7,
    DEVICE_BUSY) after its retry, nothing stays locked, and once rank 1 goes on both ranks
    print exactly the reference's lines."""
    import os
    import signal

    from npusnap_cli.errors import ExitCode
    from tests.integration.dumplib import agent_state

    env = _env(sim_env, runtime_dir, False)
    args = ["--steps", "40", *ARGS]
    ref = _reference(env, [*args, "--ranks", "2"])
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    jobs = []
    for r in (0, 1):
        d = tmp_path / f"rank{r}"
        d.mkdir()
        argv = [
            PY,
            JOB,
            *args,
            "--rank",
            str(r),
            "--world",
            "2",
            "--device",
            str(r),
            "--rendezvous",
            str(rdv),
        ]
        jobs.append(Job(d, env, [*argv, "--prefix", f"[rank {r}] "]))
    try:
        wait_until(lambda: all(len(j.lines()) >= 3 for j in jobs), 60, "both ranks")
        os.kill(jobs[1].pid, signal.SIGSTOP)
        time.sleep(0.5)  # rank 0 reaches its next all-reduce and waits there
        held = len(jobs[0].lines())
        rc, out, err = cli(env, "dump", str(jobs[0].pid), str(tmp_path / "img"), "--drain-timeout", "1")
        assert rc == ExitCode.DEVICE, (out or {}).get("error") or err
        assert out is not None and out["error"]["details"]["agent_error"]["name"] == "DEVICE_BUSY", out[
            "error"
        ]
        assert not (tmp_path / "img").exists()
        assert agent_state(jobs[0].pid) == "RUNNING"
        assert len(jobs[0].lines()) == held  # still waiting for rank 1, not failed
        os.kill(jobs[1].pid, signal.SIGCONT)
        for j in jobs:
            assert j.reap(120) == 0, j.text()[-2000:]
        for r in (0, 1):
            assert jobs[r].lines() == [ln for ln in ref if ln.startswith(f"[rank {r}]")], r
    finally:
        for j in jobs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(j.pid, signal.SIGCONT)
            j.cleanup()


def test_a_job_dump_of_ranks_started_by_hand(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Two ranks started separately (each under `npusnap run`), dumped as one job image
    (`dump PID PID DIR`) and restored together: each rank's pipeline drains and retries on its
    own, and both continue exactly."""
    import os

    env = _env(sim_env, runtime_dir, False)
    args = ["--steps", "100", *ARGS]
    ref = _reference(env, [*args, "--ranks", "2"])
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    jobs = []
    for r in (0, 1):
        d = tmp_path / f"rank{r}"
        d.mkdir()
        argv = [
            PY,
            JOB,
            *args,
            "--rank",
            str(r),
            "--world",
            "2",
            "--device",
            str(r),
            "--rendezvous",
            str(rdv),
        ]
        jobs.append(Job(d, env, [*argv, "--prefix", f"[rank {r}] "]))
    img = tmp_path / "img"
    try:
        wait_until(lambda: all(len(j.lines()) >= 5 for j in jobs), 60, "both ranks")
        rc, out, err = cli(env, "dump", str(jobs[0].pid), str(jobs[1].pid), str(img), timeout=240)
        assert rc == 0, (out or {}).get("error") or err
        for j in jobs:
            j.reap(30)
        rc, out, err = cli(env, "restore", str(img), timeout=240)
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        for j, r in zip(jobs, out["result"]["ranks"]):
            j.restored_pid = int(r["root_pid"])
        for r, j in enumerate(jobs):
            wait_until(lambda j=j: not alive(j.restored_pid), 120, f"rank {r} to finish")
            assert j.lines() == [ln for ln in ref if ln.startswith(f"[rank {r}]")], (r, os.getpid())
    finally:
        for j in jobs:
            j.cleanup()
