"""`npusnap dump` + `npusnap restore` end to end: real CRIU, real processes, the simulated NPU.

The workloads keep their state in simulated device memory; a restored run must print exactly the
lines of an uninterrupted run, which proves that host and device state both came back.
"""

from __future__ import annotations

import json
import shutil
import stat
import time
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.image import layout
from tests.conftest import requires_root
from tests.integration.dumplib import (
    LAUNCHER,
    PY,
    TRAIN,
    TRAIN_ARGS,
    Job,
    agent_state,
    alive,
    cli,
    continues_reference,
    job_env,
    kill,
    reference,
    wait_until,
)

pytestmark = [pytest.mark.integration, requires_root]


def test_dump_midway_restore_prints_the_uninterrupted_run(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "40", *TRAIN_ARGS, "--device", "0", "--seed", "3"]
    ref = reference(env, args)
    assert len(ref) == 40
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(8)
        rc, env_out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (env_out or {}).get("error") or err
        job.reap()
        res = env_out["result"] if env_out else {}
        assert res["npu_pids"] == [job.pid] and res["leave_running"] is False
        assert res["timings"]["frozen_s"] > 0 and res["timings"]["criu_total_s"] > 0
        assert res["bytes"]["device_bytes"] >= 65536
        dumped_lines = len(job.lines())
        assert 8 <= dumped_lines < 40

        # The image: private, complete, verifiable, no work area left behind; CRIU's log and
        # statistics kept in it (a good dump's record, outside the checksummed files).
        assert stat.S_IMODE(img.stat().st_mode) == 0o700
        assert layout.temp_siblings(img) == []
        assert (layout.logs_dir(img) / layout.DUMP_LOG).is_file()
        assert not any(
            f["path"].startswith("logs/") for f in json.loads(layout.manifest_path(img).read_text())["files"]
        )
        manifest = json.loads(layout.manifest_path(img).read_text())
        assert manifest["processes"][0]["npu"] is True
        assert manifest["processes"][0]["devices"] == [0]
        assert manifest["versions"]["cann_simulated"] is True
        rc, _, err = cli(env, "verify", str(img))
        assert rc == 0, err
        rc, insp, _ = cli(env, "inspect", str(img))
        assert rc == 0 and insp is not None and insp["result"]["root_pid"] == job.pid

        # Another process on device 0: restore must refuse before touching anything. npusnap finds
        # it in /proc (device mappings) and its agent names its device (a process without an
        # agent cannot say which device it uses: the runtime's Restore refuses that one, 507909).
        occ_dir = tmp_path / "occ"
        occ_dir.mkdir()
        occupier = Job(occ_dir, env, [PY, TRAIN, "--steps", "0", *TRAIN_ARGS, "--device", "0"])
        try:
            occupier.wait_lines(1)
            rc, out, _ = cli(env, "restore", str(img))
            assert rc == ExitCode.BUSY
            assert out is not None and "occupied" in out["error"]["message"]
            assert f"pid {occupier.pid}" in out["error"]["message"]
            assert not alive(job.pid)
        finally:
            occupier.cleanup()

        # A pidfile that cannot be written is refused before anything is restored.
        rc, out, _ = cli(env, "restore", str(img), "--pidfile", str(tmp_path / "no-such-dir" / "p"))
        assert rc == ExitCode.USAGE and out is not None and "pidfile" in out["error"]["message"]
        assert not alive(job.pid)

        pidfile = tmp_path / "restored.pid"
        rc, out, err = cli(env, "restore", str(img), "--pidfile", str(pidfile))
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        job.restored_pid = int(pidfile.read_text())
        assert job.restored_pid == job.pid == out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert job.lines() == ref
    finally:
        job.cleanup()


def test_leave_running_keeps_computing_and_image_restores_later(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "120", *TRAIN_ARGS, "--device", "1", "--seed", "5"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(5)
        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--leave-running", "--keep")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["leave_running"] is True
        assert out["result"]["timings"]["unlock_s"] is not None
        assert (layout.logs_dir(img) / layout.DUMP_LOG).is_file()  # --keep
        assert alive(job.pid)
        assert agent_state(job.pid) == "RUNNING"

        # The original still holds the pid: restore refuses, clearly, before touching anything.
        rc, out, _ = cli(env, "restore", str(img))
        assert rc == ExitCode.BUSY
        assert out is not None and "in use" in out["error"]["message"]

        assert job.reap(30) == 0
        assert job.lines() == ref  # the original computed correctly to the end

        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        continuation = job.lines()[len(ref) :]
        assert len(continuation) >= 1
        assert continues_reference(continuation, ref), continuation[:3]
        assert len(continuation) < len(ref)  # it resumed midway, not from the start
    finally:
        job.cleanup()


@pytest.mark.parametrize("load_acl", [False, True], ids=["plain-launcher", "launcher-with-acl"])
def test_two_worker_launcher_round_trips(
    load_acl: bool, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A launcher and two workers on devices 0 and 1. With --load-acl the launcher has the CANN
    runtime loaded and an agent but no device open (torchrun with torch_npu imported): its Lock
    finds no device (no LOCK_PRE callback runs), it is not left locked, and the dump goes on."""
    env = job_env(sim_env, runtime_dir)
    steps = ["--steps", "80", *TRAIN_ARGS]
    refs = [
        [f"[rank {r}] {line}" for line in reference(env, [*steps, "--device", str(r), "--seed", str(r)])]
        for r in (0, 1)
    ]
    extra = ["--load-acl"] if load_acl else []
    job = Job(tmp_path, env, [PY, LAUNCHER, *steps, "--devices", "0,1", *extra])
    img = tmp_path / "img"
    try:
        wait_until(lambda: sum(1 for ln in job.lines() if ln.startswith("[rank 1]")) >= 4, 20, "both ranks")
        wait_until(lambda: sum(1 for ln in job.lines() if ln.startswith("[rank 0]")) >= 4, 20, "both ranks")
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        npu = out["result"]["npu_pids"]
        if load_acl:  # the runtime is loaded: locked and unlocked at once, no device
            assert len(npu) == 3 and job.pid in npu
            launcher = [p for p in out["result"]["processes"] if p["pid"] == job.pid]
            assert launcher and launcher[0]["devices"] == []
        else:
            assert len(npu) == 2 and job.pid not in npu  # the launcher has no device, the workers do
        devices = sorted(d for p in out["result"]["processes"] for d in p["devices"])
        assert devices == [0, 1]
        job.reap()
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, out and out["error"]
        job.restored_pid = out["result"]["root_pid"] if out else 0
        assert job.restored_pid == job.pid
        wait_until(lambda: not alive(job.restored_pid), 40, "the restored job to finish")
        for r in (0, 1):
            mine = [ln for ln in job.lines() if ln.startswith(f"[rank {r}]")]
            assert mine == refs[r]
    finally:
        job.cleanup()


def test_restore_refuses_bad_images(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, "--steps", "0", *TRAIN_ARGS, "--device", "0"])
    img = tmp_path / "img"
    try:
        job.wait_lines(2)
        rc, _, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, err
        job.reap()

        rc, out, _ = cli(env, "restore", str(tmp_path / "missing"))
        assert rc == ExitCode.IMAGE and out is not None and "no image" in out["error"]["message"]

        manifest = json.loads(layout.manifest_path(img).read_text())
        biggest = max(manifest["files"], key=lambda f: f["size"])["path"]

        truncated = tmp_path / "truncated"
        shutil.copytree(img, truncated)
        with open(truncated / biggest, "r+b") as f:
            f.truncate(100)
        rc, out, _ = cli(env, "restore", str(truncated))
        assert rc == ExitCode.IMAGE and out is not None and biggest in out["error"]["message"]

        tampered = tmp_path / "tampered"
        shutil.copytree(img, tampered)
        with open(tampered / biggest, "r+b") as f:
            f.seek(50)
            byte = f.read(1)
            f.seek(50)
            f.write(bytes([byte[0] ^ 0xFF]))
        rc, out, _ = cli(env, "restore", str(tampered))
        assert rc == ExitCode.IMAGE and out is not None
        assert biggest in out["error"]["message"] and "checksum" in out["error"]["message"]

        half = tmp_path / "half-manifest"
        shutil.copytree(img, half)
        text = layout.manifest_path(half).read_text()
        layout.manifest_path(half).write_text(text[: len(text) // 2])
        rc, out, _ = cli(env, "restore", str(half))
        assert rc == ExitCode.IMAGE and out is not None and "JSON" in out["error"]["message"]

        # None of this started anything: the pid is still free, and a good image still restores.
        assert not alive(job.pid)
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        n = len(job.lines())
        job.wait_lines(n + 2)
        kill(job.restored_pid)
    finally:
        job.cleanup()


def test_dump_attaches_an_agent_where_missing_and_round_trips(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """An attached agent cannot see the job's allocations: the default dump refuses (nothing is
    locked); --device-memory discard dumps it, restore refuses until the loss is accepted, and
    the restored job then really computes on the poisoned memory."""
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "60", *TRAIN_ARGS, "--device", "0", "--seed", "11"]
    ref = reference(env, args)
    # A dump can freeze the job inside a step, where no dump sees it (the lock only waits for device
    # calls). Frozen after the step read the parameters and before it wrote them back: the step
    # writes them back whole from host memory, as on CANN, and no later step sees the poison; rare
    # at one step per 50 ms, so the cycle then runs again on a new job. Frozen after the write-back:
    # the step prints its right line after the restore, and the next one reads the poison.
    for attempt in range(3):
        got, stopped_at = _attach_discard_and_restore(env, args, tmp_path / f"try{attempt}")
        assert len(got) == len(ref) and got[:stopped_at] == ref[:stopped_at]
        if got != ref:
            break
    else:
        pytest.fail("three dumps in a row froze the job between a step's device read and its write")
    first = stopped_at + (got[stopped_at] == ref[stopped_at])
    assert all(a != b for a, b in zip(got[first:], ref[first:]))  # poison, as on CANN


def _attach_discard_and_restore(env: dict[str, str], args: list[str], where: Path) -> tuple[list[str], int]:
    """Start the job without an agent, see the default dump refused, dump it with
    ``--device-memory discard`` and restore it: the lines it printed, and how many were before."""
    where.mkdir()
    job = Job(where, env, [PY, TRAIN, *args], agent=False)  # plain start: no agent
    img = where / "img"
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == ExitCode.TARGET, err
        assert out is not None
        assert "does not know their device memory" in out["error"]["message"]
        assert "npusnap run" in out["error"]["fix"] and "--device-memory" in out["error"]["fix"]
        assert agent_state(job.pid) == "RUNNING"
        at = len(job.lines())
        wait_until(lambda: len(job.lines()) > at, 10, "the job to go on after the refusal")

        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--device-memory", "discard")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["attached"] == []  # attached by the first dump
        assert out["result"]["device_memory"]["continuity"] == "lost"
        job.reap()
        stopped_at = len(job.lines())
        rc, out, err = cli(env, "restore", str(img))
        assert rc == ExitCode.PREFLIGHT, err
        assert out is not None and "--accept-lost-device-memory" in out["error"]["fix"]
        rc, out, err = cli(env, "restore", str(img), "--accept-lost-device-memory")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["device_memory_lost"] is True
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        return job.lines(), stopped_at
    finally:
        job.cleanup()


def test_a_restored_job_can_be_dumped_again(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Regression: the agent of a restored process refused the legal BACKED_UP -> Unlock of a later
    `--leave-running` dump (RESTORE_REQUIRED), because it never forgot the earlier CRIU restore."""
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "120", *TRAIN_ARGS, "--device", "0", "--seed", "11"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    first, second = tmp_path / "img1", tmp_path / "img2"
    try:
        job.wait_lines(5)
        rc, _, err = cli(env, "dump", str(job.pid), str(first))
        assert rc == 0, err
        job.reap()
        rc, out, err = cli(env, "restore", str(first))
        assert rc == 0 and out is not None, err
        job.restored_pid = out["result"]["root_pid"]
        at = len(job.lines())
        wait_until(lambda: len(job.lines()) >= at + 3, 30, "the restored job to compute")

        # Second snapshot of the restored process, keeping it running, then a third restore
        # after it finished.
        rc, out, err = cli(env, "dump", str(job.restored_pid), str(second), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert agent_state(job.restored_pid) == "RUNNING"
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert job.lines() == ref

        rc, out, err = cli(env, "restore", str(second))
        assert rc == 0 and out is not None, err
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 30, "the second restored run to finish")
        continuation = job.lines()[len(ref) :]
        assert continuation and continues_reference(continuation, ref), continuation[:3]
    finally:
        job.cleanup()


CLOCK_WRAPPER = """
import runpy, sys, threading, time
def tick(path):
    with open(path, "a") as f:
        while True:
            f.write(f"{time.monotonic():.3f} {time.time():.3f}\\n")
            f.flush()
            time.sleep(0.1)
threading.Thread(target=tick, args=(sys.argv[1],), daemon=True).start()
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_late_restore_makes_no_time_pass_in_the_jobs_monotonic_clock(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Restored 4 s after the dump, the job sees its wall clock jump by those seconds and its
    CLOCK_MONOTONIC (the clock of timeouts: torch's collective work timeout, heartbeats) go on
    from the dump: CRIU restores the tree into a time namespace whose offsets say so (its restore
    log: "timens: monotonic ..."). A job restored long after its dump does not time out for it."""
    env = job_env(sim_env, runtime_dir)
    wrapper = tmp_path / "clock_train.py"
    wrapper.write_text(CLOCK_WRAPPER)
    ticks = tmp_path / "ticks"
    job = Job(tmp_path, env, [PY, str(wrapper), str(ticks), TRAIN, *TRAIN_ARGS, "--steps", "200"])
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"))
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        time.sleep(4)
        rc, out, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.restored_pid = int(out["result"]["root_pid"])
        wait_until(lambda: not alive(job.restored_pid), 120, "the restored job to finish")
        pairs = [tuple(map(float, ln.split())) for ln in ticks.read_text().splitlines()[:-1]]
        at = max(range(1, len(pairs)), key=lambda i: pairs[i][1] - pairs[i - 1][1])
        assert len(pairs) - at > 5, "too few ticks after the restore"
        wall_gap = pairs[at][1] - pairs[at - 1][1]
        mono_gap = pairs[at][0] - pairs[at - 1][0]
        assert wall_gap > 4, wall_gap
        assert mono_gap < 2, f"CLOCK_MONOTONIC jumped by {mono_gap:.1f}s across the restore"
    finally:
        job.cleanup()
