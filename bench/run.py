"""The npusnap benchmarks, one command: dump/restore against raw CRIU, frozen time, disk, start-up.

    sudo .venv/bin/python bench/run.py [--sizes 64,256,1024,4096,8192] [--ranks 1,2,4] [--reps 3]

For every size (MiB of simulated device memory, plus ``--host-mib`` of host memory) and every
repetition, in the same run:

* ``npusnap dump`` of ``bigalloc.py`` (started with ``npusnap run``) against a raw ``criu dump``
  of ``hostalloc.py`` holding the same bytes in plain host memory, followed by ``sync -f`` of
  its image (npusnap makes its image durable, so the baseline must too); the manifest's per-phase
  timings break the frozen time down;
* ``npusnap dump --leave-running`` of a fresh bigalloc: the frozen time (lock to unlock) and the
  gap in the workload's ticks seen from outside, to show that publishing (checksums, fsync)
  happens after the job runs again;
* the machine's floor: right before the raw dump, ``hostalloc.py`` writes the bytes it holds
  with plain ``write()`` calls, then ``fsync`` (``floor.py``); the scale section judges each
  super-linear dump figure by what it adds over that floor;
* ``npusnap restore`` against ``criu restore -d``, and the time until the restored workload
  prints its next tick (it computes again);
* a plain sequential write with fsync in the image directory (this disk's physical limit), next
  to the rate at which the dumps wrote their images;
* at the size the targets are judged at, the same npusnap dump without warming memory first
  (see ``warm_memory``): what a VM's lazily backed memory costs a dump;
* CLI start-up: ``npusnap --help``, ``--version`` and ``npusnap status PID``;
* this machine's memcpy rate next to the simulated NPU's copy rate (``copyrate.py``);
* the scale with processes: a tree of 1, 2, 4 NPU ranks (``tree.py``) sharing ``--ranks-mib`` of
  device memory, dumped and restored by npusnap and by raw CRIU (the same tree without a device).

The report fits time against bytes and against ranks (``report.py``: slope, intercept, and any
super-linear term) and draws both in a PNG next to ``--out`` (matplotlib: ``.venv/bin/pip install
'matplotlib>=3.7'``, the ``bench`` extra; ``--no-plot`` goes without).

Right before every timed command, a helper process touches and frees up to three times the
command's bytes of free memory (``warm_memory``; ``--cold`` turns this off). On a VM whose balloon
reports free pages to the host, memory that was free for a moment is handed back to the host, and
the first write to each such page then faults in the host too; whichever step touches memory first
would pay for that — in a dump, CRIU writing the image into new page cache right after Backup took
the recently freed memory (docs/benchmarks.md, "Measurements behind design choices"). Warming
treats npusnap and raw CRIU alike, and ``pagereport.py`` holds the VM's reporting off for the run
so that warmed memory stays backed.

The code: ``run.py`` (this file: options, the order of the run); the cases, one function each
(add a case there): ``cases.py`` (every size against raw CRIU, and the machine's limits),
``lazy.py``, ``ranks.py``, ``attach.py``; ``measure.py`` (how a case runs and times commands, the
plan), ``vmstat.py`` (the page cache during a command), ``pagereport.py`` (the VM's free page
reporting held off during the run), ``floor.py`` (the machine's floor for writing the bytes),
``session.py`` (starting and watching processes, cleanup), ``machine.py`` (machine facts); the
report: ``report.py`` (the Markdown report and the targets), ``scale.py`` (the fits, the targets,
the scale), ``plot.py`` (the PNG); ``common.py`` (paths, constants, the samples
store); and the workloads ``hostalloc.py``, ``tree.py``, ``copyrate.py`` (plus
``npusnap_workloads/bigalloc.py``).

Medians go to a Markdown report (``--out``). This is not a test: nothing here asserts timings.
Everything it starts (a private simulated NPU daemon, workloads, restored processes, images) is
removed at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import pagereport  # noqa: E402
from bench.attach import bench_attach  # noqa: E402
from bench.cases import (  # noqa: E402
    bench_copyrate,
    bench_disk,
    bench_hash,
    bench_leave_running,
    bench_npusnap,
    bench_raw,
    bench_startup,
)
from bench.common import NPUSNAP, REPO, TARGET_MIB, BenchError, MiB, Samples, progress  # noqa: E402
from bench.compute import bench_compute  # noqa: E402
from bench.lazy import LAZY_DEVICE_MIB, bench_lazy, lazy_section  # noqa: E402
from bench.machine import machine_info, read_text, versions  # noqa: E402
from bench.measure import Plan  # noqa: E402
from bench.plot import PLOT_NAME, draw, plot_available  # noqa: E402
from bench.ranks import bench_ranks  # noqa: E402
from bench.report import pick_size, render  # noqa: E402
from bench.session import Session  # noqa: E402
from npusnap_cli import criu as criu_mod  # noqa: E402
from npusnap_sim import manager  # noqa: E402

# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes wants MiB as comma-separated integers, not {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("--sizes needs at least one positive size")
    return sizes


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks wants comma-separated integers, not {text!r}") from None
    if not ranks or min(ranks) < 1 or max(ranks) > 16:
        raise argparse.ArgumentTypeError("--ranks wants process counts from 1 to 16")
    return ranks


def _compile_bytecode() -> None:
    """Byte-compile npusnap as an install does: the commands measured here must not compile
    their modules on every run (with PYTHONDONTWRITEBYTECODE set, Python would, for any module
    edited since its last .pyc: tens of ms on each `--help`)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    repo = Path(__file__).resolve().parent.parent
    pkgs = [str(repo / name) for name in ("npusnap_cli", "npusnap_sim", "npusnap_workloads")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *pkgs], env=env, check=True, timeout=300)


def _check_resources(plan: Plan, image_parent: Path) -> None:
    """Refuse sizes that do not fit this machine's memory or the image directory's disk."""
    lazy = [m + LAZY_DEVICE_MIB for m in plan.lazy_mib]
    biggest = max(*plan.sizes, plan.ranks_mib if plan.ranks else 0, *lazy) + plan.host_mib
    # Peak, at restore: the daemon's shared memory (device memory) + the process's host copy of
    # it (npusnap's own device copy, restored by CRIU) + its host memory; the image's page cache
    # is reclaimable. Plus 1 GiB for CRIU, Python and the daemon.
    need_mem = (2 * biggest + 1024) * MiB
    avail = next(
        (
            int(ln.split()[1]) * 1024
            for ln in read_text("/proc/meminfo").splitlines()
            if ln.startswith("MemAvailable")
        ),
        need_mem,
    )
    if avail < need_mem:
        raise BenchError(
            f"not enough memory for {max(plan.sizes)} MiB: {avail // MiB} MiB available, about "
            f"{need_mem // MiB} MiB needed (2 × (size + host) + 1 GiB); use smaller --sizes"
        )
    free = shutil.disk_usage(image_parent).free
    # One image at a time (each case removes its own), the disk probe, and room to spare.
    need_disk = (biggest + plan.disk_mib + 1024) * MiB
    if free < need_disk:
        raise BenchError(
            f"not enough free space in {image_parent} for {max(plan.sizes)} MiB: {free // MiB} MiB "
            f"free, {need_disk // MiB} MiB needed (one image + the {plan.disk_mib} MiB disk probe + "
            "1 GiB); free some space, use smaller --sizes or another --image-dir"
        )


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run through the normal cleanup (like Ctrl-C)."""

    def handler(signum: int, _frame: Optional[FrameType]) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=_sizes, default=[64, 256, 1024, 2048], help="device MiB, comma-separated")
    ap.add_argument(
        "--ranks", type=_ranks, default=[1, 2, 4], help="NPU processes per tree, comma-separated (scale)"
    )
    ap.add_argument("--ranks-mib", type=int, default=1024, help="device MiB the ranks of a tree share")
    ap.add_argument("--copy-mib", type=int, default=1024, help="MiB per copy of the copy-rate probe")
    ap.add_argument("--no-plot", action="store_true", help="no PNG (matplotlib is not installed)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per size (medians are reported)")
    ap.add_argument("--host-mib", type=int, default=64, help="host memory of the workload besides the device")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between the workloads' ticks")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md", help="the Markdown report")
    ap.add_argument("--json-out", type=Path, help="also write every sample as JSON here")
    ap.add_argument(
        "--image-dir", type=Path, default=Path("/var/tmp"), help="where images go (its disk is measured)"
    )
    ap.add_argument("--disk-mib", type=int, default=1024, help="size of the sequential-write probe")
    ap.add_argument("--startup-runs", type=int, default=20, help="runs per CLI start-up measurement")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="do not warm memory before the timed commands (see the module docstring)",
    )
    ap.add_argument(
        "--lazy-mib",
        type=_sizes,
        default=[],
        help="also measure `restore --lazy` against raw CRIU with a job of this much host memory "
        "(MiB, comma-separated; e.g. 4096)",
    )
    ap.add_argument("--only-lazy", action="store_true", help="measure only the --lazy-mib case")
    ap.add_argument(
        "--keep-page-reporting",
        action="store_true",
        help="leave the VM's free page reporting as it is (bench/pagereport.py: by default freed "
        "memory is held back from the host for 60 s during the run, however much is freed, so "
        "that warming holds)",
    )
    ap.add_argument(
        "--render-only",
        type=Path,
        metavar="JSON",
        help="measure nothing: rewrite --out from the samples of an earlier run's --json-out",
    )
    ns = ap.parse_args(argv)
    if ns.render_only:
        saved = json.loads(ns.render_only.read_text())
        data = Samples()
        for size, metrics in saved["samples"].items():
            for name, values in metrics.items():
                for v in values:
                    data.add(int(size), name, v)
        for size, metrics in saved["flags"].items():
            for name, flags in metrics.items():
                for f in flags:
                    data.flag(int(size), name, bool(f))
        saved["plan"]["lazy_mib"] = tuple(saved["plan"].get("lazy_mib") or ())
        plan = Plan(**{**saved["plan"], "ranks": tuple(saved["plan"].get("ranks", (1, 2, 4)))})
        ns.out.write_text(render(plan, data, saved["info"], saved["info"]["command"], plot_name(ns, plan)))
        if not ns.no_plot:
            draw(plan, data, ns.out.with_name(PLOT_NAME))
        progress(f"report written to {ns.out} from {ns.render_only}")
        return 0
    if os.geteuid() != 0:
        print("bench: must run as root (CRIU dump/restore)", file=sys.stderr)
        return 2
    if ns.reps < 1 or ns.disk_mib < 1 or ns.startup_runs < 1 or ns.host_mib < 0:
        print("bench: --reps, --disk-mib and --startup-runs must be >= 1, --host-mib >= 0", file=sys.stderr)
        return 2
    if not NPUSNAP.exists():
        print(
            f"bench: {NPUSNAP} not found: run with the virtualenv's python (.venv/bin/python)",
            file=sys.stderr,
        )
        return 2
    if ns.ranks_mib < 1 or ns.copy_mib < 1:
        print("bench: --ranks-mib and --copy-mib must be >= 1", file=sys.stderr)
        return 2
    if not ns.no_plot and not plot_available():
        print(
            "bench: matplotlib is not installed, so the scale plot cannot be drawn: "
            "`.venv/bin/pip install 'matplotlib>=3.7'` (the bench extra; not `pip install -e '.[bench]'`, "
            "which would undo setup's faster editable install), or run with --no-plot",
            file=sys.stderr,
        )
        return 2
    plan = Plan(
        ns.sizes,
        ns.reps,
        ns.host_mib,
        ns.interval,
        ns.disk_mib,
        ns.startup_runs,
        warm=not ns.cold,
        lazy_mib=tuple(ns.lazy_mib),
        ranks=tuple(ns.ranks),
        ranks_mib=ns.ranks_mib,
        copy_mib=ns.copy_mib,
    )
    command = ".venv/bin/python bench/run.py " + shlex.join(
        [
            "--sizes",
            ",".join(map(str, plan.sizes)),
            "--reps",
            str(plan.reps),
            "--host-mib",
            str(plan.host_mib),
            "--interval",
            str(plan.interval),
            "--disk-mib",
            str(plan.disk_mib),
            "--startup-runs",
            str(plan.startup_runs),
            "--ranks",
            ",".join(map(str, plan.ranks)),
            "--ranks-mib",
            str(plan.ranks_mib),
            "--copy-mib",
            str(plan.copy_mib),
            *(["--no-plot"] if ns.no_plot else []),
            *(["--cold"] if ns.cold else []),
            *(["--keep-page-reporting"] if ns.keep_page_reporting else []),
            *(["--lazy-mib", ",".join(map(str, plan.lazy_mib))] if plan.lazy_mib else []),
            *(["--only-lazy"] if ns.only_lazy else []),
            "--image-dir",
            str(ns.image_dir),
            "--out",
            str(ns.out),
        ]
    )
    try:
        ns.image_dir.mkdir(parents=True, exist_ok=True)
        _check_resources(plan, ns.image_dir)
        _compile_bytecode()
        criu = criu_mod.find_criu()
    except (BenchError, OSError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # PreflightError from find_criu
        print(f"bench: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1

    saved_env = dict(os.environ)
    tmp = Path(tempfile.mkdtemp(prefix="npusnap-bench-"))
    work = Path(tempfile.mkdtemp(prefix="npusnap-bench-", dir=ns.image_dir))
    # The sim manager resolves its socket from the environment; a private daemon of our own,
    # with room for the largest size, leaves the system's and the tests' daemons alone.
    os.environ["NPUSIM_SOCKET"] = str(tmp / "sim.sock")
    os.environ["NPUSNAP_RUNTIME_DIR"] = str(tmp / "rt")
    (tmp / "rt").mkdir(mode=0o700)
    session = Session(tmp=tmp, work=work, env={})
    data = Samples()
    started = time.monotonic()
    rc = 0
    reporting = pagereport.Hold()
    with _terminate_as_exit():
        try:
            reporting_note = (
                f"left as it is (--keep-page-reporting): {pagereport.current()}"
                if ns.keep_page_reporting
                else reporting.start()
            )
            capacity = (max(*plan.sizes, plan.ranks_mib, plan.copy_mib, LAZY_DEVICE_MIB) + 64) * MiB
            devices = max(plan.ranks, default=1)  # a tree's rank R uses device R
            session.start_daemon(devices, capacity)
            os.environ.update(manager.env())
            session.env = dict(os.environ)
            info: dict[str, Any] = {"machine": machine_info(work), "versions": versions(criu)}
            info["machine"]["free page reporting"] = reporting_note
            progress(f"free page reporting: {reporting_note}")
            progress(
                f"private simulated NPU: {devices} device(s) of {capacity // MiB} MiB at {tmp / 'sim.sock'}"
            )
            progress(f"images in {work}")
            others_start = _other_load_note()
            for host_mib in plan.lazy_mib:
                for rep in range(plan.reps):
                    bench_lazy(session, plan, host_mib, rep, data, criu.path)
            if not ns.only_lazy:
                bench_startup(session, plan, data)
                bench_disk(session, plan, data)
                bench_hash(plan, data)
                bench_copyrate(session, plan, data)
                bench_attach(session, plan, data)
                for rep in range(plan.reps):
                    bench_compute(session, plan, rep, data)
            for size in [] if ns.only_lazy else plan.sizes:
                for rep in range(plan.reps):
                    # Alternate which goes first so that neither always meets the other's writeback.
                    if rep % 2 == 0:
                        bench_npusnap(session, plan, size, rep, data)
                        bench_raw(session, plan, size, rep, data, criu.path)
                    else:
                        bench_raw(session, plan, size, rep, data, criu.path)
                        bench_npusnap(session, plan, size, rep, data)
                    bench_leave_running(session, plan, size, rep, data)
                    if size == pick_size(plan.sizes, TARGET_MIB):
                        bench_npusnap(session, plan, size, rep, data, inproc=True)
                    if plan.warm and size == pick_size(plan.sizes, TARGET_MIB):
                        with reporting.released():  # what the machine's own reporting costs
                            bench_npusnap(session, plan, size, rep, data, cold=True)
            for ranks in [] if ns.only_lazy else plan.ranks:
                for rep in range(plan.reps):
                    bench_ranks(session, plan, ranks, rep, data, criu.path)
            load = session.load or [0.0]
            others = f"At the start: {others_start} At the end: {_other_load_note()}"
            info.update(
                command=command,
                date=time.strftime("%Y-%m-%d %H:%M %Z"),
                duration_s=time.monotonic() - started,
                load={"median": statistics.median(load), "max": max(load)},
                load_note=others,
            )
            if ns.only_lazy:
                head = ["# Benchmarks (lazy restore only)", "", f"    {command}", ""]
                text = "\n".join([*head, *lazy_section(data, list(plan.lazy_mib))])
            else:
                text = render(plan, data, info, command, plot_name(ns, plan))
            ns.out.parent.mkdir(parents=True, exist_ok=True)
            ns.out.write_text(text)
            if not ns.no_plot:
                draw(plan, data, ns.out.with_name(PLOT_NAME))
                progress(f"plot written to {ns.out.with_name(PLOT_NAME)}")
            if ns.json_out:
                ns.json_out.write_text(
                    json.dumps({"plan": plan.__dict__, "info": info, **data.to_dict()}, indent=1)
                )
            progress(f"report written to {ns.out}")
        except BenchError as exc:
            print(f"bench: error: {exc}", file=sys.stderr)
            rc = 1
        except subprocess.TimeoutExpired as exc:
            print(f"bench: error: timed out: {exc}", file=sys.stderr)
            rc = 1
        except KeyboardInterrupt:
            print("bench: interrupted; cleaning up", file=sys.stderr)
            rc = 130
        finally:
            problems = session.close()
            problem = reporting.stop()
            if problem is not None:
                problems.append(problem)
            os.environ.clear()
            os.environ.update(saved_env)
            for p in problems:
                print(f"bench: cleanup: {p}", file=sys.stderr)
                rc = rc or 1
    return rc


def plot_name(ns: argparse.Namespace, plan: Plan) -> Optional[str]:
    """The PNG's file name as the report links it, or None without a plot."""
    return None if ns.no_plot else PLOT_NAME


def _other_load_note() -> str:
    """Which other processes kept the machine busy (e.g. other test runs), over one second."""
    try:
        import psutil
    except ImportError:
        return ""
    me = os.getpid()
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
    time.sleep(1.0)
    busy: list[tuple[float, str]] = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            cpu = p.cpu_percent(None)
            if p.pid != me and cpu >= 5.0:
                busy.append((cpu, " ".join((p.info.get("cmdline") or [p.info.get("name") or "?"])[:3])[:60]))
    if not busy:
        return "no other process used more than 5 % of a core."
    busy.sort(reverse=True)
    return (
        "Other processes busy when the run ended: "
        + "; ".join(f"`{c}` {cpu:.0f} %" for cpu, c in busy[:5])
        + "."
    )


if __name__ == "__main__":
    raise SystemExit(main())
