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
from tests.integration.dumplib import NPUSNAP, PY, TRAIN, Job, alive, cli, job_env, reference, wait_until

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _ticks(job: Job) -> list[str]:
    return [ln.split(" checksum ")[1] for ln in job.text().splitlines() if ln.startswith("tick ")]


def _bigalloc(tmp: Path, env: dict[str, str], mib: int) -> Job:
    argv = [PY, str(REPO / "npusnap_workloads" / "bigalloc.py"), "--device-mib", str(mib)]
    job = Job(tmp, env, [*argv, "--host-mib", "1", "--interval", "0.05", "--seed", "5"])
    wait_until(lambda: len(_ticks(job)) >= 2, 60, "bigalloc's first ticks")
    return job


def _base(image: Path, pid: int) -> object:
    """The image an incremental save of ``pid`` took its unchanged pieces from (its name)."""
    manifest = json.loads((image / "npusnap.json").read_text())
    return manifest["device_memory"]["processes"][str(pid)].get("base")


def _restores_with_its_ticks(env: dict[str, str], image: Path, job: Job, before: set[str]) -> None:
    """Restored from ``image``, the job ticks on with the checksums it had: its device memory
    came back whole (bigalloc checksums all of it every tick)."""
    rc, out, err = cli(env, "restore", str(image))
    assert rc == 0, (out or {}).get("error") or err
    job.restored_pid = out["result"]["root_pid"]
    n = len(_ticks(job))
    wait_until(lambda: len(_ticks(job)) >= n + 3, 30, "ticks after the restore")
    assert set(_ticks(job)) == before, "the restored job's device memory differs"


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
        assert _base(images / "b", job.pid) == "a"
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
        _restores_with_its_ticks(env, images / "b", job, before)
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


LORA = str(REPO / "npusnap_workloads" / "torch_npu_lora.py")


def test_a_lora_job_second_snapshot_writes_under_5_percent_and_restores_exactly(
    torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A real torch_npu fine-tuning job with a frozen 64 MiB base: the second snapshot, next to
    the first, writes at most 5 % of its device memory; restored from it alone, the job's every
    later step line (loss and adapter hash) and the base's hash at the end equal an
    uninterrupted run's."""
    env = job_env(sim_env, runtime_dir)
    args = [LORA, "--steps", "60", "--base-mib", "64", "--interval", "0.1"]
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
        # The agent copies everything once more, and the dump checks that every piece its write
        # tracking called unchanged since "a" is: a missed write fails this dump.
        n = len(job.lines())
        job.wait_lines(n + 3, timeout=120)
        checked = dict(env, NPUSNAP_TEST_CHECK_WRITES="1")
        rc, out, err = cli(
            checked, "dump", "--leave-running", str(job.pid), str(images / "check"), timeout=300
        )
        assert rc == 0, (out or {}).get("error") or err
        assert _base(images / "check", job.pid) == "a"
        # Every launch of this job named what it writes: nothing counted as writing everything.
        rc, st, err = cli(env, "status", str(job.pid))
        tracking = st["result"]["processes"][0]["hello"]["device_memory"]["tracking"]
        assert tracking["marks_all"] == 0 and tracking["untracked"] is None, tracking
        n = len(job.lines())
        job.wait_lines(n + 3, timeout=120)
        rc, second, err = cli(env, "dump", str(job.pid), str(images / "b"), timeout=300)
        assert rc == 0, (second or {}).get("error") or err
        assert _base(images / "b", job.pid) == "check"  # the newest of its history next to it

        b1, b2 = first["result"]["bytes"], second["result"]["bytes"]
        assert b1["device_total"] >= 64 << 20 and b1["device_new"] > b1["device_total"] // 2, b1
        assert b2["device_new"] <= 0.05 * b2["device_total"], b2
        job.reap(60)
        shutil.rmtree(images / "a")
        shutil.rmtree(images / "check")
        rc, out, err = cli(env, "restore", str(images / "b"), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 300, "the restored job to finish")
        lines = [ln for ln in job.text().splitlines() if ln.startswith(("step", "base"))]
        assert lines == ref, job.text()[-3000:]
    finally:
        job.cleanup()


RAW_WRITER = r"""
import ctypes, os, sys, time, zlib
home = os.environ["ASCEND_HOME_PATH"]
acl = ctypes.CDLL(os.path.join(home, "lib64", "libacl_rt.so"))
vp = ctypes.c_void_p
acl.aclrtMalloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_int]
acl.aclrtMemcpy.argtypes = [vp, ctypes.c_size_t, vp, ctypes.c_size_t, ctypes.c_int]
acl.aclrtBinaryLoadFromFile.argtypes = [ctypes.c_char_p, vp, ctypes.POINTER(vp)]
acl.aclrtBinaryGetFunction.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(vp)]
acl.aclrtLaunchKernel.argtypes = [vp, ctypes.c_uint32, vp, ctypes.c_size_t, vp]
acl.aclrtCreateStream.argtypes = [ctypes.POINTER(vp)]
acl.aclrtSynchronizeStream.argtypes = [vp]
def ok(rc, what):
    if rc:
        sys.exit(f"{what} failed: {rc}")
MiB = 1 << 20
acl.aclInit(None)
ok(acl.aclrtSetDevice(0), "set device")
buf, stream, binh, fill = vp(), vp(), vp(), vp()
ok(acl.aclrtMalloc(ctypes.byref(buf), 8 * MiB, 0), "malloc")
ok(acl.aclrtCreateStream(ctypes.byref(stream)), "stream")
ok(acl.aclrtBinaryLoadFromFile(sys.argv[1].encode(), None, ctypes.byref(binh)), "load")
ok(acl.aclrtBinaryGetFunction(binh, b"npusim_slow_fill", ctypes.byref(fill)), "function")
host = ctypes.create_string_buffer(8 * MiB)
ok(acl.aclrtMemcpy(buf, 8 * MiB, host, 8 * MiB, 1), "h2d")
class Fill(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("chunk", ctypes.c_uint64), ("chunks", ctypes.c_uint32),
                ("value", ctypes.c_uint32), ("delay_ms", ctypes.c_uint32), ("pad", ctypes.c_uint32)]
print("ready", flush=True)
for tick in range(1, int(sys.argv[2]) + 1):
    # A raw kernel launch writes one MiB of the buffer, a different one each tick: nothing in the
    # call says where it writes (its arguments are an opaque block).
    a = Fill(buf.value + (tick % 8) * MiB, 65536, 16, tick, 0, 0)
    ok(acl.aclrtLaunchKernel(fill, 1, ctypes.byref(a), ctypes.sizeof(a), stream), "launch")
    ok(acl.aclrtSynchronizeStream(stream), "sync")
    ok(acl.aclrtMemcpy(host, 8 * MiB, buf, 8 * MiB, 2), "d2h")
    print(f"tick {tick} checksum {zlib.crc32(host.raw):08x}", flush=True)
    time.sleep(0.05)
"""


def test_a_raw_kernel_writer_is_copied_whole_and_checked_exact(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A job whose writes come from raw kernel launches (aclrtLaunchKernel: an opaque argument
    block) gets the conservative rule: every piece counts as written. The check mode copies
    everything and compares each piece the tracking called unchanged with the base image; the
    image restores the job's device memory bit for bit (its checksum of all 8 MiB goes on)."""
    kernels = tmp_path / "sim_kernels.so"
    src = REPO / "tests" / "integration" / "sim_helpers" / "sim_kernels.c"
    inc = REPO / "native" / "npusim"
    subprocess.run(["cc", "-O1", "-fPIC", "-shared", f"-I{inc}", "-o", str(kernels), str(src)], check=True)
    script = tmp_path / "raw_writer.py"
    script.write_text(RAW_WRITER)
    env = job_env(sim_env, runtime_dir)
    ticks = "80"
    ref = subprocess.run(
        [PY, str(script), str(kernels), ticks], env=env, capture_output=True, text=True, timeout=120
    )
    assert ref.returncode == 0, ref.stderr
    expected = [ln for ln in ref.stdout.splitlines() if ln.startswith("tick ")]
    job = Job(tmp_path, env, [PY, str(script), str(kernels), ticks])
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    try:
        wait_until(lambda: len(_ticks(job)) >= 3, 60, "the first ticks")
        rc, out, err = cli(env, "dump", "--leave-running", str(job.pid), str(images / "a"))
        assert rc == 0, (out or {}).get("error") or err
        n = len(_ticks(job))
        wait_until(lambda: len(_ticks(job)) >= n + 3, 60, "more ticks")
        rc, st, err = cli(env, "status", str(job.pid))
        tracking = st["result"]["processes"][0]["hello"]["device_memory"]["tracking"]
        assert tracking["marks_all"] > 0 and tracking["all_why"] == "aclrtLaunchKernel", tracking
        # Left running, copied while the kernels go on writing: each launch waits for the whole
        # copy (its writes are not known), and the copy equals the cut's, bit for bit.
        concurrent = dict(env, NPUSNAP_TEST_CHECK_CONCURRENT="1", NPUSNAP_NO_INCREMENTAL="1")
        alone = tmp_path / "alone"
        alone.mkdir(mode=0o700)
        rc, out, err = cli(concurrent, "dump", "--leave-running", str(job.pid), str(alone / "c"))
        assert rc == 0, (out or {}).get("error") or err
        m = json.loads((alone / "c" / "npusnap.json").read_text())
        assert "concurrent" in m["device_memory"]["processes"][str(job.pid)], m["device_memory"]
        checked = dict(env, NPUSNAP_TEST_CHECK_WRITES="1")
        rc, out, err = cli(checked, "dump", str(job.pid), str(images / "b"))
        assert rc == 0, (out or {}).get("error") or err
        assert _base(images / "b", job.pid) == "a"
        job.reap()
        rc, out, err = cli(env, "restore", str(images / "b"))
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored job to finish")
        # Every tick's checksum over all 8 MiB, before and after the cut, is the uninterrupted run's.
        assert [ln for ln in job.text().splitlines() if ln.startswith("tick ")] == expected
    finally:
        job.cleanup()


def test_images_of_one_job_outlive_a_crashed_dump_and_travel_alone(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A dump killed while publishing leaves the images next to it whole; an image exported,
    every image of the job removed, and imported again restores the job by itself."""
    env = job_env(sim_env, runtime_dir)
    job = _bigalloc(tmp_path, env, 6)
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    try:
        for name in ("a", "b"):
            rc, out, err = cli(env, "dump", "--leave-running", str(job.pid), str(images / name))
            assert rc == 0, (out or {}).get("error") or err
        crash = dict(env, NPUSNAP_TEST_CRASH_AT="publish:before-rename")
        done = subprocess.run(
            [NPUSNAP, "dump", "--leave-running", str(job.pid), str(images / "c")],
            env=crash,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == -9, done.stderr
        assert not (images / "c").exists()
        for name in ("a", "b"):
            rc, out, err = cli(env, "verify", str(images / name))
            assert rc == 0, (name, (out or {}).get("error") or err)
        archive = tmp_path / "b.tar.zst"
        rc, out, err = cli(env, "export", str(images / "b"), str(archive))
        assert rc == 0, (out or {}).get("error") or err
        before = set(_ticks(job))
        shutil.rmtree(images)
        job.proc.kill()
        job.reap()
        rc, out, err = cli(env, "import", str(archive), str(tmp_path / "imported"))
        assert rc == 0, (out or {}).get("error") or err
        chunks = list((tmp_path / "imported" / "device" / "chunks").iterdir())
        assert chunks and all(c.stat().st_nlink == 1 for c in chunks)  # inlined: its own files
        _restores_with_its_ticks(env, tmp_path / "imported", job, before)
    finally:
        job.cleanup()


def test_an_image_of_schema_1_still_verifies_and_restores(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Images made before chunks (schema 1: one devmem-PID.bin, no device_total/device_new): made
    here as that layout (NPUSNAP_DEVMEM_FLAT=1) with its manifest written back as schema 1."""
    from npusnap_cli.image.manifest import SELF_HASH_KEY, _self_hash

    env = job_env(sim_env, runtime_dir)
    job = _bigalloc(tmp_path, env, 4)
    image = tmp_path / "old"
    try:
        rc, out, err = cli(dict(env, NPUSNAP_DEVMEM_FLAT="1"), "dump", str(job.pid), str(image))
        assert rc == 0, (out or {}).get("error") or err
        before = set(_ticks(job))
        job.reap()
        path = image / "npusnap.json"
        m = json.loads(path.read_text())
        assert f"device/devmem-{job.pid}.bin" in {f["path"] for f in m["files"]}
        m["schema"] = 1
        for key in ("device_total", "device_new"):
            del m["bytes"][key]
        for p in m["device_memory"]["processes"].values():
            p.pop("save", None)
        del m[SELF_HASH_KEY]
        m[SELF_HASH_KEY] = _self_hash(m)
        path.write_text(json.dumps(m, indent=2))
        rc, out, err = cli(env, "verify", str(image))
        assert rc == 0, (out or {}).get("error") or err
        _restores_with_its_ticks(env, image, job, before)
    finally:
        job.cleanup()


def test_a_leave_running_dump_copies_while_the_job_runs_and_matches_the_cut(
    torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """`dump --leave-running` holds the job only for the cut: its device memory is copied after
    the unlock while it trains, a piece it is about to write copied first. Checked here
    (NPUSNAP_TEST_CHECK_CONCURRENT=1): the cut's full copy is taken as well, and every piece the
    concurrent copy wrote equals it bit for bit; the image restores every later step exactly."""
    env = job_env(sim_env, runtime_dir)
    args = [LORA, "--steps", "30", "--base-mib", "48", "--interval", "0.05"]
    done = subprocess.run([torch_npu_python, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = [ln for ln in done.stdout.splitlines() if ln.startswith(("step", "base"))]
    job = Job(tmp_path, env, [torch_npu_python, *args])
    image = tmp_path / "img"
    try:
        job.wait_lines(4, timeout=180)
        checked = dict(env, NPUSNAP_TEST_CHECK_CONCURRENT="1")
        rc, out, err = cli(checked, "dump", "--leave-running", str(job.pid), str(image), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        m = json.loads((image / "npusnap.json").read_text())
        stats = m["device_memory"]["processes"][str(job.pid)]["concurrent"]
        assert stats["cow_pieces"] + stats["background_pieces"] >= 40, stats
        assert job.reap(300) == 0
        first = len(job.lines())
        rc, out, err = cli(env, "restore", str(image), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 300, "the restored job to finish")
        lines = [ln for ln in job.text().splitlines() if ln.startswith(("step", "base"))]
        assert lines[: len(ref)] == ref, "the original, left running, went on differently"
        again = lines[len(ref) :]
        assert again and again == ref[len(ref) - len(again) :], job.text()[-3000:]
        assert first
    finally:
        job.cleanup()


@requires_root
def test_a_job_writing_all_the_time_survives_snapshots_in_a_row(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Its writes meet the copy at every moment: a write that waits for a piece the copier is
    taking, a copy that ends while writes wait, the next snapshot's plan right after. Each
    leave-running dump succeeds, and the job runs on to the uninterrupted run's last line."""
    env = job_env(sim_env, runtime_dir)
    steps = 600  # 4 MiB steps: about 10 s, room for several snapshots before the last 150
    args = ["--steps", str(steps), "--interval", "0", "--param-bytes", str(4 * MiB + 123), "--seed", "3"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    try:
        job.wait_lines(3)
        done = 0
        while done < 8 and len(job.lines()) < steps - 150:
            image = tmp_path / f"img{done}"
            rc, out, err = cli(env, "dump", "--leave-running", str(job.pid), str(image))
            assert rc == 0, (done, (out or {}).get("error") or err)
            shutil.rmtree(image)
            done += 1
        assert done >= 3, f"only {done} snapshots before the job neared its end"
        assert job.reap(300) == 0, job.text()[-2000:]
        assert job.lines() == ref
    finally:
        job.cleanup()
