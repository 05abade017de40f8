"""Agent pieces that need no target: the run-time lease, hook registry, socket directory checks."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from npusnap_cli.agent import hooks as hooks_mod
from npusnap_cli.agent.lease import FREEZE_GAP, TICK, Lease
from npusnap_cli.agent.server import Agent, _ensure_private_dir, read_start_time


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lease_counts_run_time_and_expires() -> None:
    clock = Clock()
    lease = Lease(clock)
    lease.grant(1.0)
    for _ in range(9):
        clock.now += TICK
        assert lease.tick() is False
    clock.now += TICK + 0.001
    assert lease.tick() is True
    assert lease.active is False and lease.expired_duration == 1.0


def test_lease_ignores_a_freeze_gap() -> None:
    clock = Clock()
    lease = Lease(clock)
    lease.grant(1.0)
    clock.now += 3600  # frozen by CRIU for an hour
    assert lease.tick() is False
    assert lease.remaining is not None and lease.remaining == pytest.approx(1.0 - TICK)
    assert lease.frozen_gaps == 1
    clock.now += FREEZE_GAP * 0.9  # a slow tick on a busy host still counts
    assert lease.tick() is False
    assert lease.remaining == pytest.approx(1.0 - TICK - FREEZE_GAP * 0.9)


def test_lease_renew_release_void_and_skip_gap() -> None:
    clock = Clock()
    lease = Lease(clock)
    assert lease.renew() is False
    lease.grant(2.0)
    clock.now += 0.5
    lease.tick()
    assert lease.renew() is True and lease.remaining == 2.0
    clock.now += 0.9
    lease.skip_gap()  # an operation ran: not silence
    assert lease.tick() is False and lease.remaining == 2.0
    lease.void("restored")
    assert not lease.active and lease.voided_reason == "restored"
    lease.release()
    assert lease.info()["active"] is False


def test_hook_registry_runs_in_order_and_reports_the_failing_hook() -> None:
    reg = hooks_mod.HookRegistry()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")

    def broken() -> None:
        raise ValueError("no weights")

    reg.register("pre_lock", first)
    reg.register("pre_lock", broken, name="broken-hook")
    assert reg.names()["pre_lock"] == [
        f"{__name__}.test_hook_registry_runs_in_order_and_reports_the_failing_hook.<locals>.first",
        "broken-hook",
    ]
    with pytest.raises(hooks_mod.HookFailed) as info:
        reg.run("pre_lock")
    assert ran == ["first"]
    assert (info.value.stage, info.value.hook, info.value.error) == (
        "pre_lock",
        "broken-hook",
        "ValueError: no weights",
    )
    assert reg.unregister("pre_lock", broken) is True
    assert reg.run("pre_lock") == [reg.names()["pre_lock"][0]]
    with pytest.raises(ValueError):
        reg.register("pre_backup", first)


def test_private_dir_is_created_0700_and_checked(tmp_path: Path) -> None:
    d = tmp_path / "npusnap"
    old = os.umask(0o177)  # would leave a 0600 directory without the explicit chmod
    try:
        _ensure_private_dir(d)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(PermissionError, match="not 700"):
        _ensure_private_dir(loose)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(PermissionError, match="symlink"):
        _ensure_private_dir(link)


def test_bind_replaces_a_stale_socket_but_never_a_file(tmp_path: Path) -> None:
    d = tmp_path / "npusnap"
    d.mkdir(mode=0o700)
    path = d / "1.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays behind, like after a crash
    agent = Agent(socket_path=path, runtime_finder=lambda: None)
    agent.bind()
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    finally:
        agent.stop()
    assert not path.exists()
    path.write_text("not a socket")
    agent = Agent(socket_path=path, runtime_finder=lambda: None)
    with pytest.raises(OSError, match="not a socket"):
        agent.bind()
    assert path.read_text() == "not a socket"


def test_start_time_is_read_from_proc() -> None:
    assert isinstance(read_start_time(), int)
    assert read_start_time(str(os.getpid())) == read_start_time()


def test_run_leaves_only_a_foreign_session(monkeypatch: pytest.MonkeyPatch) -> None:
    from npusnap_cli.agent import launch

    calls: list[str] = []
    monkeypatch.setattr(os, "setsid", lambda: calls.append("setsid"))
    monkeypatch.setattr(os, "getsid", lambda pid: 4242)
    assert launch.leave_foreign_session() is None and calls == []  # a session we can see: kept

    monkeypatch.setattr(os, "getsid", lambda pid: 0)
    note = launch.leave_foreign_session()
    assert calls == ["setsid"] and note is not None and "new session" in note

    def refuse() -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setsid", refuse)
    note = launch.leave_foreign_session()
    assert note is not None and "cannot be dumped" in note and "setsid" in note
