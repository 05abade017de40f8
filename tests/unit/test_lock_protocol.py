"""Lock ownership in the agent (docs/internals.md, "Lock ownership"), driven through ``dispatch``
with a fake runtime: the exact errors, what changes and what does not. No device, no root."""

from __future__ import annotations

import re
from typing import Any, Optional

import pytest

from npusnap_cli import protocol
from npusnap_cli.agent.server import BACKED_UP, LOCKED, RUNNING, Agent, OpError


class FakeRuntime:
    path = "/fake/libacl_rt.so"
    version = "9.1.0"

    def __init__(self) -> None:
        self.st = RUNNING
        self.calls: list[str] = []

    def state(self) -> Optional[int]:
        return self.st

    def lock(self) -> None:
        self.calls.append("lock")
        self.st = LOCKED

    def backup(self) -> None:
        self.calls.append("backup")
        self.st = BACKED_UP

    def restore(self) -> None:
        self.calls.append("restore")

    def unlock(self) -> None:
        self.calls.append("unlock")
        self.st = RUNNING

    def devices(self) -> list[int]:
        return [0]


@pytest.fixture
def agent(tmp_path: Any) -> tuple[Agent, FakeRuntime]:
    rt = FakeRuntime()
    return Agent(socket_path=tmp_path / "1.sock", runtime_finder=lambda: rt), rt


def _refused(a: Agent, op: str, args: dict[str, Any]) -> dict[str, Any]:
    protocol.validate_args(op, args)
    with pytest.raises(OpError) as exc:
        a.dispatch(op, args)
    return exc.value.error


def test_lock_records_the_owner_and_answers_a_token(agent: tuple[Agent, FakeRuntime]) -> None:
    a, _rt = agent
    res = a.dispatch("lock", {"lease_s": 30, "owner": {"command": "freeze", "pid": 4242}})
    assert re.fullmatch(r"[0-9a-f]{32}", res["token"])
    assert res["owner"]["command"] == "freeze" and res["owner"]["pid"] == 4242
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", res["owner"]["since"])
    assert a.dispatch("status", {})["owner"] == res["owner"]
    assert a.dispatch("hello", {})["owner"] == res["owner"]


def test_a_second_lock_is_refused_and_changes_nothing(agent: tuple[Agent, FakeRuntime]) -> None:
    a, rt = agent
    first = a.dispatch("lock", {"owner": {"command": "freeze", "pid": 1}})
    err = _refused(a, "lock", {"owner": {"command": "dump", "pid": 2}})
    assert err["type"] == "state" and err["name"] == protocol.ALREADY_LOCKED
    assert (
        err["owner"] == first["owner"]
        and "freeze" in err["message"]
        and first["owner"]["since"] in err["message"]
    )
    assert rt.calls == ["lock"] and a.owner == first["owner"]


def test_ops_without_the_token_are_refused(agent: tuple[Agent, FakeRuntime]) -> None:
    a, rt = agent
    token = a.dispatch("lock", {"lease_s": 30, "owner": {"command": "dump", "pid": 7}})["token"]
    for op, args in [
        ("backup", {}),
        ("backup", {"token": "0" * 32}),
        ("renew", {}),
        ("release", {}),
        ("restore", {}),
        ("unlock", {}),
        ("rollback", {"token": token[::-1]}),
    ]:
        err = _refused(a, op, args)
        assert err["name"] == protocol.NOT_OWNER and err["owner"]["pid"] == 7, op
    assert rt.calls == ["lock"] and rt.st == LOCKED and a.lease.active
    assert a.dispatch("backup", {"token": token})["state"] == "BACKED_UP"
    assert a.dispatch("unlock", {"token": token})["state"] == "RUNNING"
    assert a.owner is None
    # Unowned again: a new lock works, and rollback without a token is fine with no owner.
    a.dispatch("lock", {})
    assert a.owner is not None and a.owner["command"] == "unknown"


def test_force_takes_the_lock_away_and_is_logged(agent: tuple[Agent, FakeRuntime]) -> None:
    a, rt = agent
    a.dispatch("lock", {"owner": {"command": "dump", "pid": 7}})
    a.dispatch("rollback", {"force": True})
    assert rt.st == RUNNING and a.owner is None
    assert any("forced" in e for e in a.events)
    a.dispatch("lock", {"owner": {"command": "freeze", "pid": 8}})
    a.dispatch("unlock", {"force": True})
    assert rt.st == RUNNING and a.owner is None


def test_the_lease_firing_clears_the_owner(agent: tuple[Agent, FakeRuntime]) -> None:
    a, rt = agent
    a.dispatch("lock", {"lease_s": 1, "owner": {"command": "dump", "pid": 7}})
    a.do_rollback()  # what the watchdog does when the lease runs out
    assert rt.st == RUNNING and a.owner is None


def test_an_external_lock_without_owner_is_already_locked(agent: tuple[Agent, FakeRuntime]) -> None:
    a, rt = agent
    rt.st = LOCKED  # locked by something that is not an npusnap agent client
    err = _refused(a, "lock", {"owner": {"command": "dump", "pid": 2}})
    assert err["name"] == protocol.ALREADY_LOCKED and err["owner"] is None
    assert rt.calls == []


@pytest.mark.parametrize(
    "args",
    [
        {"owner": {"command": "", "pid": 1}},
        {"owner": {"command": "x", "pid": 0}},
        {"owner": {"command": "x", "pid": True}},
        {"owner": {"command": "x", "pid": 1, "extra": 1}},
        {"owner": "dump"},
    ],
)
def test_owner_argument_is_validated(args: dict[str, Any]) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.validate_args("lock", args)


def test_force_must_be_a_boolean_and_token_a_string() -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.validate_args("unlock", {"force": 1})
    with pytest.raises(protocol.ProtocolError):
        protocol.validate_args("backup", {"token": 5})
    with pytest.raises(protocol.ProtocolError):
        protocol.validate_args("backup", {"force": True})  # only unlock and rollback take force
