"""A child forked a moment before the dump (holding only its parent's agent socket) that exits
between the tree's resolution and the agents' connection is not part of the snapshot: the dump
goes on without it, and says so. Anything else that fails still fails: a rank with an agent of
its own that dies meanwhile, the root, a living process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from npusnap_cli.host.proctree import ProcInfo
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.dump import agents
from npusnap_cli.pipelines.dump import target as target_mod
from npusnap_cli.pipelines.dump.options import DumpOptions
from npusnap_cli.pipelines.dump.state import DumpState
from npusnap_cli.pipelines.dump.target import _Target
from npusnap_cli.pipelines.engine import SignalGuard


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid  # reaped: nothing has it now


def _state(npu_pids: tuple[int, ...], notes: list[str], borrowed: tuple[int, ...] = ()) -> DumpState:
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
    s.resolved.found = _Target(root_pid=npu_pids[0], tree=(), npu_pids=npu_pids, borrowed_socket=borrowed)
    return s


def test_a_forked_child_gone_since_the_resolution_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    root, gone = 1, _dead_pid()
    made: list[tuple[int, ...]] = []
    monkeypatch.setattr(agents, "DeviceGroup", lambda pids, **_kw: made.append(tuple(pids)))
    notes: list[str] = []
    s = _state((root, gone), notes, borrowed=(gone,))
    agents._connect(s)
    assert made == [(root,)]
    assert s.target.npu_pids == (root,)
    assert notes and f"{gone} exited before the freeze" in notes[0]


@pytest.mark.parametrize("who", ["a rank of its own", "the root", "a living child"])
def test_anyone_else_is_asked(monkeypatch: pytest.MonkeyPatch, who: str) -> None:
    """A process with an agent of its own that is gone (a rank killed mid-dump), the root, or a
    child still alive stay in the group: connecting to them fails the dump, loudly."""
    root, rank = _dead_pid(), _dead_pid()
    alive = 1  # init: there
    borrowed = {"a rank of its own": (), "the root": (root,), "a living child": (alive,)}[who]
    made: list[tuple[int, ...]] = []
    monkeypatch.setattr(agents, "DeviceGroup", lambda pids, **_kw: made.append(tuple(pids)))
    notes: list[str] = []
    s = _state((root, alive, rank), notes, borrowed=borrowed)
    agents._connect(s)
    assert made == [(root, alive, rank)] and notes == []


def test_a_child_without_an_agent_gone_before_its_attach_is_left_out() -> None:
    """A freshly forked NPU child with no agent yet, that exits before the dump attaches one, is
    no part of what CRIU freezes: the dump goes on and says so (no "no process with pid")."""
    gone = _dead_pid()
    child = ProcInfo(
        pid=gone,
        ppid=os.getpid(),
        depth=1,
        uid=0,
        name="python",
        cmdline=("python",),
        agent_socket=None,
        acl_library="/opt/cann/lib64/libascendcl.so",
    )
    notes: list[str] = []
    target = _Target(root_pid=os.getpid(), tree=(child,), npu_pids=(gone,))
    refreshed = target_mod.attach_missing(target, note=notes.append)
    assert gone not in refreshed.npu_pids
    assert any(f"pid {gone} exited before it could be attached" in n for n in notes), notes
