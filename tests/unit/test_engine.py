"""The pipeline engine: order, undo, interruption, barriers, failure enrichment."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import pytest

from npusnap_cli.errors import InterruptedError_, NpusnapError, StateUnknownError, TargetError
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.engine import Pipeline, SignalGuard, Step


@dataclass
class World:
    log: list[str] = field(default_factory=list)


def _step(
    name: str, *, fail: BaseException | None = None, undo_fails: BaseException | None = None
) -> Step[World]:
    def do(w: World) -> None:
        w.log.append(f"do {name}")
        if fail is not None:
            raise fail

    def undo(w: World, _err: BaseException) -> None:
        w.log.append(f"undo {name}")
        if undo_fails is not None:
            raise undo_fails

    return Step(name, do, undo, phase=name)


def test_steps_run_in_order_and_announce_their_phase() -> None:
    phases: list[str] = []
    p = Pipeline("dump", [_step("a"), _step("b")], cb=PipelineCallbacks(phase=phases.append))
    w = p.run(World())
    assert w.log == ["do a", "do b"]
    assert phases == ["a", "b"]
    assert set(p.timings) == {"a", "b"} and p.completed == ["a", "b"]


def test_a_failure_undoes_completed_steps_in_reverse_not_the_failed_one() -> None:
    w = World()
    seen: list[bool] = []

    def enrich(_w: World, err: NpusnapError, undone: bool) -> NpusnapError:
        seen.append(undone)
        err.details["enriched"] = True
        return err

    p = Pipeline("dump", [_step("a"), _step("b"), _step("c", fail=TargetError("gone"))], on_failure=enrich)
    with pytest.raises(TargetError) as info:
        p.run(w)
    assert w.log == ["do a", "do b", "do c", "undo b", "undo a"]
    assert info.value.details["enriched"] is True and seen == [True]


def test_an_undo_that_leaves_the_state_unknown_wins_and_carries_the_original() -> None:
    w = World()
    p = Pipeline(
        "dump",
        [
            _step("a", undo_fails=StateUnknownError("still locked")),
            _step("b"),
            _step("c", fail=TargetError("boom")),
        ],
    )
    with pytest.raises(StateUnknownError) as info:
        p.run(w)
    assert w.log == ["do a", "do b", "do c", "undo b", "undo a"]  # every undo still ran
    assert info.value.details["original_error"] == "boom"


def test_other_undo_problems_are_reported_with_the_original_error() -> None:
    w = World()
    p = Pipeline("dump", [_step("a", undo_fails=OSError("disk")), _step("b", fail=TargetError("boom"))])
    with pytest.raises(TargetError) as info:
        p.run(w)
    assert info.value.details["undo_problems"] == ["a: OSError: disk"]


def test_a_bug_still_undoes_and_is_raised_unchanged() -> None:
    w = World()
    p = Pipeline("dump", [_step("a"), _step("b", fail=KeyError("bug"))])
    with pytest.raises(KeyError):
        p.run(w)
    assert w.log == ["do a", "do b", "undo a"]


def test_skipped_steps_are_not_undone() -> None:
    w = World()
    skipped = Step(
        "s", lambda x: x.log.append("do s"), lambda x, _e: x.log.append("undo s"), when=lambda _w: False
    )
    p = Pipeline("dump", [_step("a"), skipped, _step("b", fail=TargetError("x"))])
    with pytest.raises(TargetError):
        p.run(w)
    assert w.log == ["do a", "do b", "undo a"]


def test_a_signal_during_a_step_finishes_it_then_rolls_back() -> None:
    w = World()
    notes: list[str] = []

    def interrupted(x: World) -> None:
        x.log.append("do b")
        os.kill(os.getpid(), signal.SIGTERM)  # recorded by the guard, the step goes on

    with SignalGuard(notes.append, what="dump") as guard:
        p = Pipeline(
            "dump",
            [_step("a"), Step("b", interrupted, lambda x, _e: x.log.append("undo b")), _step("c")],
            guard=guard,
        )
        with pytest.raises(InterruptedError_) as info:
            p.run(w)
    assert w.log == ["do a", "do b", "undo b", "undo a"]
    assert "SIGTERM" in info.value.message and notes


def test_past_the_commit_nothing_is_interrupted_or_undone() -> None:
    w = World()

    def commit(x: World) -> None:
        x.log.append("do commit")
        os.kill(os.getpid(), signal.SIGINT)

    with SignalGuard() as guard:
        p = Pipeline(
            "dump",
            [_step("a"), Step("commit", commit, commit=True), _step("after", fail=TargetError("late"))],
        )
        p.guard = guard
        with pytest.raises(TargetError):
            p.run(w)
    assert w.log == ["do a", "do commit", "do after"]  # nothing before the commit is undone


def test_a_barrier_is_synced_after_its_step_and_its_failure_undoes() -> None:
    w = World()
    points: list[str] = []

    class Fails:
        def sync(self, point: str) -> None:
            points.append(point)
            if point == "locked":
                raise TargetError("rank 1 failed")

    p = Pipeline(
        "job dump",
        [
            Step(
                "lock", lambda x: x.log.append("lock"), lambda x, _e: x.log.append("unlock"), barrier="locked"
            )
        ],
        barrier=Fails(),
    )
    with pytest.raises(TargetError):
        p.run(w)
    assert points == ["locked"] and w.log == ["lock", "unlock"]


def test_a_checkpoint_names_where_a_signal_stopped_the_pipeline() -> None:
    w = World()

    def interrupted(x: World) -> None:
        x.log.append("do check")
        os.kill(os.getpid(), signal.SIGINT)

    with SignalGuard(what="restore") as guard:
        p = Pipeline(
            "restore",
            [Step("check", interrupted, checkpoint=("before anything was started", "nothing was restored"))],
            guard=guard,
        )
        with pytest.raises(InterruptedError_) as info:
            p.run(w)
    assert info.value.message == "restore interrupted by SIGINT before anything was started"
    assert info.value.details["state"] == "nothing was restored"


def test_past_a_finishing_step_a_signal_is_ignored_but_a_failure_still_undoes() -> None:
    def publish(x: World) -> None:
        x.log.append("do publish")
        os.kill(os.getpid(), signal.SIGINT)  # after the image is published: finish, never undo

    w = World()
    with SignalGuard() as guard:
        Pipeline(
            "dump", [_step("a"), Step("publish", publish, finishing=True), _step("kill")], guard=guard
        ).run(w)
    assert w.log == ["do a", "do publish", "do kill"]

    w = World()
    with SignalGuard() as guard:
        p = Pipeline(
            "dump",
            [_step("a"), Step("publish", publish, finishing=True), _step("kill", fail=TargetError("late"))],
            guard=guard,
        )
        with pytest.raises(TargetError):
            p.run(w)
    assert w.log == ["do a", "do publish", "do kill", "undo a"]


def test_a_phase_may_be_worded_from_the_state() -> None:
    phases: list[str] = []
    w = World(log=["lazy"])
    Pipeline(
        "restore",
        [Step("criu", lambda _x: None, phase=lambda x: "criu restore" + (" (lazy)" if x.log else ""))],
        cb=PipelineCallbacks(phase=phases.append),
    ).run(w)
    assert phases == ["criu restore (lazy)"]
