"""`--criu-opt`: CRIU options passed through to a real CRIU, end to end, on a C program on the
simulated NPU (CRIU's own zdtm tests exercise each option too: tests/zdtm/parity.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from npusnap_cli.errors import ExitCode
from tests.integration.dumplib import Job, alive, cli, job_env, wait_until
from tests.integration.test_any_program import assert_continuous, pytestmark, stepper, steps_of

__all__ = ["pytestmark", "stepper"]


def test_passed_options_reach_criu_and_the_job_continues(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """dump with manage-cgroups and ghost-limit, restore with manage-cgroups: CRIU read them
    (its logs say so), the manifest records them, the job continues where it was."""
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "120", "--interval-ms", "30", "--device", "0"])
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        dump_opts = ["--criu-opt", "manage-cgroups", "--criu-opt", "ghost-limit=2M"]
        rc, out, err = cli(env, "dump", str(job.pid), str(img), *dump_opts)
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        manifest = json.loads((img / "npusnap.json").read_text())
        assert manifest["criu_options"]["passthrough"] == ["manage-cgroups", "ghost-limit=2M"]
        dump_log = (img / "logs" / "dump.log").read_text()
        assert "Would overwrite RPC settings with values from" in dump_log
        assert "cg: Dumping cgroups" in dump_log or "cgroup" in dump_log.lower()

        rc, out, err = cli(env, "restore", str(img), "--criu-opt", "manage-cgroups=soft")
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        restore_log = (img / "logs" / "restore.log").read_text()
        assert "Would overwrite RPC settings with values from" in restore_log
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert [s for s, _ in steps_of(job)] == list(range(120))
        assert_continuous(job)
    finally:
        job.cleanup()


def test_an_option_off_the_list_is_refused_before_anything(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [stepper, "--steps", "0", "--interval-ms", "30", "--device", "1"])
    try:
        job.wait_lines(3)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        for bad in ("action-script=/tmp/x.sh", "root=/", "ghost-limit=8M\nexec-cmd"):
            rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--criu-opt", bad)
            assert rc == ExitCode.USAGE and out is not None, err
            assert "--criu-opt" in out["error"]["message"]
            assert not (tmp_path / "img").exists()
        at = len(job.lines())
        job.wait_lines(at + 3)
    finally:
        job.cleanup()


def test_restore_joins_an_existing_network_namespace(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """restore --criu-opt join-ns=net:PATH: the restored job runs in that namespace, its device
    state back, and continues where it was."""
    env = job_env(sim_env, runtime_dir)
    ns = f"npusnap-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
    job = Job(tmp_path, env, [stepper, "--steps", "80", "--interval-ms", "30", "--device", "0"])
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        rc, out, err = cli(env, "restore", str(img), "--criu-opt", f"join-ns=net:/var/run/netns/{ns}")
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        joined = os.stat(f"/proc/{job.restored_pid}/ns/net").st_ino
        assert joined == os.stat(f"/var/run/netns/{ns}").st_ino != os.stat("/proc/self/ns/net").st_ino
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert [s for s, _ in steps_of(job)] == list(range(80))
        assert_continuous(job)
    finally:
        job.cleanup()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
