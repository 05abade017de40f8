"""The cases measured at every size (npusnap dump/restore, --leave-running, raw CRIU) and the
machine's own limits (disk, hashing, start-up, copy rates). The other cases have modules of their
own: ``lazy.py`` (restore --lazy), ``ranks.py`` (trees of NPU processes), ``attach.py``.

To add a case: write ``bench_<name>(session, plan, ..., out: Samples)`` in a module of the cases,
recording what it measures with ``out.add(size, name, value)`` (size 0 for figures that have no
size) and using ``measure.py`` to run and time commands; call it from ``run.main`` and show it in
``report.render`` (or, for a figure of the scale, add it to ``scale.SIZE_FIGURES`` /
``scale.RANK_FIGURES``: the tables, the fits and the plot follow).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional

from bench import floor as floor_mod
from bench import vmstat
from bench.common import (
    BIGALLOC,
    COPYRATE,
    GAP_SLACK_S,
    HOSTALLOC,
    NPUSNAP,
    WRITE_CHUNK,
    BenchError,
    MiB,
    Samples,
    progress,
)
from bench.measure import (
    COLD_PAUSE_S,
    Plan,
    add_page_cache,
    dir_bytes,
    npusnap_json,
    run_timed,
    start_timeout,
    until_first_tick,
    warm_memory,
)
from bench.session import Session, TickWatcher
from npusnap_cli import criu as criu_mod


def bench_npusnap(
    s: Session, plan: Plan, size: int, rep: int, out: Samples, *, cold: bool = False, inproc: bool = False
) -> None:
    """npusnap dump (default: the original is gone), then npusnap restore of that image.

    ``cold``: without warming memory first, after a pause that lets the host take freed memory
    back; its figures are recorded under ``cold_*``. ``inproc``: the agent keeps its copy of the
    device memory in the process's memory (``NPUSNAP_DEVMEM_IN_PROCESS=1``, the way before the
    copy went into its own image file); recorded under ``inproc_*``.
    """
    pre = "cold_" if cold else "inproc_" if inproc else ""
    label = " (cold memory)" if cold else " (device copy in process memory)" if inproc else ""
    env = dict(s.env, NPUSNAP_DEVMEM_IN_PROCESS="1") if inproc else s.env

    def before_timed() -> Optional[int]:
        if cold:
            time.sleep(COLD_PAUSE_S)
            return None
        return warm_memory(plan, size)

    s.drop_kept_memory(f"npusnap dump{label}")
    d = s.work / f"{pre}np-{size}-{rep}"
    d.mkdir()
    log = d / "job.out"
    argv = [sys.executable, str(BIGALLOC), "--device-mib", str(size), "--host-mib", str(plan.host_mib)]
    argv += ["--interval", str(plan.interval)]
    t0 = time.monotonic()
    proc = s.start(argv, log, agent=True, timeout=start_timeout(size))
    out.add(size, "workload_start_s", time.monotonic() - t0)
    image = d / "img"
    s.sample_load()
    warmed = before_timed()
    watch = vmstat.Watch().start()
    try:
        wall, res = npusnap_json(["dump", str(proc.pid), str(image)], env, timeout=900)
    finally:
        add_page_cache(out, size, f"{pre}dump", watch.stop(), warmed)
    s.reap(proc)
    out.add(size, f"{pre}dump_wall", wall)
    for k, v in res["timings"].items():
        out.add(size, f"{pre}dump_{k}", v)
    for k, v in res["bytes"].items():
        out.add(size, f"{pre}dump_{k}", v)
    progress(
        f"{size} MiB rep {rep + 1}: npusnap dump{label} {wall:.2f} s "
        f"(frozen {res['timings']['frozen_s']:.2f} s)"
    )

    pidfile = d / "restored.pid"
    s.sample_load()
    warmed = before_timed()
    watch = vmstat.Watch().start()
    try:
        (wall, res), first = until_first_tick(
            s,
            log,
            pidfile,
            BIGALLOC.name,
            lambda: npusnap_json(["restore", str(image), "--pidfile", str(pidfile)], s.env, timeout=900),
        )
    finally:
        add_page_cache(out, size, f"{pre}restore", watch.stop(), warmed)
    out.add(size, f"{pre}restore_wall", wall)
    out.add(size, f"{pre}restore_first_tick", first)
    for k, v in res["timings"].items():
        out.add(size, f"{pre}restore_{k}", v)
    progress(
        f"{size} MiB rep {rep + 1}: npusnap restore{label} {wall:.2f} s, computes again after {first:.2f} s"
    )
    s.kill_all()
    shutil.rmtree(d)
    s.wait_device_free()


def bench_leave_running(s: Session, plan: Plan, size: int, rep: int, out: Samples) -> None:
    """npusnap dump --leave-running of a fresh workload, watched from outside through its ticks."""
    s.drop_kept_memory("npusnap dump --leave-running")
    d = s.work / f"lr-{size}-{rep}"
    d.mkdir()
    log = d / "job.out"
    argv = [sys.executable, str(BIGALLOC), "--device-mib", str(size), "--host-mib", str(plan.host_mib)]
    argv += ["--interval", str(plan.interval)]
    proc = s.start(argv, log, agent=True, timeout=start_timeout(size))
    s.sample_load()
    warm_memory(plan, size)
    watcher = TickWatcher(log)
    try:
        start = time.monotonic()
        wall, res = npusnap_json(["dump", str(proc.pid), str(d / "img"), "--leave-running"], s.env, 900)
        end = time.monotonic()
        watcher.wait_for(len(watcher.arrivals) + 2, 60)  # it goes on computing
    finally:
        arrivals = watcher.stop()
    if proc.poll() is not None:
        raise BenchError(
            f"the workload exited during/after `npusnap dump --leave-running` ({proc.returncode})"
        )
    t = res["timings"]
    out.add(size, "lr_wall", wall)
    for k, v in t.items():
        out.add(size, f"lr_{k}", v)
    # The longest silence of the workload around the dump, and when it ended (relative to the
    # moment the dump command returned: negative = the job computed while npusnap was still busy).
    marks = [start, *[a for a in arrivals if a > start]]
    gaps = [(b - a, b) for a, b in zip(marks, marks[1:])]
    gap, resumed = max(gaps) if gaps else (end - start, end)
    out.add(size, "lr_gap", gap)
    out.add(size, "lr_resumed_rel_end", resumed - end)
    publish = float(t.get("publish_s") or 0.0)
    frozen = float(t["frozen_s"])
    out.flag(size, "lr_not_lengthened", gap <= frozen + plan.interval + GAP_SLACK_S)
    out.flag(size, "lr_discriminating", publish > plan.interval + GAP_SLACK_S)
    progress(
        f"{size} MiB rep {rep + 1}: npusnap dump --leave-running {wall:.2f} s (frozen {frozen:.2f} s, "
        f"tick gap {gap:.2f} s, publish {publish:.2f} s)"
    )
    s.kill_all()
    shutil.rmtree(d)
    s.wait_device_free()


def bench_raw(s: Session, plan: Plan, size: int, rep: int, out: Samples, criu_path: str) -> None:
    """Raw CRIU on the equivalent host-only process: dump + sync -f, then restore -d."""
    s.drop_kept_memory()
    d = s.work / f"raw-{size}-{rep}"
    d.mkdir()
    log = d / "job.out"
    image = d / "img"
    image.mkdir()
    argv = [sys.executable, str(HOSTALLOC), "--mib", str(size + plan.host_mib)]
    argv += ["--interval", str(plan.interval), "--floor-file", str(d / "floor.tmp")]
    proc = s.start(argv, log, agent=False, timeout=start_timeout(size))
    s.sample_load()
    # The machine's floor: the workload writes the same bytes from its memory (floor.py).
    warm_memory(plan, size)
    floor = floor_mod.measure(proc, log, timeout=start_timeout(size))
    out.add(size, "floor_write_s", floor.write_s)
    out.add(size, "floor_durable_s", floor.durable_s)
    progress(
        f"{size} MiB rep {rep + 1}: write() of the same bytes {floor.write_s:.2f} s, "
        f"+ fsync {floor.durable_s:.2f} s"
    )
    warmed = warm_memory(plan, size)
    dump_log = image / "dump.log"
    watch = vmstat.Watch().start()
    try:
        # Same CRIU options as npusnap's dump (no shell job, no TCP, debug log level 4).
        crit = run_timed(
            [criu_path, "dump", "-t", str(proc.pid), "-D", str(image), "-o", "dump.log", "-v4"],
            "criu dump",
            dump_log,
        )
        sync = run_timed(["sync", "-f", str(image)], "sync -f")
    finally:
        add_page_cache(out, size, "raw_dump", watch.stop(), warmed)
    s.reap(proc)
    out.add(size, "raw_dump_criu", crit)
    out.add(size, "raw_dump_sync", sync)
    out.add(size, "raw_dump_wall", crit + sync)
    out.add(size, "raw_image_bytes", dir_bytes(image, skip=("dump.log",)))
    stats = criu_mod.read_dump_stats(str(image))
    if stats is not None:
        out.add(size, "raw_criu_frozen_s", stats.frozen_time_us * 1e-6)
        out.add(size, "raw_criu_memdump_s", stats.memdump_time_us * 1e-6)
        out.add(size, "raw_criu_memwrite_s", stats.memwrite_time_us * 1e-6)
    progress(f"{size} MiB rep {rep + 1}: raw criu dump {crit:.2f} s + sync {sync:.2f} s")

    pidfile = d / "restored.pid"
    s.sample_load()
    warmed = warm_memory(plan, size)
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
    watch = vmstat.Watch().start()
    try:
        wall, first = until_first_tick(
            s, log, pidfile, HOSTALLOC.name, lambda: run_timed(cmd, "criu restore", image / "restore.log")
        )
    finally:
        add_page_cache(out, size, "raw_restore", watch.stop(), warmed)
    out.add(size, "raw_restore_wall", wall)
    out.add(size, "raw_restore_first_tick", first)
    progress(f"{size} MiB rep {rep + 1}: raw criu restore {wall:.2f} s, computes again after {first:.2f} s")
    s.kill_all()
    shutil.rmtree(d)


def bench_disk(s: Session, plan: Plan, out: Samples) -> None:
    """Sequential write of ``disk_mib`` with fsync in the image directory: the disk's limit."""
    chunk = os.urandom(WRITE_CHUNK)
    path = s.work / "seqwrite.tmp"
    for _ in range(plan.reps):
        s.sample_load()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            start = time.perf_counter()
            left = plan.disk_mib * MiB
            view = memoryview(chunk)
            while left > 0:
                n = os.write(fd, view[: min(left, WRITE_CHUNK)])
                left -= n
            os.fsync(fd)
            wall = time.perf_counter() - start
        finally:
            os.close(fd)
            path.unlink()
        out.add(0, "disk_write_s", wall)
        out.add(0, "disk_mib_s", plan.disk_mib / wall)
        progress(f"sequential write {plan.disk_mib} MiB + fsync: {plan.disk_mib / wall:.0f} MiB/s")


def bench_hash(plan: Plan, out: Samples) -> None:
    """One core's rate for the images' checksum (digest.DEFAULT) and for sha256 (what images
    used before): publish and verify hash every image file, so it bounds them."""
    from npusnap_cli.image import digest

    buf = os.urandom(256 * MiB)
    for _ in range(plan.reps):
        for algo, key in ((digest.DEFAULT, "hash_mib_s"), ("sha256", "sha256_mib_s")):
            h = digest.new(algo)
            start = time.perf_counter()
            h.update(buf)
            h.hexdigest()
            out.add(0, key, 256 / (time.perf_counter() - start))
    progress(
        f"{digest.DEFAULT}: {out.med(0, 'hash_mib_s') or 0:.0f} MiB/s, sha256: "
        f"{out.med(0, 'sha256_mib_s') or 0:.0f} MiB/s on one core"
    )


def _time_cli(args: list[str], env: dict[str, str], runs: int) -> list[float]:
    times: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run([str(NPUSNAP), *args], env=env, capture_output=True, timeout=60)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise BenchError(
                f"npusnap {shlex.join(args)} exited with {proc.returncode}: {proc.stderr[-500:]!r}"
            )
    return times


def bench_startup(s: Session, plan: Plan, out: Samples) -> None:
    """CLI start-up; ``status`` asks a live workload's agent (1 MiB on the device)."""
    d = s.work / "startup"
    d.mkdir()
    argv = [sys.executable, str(BIGALLOC), "--device-mib", "1", "--host-mib", "0", "--interval", "1"]
    proc = s.start(argv, d / "job.out", agent=True, timeout=60)
    _time_cli(["--version"], s.env, 2)  # warm the page cache
    s.sample_load()
    for name, args in (
        ("help", ["--help"]),
        ("version", ["--version"]),
        ("status", ["status", str(proc.pid)]),
    ):
        for t in _time_cli(args, s.env, plan.startup_runs):
            out.add(0, f"startup_{name}", t)
        med = out.med(0, f"startup_{name}") or 0.0
        progress(f"npusnap {' '.join(args)}: median {med * 1000:.0f} ms")
    s.kill_all()
    shutil.rmtree(d)
    s.wait_device_free()


def bench_copyrate(s: Session, plan: Plan, out: Samples) -> None:
    """This machine's memcpy next to the simulated NPU's copies (``bench/copyrate.py``)."""
    s.sample_load()
    cmd = [sys.executable, str(COPYRATE), "--mib", str(plan.copy_mib), "--reps", "3", "--json"]
    proc = subprocess.run(cmd, env=s.env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise BenchError(f"copy-rate probe failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    rates = json.loads(proc.stdout)
    for k in ("memcpy", "host_to_device", "device_to_host"):
        out.add(0, f"copy_{k}_gb_s", rates[k] / 1e9)
    progress(
        f"copies of {plan.copy_mib} MiB: memcpy {rates['memcpy'] / 1e9:.2f} GB/s, simulator "
        f"host->device {rates['host_to_device'] / 1e9:.2f} GB/s, "
        f"device->host {rates['device_to_host'] / 1e9:.2f} GB/s"
    )
