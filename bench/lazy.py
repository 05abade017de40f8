"""The lazy-restore case: ``npusnap restore --lazy`` against raw CRIU's eager
and lazy restores of the same bytes, and its section of the report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from bench.common import (
    BIGALLOC,
    HOSTALLOC,
    BenchError,
    Samples,
    progress,
)
from bench.measure import Plan, npusnap_json, run_timed, start_timeout, until_first_tick, warm_memory
from bench.session import Session
from npusnap_cli import criu as criu_mod

# The lazy-restore case: a job with several GiB of host memory whose next step
# reads only a little of it; device memory kept small so that host memory dominates.
LAZY_DEVICE_MIB = 64
LAZY_TICK_MIB = 16


def bench_lazy(s: Session, plan: Plan, host_mib: int, rep: int, out: Samples, criu_path: str) -> None:
    """``npusnap restore --lazy`` against raw ``criu restore -d`` of the same bytes, until the job
    computes again (its next tick), in the same run. Recorded under size ``host_mib``:
    ``lazy_first_tick`` / ``lazy_wall`` (the command returns once every page is in and verified),
    ``lazy_raw_first_tick``, and npusnap's own phases (``lazy_restore_*``)."""
    s.drop_kept_memory("npusnap restore --lazy")
    d = s.work / f"lazy-{host_mib}-{rep}"
    d.mkdir()
    log = d / "job.out"
    argv = [sys.executable, str(BIGALLOC), "--device-mib", str(LAZY_DEVICE_MIB), "--host-mib", str(host_mib)]
    argv += ["--fill-host", "--tick-mib", str(LAZY_TICK_MIB), "--interval", str(plan.interval)]
    proc = s.start(argv, log, agent=True, timeout=start_timeout(host_mib))
    image = d / "img"
    warm_memory(plan, host_mib)
    npusnap_json(["dump", str(proc.pid), str(image)], s.env, timeout=900)
    s.reap(proc)
    pidfile = d / "restored.pid"
    s.sample_load()
    warm_memory(plan, host_mib)
    (wall, res), first = until_first_tick(
        s,
        log,
        pidfile,
        BIGALLOC.name,
        lambda: npusnap_json(
            ["restore", str(image), "--lazy", "--pidfile", str(pidfile)], s.env, timeout=900
        ),
    )
    out.add(host_mib, "lazy_first_tick", first)
    out.add(host_mib, "lazy_wall", wall)
    for k, v in res["timings"].items():
        out.add(host_mib, f"lazy_restore_{k}", v)
    progress(
        f"{host_mib} MiB host rep {rep + 1}: npusnap restore --lazy computes again after {first:.2f} s, "
        f"every page in and verified after {wall:.2f} s"
    )
    s.kill_all()
    shutil.rmtree(d)
    s.wait_device_free()

    # Raw CRIU, eager: the same bytes (host + device) in plain host memory.
    s.drop_kept_memory()
    d.mkdir()
    image.mkdir()
    argv = [sys.executable, str(HOSTALLOC), "--mib", str(host_mib + LAZY_DEVICE_MIB)]
    argv += ["--interval", str(plan.interval)]
    proc = s.start(argv, log, agent=False, timeout=start_timeout(host_mib))
    warm_memory(plan, host_mib)
    run_timed([criu_path, "dump", "-t", str(proc.pid), "-D", str(image), "-o", "dump.log"], "criu dump")
    s.reap(proc)
    s.sample_load()
    warm_memory(plan, host_mib)
    cmd = [
        criu_path,
        "restore",
        "-d",
        "-D",
        str(image),
        "-o",
        "restore.log",
        "-v4",
        "--pidfile",
        str(pidfile),
    ]
    _, raw = until_first_tick(
        s, log, pidfile, HOSTALLOC.name, lambda: run_timed(cmd, "criu restore", image / "restore.log")
    )
    out.add(host_mib, "lazy_raw_first_tick", raw)
    progress(f"{host_mib} MiB host rep {rep + 1}: raw criu restore computes again after {raw:.2f} s")
    restored_pid = int(pidfile.read_text().strip())
    s.kill_all()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{restored_pid}"):  # a zombie until init reaps it; CRIU needs the pid
        if time.monotonic() > deadline:
            raise BenchError(f"pid {restored_pid} still exists 10 s after it was killed")
        time.sleep(0.02)

    # Raw CRIU, lazy, from the same image: CRIU's own floor (no verification, no device).
    work = d / "lazy-work"
    work.mkdir()
    pidfile.unlink(missing_ok=True)  # CRIU writes its pidfile with O_EXCL
    daemon = subprocess.Popen(
        [criu_path, "lazy-pages", "-D", str(image), "-W", str(work), "-o", "lazy-pages.log"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not (work / criu_mod.LAZY_SOCKET).exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"criu lazy-pages did not start (see {work / 'lazy-pages.log'})")
            time.sleep(0.01)
        s.sample_load()
        cmd = [criu_path, "restore", "-d", "-D", str(image), "-W", str(work), "--lazy-pages"]
        argv = [*cmd, "-o", "restore.log", "--pidfile", str(pidfile)]
        _, raw_lazy = until_first_tick(
            s,
            log,
            pidfile,
            HOSTALLOC.name,
            lambda: run_timed(argv, "criu restore --lazy-pages", work / "restore.log"),
        )
        daemon.wait(timeout=300)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    out.add(host_mib, "lazy_rawlazy_first_tick", raw_lazy)
    progress(f"{host_mib} MiB host rep {rep + 1}: raw criu lazy restore computes again after {raw_lazy:.2f}s")
    s.kill_all()
    shutil.rmtree(d)


def lazy_section(data: Samples, sizes: list[int]) -> list[str]:
    """The report's lines for ``bench_lazy`` (empty when it did not run)."""
    rows = []
    for size in sizes:
        lazy, raw = data.med(size, "lazy_first_tick"), data.med(size, "lazy_raw_first_tick")
        if lazy is None or raw is None:
            continue
        dev = data.med(size, "lazy_restore_device_restore_s") or 0.0
        wall = data.med(size, "lazy_wall") or 0.0
        floor = data.med(size, "lazy_rawlazy_first_tick")
        ratio = lazy / (raw + dev)
        rows.append(
            f"| {size} MiB host + {LAZY_DEVICE_MIB} MiB device | {lazy:.2f} s | {raw:.2f} s | {dev:.2f} s "
            f"| {ratio:.2f} {'✓' if ratio <= 0.5 else '✗'} | {wall:.2f} s "
            f"| {'' if floor is None else f'{floor:.2f} s'} |"
        )
    if not rows:
        return []
    return [
        "## Lazy restore (`npusnap restore --lazy`)",
        "",
        f"A job with the given host memory (every page written) whose step reads {LAZY_TICK_MIB} MiB of it "
        "(`bigalloc.py --fill-host --tick-mib`), against raw `criu restore -d` of a process holding the "
        "same bytes (`hostalloc.py`). Until the job computes again (its next tick); the target is "
        "≤ 0.5 × (raw CRIU + the device copy), the device copy being npusnap's device restore + unlock. "
        "`--lazy` returns only once every page is in and the page files are verified. The last column "
        "is CRIU's own lazy restore of the raw image (`criu lazy-pages` + `criu restore --lazy-pages`, "
        "no verification, no device): the floor npusnap's figure can approach.",
        "",
        "| job | npusnap --lazy | raw criu restore | device copy | ratio (target ≤ 0.5) | --lazy returns "
        "| raw criu lazy restore |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
