"""The agent's replies, decoded by the records generated from the contract (npusnap_cli/replies.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from npusnap_cli import contract
from npusnap_cli import replies as agent_replies
from npusnap_cli.device import protocol
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import AgentError
from tests import replies

LOCK: dict[str, Any] = {
    "state": "LOCKED",
    "lease": {"active": True, "lease_s": 60.0, "remaining_s": 59.5, "voided_reason": None, "frozen_gaps": 0},
    "owner": replies.OWNER,
    "elapsed_s": 0.25,
    "runtime_lock_s": 0.01,
    "device_copy_s": 0.2,
    "drain_s": 0,  # an integer is a number too
    "hooks_run": ["app.save"],
    "token": "ab" * 16,
    "device_memory": {
        "available": True,
        "mode": "preserve",
        "saved": True,
        "flow": "legacy",
        "file_bytes": 4096,
        "devices": [0, 1],
        "allocations": 2,
        "bytes": 4096,
        "saved_bytes": 0,
        "excluded_bytes": 0,
        "vmm_bytes": 0,
        "reserved_bytes": 0,
        "interposed": True,
        "gate_closed": False,
        "tracking": {
            "epoch": 3,
            "app_bytes": 0,
            "marks_all": 0,
            "all_why": None,
            "untracked": None,
            "lineage": [["00000000000000aa", 1]],
            "save": {
                "id": "00000000000000ab",
                "epoch": 3,
                "since_used": True,
                "pieces": 9,
                "unchanged": "ff01",
            },
        },
    },
    "callback_devices": [0],
    "callback": "registered",
    "no_device": False,
}


def test_a_good_reply_is_decoded_and_given_back_as_it_came() -> None:
    lock = agent_replies.LockReply.from_json(json.loads(json.dumps(LOCK)))
    assert lock.token == "ab" * 16 and lock.owner is not None and lock.owner.pid == 4242
    tracking = lock.device_memory.tracking
    assert tracking is not None and tracking.lineage == (("00000000000000aa", 1),)
    assert tracking.save is not None and tracking.save.unchanged == "ff01"
    assert lock.device_memory.fallback is None and lock.device_memory.steps is None
    # Members in the agent's order, the left-out ones still left out.
    assert json.dumps(lock.to_json()) == json.dumps(LOCK)
    assert agent_replies.LockReply.from_json(lock.to_json()) == lock
    assert hash(lock) == hash(agent_replies.LockReply.from_json(LOCK))


def test_a_missing_member_is_named_with_its_op() -> None:
    status = replies.merged(replies.STATUS, {})
    del status["lease"]
    with pytest.raises(protocol.ProtocolError) as exc:
        agent_replies.StatusReply.from_json(status)
    assert exc.value.name == contract.E_BAD_MESSAGE
    assert exc.value.message == "status reply: no member 'lease'"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"device_memory": {"bytes": "4096"}},
            "lock reply.device_memory.bytes: expected an integer, got a string",
        ),
        ({"no_device": 0}, "lock reply.no_device: expected a boolean, got an integer"),
        ({"elapsed_s": True}, "lock reply.elapsed_s: expected a number, got a boolean"),
        ({"token": 7}, "lock reply.token: expected a string, got an integer"),
        ({"callback_devices": [0, None]}, "lock reply.callback_devices[1]: expected an integer, got null"),
        ({"owner": ["dump"]}, "lock reply.owner: expected an object, got a list"),
        ({"lease": None}, "lock reply.lease: expected an object, got null"),
        (
            {"device_memory": {"tracking": {"lineage": [["aa"]]}}},
            "lock reply.device_memory.tracking.lineage[0]: expected a list of 2, got a list",
        ),
    ],
)
def test_a_member_of_the_wrong_type_is_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(protocol.ProtocolError) as exc:
        agent_replies.LockReply.from_json(replies.merged(LOCK, change))
    assert exc.value.message == message


def test_the_error_object_keeps_a_null_owner_apart_from_none() -> None:
    locked = {"code": 0, "message": "m", "name": "ALREADY_LOCKED", "type": "state", "owner": None}
    assert agent_replies.ErrorReply.from_json(locked).to_json() == locked
    plain = {"code": 507906, "message": "m", "name": "ACL_ERROR_SNAPSHOT_LOCK_FAILED", "type": "acl"}
    assert agent_replies.ErrorReply.from_json(plain).to_json() == plain
    hook = dict(plain, type="hook", hook="app.h", stage="pre_lock", exception="ValueError")
    decoded = agent_replies.ErrorReply.from_json(hook)
    assert (decoded.stage, decoded.owner, decoded.owner_sent) == ("pre_lock", None, False)


def test_records_are_frozen() -> None:
    hello = replies.hello()
    with pytest.raises(AttributeError):
        hello.pid = 1  # type: ignore[misc]


def test_every_op_has_its_reply_record() -> None:
    assert set(agent_replies.REPLIES) == set(contract.PROTOCOL_OPS)


def test_the_client_calls_a_reply_of_the_wrong_shape_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    client = AgentClient(4242, connect=False)
    monkeypatch.setattr(client, "_request", lambda *a, **kw: dict(replies.STATUS, events="none"))
    with pytest.raises(AgentError) as exc:
        client.status()
    assert "malformed answer to 'status'" in exc.value.message
    assert "status reply.events: expected a list, got a string" in exc.value.message
