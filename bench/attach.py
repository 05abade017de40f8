"""`npusnap attach` on processes the size of a JAX job: the stop it reports and the stall the job
shows."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (
    REPO,
    BenchError,
    Samples,
    progress,
)
from bench.measure import Plan, npusnap_json, run_timed
from bench.session import Session


def _start_stepping(s: Session, argv: list[str], out: Path) -> subprocess.Popen[bytes]:
    """Start a workload that prints ``step`` lines, without an agent; wait for its fifth step."""
    with open(out, "ab") as f:
        proc = subprocess.Popen(
            argv, env=s.env, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True, cwd=s.work
        )
    s.children.append(proc)
    end = time.monotonic() + 60
    while sum(ln.startswith(b"step") for ln in out.read_bytes().splitlines()) < 5:
        if proc.poll() is not None or time.monotonic() > end:
            raise BenchError(f"workload {shlex.join(argv[:3])} did not start: {out.read_text()[-1000:]}")
        time.sleep(0.05)
    return proc


def bench_attach(s: Session, plan: Plan, out: Samples) -> None:
    """`npusnap attach` on processes the size of a JAX job (npusnap_workloads/jaxsize.py: 240
    libraries with symbols and debug info, 1.4 GiB of text, 48 pool threads), a Python one and a
    C one: the stop it reports, and the stall the job shows (the longest gap between its steps,
    20 ms apart, less one step)."""
    from npusnap_workloads import jaxsize

    if shutil.which("gdb") is None or shutil.which("cc") is None:
        progress("attach: skipped (needs gdb and cc)")
        return
    d = s.work / "attach"
    d.mkdir()
    started = time.monotonic()
    libs = jaxsize.build_libs(REPO / ".build")
    progress(f"attach: {jaxsize.LIBS} libraries ready in {time.monotonic() - started:.1f} s ({libs})")
    stepper = d / "npu_stepper"
    lib64 = Path(s.env["ASCEND_HOME_PATH"]) / "lib64"
    run_timed(
        [
            "cc",
            "-O1",
            "-o",
            str(stepper),
            str(REPO / "tests" / "data" / "npu_stepper.c"),
            f"-L{lib64}",
            "-lacl_rt",
        ],
        "cc npu_stepper",
    )
    train = ["--steps", "0", "--interval", "0.02", "--param-bytes", "65536"]
    threads = ["--threads", str(jaxsize.THREADS)]
    targets = {
        "py": [sys.executable, "-m", "npusnap_workloads.jaxsize", "--libs", str(libs), "--", *train],
        "c": [str(stepper), "--steps", "0", "--interval-ms", "20", "--libs", str(libs), *threads],
    }
    for rep in range(plan.reps):
        for kind, argv in targets.items():
            log = d / f"{kind}-{rep}.out"
            proc = _start_stepping(s, argv, log)
            size = jaxsize.maps_summary(proc.pid)
            clock = jaxsize.StepClock(log)
            try:
                clock.wait_for(5, 30)
                since = time.monotonic()
                wall, res = npusnap_json(["attach", str(proc.pid), "--timeout", "30"], s.env, 120)
                until = time.monotonic()
                time.sleep(0.3)
            finally:
                arrivals = clock.stop()
            gap = jaxsize.StepClock.stall(arrivals, since, until, end=time.monotonic())
            out.add(0, f"attach_{kind}_stopped_s", res.get("stopped_s"))
            out.add(0, f"attach_{kind}_gap_s", gap)
            out.add(0, f"attach_{kind}_wall_s", wall)
            progress(
                f"attach {kind} rep {rep + 1}: reported stop {res.get('stopped_s')} s, "
                f"job stalled {gap:.3f} s, command {wall:.2f} s ({res.get('safe_point')}; "
                f"{size['mappings']} mappings, "
                f"{size['text_mib']} MiB text, {size['threads']} threads)"
            )
            s.kill_all()
    shutil.rmtree(d)
