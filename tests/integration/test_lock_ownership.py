"""Issue 14, items 3 and 4: every lock has an owner, commands do not undo each other's locks, and
freeze keeps its interrupt contract. Real agents in real workloads on the simulated NPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import ExitCode
from tests.integration.agentlib import PY, REPO, Sim, Workload, start_agent_workload

pytestmark = pytest.mark.integration


def npusnap(*args: str, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [PY, "-m", "npusnap_cli", *args, "--json"], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"not one JSON envelope: {done.stdout!r} {done.stderr!r}") from None


def status_of(pid: int) -> dict[str, Any]:
    with AgentClient(pid) as c:
        return dict(c.status().to_json())  # the agent's JSON, as tests read it


def test_freeze_twice_refuses_the_second_and_keeps_the_first(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    rc, env = npusnap("freeze", str(w.pid))
    assert rc == 0, env
    assert (runtime_dir / f"{w.pid}.lock-token").exists()
    assert oct((runtime_dir / f"{w.pid}.lock-token").stat().st_mode & 0o777) == "0o600"
    first = status_of(w.pid)["owner"]
    assert first["command"] == "freeze" and first["since"]

    rc, env = npusnap("freeze", str(w.pid))
    assert rc == ExitCode.BUSY, env
    err = env["error"]
    assert (
        "freeze" in err["message"]
        and first["since"] in err["message"]
        and str(first["pid"]) in err["message"]
    )
    assert "thaw --force" in err["fix"]
    st = status_of(w.pid)
    assert st["state"] == "BACKED_UP" and st["owner"] == first  # the first freeze still holds it

    rc, env = npusnap("status", str(w.pid))
    assert rc == 0 and env["result"]["processes"][0]["status"]["owner"]["command"] == "freeze"

    rc, env = npusnap("thaw", str(w.pid))  # thaw presents the freeze's token
    assert rc == 0, env
    assert status_of(w.pid)["state"] == "RUNNING" and status_of(w.pid)["owner"] is None
    assert not (runtime_dir / f"{w.pid}.lock-token").exists()
    w.wait_steps(3)
    w.assert_correct()


def test_thaw_and_dump_refuse_a_lock_held_by_someone_else(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    """A cron snapshotter must not unfreeze a job in the middle of someone's checkpoint."""
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    holder = AgentClient(w.pid)
    holder.lock(lease_s=120, command="dump")
    holder.backup()
    holder.close()
    try:
        rc, env = npusnap("thaw", str(w.pid))
        assert rc == ExitCode.BUSY, env
        assert "dump" in env["error"]["message"] and f"pid {os.getpid()}" in env["error"]["message"]
        assert status_of(w.pid)["state"] == "BACKED_UP"

        image = tmp_path / "img"
        rc, env = npusnap("dump", str(w.pid), str(image), timeout=120)
        assert rc == ExitCode.BUSY, env
        assert "changed nothing" in env["error"]["message"]
        assert not image.exists() and not list(tmp_path.glob(".img.npusnap-tmp-*"))
        assert status_of(w.pid)["state"] == "BACKED_UP"  # the dump did not roll back a lock it did not take

        rc, env = npusnap("thaw", "--force", str(w.pid))
        assert rc == 0, env
        assert status_of(w.pid)["state"] == "RUNNING"
        assert any("forced" in e for e in status_of(w.pid)["events"])
        # The old owner's token no longer releases anything: the lock is gone.
        holder.connect()
        with pytest.raises(Exception, match=r"no lease|not possible|NO_LEASE"):
            holder.renew()
    finally:
        holder.close()
    w.wait_steps(3)
    w.assert_correct()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_freeze_interrupted_during_backup_rolls_back_with_exit_130(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload], sig: int
) -> None:
    hook_log = tmp_path / "hooks.log"
    w = start_agent_workload(
        sim, runtime_dir, tmp_path, workloads, WL_HOOK_LOG=str(hook_log), WL_HOOK_SLEEP="post_backup:2"
    )
    proc = subprocess.Popen(
        [PY, "-m", "npusnap_cli", "freeze", str(w.pid), "--json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    # The agent writes the stage into the log, then sleeps in the hook: freeze is mid-backup.
    while "post_backup" not in (hook_log.read_text() if hook_log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, "freeze never reached the backup"
        time.sleep(0.02)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED, (out, err)
    envelope = json.loads(out)
    assert "interrupted" in envelope["error"]["message"] and "rolled back" in envelope["error"]["message"]
    st = status_of(w.pid)
    assert st["state"] == "RUNNING" and st["owner"] is None
    w.wait_steps(3)
    w.assert_correct()


def test_a_job_stopped_by_a_checkpoint_is_refused_at_once(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    """thaw or dump during someone's CRIU step: the agent cannot answer; refuse, do not wait."""
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    rc, env = npusnap("freeze", str(w.pid))
    assert rc == 0, env
    os.kill(w.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        rc, env = npusnap("thaw", str(w.pid))
        assert rc == ExitCode.BUSY and "stopped" in env["error"]["message"], env
        rc, env = npusnap("dump", str(w.pid), str(tmp_path / "img"), timeout=120)
        assert rc == ExitCode.BUSY and "stopped" in env["error"]["message"], env
        assert time.monotonic() - start < 20  # no wait for an answer that cannot come
    finally:
        os.kill(w.pid, signal.SIGCONT)
    assert status_of(w.pid)["state"] == "BACKED_UP"  # nothing changed
    rc, env = npusnap("thaw", str(w.pid))
    assert rc == 0, env
    w.wait_steps(3)
    w.assert_correct()
