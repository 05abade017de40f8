"""What a CRIU dump or restore answers, with CRIU's own statistics (its ``stats-*`` images)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from npusnap_cli import criuimages

STATS_DUMP_FILE = "stats-dump"
STATS_RESTORE_FILE = "stats-restore"


@dataclass(frozen=True)
class DumpStats:
    """CRIU's own dump statistics (the ``stats-dump`` image), times in microseconds."""

    freezing_time_us: int = 0
    frozen_time_us: int = 0
    memdump_time_us: int = 0
    memwrite_time_us: int = 0
    pages_scanned: int = 0
    pages_written: int = 0


@dataclass(frozen=True)
class RestoreStats:
    """CRIU's own restore statistics (the ``stats-restore`` image), times in microseconds."""

    forking_time_us: int = 0
    restore_time_us: int = 0
    pages_restored: int = 0


@dataclass(frozen=True)
class DumpResult:
    log_path: str
    wall_s: float
    stats: Optional[DumpStats]


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    log_path: str
    wall_s: float
    stats: Optional[RestoreStats]


def load_stats(work_dir: str, name: str) -> Optional[dict[str, int]]:
    """Read a CRIU stats image (CRIU writes it into its work dir); None when absent or unreadable:
    statistics are informative only, a decoding problem must not fail a good dump."""
    return criuimages.stats(os.path.join(work_dir, name))


def read_dump_stats(work_dir: str) -> Optional[DumpStats]:
    raw = load_stats(work_dir, STATS_DUMP_FILE)
    if raw is None:
        return None
    return DumpStats(
        freezing_time_us=raw.get("freezing_time", 0),
        frozen_time_us=raw.get("frozen_time", 0),
        memdump_time_us=raw.get("memdump_time", 0),
        memwrite_time_us=raw.get("memwrite_time", 0),
        pages_scanned=raw.get("pages_scanned", 0),
        pages_written=raw.get("pages_written", 0),
    )


def read_restore_stats(work_dir: str) -> Optional[RestoreStats]:
    raw = load_stats(work_dir, STATS_RESTORE_FILE)
    if raw is None:
        return None
    return RestoreStats(
        forking_time_us=raw.get("forking_time", 0),
        restore_time_us=raw.get("restore_time", 0),
        pages_restored=raw.get("pages_restored", 0),
    )
