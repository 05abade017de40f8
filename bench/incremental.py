"""Incremental snapshots of a LoRA-shaped torch_npu job: what the second and the tenth snapshot
write and take, against a full one, in one run.

The job is npusnap_workloads/torch_npu_lora.py (a frozen base of ``--base-mib`` float32
weights on the simulated NPU, a rank-8 adapter per layer trained with AdamW), started with
``npusnap run``. While it trains, ``npusnap dump --leave-running --json`` is taken ``--snapshots``
times into one directory (each after a few more steps): the first is a full save, every later one
an incremental save since the one before (docs/image-format.md, "Device-memory chunks"). For the
full reference, each snapshot of the same job is also taken with ``NPUSNAP_NO_INCREMENTAL=1``
into a directory of its own (nothing to share): the agent copies and the dump hashes and writes
everything. Reported per snapshot: device bytes total and new, ``total_s`` and ``frozen_s``.

    .venv/bin/python -m bench.incremental --out docs/benchmarks-incremental.md

It also rewrites the incremental section of docs/benchmarks.md.
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

from bench.common import NPUSNAP, REPO, replace_section

JOB = str(REPO / "npusnap_workloads" / "torch_npu_lora.py")
PAGE = REPO / "docs" / "benchmarks-incremental.md"
SUMMARY = REPO / "docs" / "benchmarks.md"
HEADING = "## Incremental snapshots"
TARGET_SHARE = 0.05


def _python() -> str:
    py = Path(os.environ.get("NPUSNAP_BUILD_DIR") or REPO / ".build") / "torch-npu" / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"bench.incremental: no {py}: scripts/setup-torch-npu.sh makes it")
    return str(py)


def _steps(out: Path) -> int:
    try:
        return sum(1 for ln in out.read_text().splitlines() if ln.startswith("step "))
    except OSError:
        return 0


def _wait_steps(out: Path, n: int, proc: subprocess.Popen[bytes], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while _steps(out) < n:
        if proc.poll() is not None:
            raise SystemExit(f"bench.incremental: the job ended: {out.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"bench.incremental: the job did not reach step {n}")
        time.sleep(0.2)


def _dump(env: dict[str, str], pid: int, image: Path) -> dict[str, Any]:
    done = subprocess.run(
        [str(NPUSNAP), "dump", "--leave-running", "--json", str(pid), str(image)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = json.loads(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"bench.incremental: dump failed: {out.get('error')}")
    r = out["result"]
    t = r["timings"]
    return {
        "device_total": r["bytes"]["device_total"],
        "device_new": r["bytes"]["device_new"],
        "total_s": t["total_s"],
        "frozen_s": t["frozen_s"],
        "device_copy_s": t.get("device_copy_s"),
    }


def measure(ns: argparse.Namespace) -> dict[str, Any]:
    from npusnap_sim import manager

    python = _python()
    work = Path(tempfile.mkdtemp(prefix="npusnap-bench-incremental-"))
    os.environ["NPUSIM_SOCKET"] = str(work / "npusim.sock")
    manager.start()
    env = {**os.environ, **manager.env(), "NPUSNAP_RUNTIME_DIR": str(work / "npusnap")}
    full_env = {**env, "NPUSNAP_NO_INCREMENTAL": "1"}
    out = work / "job.out"
    res: dict[str, Any] = {"base_mib": ns.base_mib, "snapshots": ns.snapshots, "between": ns.between}
    chain = work / "chain"
    chain.mkdir(mode=0o700)
    steps = 1_000_000  # killed when done
    with out.open("wb") as f:
        proc = subprocess.Popen(
            [str(NPUSNAP), "run", "--", python, JOB, "--base-mib", str(ns.base_mib), "--steps", str(steps)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # `npusnap run` becomes the job: a session of its own
        )
    try:
        _wait_steps(out, 3, proc)
        pid = proc.pid
        rows = []
        for k in range(1, ns.snapshots + 1):
            _wait_steps(out, _steps(out) + ns.between, proc)
            inc = _dump(env, pid, chain / f"snap-{k:02d}")
            alone = work / f"full-{k:02d}"
            alone.mkdir(mode=0o700)
            full = _dump(full_env, pid, alone / "img")
            shutil.rmtree(alone)  # nothing to share for the next full one
            rows.append({"k": k, "incremental": inc, "full": full})
            print(json.dumps(rows[-1]), flush=True)
        res["rows"] = rows
        res["loadavg"] = os.getloadavg()[0]
    finally:
        proc.kill()
        proc.wait()
        manager.stop()
        shutil.rmtree(work, ignore_errors=True)
    return res


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _table(res: dict[str, Any]) -> list[str]:
    lines = [
        "| snapshot | device memory | written: incremental | written: full | total_s incremental / full | "
        "frozen_s incremental / full |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        i, f = r["incremental"], r["full"]
        share = i["device_new"] / max(1, i["device_total"])
        lines.append(
            f"| {r['k']} | {_mib(i['device_total'])} | {_mib(i['device_new'])} ({share:.1%}) | "
            f"{_mib(f['device_new'])} | {i['total_s']:.2f} / {f['total_s']:.2f} s | "
            f"{i['frozen_s']:.2f} / {f['frozen_s']:.2f} s |"
        )
    return lines


def section(res: dict[str, Any]) -> list[str]:
    later = res["rows"][1:]
    share = statistics.median(
        r["incremental"]["device_new"] / max(1, r["incremental"]["device_total"]) for r in later
    )
    speed = statistics.median(r["full"]["total_s"] / max(1e-9, r["incremental"]["total_s"]) for r in later)
    return [
        HEADING,
        "",
        f"A LoRA-shaped torch_npu job (`torch_npu_lora.py`, a frozen {res['base_mib']} MiB base, AdamW on "
        f"a rank-8 adapter), snapshotted with `dump --leave-running` every {res['between']} steps, "
        f"{res['snapshots']} times into one directory, each also taken in full (`NPUSNAP_NO_INCREMENTAL=1`, "
        "alone in a directory) right after: from the second snapshot on, the median incremental "
        f"snapshot writes **{share:.1%}** of the job's device memory (target: at most "
        f"{TARGET_SHARE:.0%}) and its whole dump is **{speed:.2f}×** faster than the full one. "
        f"Details: [benchmarks-incremental.md](benchmarks-incremental.md).",
        "",
    ]


def page(res: dict[str, Any], argv: list[str]) -> str:
    return "\n".join(
        [
            "# Incremental snapshots: measured",
            "",
            f"`.venv/bin/python -m bench.incremental {' '.join(argv)}` (bench/incremental.py, its docstring "
            "says what it does); load average at the end "
            f"{res['loadavg']:.2f}. Simulated NPU: the device copy is a memory copy, so the figures show "
            "what is not copied, hashed and written; on a node the copy off the device (HBM over PCIe) "
            "is what incremental saves leave out as well.",
            "",
            *_table(res),
            "",
        ]
    )


def write(res: dict[str, Any], argv: list[str], out: Path) -> None:
    out.write_text(page(res, argv))
    replace_section(SUMMARY, HEADING, section(res))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-mib", type=int, default=512, help="MiB of frozen base weights (default 512)")
    ap.add_argument("--snapshots", type=int, default=10, help="snapshots in the chain (default 10)")
    ap.add_argument("--between", type=int, default=3, help="training steps between two (default 3)")
    ap.add_argument("--out", type=Path, default=PAGE)
    args = sys.argv[1:] if argv is None else argv
    ns = ap.parse_args(args)
    res = measure(ns)
    write(res, args, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
