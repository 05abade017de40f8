"""Descriptors CRIU 4.2.1 cannot dump (a real io_uring here) are refused in preflight, before the
NPU lock: the job keeps computing, unlocked, and the error names the process, the fd, the thread
that uses it and the fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from tests.integration.dumplib import (
    PY,
    REPO,
    TRAIN,
    TRAIN_ARGS,
    Job,
    agent_state,
    alive,
    assert_no_image,
    cli,
    job_env,
)

pytestmark = pytest.mark.integration

SOURCE = REPO / "tests" / "data" / "uring_agent.c"


def build_uring_agent(tmp: Path) -> Path:
    out = tmp / "uring_agent"
    subprocess.run(["cc", "-O1", "-Wall", "-Werror", "-pthread", "-o", str(out), str(SOURCE)], check=True)
    probe = subprocess.run([str(out), "true"], capture_output=True, text=True, timeout=20)
    if probe.returncode == 2:
        pytest.skip(f"the kernel refuses io_uring here: {probe.stderr.strip()}")
    return out


def test_io_uring_in_the_launcher_is_refused_before_the_lock(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    agent = build_uring_agent(tmp_path)
    job = Job(tmp_path, env, [str(agent), PY, TRAIN, *TRAIN_ARGS, "--steps", "400"])
    try:
        job.wait_lines(3, timeout=60)
        worker = int(subprocess.check_output(["pgrep", "-P", str(job.pid)], text=True).split()[0])
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"))
        assert rc == ExitCode.PREFLIGHT and out is not None, err
        e = out["error"]
        assert f"pid {job.pid} (uring_agent) holds anon_inode:[io_uring]" in e["message"], e
        assert "store-loop" in e["message"], e
        assert "USE_LIBUV=0" in e["fix"] and "use_libuv=0" in e["fix"], e
        held = e["details"]["undumpable_fds"]
        assert [(h["pid"], h["kind"]) for h in held] == [(job.pid, "[io_uring]")]
        assert_no_image(tmp_path / "img")
        # Never locked: the worker's agent reports RUNNING and it goes on computing.
        assert agent_state(worker) == "RUNNING"
        before = len(job.lines())
        job.wait_lines(before + 2, timeout=30)
        assert alive(job.pid)
    finally:
        job.cleanup()
