"""Incremental snapshots: images of one job share their device-memory chunks (devchunks.py).

A second snapshot next to the first writes only the pieces that changed; every image stays
complete by itself (verify, restore, export, rm of another); a missing or altered chunk is named
by verify and refused by restore before the device memory is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from tests.conftest import REPO, requires_root
from tests.integration.dumplib import PY, Job, alive, cli, job_env, wait_until

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _ticks(job: Job) -> list[str]:
    return [ln.split(" checksum ")[1] for ln in job.text().splitlines() if ln.startswith("tick ")]


def _bigalloc(tmp: Path, env: dict[str, str], mib: int) -> Job:
    argv = [PY, str(REPO / "npusnap_cli" / "workloads" / "bigalloc.py"), "--device-mib", str(mib)]
    job = Job(tmp, env, [*argv, "--host-mib", "1", "--interval", "0.05", "--seed", "5"])
    wait_until(lambda: len(_ticks(job)) >= 2, 60, "bigalloc's first ticks")
    return job


def _files(image: Path) -> dict[str, dict[str, object]]:
    return {f["path"]: f for f in json.loads((image / "npusnap.json").read_text())["files"]}


@requires_root
def test_second_snapshot_links_what_did_not_change(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    mib = 16
    env = job_env(sim_env, runtime_dir)
    job = _bigalloc(tmp_path, env, mib)
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    try:
        rc, first, err = cli(env, "dump", "--leave-running", str(job.pid), str(images / "a"))
        assert rc == 0, (first or {}).get("error") or err
        b1 = first["result"]["bytes"]
        assert b1["device_total"] >= mib * MiB and b1["device_new"] == b1["device_total"], b1
        rc, second, err = cli(env, "dump", str(job.pid), str(images / "b"))
        assert rc == 0, (second or {}).get("error") or err
        b2 = second["result"]["bytes"]
        # Nothing of bigalloc's device memory changed: only the records' piece is new.
        assert b2["device_total"] == b1["device_total"] and b2["device_new"] < 64 << 10, b2
        chunks = [p for p in _files(images / "b") if p.startswith("device/chunks/")]
        assert len(chunks) >= mib
        for rel in chunks:
            st = (images / "b" / rel).stat()
            assert st.st_nlink == 2 and not st.st_mode & 0o222, rel  # linked from a, read-only
        before = set(_ticks(job))
        job.reap()

        # Each image stands alone: the first removed, the second still verifies and restores.
        shutil.rmtree(images / "a")
        rc, out, err = cli(env, "verify", str(images / "b"))
        assert rc == 0, (out or {}).get("error") or err
        rc, out, err = cli(env, "restore", str(images / "b"))
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"]
        n = len(_ticks(job))
        wait_until(lambda: len(_ticks(job)) >= n + 3, 30, "ticks after the restore")
        assert set(_ticks(job)) == before, "the restored job's device memory differs"
        assert alive(job.restored_pid)
    finally:
        job.cleanup()


@requires_root
def test_a_bad_chunk_is_named_and_refused(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    env = job_env(sim_env, runtime_dir)
    job = _bigalloc(tmp_path, env, 4)
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    try:
        rc, out, err = cli(env, "dump", "--leave-running", str(job.pid), str(images / "a"))
        assert rc == 0, (out or {}).get("error") or err
        rc, out, err = cli(env, "dump", "--leave-running", str(job.pid), str(images / "b"))
        assert rc == 0, (out or {}).get("error") or err
    finally:
        job.cleanup()
    chunk = sorted(p for p in _files(images / "b") if p.startswith("device/chunks/"))[-1]
    # Altered through the other image's name: both images hold the one file.
    path = images / "a" / chunk
    os.chmod(path, 0o600)
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    for name in ("a", "b"):
        rc, out, err = cli(env, "verify", str(images / name))
        assert rc == ExitCode.IMAGE and out is not None, (rc, out, err)
        assert chunk in json.dumps(out["error"]), out["error"]
    rc, out, err = cli(env, "restore", str(images / "b"))
    assert rc == ExitCode.IMAGE and out is not None, (rc, out, err)
    assert chunk in json.dumps(out["error"]), out["error"]
    for pid in out["error"]["details"].get("killed_before_device_memory", []):
        wait_until(lambda p=pid: not alive(p), 10, f"pid {pid} to be gone")
    # Missing: named too.
    (images / "a" / chunk).unlink()
    (images / "b" / chunk).unlink()
    rc, out, err = cli(env, "verify", str(images / "b"))
    assert rc == ExitCode.IMAGE and chunk in json.dumps(out["error"]), (rc, out, err)


LORA = str(REPO / "npusnap_cli" / "workloads" / "torch_npu_lora.py")


def test_a_lora_job_second_snapshot_writes_under_5_percent_and_restores_exactly(
    torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A real torch_npu fine-tuning job with a frozen 64 MiB base: the second snapshot, next to
    the first, writes at most 5 % of its device memory; restored from it alone, the job's every
    later step line (loss and adapter hash) and the base's hash at the end equal an
    uninterrupted run's."""
    env = job_env(sim_env, runtime_dir)
    args = [LORA, "--steps", "24", "--base-mib", "64", "--interval", "0.1"]
    done = subprocess.run([torch_npu_python, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = [ln for ln in done.stdout.splitlines() if ln.startswith(("step", "base"))]
    job = Job(tmp_path, env, [torch_npu_python, *args])
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    try:
        job.wait_lines(4, timeout=180)
        rc, first, err = cli(env, "dump", "--leave-running", str(job.pid), str(images / "a"), timeout=300)
        assert rc == 0, (first or {}).get("error") or err
        n = len(job.lines())
        job.wait_lines(n + 3, timeout=120)
        rc, second, err = cli(env, "dump", str(job.pid), str(images / "b"), timeout=300)
        assert rc == 0, (second or {}).get("error") or err
        b1, b2 = first["result"]["bytes"], second["result"]["bytes"]
        assert b1["device_total"] >= 64 << 20 and b1["device_new"] > b1["device_total"] // 2, b1
        assert b2["device_new"] <= 0.05 * b2["device_total"], b2
        job.reap(60)
        shutil.rmtree(images / "a")
        rc, out, err = cli(env, "restore", str(images / "b"), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 300, "the restored job to finish")
        lines = [ln for ln in job.text().splitlines() if ln.startswith(("step", "base"))]
        assert lines == ref, job.text()[-3000:]
    finally:
        job.cleanup()
