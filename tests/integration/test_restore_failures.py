"""A restore whose device step fails leaves the process locked (never half-running), names the pid
and the step, and `npusnap thaw PID` then brings it back with its device state intact."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.host import procfs
from tests.conftest import plugin_dir_with, requires_root
from tests.integration.dumplib import (
    NPUSNAP,
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


def test_a_corrupt_page_file_is_caught_while_criu_restores_and_nothing_runs(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The sha256 check overlaps with CRIU's restore; CRIU leaves the tree stopped until it is
    done, and a mismatch kills the tree before it ran a single instruction."""
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "200", *TRAIN_ARGS, "--device", "0", "--seed", "4"]
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, _, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, err
        job.reap()
        pages = max((img / "criu").glob("pages-*.img"), key=lambda p: p.stat().st_size)
        with open(pages, "r+b") as f:  # flip one byte in the middle: same size, other contents
            f.seek(pages.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        before = len(job.lines())
        rc, out, _ = cli(env, "restore", str(img))
        assert rc == ExitCode.IMAGE and out is not None, out
        assert "checksum" in out["error"]["message"] and "killed before it ran" in out["error"]["message"]
        killed = out["error"]["details"]["killed_unrun"]
        wait_until(lambda: not any(alive(p) for p in killed), 10, "the unverified tree to be gone")
        time.sleep(0.3)
        assert len(job.lines()) == before  # not one step of the corrupt image ran
    finally:
        job.cleanup()


def test_restore_without_the_simulated_devices_plugin_is_refused_by_criu_and_then_works(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The image records that its device connections need npusim_plugin.so (CRIU's inventory):
    a CRIU without it refuses to restore, nothing runs; with it the job continues exactly."""
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "40", *TRAIN_ARGS, "--device", "0", "--seed", "4"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(4)
        rc, _, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, err
        assert len(list((img / "criu").glob("npusim-dev-*.img"))) == 1
        job.reap()
        no_plugins = dict(env, CRIU_LIBS_DIR=str(plugin_dir_with(tmp_path)))
        rc, out, _ = cli(no_plugins, "restore", str(img))
        assert rc == ExitCode.CRIU, out
        assert out is not None
        assert "Missing required plugin: npusim_plugin" in "\n".join(
            out["error"]["details"].get("criu_log_excerpt", [])
        ), out["error"]
        assert not alive(job.pid)
        rc, _, errtext = cli(env, "restore", str(img))
        assert rc == 0, errtext
        job.restored_pid = job.pid
        wait_until(lambda: not alive(job.pid), 30, "the restored run to finish")
        assert job.lines() == ref
    finally:
        job.cleanup()


def test_a_restore_paused_past_the_lease_reports_what_the_lease_did(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The restore stops after CRIU restored the job, before its device step, for longer than the
    lease the image's agents carry: the lease restores the device state and unlocks the job by
    itself. The resumed restore must not say the job stays locked: it says that it runs, and
    `status` says the same."""
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "400", *TRAIN_ARGS, "--device", "1", "--seed", "3"]
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(4)
        rc, _, err = cli(env, "dump", str(job.pid), str(img), "--lease", "3")
        assert rc == 0, err
        job.reap()
        restore = subprocess.Popen(
            [NPUSNAP, "restore", str(img), "--json"],
            env={**env, "NPUSNAP_TEST_STOP_AT": "restore:device-restore"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(lambda: procfs.state(restore.pid) == "T", 120, "the restore to stop")
            job.restored_pid = job.pid
            wait_until(lambda: agent_state(job.pid) == "RUNNING", 60, "the lease to unlock the job")
        finally:
            restore.send_signal(signal.SIGCONT)
        stdout, stderr = restore.communicate(timeout=120)
        out = json.loads(stdout) if stdout.strip() else None
        assert out is not None, stderr
        said = json.dumps(out)
        assert "stay locked" not in said and "stays locked" not in said, out
        n = len(job.lines())
        wait_until(lambda: len(job.lines()) > n, 30, "the job to compute again")
        rc, st, err = cli(env, "status", str(job.pid))
        assert rc == 0 and st is not None, err
        assert st["result"]["processes"][0]["status"]["state"] == "RUNNING"
        if restore.returncode != 0:
            e = out["error"]
            assert e["details"]["locked_pids"] == [] and e["details"]["running_pids"] == [job.pid], e
            assert f"pid {job.pid} runs" in e["message"], e
    finally:
        job.cleanup()
