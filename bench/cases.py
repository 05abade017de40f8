"""The measurements: one function per case (npusnap dump/restore, raw CRIU, disk, hashing, start-up,
copy rates, trees of ranks).

To add a case: write ``bench_<name>(session, plan, ..., out: Samples)`` here, recording what it
measures with ``out.add(size, name, value)`` (size 0 for figures that have no size), call it from
``run.main`` and show it in ``report.render`` (or, for a figure of the scale, add it to
``scale.SIZE_FIGURES`` / ``scale.RANK_FIGURES``: the tables, the fits and the plot follow).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import psutil

from bench.common import (
    BIGALLOC,
    COPYRATE,
    GAP_SLACK_S,
    HOSTALLOC,
    NPUSNAP,
    REPO,
    TREE,
    WRITE_CHUNK,
    BenchError,
    MiB,
    Samples,
    progress,
)
from bench.machine import mem_available
from bench.session import Session, TickWatcher, _wait
from npusnap_cli import criu as criu_mod
from npusnap_cli.host import procfs

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# The measurements
# --------------------------------------------------------------------------------------------


def _npusnap_json(args: list[str], env: dict[str, str], timeout: float) -> tuple[float, dict[str, Any]]:
    """Run ``npusnap ARGS --json``; (wall seconds, result). BenchError if it failed."""
    start = time.perf_counter()
    proc = subprocess.run(
        [str(NPUSNAP), *args, "--json"], env=env, capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - start
    try:
        envelope = json.loads(proc.stdout)
    except ValueError:
        envelope = None
    if proc.returncode != 0 or not envelope or not envelope.get("ok"):
        msg = (envelope or {}).get("error") or {"message": proc.stderr[-1500:]}
        raise BenchError(f"npusnap {shlex.join(args)} failed (exit {proc.returncode}): {msg.get('message')}")
    return wall, dict(envelope["result"])


def _until_first_tick(
    s: Session, log: Path, pidfile: Path, script: str, run: Callable[[], T]
) -> tuple[T, float]:
    """Run ``run`` (a restore that writes ``pidfile``) and wait for the restored workload's next
    ``tick`` in ``log``: (run's result, seconds from its start until that tick). The restored pid
    is recorded for cleanup whatever happens."""
    watcher = TickWatcher(log)
    try:
        start = time.monotonic()
        try:
            result = run()
        finally:
            if pidfile.exists():
                s.restored.append((int(pidfile.read_text().strip()), script))
        watcher.wait_for(1, 60)
    finally:
        arrivals = watcher.stop()
    return result, arrivals[0] - start


def _run_timed(cmd: list[str], what: str, log: Optional[Path] = None, timeout: float = 600) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        detail = proc.stderr[-800:]
        if log is not None and log.exists():
            detail += "\n" + "\n".join(criu_mod.log_excerpt(str(log), tail=15))
        raise BenchError(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{detail}")
    return wall


def _dir_bytes(path: Path, skip: tuple[str, ...] = ()) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name not in skip)


@dataclass(frozen=True)
class Plan:
    sizes: list[int]
    reps: int
    host_mib: int
    interval: float
    disk_mib: int
    startup_runs: int
    warm: bool = True
    lazy_mib: tuple[int, ...] = ()  # host MiB of the lazy-restore case (bench_lazy); empty: not run
    # The scale with processes: a tree of N ranks sharing ranks_mib MiB of device memory.
    ranks: tuple[int, ...] = (1, 2, 4)
    ranks_mib: int = 1024
    # The size of the memcpy / simulator copy-rate probe.
    copy_mib: int = 1024


def _start_timeout(size_mib: int) -> float:
    # The workload fills its device memory before it is ready; allow for a slow, loaded machine.
    return 60.0 + size_mib / 10.0


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

    def before_timed() -> None:
        if cold:
            time.sleep(COLD_PAUSE_S)
        else:
            warm_memory(plan, size)

    d = s.work / f"{pre}np-{size}-{rep}"
    d.mkdir()
    log = d / "job.out"
    argv = [sys.executable, str(BIGALLOC), "--device-mib", str(size), "--host-mib", str(plan.host_mib)]
    argv += ["--interval", str(plan.interval)]
    t0 = time.monotonic()
    proc = s.start(argv, log, agent=True, timeout=_start_timeout(size))
    out.add(size, "workload_start_s", time.monotonic() - t0)
    image = d / "img"
    s.sample_load()
    before_timed()
    wall, res = _npusnap_json(["dump", str(proc.pid), str(image)], env, timeout=900)
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
    before_timed()
    (wall, res), first = _until_first_tick(
        s,
        log,
        pidfile,
        BIGALLOC.name,
        lambda: _npusnap_json(["restore", str(image), "--pidfile", str(pidfile)], s.env, timeout=900),
    )
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
    d = s.work / f"lr-{size}-{rep}"
    d.mkdir()
    log = d / "job.out"
    argv = [sys.executable, str(BIGALLOC), "--device-mib", str(size), "--host-mib", str(plan.host_mib)]
    argv += ["--interval", str(plan.interval)]
    proc = s.start(argv, log, agent=True, timeout=_start_timeout(size))
    s.sample_load()
    warm_memory(plan, size)
    watcher = TickWatcher(log)
    try:
        start = time.monotonic()
        wall, res = _npusnap_json(["dump", str(proc.pid), str(d / "img"), "--leave-running"], s.env, 900)
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
    d = s.work / f"raw-{size}-{rep}"
    d.mkdir()
    log = d / "job.out"
    image = d / "img"
    image.mkdir()
    argv = [sys.executable, str(HOSTALLOC), "--mib", str(size + plan.host_mib)]
    argv += ["--interval", str(plan.interval)]
    proc = s.start(argv, log, agent=False, timeout=_start_timeout(size))
    s.sample_load()
    warm_memory(plan, size)
    dump_log = image / "dump.log"
    # Same CRIU options as npusnap's dump (no shell job, no TCP, debug log level 4).
    crit = _run_timed(
        [criu_path, "dump", "-t", str(proc.pid), "-D", str(image), "-o", "dump.log", "-v4"],
        "criu dump",
        dump_log,
    )
    sync = _run_timed(["sync", "-f", str(image)], "sync -f")
    s.reap(proc)
    out.add(size, "raw_dump_criu", crit)
    out.add(size, "raw_dump_sync", sync)
    out.add(size, "raw_dump_wall", crit + sync)
    out.add(size, "raw_image_bytes", _dir_bytes(image, skip=("dump.log",)))
    stats = criu_mod.read_dump_stats(str(image))
    if stats is not None:
        out.add(size, "raw_criu_frozen_s", stats.frozen_time_us * 1e-6)
        out.add(size, "raw_criu_memdump_s", stats.memdump_time_us * 1e-6)
        out.add(size, "raw_criu_memwrite_s", stats.memwrite_time_us * 1e-6)
    progress(f"{size} MiB rep {rep + 1}: raw criu dump {crit:.2f} s + sync {sync:.2f} s")

    pidfile = d / "restored.pid"
    s.sample_load()
    warm_memory(plan, size)
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
    wall, first = _until_first_tick(
        s, log, pidfile, HOSTALLOC.name, lambda: _run_timed(cmd, "criu restore", image / "restore.log")
    )
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


# Runs in a fresh process: map SIZE MiB of anonymous memory, fill it with one memset and exit,
# which frees it again: the next allocations of the machine get pages the host has just backed.
_WARM = """
import ctypes as C, sys
size = int(sys.argv[1]) << 20
libc = C.CDLL(None, use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
addr = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
if addr in (None, C.c_void_p(-1).value):
    raise OSError(C.get_errno(), "mmap failed")
C.memset(addr, 1, size)
"""
# A cold dump waits this long first: free page reporting hands freed pages back after about 2 s.
COLD_PAUSE_S = 4.0


def warm_mib(plan: Plan, size: int) -> int:
    """What a dump or restore of ``size`` touches (process memory, backup, page cache), with margin."""
    want = 3 * (size + plan.host_mib) + 512
    avail = mem_available() or 0
    return max(0, min(want, avail // MiB // 2))


def warm_memory(plan: Plan, size: int) -> None:
    """Touch and free memory right before a timed command, unless the plan says --cold."""
    if not plan.warm:
        return
    proc = subprocess.run(
        [sys.executable, "-c", _WARM, str(warm_mib(plan, size))],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise BenchError(f"warming memory failed: {proc.stderr.strip()[-500:]}")


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


# The lazy-restore case (issue 16, item 5): a job with several GiB of host memory whose next step
# reads only a little of it; device memory kept small so that host memory dominates.
LAZY_DEVICE_MIB = 64
LAZY_TICK_MIB = 16


def bench_lazy(s: Session, plan: Plan, host_mib: int, rep: int, out: Samples, criu_path: str) -> None:
    """``npusnap restore --lazy`` against raw ``criu restore -d`` of the same bytes, until the job
    computes again (its next tick), in the same run. Recorded under size ``host_mib``:
    ``lazy_first_tick`` / ``lazy_wall`` (the command returns once every page is in and verified),
    ``lazy_raw_first_tick``, and npusnap's own phases (``lazy_restore_*``)."""
    d = s.work / f"lazy-{host_mib}-{rep}"
    d.mkdir()
    log = d / "job.out"
    argv = [sys.executable, str(BIGALLOC), "--device-mib", str(LAZY_DEVICE_MIB), "--host-mib", str(host_mib)]
    argv += ["--fill-host", "--tick-mib", str(LAZY_TICK_MIB), "--interval", str(plan.interval)]
    proc = s.start(argv, log, agent=True, timeout=_start_timeout(host_mib))
    image = d / "img"
    warm_memory(plan, host_mib)
    _npusnap_json(["dump", str(proc.pid), str(image)], s.env, timeout=900)
    s.reap(proc)
    pidfile = d / "restored.pid"
    s.sample_load()
    warm_memory(plan, host_mib)
    (wall, res), first = _until_first_tick(
        s,
        log,
        pidfile,
        BIGALLOC.name,
        lambda: _npusnap_json(
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
    d.mkdir()
    image.mkdir()
    argv = [sys.executable, str(HOSTALLOC), "--mib", str(host_mib + LAZY_DEVICE_MIB)]
    argv += ["--interval", str(plan.interval)]
    proc = s.start(argv, log, agent=False, timeout=_start_timeout(host_mib))
    warm_memory(plan, host_mib)
    _run_timed([criu_path, "dump", "-t", str(proc.pid), "-D", str(image), "-o", "dump.log"], "criu dump")
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
    _, raw = _until_first_tick(
        s, log, pidfile, HOSTALLOC.name, lambda: _run_timed(cmd, "criu restore", image / "restore.log")
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
        _, raw_lazy = _until_first_tick(
            s,
            log,
            pidfile,
            HOSTALLOC.name,
            lambda: _run_timed(argv, "criu restore --lazy-pages", work / "restore.log"),
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


def _adopt_tree(s: Session, root: int, script: str) -> list[int]:
    """The ranks (children) of a tree's root, recorded so that cleanup kills them too."""
    try:
        kids = [c.pid for c in psutil.Process(root).children() if script in procfs.cmdline(c.pid)]
    except psutil.Error:
        kids = []
    s.restored.extend((p, script) for p in kids)
    return kids


def _pids_gone(pids: list[int]) -> Callable[[], bool]:
    """A condition: none of ``pids`` is in /proc any more (a zombie still holds its pid)."""
    return lambda: not any(Path(f"/proc/{p}").exists() for p in pids)


def _first_ticks(logs: list[Path], start: float, timeout: float) -> float:
    """Seconds from ``start`` until every rank's log shows a new tick (the whole tree computes)."""
    watchers = [TickWatcher(f) for f in logs]
    try:
        for w in watchers:
            w.wait_for(1, timeout)
    finally:
        firsts = [w.stop()[0] if w.arrivals else float("inf") for w in watchers]
    return max(firsts) - start


def bench_ranks(s: Session, plan: Plan, ranks: int, rep: int, out: Samples, criu_path: str) -> None:
    """A tree of ``ranks`` NPU processes (``bench/tree.py`` over bigalloc, rank R on device R)
    sharing ``plan.ranks_mib`` MiB of device memory, dumped and restored by npusnap (one command: the
    ranks' device parts in parallel), beside raw CRIU on the same tree of hostalloc processes
    holding the same bytes. Recorded at size 0 as ``ranks<N>_*``."""
    each = max(1, plan.ranks_mib // ranks)
    host_each = plan.host_mib // ranks
    pre = f"ranks{ranks}_"
    for kind in ("npusnap", "raw"):
        d = s.work / f"tree-{kind}-{ranks}-{rep}"
        d.mkdir()
        logs = [d / f"rank{r}.out" for r in range(ranks)]
        if kind == "npusnap":
            # One device per rank: CANN's Restore needs the device free of other processes.
            worker = [sys.executable, str(BIGALLOC), "--device-mib", str(each), "--host-mib", str(host_each)]
            worker += ["--device", "{rank}"]
            script = BIGALLOC.name
        else:
            worker = [sys.executable, str(HOSTALLOC), "--mib", str(each + host_each)]
            script = HOSTALLOC.name
        worker += ["--interval", str(plan.interval)]
        argv = [sys.executable, str(TREE), "--ranks", str(ranks), "--out-dir", str(d), "--", *worker]
        proc = s.start(
            argv, d / "tree.out", agent=kind == "npusnap", timeout=_start_timeout(plan.ranks_mib), watch=logs
        )
        kids = _adopt_tree(s, proc.pid, script)
        if len(kids) != ranks:
            raise BenchError(f"the tree of {ranks} ranks has {len(kids)} {script} processes")
        image = d / "img"
        s.sample_load()
        warm_memory(plan, plan.ranks_mib)
        if kind == "npusnap":
            wall, res = _npusnap_json(["dump", str(proc.pid), str(image)], s.env, timeout=900)
            out.add(0, f"{pre}dump_frozen_s", res["timings"]["frozen_s"])
        else:
            image.mkdir()
            crit = _run_timed(
                [criu_path, "dump", "-t", str(proc.pid), "-D", str(image), "-o", "dump.log", "-v4"],
                "criu dump (tree)",
                image / "dump.log",
            )
            wall = crit + _run_timed(["sync", "-f", str(image)], "sync -f")
            stats = criu_mod.read_dump_stats(str(image))
            if stats is not None:
                out.add(0, f"{pre}raw_criu_frozen_s", stats.frozen_time_us * 1e-6)
        s.reap(proc)
        # The ranks die with the dump too; their pids must be free before the restore takes them.
        # (A zombie still holds its pid: wait until /proc has none of them.)
        _wait(_pids_gone(kids), 20, "the dumped ranks to go")
        key = f"{pre}{'' if kind == 'npusnap' else 'raw_'}"
        out.add(0, f"{key}dump_wall", wall)
        pidfile = d / "restored.pid"
        s.sample_load()
        warm_memory(plan, plan.ranks_mib)
        start = time.monotonic()
        try:
            if kind == "npusnap":
                rwall, _res = _npusnap_json(
                    ["restore", str(image), "--pidfile", str(pidfile)], s.env, timeout=900
                )
            else:
                cmd = [criu_path, "restore", "-d", "-D", str(image), "-o", "restore.log", "-v4"]
                rwall = _run_timed(
                    [*cmd, "--pidfile", str(pidfile)], "criu restore (tree)", image / "restore.log"
                )
        finally:
            if pidfile.exists():
                root = int(pidfile.read_text().strip())
                s.restored.append((root, TREE.name))
                _adopt_tree(s, root, script)
        computes = _first_ticks(logs, start, 60)
        out.add(0, f"{key}restore_wall", rwall)
        out.add(0, f"{key}restore_first_tick", computes)
        progress(
            f"{ranks} rank(s) of {each} MiB, rep {rep + 1}: {kind} dump {wall:.2f} s, restore "
            f"{rwall:.2f} s, every rank computes again after {computes:.2f} s"
        )
        s.kill_all()
        shutil.rmtree(d)
        if kind == "npusnap":
            s.wait_device_free()


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
    """`npusnap attach` on processes the size of a JAX job (npusnap_cli/workloads/jaxsize.py: 240
    libraries with symbols and debug info, 1.4 GiB of text, 48 pool threads), a Python one and a
    C one: the stop it reports, and the stall the job shows (the longest gap between its steps,
    20 ms apart, less one step)."""
    from npusnap_cli.workloads import jaxsize

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
    _run_timed(
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
        "py": [sys.executable, "-m", "npusnap_cli.workloads.jaxsize", "--libs", str(libs), "--", *train],
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
                wall, res = _npusnap_json(["attach", str(proc.pid), "--timeout", "30"], s.env, 120)
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
