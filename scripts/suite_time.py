"""The suite's wall time against the time its tests took one by one.

    python scripts/suite_time.py --wall SECONDS [--zdtm REPORT] JUNIT.xml ...

Sums the duration of every test case in pytest's JUnit reports (setup, call and teardown, as
pytest measures them in its worker) and adds the seconds of each zdtm test's runs from its report: that is
what one process running the same tests one after another would take, at least (tests measured
under a parallel run's load are slower, not faster). Prints both and their ratio, the figure
CONTRIBUTING.md quotes. Prints only: a slow machine is not a failing suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def junit_seconds(path: Path) -> tuple[int, float]:
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    return len(cases), sum(float(c.get("time", "0") or 0) for c in cases)


def zdtm_seconds(path: Path) -> float:
    """Each test's raw and npusnap runs (not the run's wall time: it waits for pytest's workers)."""
    tests = json.loads(path.read_text())["tests"]
    return sum(float(t[k]["seconds"]) for t in tests for k in ("raw", "npusnap") if t.get(k))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wall", type=float, required=True, help="the suite's wall time, seconds")
    ap.add_argument("--zdtm", type=Path, default=Path(".build/zdtm-report.json"), help="zdtm's report")
    ap.add_argument("junit", type=Path, nargs="+")
    args = ap.parse_args(argv)
    count, serial = 0, 0.0
    for path in args.junit:
        if not path.is_file():
            print(f"suite time: no {path}: not measured", file=sys.stderr)
            return 0
        n, s = junit_seconds(path)
        count, serial = count + n, serial + s
    zdtm = zdtm_seconds(args.zdtm) if args.zdtm.is_file() else 0.0
    total = serial + zdtm
    ratio = args.wall / total if total else 0.0
    print(
        f"== suite time: wall {args.wall / 60:.1f} min; one by one {total / 60:.1f} min"
        f" ({count} pytest tests {serial / 60:.1f} min + zdtm {zdtm / 60:.1f} min);"
        f" wall/one-by-one {ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
