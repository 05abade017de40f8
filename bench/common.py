"""Shared by the benchmark modules: paths, constants, the error type and the samples store."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent


MiB = 1 << 20
NPUSNAP = Path(sys.executable).parent / "npusnap"
BIGALLOC = REPO / "npusnap_workloads" / "bigalloc.py"
HOSTALLOC = REPO / "bench" / "hostalloc.py"
TREE = REPO / "bench" / "tree.py"
COPYRATE = REPO / "bench" / "copyrate.py"
# The sequential-write probe writes this buffer repeatedly: random bytes, so that no layer can
# compress or deduplicate it.
WRITE_CHUNK = 4 * MiB
# Polling the workloads' output for tick lines: fine enough to time "computes again" to a few ms,
# coarse enough not to steal a core from the measured processes on a 2-core machine.
POLL_S = 0.005
# A leave-running dump's external check allows this on top of frozen_s for the tick interval's
# phase and the tick's own computation (crc32 of the host memory).
GAP_SLACK_S = 0.15
# "A large fraction of the disk's sequential bandwidth": our reading of the target.
LARGE_FRACTION = 0.5
# The targets are judged at this size (MiB of device memory), or the nearest measured one.
TARGET_MIB = 1024


class BenchError(Exception):
    """A benchmark step failed; the message says which and why."""


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------


@dataclass
class Samples:
    """Every measured value, per size (MiB) and metric name, one entry per repetition."""

    by_size: dict[int, dict[str, list[float]]] = field(default_factory=lambda: defaultdict(dict))
    flags: dict[int, dict[str, list[bool]]] = field(default_factory=lambda: defaultdict(dict))

    def add(self, size: int, name: str, value: Optional[float]) -> None:
        if value is not None:
            self.by_size[size].setdefault(name, []).append(float(value))

    def flag(self, size: int, name: str, value: bool) -> None:
        self.flags[size].setdefault(name, []).append(value)

    def med(self, size: int, name: str) -> Optional[float]:
        values = self.by_size.get(size, {}).get(name)
        return statistics.median(values) if values else None

    def span(self, size: int, name: str) -> Optional[tuple[float, float]]:
        values = self.by_size.get(size, {}).get(name)
        return (min(values), max(values)) if values else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": {str(s): dict(m) for s, m in self.by_size.items()},
            "flags": {str(s): dict(m) for s, m in self.flags.items()},
        }


def write_window_s(data: Samples, size: int) -> Optional[float]:
    """The seconds in which a dump's image went to disk: from the lock (the agents write the
    device memory first) until it was durable, i.e. the command's own time less its preflight."""
    total, pre = data.med(size, "dump_total_s"), data.med(size, "dump_preflight_s")
    return None if total is None or pre is None else total - pre


def progress(msg: str) -> None:
    """One line of progress on stderr."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# Where a generated page's hand-written part starts: kept when the bench rewrites the page.
NOTES = "<!-- notes: written by hand, kept when the bench rewrites this page -->"


def kept_notes(page: Path) -> str:
    """The hand-written part of ``page`` (from the NOTES line on), kept across runs."""
    try:
        text = page.read_text()
    except OSError:
        return ""
    at = text.find(NOTES)
    return "\n" + text[at:] if at >= 0 else ""


def replace_section(summary: Path, heading: str, lines: list[str]) -> None:
    """Put ``lines`` in place of ``summary``'s section under ``heading`` (appended if it has none)."""
    text = summary.read_text()
    new = "\n".join(lines)
    if heading in text:
        at = text.index(heading)
        nxt = text.find("\n## ", at + len(heading))
        text = text[:at] + new + ("\n" + text[nxt + 1 :] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + new
    summary.write_text(text.rstrip("\n") + "\n")
