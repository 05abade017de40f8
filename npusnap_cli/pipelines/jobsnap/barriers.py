"""The job's barriers: ``JobCoordinator`` holds every rank at each phase boundary, or releases
them all with an error; ``run_ranks`` runs one thread per rank."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Optional, TypeVar

from npusnap_cli.errors import NpusnapError
from npusnap_cli.pipelines import engine
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.netcoord import NetLink

PHASES = ("preflight", "backup", "criu", "publish")
RESTORE_PHASES = ("verified", "criu-restored", "device-restored", "settled")
DEFAULT_BARRIER_TIMEOUT_S = 600.0


class JobAbortedError(NpusnapError):
    """This rank stopped because another rank (or a signal) failed the job; it rolled back."""

    kind = "job-aborted"


class JobCoordinator:
    """One barrier per phase for ``n`` ranks; ``abort(reason)`` releases every waiter with an error.

    ``on_commit`` runs once, in the last rank to reach "publish", before any rank goes on: the
    job is committed there. If it raises, the barrier breaks and every rank rolls back.
    """

    def __init__(
        self,
        n: int,
        *,
        timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
        on_commit: Optional[Callable[[], None]] = None,
        net: Optional[NetLink] = None,
        phases: tuple[str, ...] = PHASES,
    ) -> None:
        self.n = n
        self.net = net  # the same phases across nodes
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.reason: Optional[str] = None
        self.failed_rank: Optional[int] = None
        self.commit_error: Optional[BaseException] = None
        self.reached: dict[str, int] = {}
        self._passed: set[str] = set()
        self._on_commit = on_commit
        self._barriers = {p: threading.Barrier(n, action=self._action(p)) for p in phases}

    def _action(self, phase: str) -> Callable[[], None]:
        """Runs once per phase, in the last rank to arrive, before any rank is released."""

        def act() -> None:
            if self.net is not None:
                self.net.sync(phase)  # every node's ranks got here too (raises NodeAborted)
            if phase == "publish" and self._on_commit is not None:
                try:
                    self._on_commit()
                except BaseException as exc:
                    # The barrier breaks (every other rank raises); this rank gets ``exc``.
                    self.commit_error = exc
                    with self._lock:
                        if self.reason is None:
                            self.reason = f"committing the job failed: {_describe(exc)}"
                    raise
            self._passed.add(phase)

        return act

    def abort(self, reason: str, rank: Optional[int] = None, exit_code: Optional[int] = None) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
                self.failed_rank = rank
        if self.net is not None:
            self.net.abort(reason if rank is None else f"rank {rank}: {reason}", exit_code)
        for b in self._barriers.values():
            b.abort()

    def _error(self, phase: str) -> JobAbortedError:
        who = f"rank {self.failed_rank}" if self.failed_rank is not None else "the job"
        return JobAbortedError(
            f"stopped before the end of '{phase}': {who} failed ({self.reason or 'unknown'})",
            why="a coordinated snapshot is all ranks or none",
            fix="see the failed rank's error",
            details={"phase": phase, "failed_rank": self.failed_rank},
        )

    def passed(self, phase: str) -> bool:
        """Every rank reached ``phase`` (and went on)."""
        return phase in self._passed

    def sync(self, phase: str) -> None:
        """Block until every rank reached ``phase``; JobAbortedError if the job failed meanwhile."""
        barrier = self._barriers[phase]
        with self._lock:
            self.reached[phase] = self.reached.get(phase, 0) + 1
        try:
            barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            if phase in self._passed:
                return  # released, then aborted while leaving: the next phase reports it
            if self.reason is None:
                self.abort(f"a rank did not reach '{phase}' within {self.timeout_s:.0f}s")
            raise self._error(phase) from None


R = TypeVar("R")


def run_ranks(
    ranks: dict[int, R],
    body: Callable[[R], None],
    coord: JobCoordinator,
    guard: engine.SignalGuard,
    name: str,
) -> dict[int, BaseException]:
    """``body`` for every rank, each in a thread of its own (named NAME-RANK), joined: a rank's
    own failure aborts the others through ``coord`` (an abort by another rank does not abort
    again), and so does a signal ``guard`` caught. The failures by rank."""
    errors: dict[int, BaseException] = {}

    def run(rank: int, item: R) -> None:
        try:
            body(item)
        except BaseException as exc:
            errors[rank] = exc
            if not isinstance(exc, JobAbortedError):
                coord.abort(_describe(exc), rank, getattr(exc, "exit_code", None))

    threads = [threading.Thread(target=run, args=(i, x), name=f"{name}-{i}") for i, x in ranks.items()]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.1)
        if guard.received is not None and coord.reason is None:
            coord.abort(f"{guard.name} received")
    return errors


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NpusnapError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"


def _rank_callbacks(cb: PipelineCallbacks, rank: int, lock: threading.Lock) -> PipelineCallbacks:
    """Phases and notes prefixed with the rank; byte-level progress is not shown for jobs."""

    def phase(label: str) -> None:
        with lock:
            cb.phase(f"rank {rank}: {label}")

    def note(text: str) -> None:
        with lock:
            cb.note(f"rank {rank}: {text}")

    return PipelineCallbacks(phase=phase, progress=lambda *_a: None, note=note)
