"""CLI start-up time: `npusnap --help` and `npusnap --version` (target: well under 200 ms), and
`dump --help` / `restore --help`: what a dump or a restore pays in imports before any work.

Measured by running the console script repeatedly and reporting the median, not asserted in a
test (timings depend on the machine). Usage: .venv/bin/python bench/startup.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXE = Path(sys.executable).parent / "npusnap"


def measure(args: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([str(EXE), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    ns = parser.parse_args()
    measure(["--version"], 2)  # warm the page cache
    for args in (["--help"], ["--version"], ["check", "--help"], ["dump", "--help"], ["restore", "--help"]):
        t = measure(args, ns.runs)
        print(f"npusnap {' '.join(args):<14} median {statistics.median(t) * 1000:6.1f} ms  "
              f"min {min(t) * 1000:6.1f} ms  max {max(t) * 1000:6.1f} ms  ({ns.runs} runs)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
