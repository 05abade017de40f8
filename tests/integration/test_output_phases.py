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


def test_replicas_have_names_and_logs_of_their_own_by_default(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    from tests.integration.dumplib import TRAIN_ARGS, alive, continues_reference, kill, reference, wait_until
    from tests.integration.test_pidns import lines, start_ns_job

    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "60"]
    ref = reference(env, args)
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, TRAIN, *args])
    roots: list[int] = []
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        img = tmp_path / "img"
        rc, res, err = cli(env, "dump", str(pid), str(img))
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        at = len(lines(out))
        rc, res, err = cli(
            env,
            "restore",
            str(img),
            "--replicas",
            "2",
            "--device-map",
            "0=0",
            "--device-map",
            "0=1",
            "--replica-name",
            "trainer-{n}",
        )
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        copies = res["result"]["replicas"]
        roots = [int(r["root_pid"]) for r in copies]
        assert [r["name"] for r in copies] == ["trainer-0", "trainer-1"]
        assert [r["output"] for r in copies] == [f"{out}.trainer-0", f"{out}.trainer-1"]
        assert (img / "logs" / "trainer-0" / "restore.log").is_file()
        for root in roots:
            wait_until(lambda r=root: not alive(r), 60, f"replica {root} to finish")
        assert len(lines(out)) == at, "a copy wrote into the original's log"
        for name in ("trainer-0", "trainer-1"):
            own = lines(Path(f"{out}.{name}"))
            assert own and continues_reference(own, ref), own[:3]
    finally:
        for r in roots:
            kill(r)
        kill(pid)


def test_a_dump_into_a_read_only_filesystem_names_it(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(ro)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, "--interval", "0.05", "--param-bytes", "65536"])
    try:
        job.wait_lines(2)
        for target in (ro, ro / "img"):  # the mount point itself (empty), and a new name in it
            rc, out, err = cli(env, "dump", str(job.pid), str(target))
            assert out is not None and rc != 0, (rc, out, err)
            message = out["error"]["message"]
            assert "read-only filesystem (EROFS)" in message and "free" not in message, out["error"]
        assert job.proc.poll() is None  # nothing was touched: the job runs on
    finally:
        job.cleanup()
        subprocess.run(["umount", "-l", str(ro)], check=False)
