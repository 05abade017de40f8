"""A child that exits between the tree's resolution and the agents' connection is not part of the
snapshot: the dump goes on without it, and says so. Anything else that fails still fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from npusnap_cli.errors import NpusnapError, TargetError
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.dump import agents
from npusnap_cli.pipelines.dump.options import DumpOptions
from npusnap_cli.pipelines.dump.state import DumpState
from npusnap_cli.pipelines.dump.target import _Target
from npusnap_cli.pipelines.engine import SignalGuard


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid  # reaped: nothing has it now


def _state(npu_pids: tuple[int, ...], notes: list[str]) -> DumpState:
    s = DumpState(
        pid=npu_pids[0],
        final=Path("/nonexistent/img"),
        options=DumpOptions(),
        cb=PipelineCallbacks(note=notes.append),
        guard=SignalGuard(),
        check=None,
        in_job=False,
        published=Path("/nonexistent/img"),
    )
    s.resolved.found = _Target(root_pid=npu_pids[0], tree=(), npu_pids=npu_pids)
    return s


def _failure(*pids: int) -> NpusnapError:
    return TargetError(f"no process with pid {pids[0]}", details={"failures": {str(p): "gone" for p in pids}})


def test_a_child_gone_since_the_resolution_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    root, gone = 1, _dead_pid()
    made: list[tuple[int, ...]] = []

    def group(pids: tuple[int, ...], **_kw: object) -> object:
        made.append(tuple(pids))
        if gone in pids:
            raise _failure(gone)
        return object()

    monkeypatch.setattr(agents, "DeviceGroup", group)
    notes: list[str] = []
    s = _state((root, gone), notes)
    agents._connect(s)
    assert made == [(root, gone), (root,)]
    assert s.target.npu_pids == (root,)
    assert notes and f"{gone} exited before the freeze" in notes[0]


@pytest.mark.parametrize("who", ["root", "alive child", "gone and alive"])
def test_anything_else_still_fails(monkeypatch: pytest.MonkeyPatch, who: str) -> None:
    """The root gone, a living child failing, or a gone child beside a failing living one."""
    root, gone = _dead_pid(), _dead_pid()
    alive = 1  # init: there, and not ours to drop
    failing = {"root": (root,), "alive child": (alive,), "gone and alive": (gone, alive)}[who]

    def group(pids: tuple[int, ...], **_kw: object) -> object:
        raise _failure(*failing)

    monkeypatch.setattr(agents, "DeviceGroup", group)
    s = _state((root, alive, gone), [])
    with pytest.raises(NpusnapError):
        agents._connect(s)
    assert s.target.npu_pids == (root, alive, gone)
