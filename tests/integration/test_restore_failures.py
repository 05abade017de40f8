"""A restore whose device step fails leaves the process locked (never half-running), names the pid
and the step, and `npusnap thaw PID` then brings it back with its device state intact."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from tests.conftest import requires_root
from tests.integration.dumplib import (
    PY,
    TRAIN,
    TRAIN_ARGS,
    Job,
    agent_state,
    alive,
    cli,
    job_env,
    reference,
    wait_until,
)

pytestmark = [pytest.mark.integration, requires_root]


def test_device_restore_failure_leaves_process_locked_and_thaw_resumes(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    faults = tmp_path / "faults"
    faults.write_text("")
    env = job_env(sim_env, runtime_dir, NPUSIM_FAULT_FILE=str(faults))
    args = ["--steps", "40", *TRAIN_ARGS, "--device", "1", "--seed", "2"]
    ref = reference(job_env(sim_env, runtime_dir), args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(4)
        rc, _, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, err
        job.reap()
        faults.write_text("NPUSIM_FAULT_RESTORE=1\n")
        rc, out, _ = cli(env, "restore", str(img))
        assert rc == ExitCode.DEVICE
        assert out is not None
        e = out["error"]
        assert f"root pid {job.pid}" in e["message"] and "restore" in e["message"].lower()
        assert e["details"]["locked_pids"] == [job.pid]
        assert f"npusnap thaw {job.pid}" in e["fix"]
        job.restored_pid = job.pid
        # Locked, not half-running: alive, but it prints nothing more.
        assert alive(job.pid)
        assert agent_state(job.pid) == "BACKED_UP"
        n = len(job.lines())
        time.sleep(0.3)
        assert len(job.lines()) == n

        faults.write_text("")
        rc, _, errtext = cli(env, "thaw", str(job.pid))
        assert rc == 0, errtext
        wait_until(lambda: not alive(job.pid), 30, "the resumed run to finish")
        assert job.lines() == ref
    finally:
        job.cleanup()
