"""How long `dump --leave-running` holds a LoRA-shaped torch_npu job, against its device memory,
with the concurrent copy (the default) and with the copy while held (``NPUSNAP_NO_CONCURRENT=1``),
in one run.

For each ``--base-mib`` the job (npusnap_workloads/torch_npu_lora.py, AdamW on a rank-8
adapter over a frozen base) trains under ``npusnap run``; it is snapshotted ``--repeat`` times per
mode, alternating, a few steps apart, each a full save (``NPUSNAP_NO_INCREMENTAL=1``, its own
directory). Reported per size and mode: the median ``frozen_s`` and ``total_s``, and from the
job's own step times (``--times``) its normal step (the median gap before the first snapshot),
the longest gap between two steps while a snapshot ran, and the steps it made meanwhile against
what it would have made.

    .venv/bin/python -m bench.copyconcurrent --out docs/benchmarks-concurrent.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import NPUSNAP, REPO, kept_notes, replace_section
from bench.incremental import _python, _steps, _wait_steps

JOB = str(REPO / "npusnap_workloads" / "torch_npu_lora.py")
PAGE = REPO / "docs" / "benchmarks-concurrent.md"
SUMMARY = REPO / "docs" / "benchmarks.md"
HEADING = "## Concurrent device copy (dump --leave-running)"


def _times(path: Path) -> list[float]:
    try:
        return [float(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


def _one(env: dict[str, str], pid: int, image: Path) -> dict[str, Any]:
    start = time.monotonic()
    done = subprocess.run(
        [str(NPUSNAP), "dump", "--leave-running", "--json", str(pid), str(image)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    end = time.monotonic()
    out = json.loads(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"bench.copyconcurrent: dump failed: {out.get('error')}")
    t = out["result"]["timings"]
    return {
        "start": start,
        "end": end,
        "frozen_s": t["frozen_s"],
        "drain_s": t.get("drain_s") or 0.0,
        "total_s": t["total_s"],
    }


def measure_size(ns: argparse.Namespace, base_mib: int, work: Path, env: dict[str, str]) -> dict[str, Any]:
    out = work / f"job-{base_mib}.out"
    times = work / f"times-{base_mib}"
    with out.open("wb") as f:
        proc = subprocess.Popen(
            [str(NPUSNAP), "run", "--", _python(), JOB, "--base-mib", str(base_mib), "--steps", "1000000",
             "--times", str(times)],
            env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"concurrent": [], "held": []}
    try:
        _wait_steps(out, 8, proc, timeout=1800)
        for k in range(ns.repeat):
            for mode in ("concurrent", "held") if k % 2 == 0 else ("held", "concurrent"):
                _wait_steps(out, _steps(out) + 3, proc, timeout=1800)
                menv = {**env, "NPUSNAP_NO_INCREMENTAL": "1"}
                if mode == "held":
                    menv["NPUSNAP_NO_CONCURRENT"] = "1"
                d = work / f"img-{base_mib}-{mode}-{k}"
                d.mkdir(mode=0o700)
                runs[mode].append(_one(menv, proc.pid, d / "img"))
                shutil.rmtree(d)
        _wait_steps(out, _steps(out) + 3, proc, timeout=1800)
    finally:
        proc.kill()
        proc.wait()
    ends = _times(times)
    first = min(r["start"] for rs in runs.values() for r in rs)
    before = [b - a for a, b in zip(ends, ends[1:]) if b < first]
    step = statistics.median(before[2:] or before)
    res: dict[str, Any] = {"base_mib": base_mib, "step_s": step}
    for mode, rs in runs.items():
        gaps, ratios = [], []
        for r in rs:
            inside = [e for e in ends if r["start"] <= e <= r["end"] + step]
            around = [e for e in ends if e < r["start"]][-1:] + inside
            gaps.append(max((b - a for a, b in zip(around, around[1:])), default=r["end"] - r["start"]))
            ratios.append(
                len([e for e in ends if r["start"] <= e <= r["end"]])
                / max(1e-9, (r["end"] - r["start"]) / step)
            )
        res[mode] = {
            "frozen_s": statistics.median(r["frozen_s"] for r in rs),
            "drain_s": statistics.median(r["drain_s"] for r in rs),
            "held_s": statistics.median(r["frozen_s"] - r["drain_s"] for r in rs),
            "total_s": statistics.median(r["total_s"] for r in rs),
            "longest_gap_s": statistics.median(gaps),
            "throughput": statistics.median(ratios),
        }
    return res


def measure(ns: argparse.Namespace) -> dict[str, Any]:
    from npusnap_sim import manager

    work = Path(tempfile.mkdtemp(prefix="npusnap-bench-concurrent-"))
    os.environ["NPUSIM_SOCKET"] = str(work / "npusim.sock")
    manager.start()
    env = {**os.environ, **manager.env(), "NPUSNAP_RUNTIME_DIR": str(work / "npusnap")}
    try:
        rows = [measure_size(ns, b, work, env) for b in ns.base_mib]
        for r in rows:
            print(json.dumps(r), flush=True)
        return {"rows": rows, "repeat": ns.repeat, "loadavg": os.getloadavg()[0]}
    finally:
        manager.stop()
        shutil.rmtree(work, ignore_errors=True)


def _table(res: dict[str, Any]) -> list[str]:
    lines = [
        "| base | mode | frozen_s | of which drain | frozen_s minus drain | total_s | normal step "
        "| longest gap during the dump | steps made during it |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        for mode in ("concurrent", "held"):
            m = r[mode]
            lines.append(
                f"| {r['base_mib']} MiB | {mode} | {m['frozen_s']:.3f} s | {m['drain_s']:.3f} s "
                f"| {m['held_s']:.3f} s | {m['total_s']:.2f} s "
                f"| {r['step_s']:.3f} s | {m['longest_gap_s']:.3f} s | {m['throughput']:.0%} |"
            )
    return lines


def section(res: dict[str, Any]) -> list[str]:
    rows = res["rows"]
    small = rows[0]

    def added(row: dict[str, Any], mode: str, key: str = "frozen_s") -> float:
        return float(row[mode][key]) - float(small[mode][key])

    each = "; ".join(
        f"{r['base_mib']} MiB adds **{added(r, 'concurrent'):.3f} s** "
        f"({added(r, 'concurrent', 'held_s'):.3f} s without the drain, {added(r, 'held'):.3f} s with the "
        "copy while held)"
        for r in rows[1:]
    )
    return [
        HEADING,
        "",
        f"A LoRA-shaped torch_npu job with frozen bases of {', '.join(str(r['base_mib']) for r in rows)} "
        f"MiB, `dump --leave-running` {res['repeat']} times each way (medians), against the "
        f"{small['base_mib']} MiB base, to `frozen_s` with the concurrent copy (target: at most 0.15 s): "
        f"{each}. The drain (`timings.drain_s`) is the step's kernels in flight at the cut finishing, "
        "the device busy with the job's own work. "
        "Details: [benchmarks-concurrent.md](benchmarks-concurrent.md).",
        "",
    ]


def write(res: dict[str, Any], argv: list[str], out: Path) -> None:
    out.write_text(
        "\n".join(
            [
                "# The concurrent device copy: measured",
                "",
                f"`.venv/bin/python -m bench.copyconcurrent {' '.join(argv)}` (bench/copyconcurrent.py says "
                f"what it does); load average at the end {res['loadavg']:.2f}.",
                "",
                *_table(res),
                "",
            ]
        )
        + kept_notes(out)
    )
    replace_section(SUMMARY, HEADING, section(res))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-mib", type=int, nargs="+", default=[8, 768], help="base sizes (default 8 768)")
    ap.add_argument("--repeat", type=int, default=3, help="snapshots per size and mode (default 3)")
    ap.add_argument("--out", type=Path, default=PAGE)
    args = sys.argv[1:] if argv is None else argv
    ns = ap.parse_args(args)
    write(measure(ns), args, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
