"""A real `torchrun` job (PyTorch 2.13 CPU, two gloo ranks on the simulated NPU) snapshot whole.

torchrun's elastic agent hosts its rendezvous stores on libuv, which holds an io_uring that CRIU
cannot dump: a plain `npusnap run -- torchrun ...` is refused in preflight (the error names the
agent, its store threads and the fix), and the job runs on. Under `npusnap run --no-io-uring` no
ring exists in the tree; one dump takes the agent and both ranks (with their TCP connections to
each other and to the store), and the restored job ends with exactly the lines of an
uninterrupted run. The same ranks started by hand with USE_LIBUV=0 dump as a job.

torch comes from scripts/setup-torch.sh (scripts/test.sh runs it): a cached virtualenv linked at
.build/torch.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from tests.integration import torchlib
from tests.integration.dumplib import (
    NPUSNAP,
    REPO,
    TRAIN,
    TRAIN_ARGS,
    Job,
    agent_state,
    alive,
    assert_no_image,
    cli,
    wait_until,
)
from tests.integration.test_jobs import jobs_env
from tests.integration.torchlib import TORCHRUN

WORKLOAD = str(REPO / "npusnap_workloads" / "torch_ranks.py")
STEPS = 80

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(torchlib.skip_reason() is not None, reason=str(torchlib.skip_reason())),
]


def torchrun_argv(interval: str) -> list[str]:
    return [
        TORCHRUN, "--standalone", "--nproc-per-node", "2", WORKLOAD,
        "--steps", str(STEPS), "--interval", interval, "--seed", "7",
    ]  # fmt: skip


def by_rank(lines: list[str]) -> list[list[str]]:
    return [[ln for ln in lines if ln.startswith(f"[rank {r}]")] for r in (0, 1)]


def tree(pid: int) -> list[int]:
    import psutil

    root = psutil.Process(pid)
    return [pid, *(p.pid for p in root.children(recursive=True))]


def io_urings(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[io_uring]"
        except OSError:
            pass
    return n


def seccomp_filtered(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        return any(line.split() == ["Seccomp:", "2"] for line in f)


@pytest.fixture(scope="module")
def reference(sim_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    """Both ranks' lines of an uninterrupted torchrun run (no agent, no interval)."""
    p = subprocess.run(
        torchrun_argv("0"),
        env=sim_env,
        cwd=tmp_path_factory.mktemp("torchref"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    ranks = by_rank(p.stdout.splitlines())
    assert [len(r) for r in ranks] == [STEPS, STEPS], p.stdout[-1000:]
    return ranks


def test_torchrun_holding_a_ring_is_refused_with_the_torchrun_fix(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """torchrun's agent with one worker that needs no torch (train.py on the NPU): the refusal is
    about the agent, and the worker shows that nothing was locked."""
    env = jobs_env(sim_env, runtime_dir)
    argv = [TORCHRUN, "--standalone", "--nproc-per-node", "1", TRAIN, *TRAIN_ARGS, "--steps", "400"]
    job = Job(tmp_path, env, argv)
    try:
        job.wait_lines(3, timeout=60)
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--tcp-established")
        assert rc == ExitCode.PREFLIGHT and out is not None, err
        e = out["error"]
        assert e["message"].startswith(f"pid {job.pid} (pt_elastic) holds anon_inode:[io_uring]"), e
        assert "(pt_tcpstore_uv)" in e["message"], e
        assert "npusnap run --no-io-uring -- torchrun" in e["fix"], e
        held = e["details"]["undumpable_fds"]
        assert held and all(h["pid"] == job.pid and h["torchrun"] for h in held), held
        assert_no_image(tmp_path / "img")
        # Refused before anything was locked: the worker runs on, unlocked.
        (worker,) = tree(job.pid)[1:]
        assert agent_state(worker) == "RUNNING"
        before = len(job.lines())
        job.wait_lines(before + 3, timeout=30)
    finally:
        job.cleanup()


def test_torchrun_under_no_io_uring_dumps_and_restores_whole(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, reference: list[list[str]]
) -> None:
    env = jobs_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [NPUSNAP, "run", "--no-io-uring", "--", *torchrun_argv("0.05")], agent=False)
    img = tmp_path / "img"
    try:
        job.wait_lines(6, timeout=60)
        pids = tree(job.pid)
        assert len(pids) == 3, pids  # the elastic agent and its two workers
        assert [io_urings(p) for p in pids] == [0, 0, 0]
        assert all(seccomp_filtered(p) for p in pids)

        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--tcp-established", timeout=240)
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        before = by_rank(job.lines())
        assert all(0 < len(b) < STEPS for b in before), [len(b) for b in before]

        rc, out, err = cli(env, "restore", str(img), timeout=240)
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = job.pid  # CRIU gives the tree its pids back
        assert alive(job.pid) and seccomp_filtered(job.pid)  # still no ring possible
        wait_until(lambda: not alive(job.pid), 90, "the restored torchrun to finish")
        after = by_rank(job.lines())
        for r in (0, 1):
            assert after[r] == reference[r], (r, len(before[r]), job.text()[-1500:])
    finally:
        job.cleanup()


def test_ranks_started_without_torchrun_dump_as_a_job_with_use_libuv_0(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, reference: list[list[str]]
) -> None:
    """The same two ranks started by hand (env://, rank 0 hosts the store): with USE_LIBUV=0 no
    rank holds a ring, and `npusnap dump PID0 PID1` takes them as a job."""
    from tests.integration.test_jobs import free_port

    base = jobs_env(sim_env, runtime_dir)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", USE_LIBUV="0")
    python = str(torchlib.TORCH_BIN / "python")
    argv = [python, WORKLOAD, "--steps", str(STEPS), "--interval", "0.05", "--seed", "7"]
    jobs = []
    for r in (0, 1):
        d = tmp_path / f"r{r}"
        d.mkdir()
        jobs.append(Job(d, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, argv))
    img = tmp_path / "img"
    try:
        for job in jobs:
            job.wait_lines(3, timeout=60)
        assert [io_urings(job.pid) for job in jobs] == [0, 0]
        rc, out, err = cli(base, "dump", str(jobs[0].pid), str(jobs[1].pid), str(img), "--tcp-established")
        assert rc == 0, (out or {}).get("error") or err
        for job in jobs:
            job.reap()
        rc, out, err = cli(base, "restore", str(img))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        for job, r in zip(jobs, out["result"]["ranks"]):
            job.restored_pid = int(r["root_pid"])
        for r, job in enumerate(jobs):
            wait_until(lambda j=job: not alive(j.restored_pid), 90, f"restored rank {r} to finish")
            assert job.lines() == reference[r], (r, job.text()[-1500:])
    finally:
        for job in jobs:
            job.cleanup()
