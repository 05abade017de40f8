"""`npusnap dump --dry-run`: every check of the dump, and nothing else.

Each case runs the dry run against a real job on the simulated NPU and checks both its table of
checks and that the job was not touched: no image or work area, no agent attached, the job
unlocked and computing on, and a refusal with the exit code and message the dump itself gives
for the same target.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.host import procfs
from tests.conftest import requires_root
from tests.integration.dumplib import PY, TRAIN, TRAIN_ARGS, Job, agent_state, assert_no_image, cli, job_env

pytestmark = [pytest.mark.integration, requires_root]
ARGS = ["--steps", "400", *TRAIN_ARGS, "--device", "0", "--seed", "3"]


def _problem(envelope: dict[str, Any]) -> str:
    """The first problem's message in a dry run's table."""
    return str(next(c["detail"] for c in envelope["result"]["checks"] if c["status"] == "problem"))


def _has_agent(pid: int) -> bool:
    return "libnpusnap_agent" in Path(f"/proc/{pid}/maps").read_text()


def test_a_job_that_would_dump_is_not_touched(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", "--dry-run", str(job.pid), str(img))
        assert rc == 0 and out is not None, err
        res = out["result"]
        assert res["ready"] is True and res["npu_pids"] == [job.pid] and res["would_attach"] == []
        status = {c["name"]: c["status"] for c in res["checks"]}
        assert status.pop("signing-key") == "skipped" and set(status.values()) == {"ok"}, res["checks"]
        assert {"target", "criu", "host-files", "space", "agents"} <= set(status)
        assert_no_image(img)
        assert agent_state(job.pid) == "RUNNING"
        seen = len(job.lines())
        job.wait_lines(seen + 2)  # computing on
    finally:
        job.cleanup()


def test_a_job_without_agent_would_be_attached_and_is_not(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS], agent=False)
    img = tmp_path / "img"
    try:
        job.wait_lines(2)
        rc, out, err = cli(env, "dump", "--dry-run", str(job.pid), str(img))
        assert rc == 0 and out is not None, err
        res = out["result"]
        assert res["ready"] is True and res["would_attach"] == [job.pid]
        agents = next(c for c in res["checks"] if c["name"] == "agents")
        assert agents["status"] == "skipped" and "would attach" in agents["detail"]
        assert not _has_agent(job.pid)
        assert procfs.read_stat(job.pid).state != "T"
        assert_no_image(img)
        seen = len(job.lines())
        job.wait_lines(seen + 2)
    finally:
        job.cleanup()


def test_refusals_are_the_dumps_own(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """A target the dump refuses, the dry run refuses with the same exit code and message, and
    leaves everything as it found it: a plain process, a non-empty DIR, a job another command
    holds locked, several PIDs."""
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    plain = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        job.wait_lines(2)
        full = tmp_path / "full"
        full.mkdir()
        (full / "keep.txt").write_text("precious")
        for target, where, code in (
            (plain.pid, tmp_path / "img", ExitCode.TARGET),
            (job.pid, full, ExitCode.USAGE),
        ):
            rc, out, _ = cli(env, "dump", "--dry-run", str(target), str(where))
            assert rc == code and out is not None and out["result"]["ready"] is False
            dump_rc, dump_out, _ = cli(env, "dump", str(target), str(where))
            assert dump_rc == rc and dump_out is not None
            assert _problem(out) == dump_out["error"]["message"]
        assert plain.poll() is None
        assert (full / "keep.txt").read_text() == "precious" and sorted(p.name for p in full.iterdir()) == [
            "keep.txt"
        ]

        rc, out, err = cli(env, "freeze", str(job.pid), "--no-backup")
        assert rc == 0, err
        try:
            rc, out, _ = cli(env, "dump", "--dry-run", str(job.pid), str(tmp_path / "img"))
            dump_rc, dump_out, _ = cli(env, "dump", str(job.pid), str(tmp_path / "img"))
            assert rc != 0 and rc == dump_rc and out is not None and dump_out is not None
            assert _problem(out) == dump_out["error"]["message"]
            assert agent_state(job.pid) == "LOCKED"  # the freeze's lock is still there, untouched
        finally:
            rc, _, err = cli(env, "thaw", str(job.pid))
            assert rc == 0, err
        assert agent_state(job.pid) == "RUNNING"

        rc, out, _ = cli(env, "dump", "--dry-run", str(job.pid), str(plain.pid), str(tmp_path / "img"))
        assert rc == ExitCode.USAGE and out is not None and "one process tree" in out["error"]["message"]
        assert_no_image(tmp_path / "img")
        seen = len(job.lines())
        job.wait_lines(seen + 2)
    finally:
        plain.kill()
        plain.wait()
        job.cleanup()
