"""Image management with real CRIU: rotation and `latest` around real dumps, an archive round
trip, and a restore from read-only storage whose pid is the command's stdout."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from npusnap_cli.image import layout
from tests.conftest import requires_root
from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    TRAIN,
    TRAIN_ARGS,
    Job,
    cli,
    job_env,
    reference,
    wait_until,
)

pytestmark = [pytest.mark.integration, requires_root]


@contextlib.contextmanager
def read_only_view(source: Path, where: Path) -> Iterator[Path]:
    """``source`` seen through a read-only bind mount at ``where`` (a snapshot volume, say)."""
    where.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(where)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_rotation_archive_and_read_only_restore(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir, TMPDIR=str(tmp_path))
    args = ["--steps", "200", *TRAIN_ARGS, "--device", "0", "--seed", "9"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / "notes.txt").write_text("not an image: never rotated away\n")
    try:
        job.wait_lines(3)
        made = []
        for i in range(3):
            target = snaps / f"s{i}"
            p = subprocess.run(
                [NPUSNAP, "dump", "--leave-running", "--keep-last", "2", "--latest", str(job.pid),
                 str(target)],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert p.returncode == 0, p.stderr
            assert p.stdout == f"{target}\n"  # the image path is the only thing on stdout
            made.append(target)
        assert sorted(x.name for x in snaps.iterdir()) == ["latest", "notes.txt", "s1", "s2"]
        assert os.readlink(snaps / "latest") == "s2"
        rc, out, err = cli(env, "list", str(snaps))
        assert rc == 0 and out is not None, err
        assert [Path(i["path"]).name for i in out["result"]["images"]] == ["s2", "s1"]
        assert all(i["valid"] and i["pids"] == [job.pid] for i in out["result"]["images"])

        archive = tmp_path / "s2.tar.zst"
        rc, out, err = cli(env, "export", str(snaps / "latest"), str(archive))
        assert rc == 0, (out or {}).get("error") or err
        imported = tmp_path / "imported"
        rc, out, err = cli(env, "import", str(archive), str(imported))
        assert rc == 0, err

        before = len(job.lines())
        job.proc.kill()
        job.reap()
        with read_only_view(imported, tmp_path / "ro") as ro:
            p = subprocess.run(
                [NPUSNAP, "restore", "--no-verify", str(ro)],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert p.returncode == 0, p.stderr
            assert "--no-verify" in p.stderr  # warned
            assert "not writable" in p.stderr  # and said where the log went instead
            job.restored_pid = int(p.stdout.strip())  # PID=$(npusnap restore IMG)
            assert job.restored_pid == job.pid
            assert not (layout.logs_dir(ro) / layout.RESTORE_LOG).exists()
        assert list((tmp_path / "npusnap-logs").glob("restore-*/restore.log"))
        # It redoes the steps since the snapshot, identically, and carries on.
        wait_until(lambda: len(job.lines()) >= before + 5, 30, "the restored job to compute")
        after = job.lines()[before:]
        assert after and after == ref[ref.index(after[0]) : ref.index(after[0]) + len(after)]
    finally:
        job.cleanup()
