"""The scale with processes: a tree of N NPU processes dumped and restored by one npusnap command,
beside raw CRIU on the same tree without a device."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import psutil

from bench.common import (
    BIGALLOC,
    HOSTALLOC,
    TREE,
    BenchError,
    Samples,
    progress,
)
from bench.measure import Plan, npusnap_json, run_timed, start_timeout, warm_memory
from bench.session import Session, TickWatcher, _wait
from npusnap_cli import criu as criu_mod
from npusnap_cli.host import procfs


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


def _first_ticks(watchers: list[TickWatcher], start: float, timeout: float) -> float:
    """Seconds from ``start`` until every rank's watcher saw a new tick (the whole tree computes).
    The watchers are started before the restore: a rank that computes while the restore command
    is still finishing counts from its first tick, not from the command's end."""
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
        s.drop_kept_memory(f"{kind} tree of {ranks}")
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
            argv, d / "tree.out", agent=kind == "npusnap", timeout=start_timeout(plan.ranks_mib), watch=logs
        )
        kids = _adopt_tree(s, proc.pid, script)
        if len(kids) != ranks:
            raise BenchError(f"the tree of {ranks} ranks has {len(kids)} {script} processes")
        image = d / "img"
        s.sample_load()
        warm_memory(plan, plan.ranks_mib)
        if kind == "npusnap":
            wall, res = npusnap_json(["dump", str(proc.pid), str(image)], s.env, timeout=900)
            out.add(0, f"{pre}dump_frozen_s", res["timings"]["frozen_s"])
        else:
            image.mkdir()
            crit = run_timed(
                [criu_path, "dump", "-t", str(proc.pid), "-D", str(image), "-o", "dump.log", "-v4"],
                "criu dump (tree)",
                image / "dump.log",
            )
            wall = crit + run_timed(["sync", "-f", str(image)], "sync -f")
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
        watchers = [TickWatcher(f) for f in logs]
        start = time.monotonic()
        try:
            if kind == "npusnap":
                rwall, _res = npusnap_json(
                    ["restore", str(image), "--pidfile", str(pidfile)], s.env, timeout=900
                )
            else:
                cmd = [criu_path, "restore", "-d", "-D", str(image), "-o", "restore.log", "-v4"]
                rwall = run_timed(
                    [*cmd, "--pidfile", str(pidfile)], "criu restore (tree)", image / "restore.log"
                )
        except BaseException:
            for w in watchers:
                w.stop()
            raise
        finally:
            if pidfile.exists():
                root = int(pidfile.read_text().strip())
                s.restored.append((root, TREE.name))
                _adopt_tree(s, root, script)
        computes = _first_ticks(watchers, start, 60)
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
