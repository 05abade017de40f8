"""The pipeline engine: dump, restore, freeze and thaw are each a list of steps run here.

A step does one thing and, where it changed something, says how to undo it. The engine owns what
every pipeline needs and none should write again:

- the signal guard: Ctrl-C / SIGTERM / SIGHUP are recorded, never cut a step in half, and turn
  into a rollback at the next safe point (after a step, until one commits);
- the phase announcements (``PipelineCallbacks.phase``) and the time each step took;
- barriers between steps, for the members (ranks) of a job run side by side;
- undo, in reverse order, of every step that completed, when a later one fails; an undo that
  leaves the job in an unknown state wins over the original failure, which it carries;
- failure enrichment: one hook sees every ``NpusnapError`` on its way out.

A job is the same list of steps run once per member, each in its own thread, with a shared
``Barrier`` (``pipelines/jobsnap/``'s coordinator): a rank that fails aborts the barrier and
every other rank undoes what it did.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Generic, Optional, Protocol, TypeVar, Union

from npusnap_cli.errors import InterruptedError_, NpusnapError, StateUnknownError, settle_no_space
from npusnap_cli.pipelines.callbacks import PhaseFn, PipelineCallbacks, no_phase

S = TypeVar("S")  # a pipeline's state: what its steps share (targets, the temporary image, ...)
# A step for a state serves any state that extends it (a job's rank state extends the restore's).
S_contra = TypeVar("S_contra", contravariant=True)


class SignalGuard:
    """Catch SIGINT/SIGTERM/SIGHUP for the pipeline's duration and remember them.

    The handler only records the signal: a step in progress (a device call, CRIU, a rename) is
    never cut in half. ``check()`` at the safe points between steps turns it into a rollback.
    Handlers can be installed only from the main thread; elsewhere (a rank of a job) the guard
    of the main thread's pipeline is shared instead.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, note: PhaseFn = no_phase, what: str = "dump") -> None:
        self.what = what
        self.received: Optional[int] = None
        self._old: dict[int, Any] = {}
        self._note = note

    def _handler(self, signum: int, _frame: Optional[FrameType]) -> None:
        first = self.received is None
        self.received = signum
        with contextlib.suppress(Exception):
            if first:
                self._note(f"{signal.Signals(signum).name} received: finishing the current step")
            else:
                # Said every time: a second Ctrl-C that prints nothing looks like a hang.
                self._note(
                    f"{signal.Signals(signum).name} again: still finishing the current step, then "
                    f"rolling back; the {self.what} cannot be cut short safely (the job would stay locked)"
                )

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def check(self, where: str, state: str) -> None:
        if self.received is not None:
            raise InterruptedError_(
                f"{self.what} interrupted by {self.name} {where}",
                why="Ctrl-C or SIGTERM",
                fix=f"rerun the {self.what} when ready",
                details={"state": state},
            )


class Barrier(Protocol):
    """Every member of a job reaches ``point`` before any goes on; raises when one failed."""

    def sync(self, point: str) -> None: ...


@dataclass(frozen=True)
class Step(Generic[S_contra]):
    """One step of a pipeline.

    ``do`` changes the world; ``undo`` (given the failure) puts it back and runs only if ``do``
    completed and a later step failed: a ``do`` that fails cleans up after itself. ``phase`` is
    announced before ``do`` (None: the step belongs to the phase announced before it; a function:
    the label depends on the state, e.g. "criu restore (lazy pages)"). ``barrier``
    is synced after ``do``. ``when`` skips the step (and its undo) unless it says yes.
    ``commit``: the job's new state is committed by this step (an image published, a tree
    released): once it completed, nothing before it is undone and a signal no longer rolls back.
    ``checkpoint``: (where, state) that a signal caught right after this step reports, instead
    of ("during NAME", "rolled back"), e.g. ("before anything was started", "nothing was restored").
    ``finishing``: once this step completed, a signal no longer rolls back (the pipeline runs to
    its end: an image once published is not thrown away for a Ctrl-C), yet a later failure still
    undoes every step, unlike ``commit``.
    """

    name: str
    do: Callable[[S_contra], None]
    undo: Optional[Callable[[S_contra, BaseException], None]] = None
    phase: Union[str, Callable[[S_contra], str], None] = None
    barrier: Optional[str] = None
    when: Optional[Callable[[S_contra], bool]] = None
    commit: bool = False
    checkpoint: Optional[tuple[str, str]] = None
    finishing: bool = False


def describe(exc: BaseException) -> str:
    return exc.message if isinstance(exc, NpusnapError) else f"{type(exc).__name__}: {exc}"


@dataclass
class Pipeline(Generic[S]):
    """Run ``steps`` over a state; see the module's docstring for what it owns."""

    what: str  # "dump", "restore", "freeze", "thaw": in interruption messages
    steps: Sequence[Step[S]]
    cb: PipelineCallbacks = field(default_factory=PipelineCallbacks)
    guard: Optional[SignalGuard] = None
    barrier: Optional[Barrier] = None
    # Sees every NpusnapError on its way out (after undo): adds logs, what was rolled back, ...
    on_failure: Optional[Callable[[S, NpusnapError, bool], NpusnapError]] = None
    timings: dict[str, float] = field(default_factory=dict)
    completed: list[str] = field(default_factory=list)

    def run(self, state: S) -> S:
        done: list[Step[S]] = []
        committed = False
        finishing = False  # a signal no longer rolls back
        for step in self.steps:
            if step.when is not None and not step.when(state):
                continue
            try:
                if step.phase is not None:
                    self.cb.phase(step.phase if isinstance(step.phase, str) else step.phase(state))
                start = time.monotonic()
                try:
                    step.do(state)
                finally:
                    self.timings[step.name] = self.timings.get(step.name, 0.0) + time.monotonic() - start
                self.completed.append(step.name)
                if step.commit:
                    committed = True
                    done.clear()
                else:
                    done.append(step)
                finishing = finishing or step.finishing
                if step.barrier is not None and self.barrier is not None:
                    self.barrier.sync(step.barrier)
                if not committed and not finishing and self.guard is not None:
                    where, what = step.checkpoint or (f"during {step.name}", "rolled back")
                    self.guard.check(where, what)
            except NpusnapError as err:
                # A full disk is reported as such (exit 3) whichever step's write it broke.
                raise self._fail(state, done, settle_no_space(err) or err) from None
            except Exception as exc:
                settled = settle_no_space(exc)
                if settled is not None:
                    raise self._fail(state, done, settled) from None
                # A bug: still never leave the job changed.
                self._undo(state, done, exc)
                raise
            except BaseException as exc:
                # A KeyboardInterrupt past the guard: still never leave the job changed.
                self._undo(state, done, exc)
                raise
        return state

    def _undo(self, state: S, done: list[Step[S]], err: BaseException) -> tuple[bool, list[str]]:
        """Undo ``done`` in reverse. Returns (every undo succeeded, problems); raises the first
        StateUnknownError an undo raised, once every other undo has run."""
        unknown: Optional[StateUnknownError] = None
        problems: list[str] = []
        for step in reversed(done):
            if step.undo is None:
                continue
            try:
                step.undo(state, err)
            except StateUnknownError as exc:
                exc.details.setdefault("original_error", describe(err))
                unknown = unknown or exc
            except Exception as exc:  # every undo runs; each failure is reported
                problems.append(f"{step.name}: {describe(exc)}")
        if unknown is not None:
            if problems:
                unknown.details["undo_problems"] = problems
            raise unknown
        return not problems, problems

    def _fail(self, state: S, done: list[Step[S]], err: NpusnapError) -> NpusnapError:
        try:
            undone, problems = self._undo(state, done, err)
        except StateUnknownError as unknown:
            return self.on_failure(state, unknown, False) if self.on_failure else unknown
        if problems:
            err.details["undo_problems"] = problems
        if isinstance(err, StateUnknownError):
            undone = False
        return self.on_failure(state, err, undone) if self.on_failure else err
