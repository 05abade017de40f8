"""How the dump and restore pipelines tell their caller what they are doing.

Core code never prints: it calls these, and the command wires them to ``ui.Output`` (phase
lines, progress bars, notes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

PhaseFn = Callable[[str], None]
ProgressFn = Callable[[str, int, Optional[int]], None]


def no_phase(_label: str) -> None:
    pass


def no_progress(_label: str, _done: int, _total: Optional[int]) -> None:
    pass


@dataclass(frozen=True)
class PipelineCallbacks:
    phase: PhaseFn = no_phase  # a phase starts: "lock+backup", "criu dump", "verify", ...
    progress: ProgressFn = no_progress  # (label, bytes done, bytes expected or None)
    note: PhaseFn = no_phase  # something worth telling the user (attach, interrupt received)
