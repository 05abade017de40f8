"""A real dump's phases are named for what they time: the runtime's Lock and Backup apart from
npusnap's copy of the device memory, which takes the seconds of a large job; a restore warns of
nothing when everything is normal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.integration.dumplib import PY, TRAIN, Job, cli, job_env

pytestmark = [pytest.mark.integration, requires_root]


def test_the_device_copy_is_timed_apart_from_the_runtimes_lock(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, "--interval", "0.05", "--param-bytes", str(32 << 20)])
    try:
        job.wait_lines(3)
        image = tmp_path / "img"
        rc, out, err = cli(env, "dump", str(job.pid), str(image), "--leave-running")
        assert rc == 0 and out is not None, (rc, out, err)
        t = out["result"]["timings"]
        assert t["device_copy_s"] is not None and t["device_copy_s"] > 0, t
        assert t["lock_s"] is not None and t["backup_s"] is not None, t
        # Each is a part of the time the job was frozen, none counted twice.
        assert t["lock_s"] + t["device_copy_s"] + t["backup_s"] <= t["frozen_s"] + 1e-3, t
        rc, _, err = cli(
            env, "dump", str(job.pid), str(tmp_path / "img2"), "--leave-running", json_mode=False
        )
        assert rc == 0, err
        assert "runtime Lock" in err and "device memory copy (npusnap, locked)" in err, err
        assert "device backup" not in err, err
        job.cleanup()
        rc, out, err = cli(env, "restore", str(image))
        assert rc == 0 and out is not None, (rc, out, err)
        job.restored_pid = int(out["result"]["root_pid"])
        assert out["warnings"] == [], out["warnings"]
    finally:
        job.cleanup()
