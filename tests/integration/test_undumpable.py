"""Descriptors CRIU 4.2.1 cannot dump (a real io_uring here) are refused in preflight, before the
NPU lock: the job keeps computing, unlocked, and the error names the process, the fd, the thread
that uses it and the fix: the exact PyTorch setting where PyTorch's store holds the ring (the
real torchrun is in test_torchrun.py). `npusnap run --no-io-uring` leaves no ring to refuse."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.host import preflight
from tests.integration.dumplib import (
    NPUSNAP,
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
    wait_until,
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
    job = Job(
        tmp_path, env, [str(agent), PY, TRAIN, *TRAIN_ARGS, "--steps", "400"], run_flags=("--io-uring",)
    )
    try:
        job.wait_lines(3, timeout=60)
        worker = int(subprocess.check_output(["pgrep", "-P", str(job.pid)], text=True).split()[0])
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"))
        assert rc == ExitCode.PREFLIGHT and out is not None, err
        e = out["error"]
        assert f"pid {job.pid} (uring_agent) holds anon_inode:[io_uring]" in e["message"], e
        assert "store-loop" in e["message"], e
        assert "npusnap run --no-io-uring" in e["fix"], e
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


def _held_by(agent: Path, tmp: Path, **names: str) -> tuple[str, str, list[dict[str, object]]]:
    """A launcher holding a ring, its threads and process named as PyTorch's: preflight's message,
    fix and details for it."""
    env = {**os.environ, **names}
    out = tmp / "ring.out"
    with open(out, "wb") as f:
        p = subprocess.Popen([str(agent)], env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: out.read_text().startswith("ring "), 10, "the ring")
        # The thread is named right after the ring is announced.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not preflight._torch_store_threads(p.pid):
            time.sleep(0.02)
        err = preflight.undumpable_fds_error(preflight.find_undumpable_fds([p.pid]))
        assert err is not None
        return err.message, err.fix or "", err.details["undumpable_fds"]
    finally:
        p.kill()
        p.wait(10)


def test_a_ring_of_pytorchs_store_gets_the_pytorch_fix(tmp_path: Path) -> None:
    agent = build_uring_agent(tmp_path)
    # A rank hosting the store (ranks started without torchrun): USE_LIBUV=0.
    msg, fix, held = _held_by(agent, tmp_path, URING_THREAD_NAME="pt_tcpstore_uv")
    assert "PyTorch's TCPStore runs on libuv in thread(s)" in msg and "(pt_tcpstore_uv)" in msg, msg
    assert "USE_LIBUV=0" in fix and "?use_libuv=0" in fix and "--no-io-uring" in fix, fix
    assert [h["torchrun"] for h in held] == [False]
    # torchrun's elastic agent: no torch setting, the launch under --no-io-uring.
    msg, fix, held = _held_by(agent, tmp_path, URING_THREAD_NAME="pt_tcpstore_uv", URING_COMM="pt_elastic")
    assert msg.startswith("pid ") and "(pt_elastic) holds anon_inode:[io_uring]" in msg, msg
    assert "npusnap run --no-io-uring -- torchrun" in fix and "UV_USE_IO_URING=0 does not" in fix, fix
    assert [h["torchrun"] for h in held] == [True]


def test_run_no_io_uring_leaves_no_ring_to_open(tmp_path: Path, runtime_dir: Path) -> None:
    """The seccomp filter of `npusnap run --no-io-uring`: io_uring_setup fails with ENOSYS, as on
    a kernel without io_uring, in the program and in what it starts; `--io-uring` (the default)
    leaves it alone."""
    agent = build_uring_agent(tmp_path)
    env = {**os.environ, "NPUSNAP_RUNTIME_DIR": str(runtime_dir)}
    plain = subprocess.run(
        [NPUSNAP, "run", "--io-uring", "--", str(agent), "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert plain.returncode == 0 and plain.stdout.startswith("ring "), plain.stderr
    plain = subprocess.run(
        [NPUSNAP, "run", "--", str(agent), "true"], env=env, capture_output=True, text=True, timeout=30
    )
    assert plain.returncode == 0 and plain.stdout.startswith("ring "), "--io-uring is the default"
    for flags, argv in (
        (["--no-io-uring"], [str(agent), "true"]),
        (["--no-io-uring"], ["sh", "-c", f"{agent} true"]),
    ):
        cmd = [NPUSNAP, "run", *flags, "--", *argv]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert "io_uring_setup: Function not implemented" in p.stderr, p.stderr
