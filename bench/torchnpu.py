"""A real torch_npu training step on the simulated NPU: against the CPU, and under npusnap.

The job is npusnap_workloads/torch_npu_block.py (an attention block, AdamW with its default
foreach settings; a step is forward, backward, gradient clipping, the optimizer, the next batch's
copy, ``loss.item()`` and a hash of every parameter). Each run writes its step times to a file
(``--times``), never to its output. In one run of this benchmark:

* **device against CPU**: the job on the simulated NPU with the environment ``npusnap sim env``
  gives (the simulator's defaults: ``NPUSIM_KERNEL_BLOCK_US`` unset, kernels at memory speed),
  against the same job on the CPU (``--device cpu``, torch_npu not loaded); both with
  ``--threads T`` (torch.set_num_threads). Then the device once more with
  ``NPUSIM_KERNEL_BLOCK_US=100`` (kernels charged 100 µs a block, as tests that want work in
  flight set it), to show what that costs;
* **no interference**: the job on the device without and under ``npusnap run`` (which preloads
  npusnap's agent), alternated ``--pairs`` times; step times, and whether stdout and stderr are
  byte-identical. A plain run is also compared with the next plain run: c10's warnings carry a
  timestamp, so stderr is compared with that prefix masked as well.

The figure for each run is the median step time after ``--warmup`` steps. A private simulated
NPU; nothing else is started.

    .venv/bin/python -m bench.torchnpu --out docs/benchmarks-torch-npu.md

It also rewrites the torch_npu section of docs/benchmarks.md (``section()``; bench/report.py
keeps it when bench/run.py rewrites that page).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import NOTES, NPUSNAP, REPO, kept_notes, replace_section

JOB = str(REPO / "npusnap_workloads" / "torch_npu_block.py")
PAGE = REPO / "docs" / "benchmarks-torch-npu.md"
SUMMARY = REPO / "docs" / "benchmarks.md"
HEADING = "## torch_npu on the simulated NPU"
# c10's log prefix: "[W1204 05:22:21.446618059 File.cpp:44] " (severity, date, time, source)
C10_PREFIX = re.compile(rb"^\[([WEI])\d{4} \d\d:\d\d:\d\d\.\d+ ", re.M)
TARGET_RATIO = 3.0
TARGET_INTERFERENCE = 0.05


def _python() -> str:
    py = Path(os.environ.get("NPUSNAP_BUILD_DIR") or REPO / ".build") / "torch-npu" / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"bench.torchnpu: no {py}: scripts/setup-torch-npu.sh makes it")
    return str(py)


def run_job(
    argv_prefix: list[str], env: dict[str, str], args: list[str], work: Path, tag: str
) -> dict[str, Any]:
    """One run: its step times (seconds), stdout and stderr bytes, wall time."""
    times = work / f"{tag}.times"
    t0 = time.monotonic()
    done = subprocess.run(
        [*argv_prefix, JOB, *args, "--times", str(times)], env=env, capture_output=True, timeout=900
    )
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"bench.torchnpu: {tag} failed:\n{done.stderr.decode(errors='replace')[-3000:]}")
    steps = [float(x) for x in times.read_text().split()]
    return {"steps": steps, "stdout": done.stdout, "stderr": done.stderr, "wall": wall}


def median_after(steps: list[float], warmup: int) -> float:
    return statistics.median(steps[warmup:])


def masked(stderr: bytes) -> bytes:
    return C10_PREFIX.sub(rb"[\1<time> ", stderr)


def measure(ns: argparse.Namespace) -> dict[str, Any]:
    from npusnap_sim import manager

    python = _python()
    work = Path(tempfile.mkdtemp(prefix="npusnap-bench-torchnpu-"))
    os.environ["NPUSIM_SOCKET"] = str(work / "npusim.sock")
    manager.start()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NPUSIM_KERNEL", "TASK_QUEUE"))}
    env = {**base, **manager.env(), "NPUSNAP_RUNTIME_DIR": str(work / "npusnap")}
    job = ["--steps", str(ns.steps), "--threads", str(ns.threads)]
    res: dict[str, Any] = {"steps": ns.steps, "warmup": ns.warmup, "threads": ns.threads, "pairs": ns.pairs}
    try:
        cpu_env = {**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        res["cpu"] = median_after(
            run_job([python], cpu_env, [*job, "--device", "cpu"], work, "cpu")["steps"], ns.warmup
        )
        res["npu"] = median_after(run_job([python], env, job, work, "npu")["steps"], ns.warmup)
        slow = {**env, "NPUSIM_KERNEL_BLOCK_US": "100"}
        res["npu_block100"] = median_after(run_job([python], slow, job, work, "npu100")["steps"], ns.warmup)
        plain: list[dict[str, Any]] = []
        under: list[dict[str, Any]] = []
        for k in range(ns.pairs):
            # Each side goes first in turn: whatever else the machine does hits both.
            order = ("plain", "run") if k % 2 == 0 else ("run", "plain")
            for side in order:
                prefix = [python] if side == "plain" else [str(NPUSNAP), "run", "--", python]
                r = run_job(prefix, env, job, work, f"{side}-{k}")
                (plain if side == "plain" else under).append(r)
        res["plain"] = statistics.median(median_after(r["steps"], ns.warmup) for r in plain)
        res["under_run"] = statistics.median(median_after(r["steps"], ns.warmup) for r in under)
        res["plain_runs"] = [round(median_after(r["steps"], ns.warmup), 5) for r in plain]
        res["run_runs"] = [round(median_after(r["steps"], ns.warmup), 5) for r in under]
        res["stdout_identical"] = all(u["stdout"] == plain[0]["stdout"] for u in under + plain)
        res["stderr_identical"] = all(u["stderr"] == p["stderr"] for u, p in zip(under, plain))
        res["stderr_identical_masked"] = all(
            masked(u["stderr"]) == masked(p["stderr"]) for u, p in zip(under, plain)
        )
        res["plain_stderr_identical"] = len(plain) < 2 or plain[0]["stderr"] == plain[1]["stderr"]
        res["plain_stderr_identical_masked"] = len(plain) < 2 or masked(plain[0]["stderr"]) == masked(
            plain[1]["stderr"]
        )
        extra = set(masked(under[0]["stderr"]).splitlines()) - set(masked(plain[0]["stderr"]).splitlines())
        res["stderr_only_under_run"] = sorted(x.decode(errors="replace") for x in extra)
        res["loadavg"] = os.getloadavg()[0]
    finally:
        manager.stop()
        shutil.rmtree(work, ignore_errors=True)
    return res


def _ms(x: float) -> str:
    return f"{1000 * x:.2f} ms"


def section(res: Optional[dict[str, Any]] = None) -> list[str]:
    """The lines of docs/benchmarks.md for this benchmark (from ``res``, or from the page)."""
    if res is None:
        if not PAGE.exists():
            return []
        lines = PAGE.read_text().splitlines()
        start = next((i for i, ln in enumerate(lines) if ln.startswith("| measure")), None)
        if start is None:
            return []
        table = []
        for ln in lines[start:]:
            if not ln.startswith("|"):
                break
            table.append(ln)
        verdicts = [ln for ln in lines if ln.startswith("Target")]
    else:
        table, verdicts = _table(res), _verdicts(res)
    return [
        HEADING,
        "",
        "The real torch_npu wheel training an attention block (npusnap_workloads/torch_npu_block.py)"
        " on the simulated NPU, against the CPU and under `npusnap run`; details and how it was measured:",
        "[benchmarks-torch-npu.md](benchmarks-torch-npu.md) (`python -m bench.torchnpu`).",
        "",
        *table,
        "",
        *verdicts,
        "",
    ]


def _table(res: dict[str, Any]) -> list[str]:
    t = res["threads"]
    return [
        "| measure | median step time |",
        "|---|---|",
        f"| CPU, torch.set_num_threads({t}) | {_ms(res['cpu'])} |",
        f"| simulated NPU, `sim env` defaults (kernels at memory speed), threads {t} "
        f"| {_ms(res['npu'])} ({res['npu'] / res['cpu']:.1f}× the CPU) |",
        f"| simulated NPU, NPUSIM_KERNEL_BLOCK_US=100, threads {t} "
        f"| {_ms(res['npu_block100'])} ({res['npu_block100'] / res['cpu']:.1f}× the CPU) |",
        f"| simulated NPU, without npusnap ({res['pairs']} runs) | {_ms(res['plain'])} |",
        f"| simulated NPU, under `npusnap run` ({res['pairs']} runs) "
        f"| {_ms(res['under_run'])} ({100 * (res['under_run'] / res['plain'] - 1):+.1f} %) |",
    ]


def _verdicts(res: dict[str, Any]) -> list[str]:
    ratio = res["npu"] / res["cpu"]
    diff = res["under_run"] / res["plain"] - 1
    same_err = (
        "byte-identical"
        if res["stderr_identical"]
        else (
            "identical once c10's timestamps are masked"
            if res["stderr_identical_masked"]
            else "**different**"
        )
    )
    lines = [
        f"Target (a training step on the simulated NPU with `sim env`'s defaults within {TARGET_RATIO:g}× "
        f"the CPU's): **{'met' if ratio <= TARGET_RATIO else 'not met'}** in this run ({ratio:.1f}×; "
        f"{res['npu_block100'] / res['cpu']:.1f}× with NPUSIM_KERNEL_BLOCK_US=100).",
        "",
        f"Target (step time under `npusnap run` within {100 * TARGET_INTERFERENCE:g} % of without): "
        f"**{'met' if abs(diff) <= TARGET_INTERFERENCE else 'not met'}** in this run ({100 * diff:+.1f} %). "
        f"stdout {'byte-identical' if res['stdout_identical'] else '**different**'}; stderr {same_err}"
        + (
            "; only under npusnap: " + "; ".join(f"`{x}`" for x in res["stderr_only_under_run"])
            if res["stderr_only_under_run"]
            else ""
        )
        + ".",
    ]
    return lines


def page(res: dict[str, Any], argv: list[str]) -> str:
    L = [
        "# torch_npu on the simulated NPU: step time against the CPU, and under npusnap",
        "",
        "Generated by `python -m bench.torchnpu` (do not edit by hand above the notes: rerun it).",
        "",
        f"Run on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.torchnpu "
        f"{' '.join(argv)}`; {res['steps']} steps a run, the median of the steps after the first "
        f"{res['warmup']}; 1-minute load average at the end {res['loadavg']:.2f} on {os.cpu_count()} cores.",
        "",
        "Settings: the job's defaults (vocabulary 64, width 32, 4 heads, sequence 16, batch 8, AdamW "
        "lr 3e-3 over two parameter halves); `TASK_QUEUE_ENABLE` unset (1); the device runs have exactly "
        "`npusnap sim env`'s variables (the third adds NPUSIM_KERNEL_BLOCK_US=100), and the CPU run "
        "`TORCH_DEVICE_BACKEND_AUTOLOAD=0` "
        f"(torch_npu not loaded); every run `--threads {res['threads']}` (torch.set_num_threads).",
        "",
        *_table(res),
        "",
        *_verdicts(res),
        "",
        f"Per run (without / under `npusnap run`): {res['plain_runs']} / {res['run_runs']} s. "
        f"Two plain runs' stderr byte-identical: {res['plain_stderr_identical']} "
        f"(timestamps masked: {res['plain_stderr_identical_masked']}).",
        "",
        "```json",
        json.dumps({k: v for k, v in res.items()}, indent=1, default=str),
        "```",
        "",
    ]
    return "\n".join(L)


def write(res: dict[str, Any], argv: list[str], out: Path) -> None:
    out.write_text(page(res, argv) + (kept_notes(out) or "\n" + NOTES + "\n"))
    replace_section(SUMMARY, HEADING, section(res))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps a run (default 40)")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of each median (default 10)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every run (default 1)")
    ap.add_argument("--pairs", type=int, default=3, help="runs without and under npusnap run (default 3)")
    ap.add_argument("--out", type=Path, default=PAGE)
    args = sys.argv[1:] if argv is None else argv
    ns = ap.parse_args(args)
    res = measure(ns)
    print(
        json.dumps({k: v for k, v in res.items() if k not in ("stdout", "stderr")}, default=str), flush=True
    )
    write(res, args, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
