"""A job that computes on the device (npu_train.py: aclnn operators on streams, an expandable-segment
allocator) dumped and restored by npusnap: how long it stops, when it computes again, and whether
it goes on exactly as an uninterrupted run does."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import NPUSNAP, REPO, BenchError, Samples, progress
from bench.measure import Plan, npusnap_json
from bench.session import Session, _wait

NPU_TRAIN = REPO / "npusnap_workloads" / "npu_train.py"
STEPS = 100  # long enough that the dump and restore happen mid-run
DUMP_AFTER = 20  # steps printed before the dump
HIDDEN = 64


def _steps(path: Path) -> list[str]:
    try:
        return [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith("step ")]
    except OSError:
        return []


def bench_compute(s: Session, plan: Plan, rep: int, out: Samples) -> None:
    """npu_train.py (one rank, device 0) under `npusnap run`, dumped after DUMP_AFTER steps and
    restored; recorded at size 0 as ``compute_*``: dump wall and frozen time, restore wall, seconds
    from the restore's start to the restored job's next step, and whether its whole output equals
    an uninterrupted run's (flag ``compute_continuity``)."""
    d = s.work / f"compute-{rep}"
    d.mkdir()
    job = [sys.executable, str(NPU_TRAIN), "--steps", str(STEPS), "--hidden", str(HIDDEN)]
    ref = subprocess.run(job, env=s.env, capture_output=True, text=True, timeout=600, check=False)
    if ref.returncode != 0:
        raise BenchError(f"npu_train.py failed: {ref.stderr[-1500:]}")
    reference = ref.stdout.splitlines()
    log = d / "job.out"
    argv = [str(NPUSNAP), "run", "--", *job, "--interval", str(plan.interval)]
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            argv, env=s.env, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True, cwd=s.work
        )
    s.children.append(proc)

    def started() -> bool:
        if proc.poll() is not None:
            tail = log.read_text()[-1500:]
            raise BenchError(f"{shlex.join(argv[3:5])} exited with {proc.returncode}: {tail}")
        return len(_steps(log)) >= DUMP_AFTER

    _wait(started, 120, f"{DUMP_AFTER} steps of npu_train.py")
    image = d / "img"
    wall, res = npusnap_json(["dump", str(proc.pid), str(image)], s.env, timeout=600)
    out.add(0, "compute_dump_wall", wall)
    out.add(0, "compute_dump_frozen_s", res["timings"]["frozen_s"])
    s.reap(proc)
    before = len(_steps(log))
    pidfile = d / "restored.pid"
    start = time.monotonic()
    try:
        rwall, _res = npusnap_json(["restore", str(image), "--pidfile", str(pidfile)], s.env, timeout=600)
    finally:
        if pidfile.exists():
            s.restored.append((int(pidfile.read_text().strip()), NPU_TRAIN.name))
    _wait(lambda: len(_steps(log)) > before, 120, "the restored npu_train.py to compute a step")
    computes = time.monotonic() - start
    out.add(0, "compute_restore_wall", rwall)
    out.add(0, "compute_restore_first_step", computes)
    _wait(lambda: len(_steps(log)) >= STEPS, 600, "the restored npu_train.py to finish")
    same = _steps(log) == reference
    out.flag(0, "compute_continuity", same)
    progress(
        f"compute job, rep {rep + 1}: dump {wall:.2f} s, restore {rwall:.2f} s, computes again after "
        f"{computes:.2f} s, output {'identical to' if same else 'DIFFERENT from'} an uninterrupted run"
    )
    s.kill_all()
    shutil.rmtree(d)
    s.wait_device_free()
