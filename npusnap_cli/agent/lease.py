"""The lease that makes a locked process unlock itself when the CLI goes away.

Standard library only, Python 3.9+ (runs inside the target).

A lease is counted in *run time* of the target, not wall time: the agent ticks it every
``TICK`` seconds and a gap between two ticks much longer than a tick means the whole process was
stopped (CRIU froze it for a dump, SIGSTOP, a suspended VM). Such a gap is counted as one tick
only, so a lease never expires because of a freeze. Time spent inside an operation is not
counted either (``skip_gap``): the CLI is waiting for that operation, not silent.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

TICK = 0.1  # how often the agent wakes to tick the lease
FREEZE_GAP = 1.0  # a gap longer than this between ticks is a freeze, not run time


class Lease:
    """Remaining run time before the agent rolls its process back by itself."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.duration: Optional[float] = None
        self.remaining: Optional[float] = None
        self.voided_reason: Optional[str] = None
        self.frozen_gaps = 0
        self.expired_duration: Optional[float] = None  # length of the last lease that ran out
        self._last = clock()

    @property
    def active(self) -> bool:
        return self.remaining is not None

    def grant(self, seconds: float) -> None:
        """Start (or restart) a lease of ``seconds`` of run time."""
        self.duration = float(seconds)
        self.remaining = float(seconds)
        self.voided_reason = None
        self._last = self._clock()

    def renew(self, seconds: Optional[float] = None) -> bool:
        """Refill an active lease (optionally with a new length); False if none is active."""
        if not self.active:
            return False
        length = seconds if seconds is not None else self.duration
        self.grant(float(length) if length is not None else 0.0)
        return True

    def release(self) -> None:
        """Drop the lease without touching the process."""
        self.duration = None
        self.remaining = None

    def void(self, reason: str) -> None:
        """Drop the lease because it no longer applies (e.g. the process was CRIU-restored)."""
        if self.active:
            self.voided_reason = reason
        self.release()

    def skip_gap(self) -> None:
        """Forget the time since the last tick (an operation ran meanwhile)."""
        self._last = self._clock()

    def tick(self) -> bool:
        """Count the run time since the last tick; True when the lease has just expired."""
        now = self._clock()
        delta = max(0.0, now - self._last)
        self._last = now
        if self.remaining is None:
            return False
        if delta > FREEZE_GAP:
            # The process did not run for most of this gap (frozen): count one tick at most.
            self.frozen_gaps += 1
            delta = min(delta, TICK)
        self.remaining -= delta
        if self.remaining <= 0:
            self.expired_duration = self.duration
            self.release()
            return True
        return False

    def info(self) -> Dict[str, Any]:
        return {
            "active": self.active,
            "lease_s": self.duration,
            "remaining_s": None if self.remaining is None else round(max(self.remaining, 0.0), 3),
            "voided_reason": self.voided_reason,
            "frozen_gaps": self.frozen_gaps,
        }
