"""The agent wire protocol: encoding, the op allow-list, argument checks, line limits."""

from __future__ import annotations

import json

import pytest

from npusnap_cli.device import protocol
from npusnap_cli.device.protocol import ProtocolError


def test_request_round_trip() -> None:
    line = protocol.encode_request(7, "lock", {"lease_s": 30})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.decode_request(line.rstrip(b"\n")) == (7, "lock", {"lease_s": 30})


def test_response_round_trip() -> None:
    ok = protocol.encode_result(3, {"state": "LOCKED"})
    assert protocol.decode_response(ok.rstrip(b"\n")) == (3, True, {"state": "LOCKED"})
    err = protocol.make_error(protocol.ERR_ACL, "ACL_ERROR_SNAPSHOT_LOCK_FAILED", "lock failed", 507906)
    assert protocol.decode_response(protocol.encode_error(4, err)) == (4, False, err)


@pytest.mark.parametrize(
    ("obj", "name"),
    [
        ({"v": 1, "id": 1, "op": "eval", "args": {"code": "1"}}, "UNKNOWN_OP"),
        ({"v": 1, "id": 1, "op": "lock", "args": {"lease_s": "30"}}, "BAD_ARGS"),
        ({"v": 1, "id": 1, "op": "lock", "args": {"lease_s": True}}, "BAD_ARGS"),
        ({"v": 1, "id": 1, "op": "lock", "args": {"lease_s": -1}}, "BAD_ARGS"),
        ({"v": 1, "id": 1, "op": "hello", "args": {"x": 1}}, "BAD_ARGS"),
        ({"v": 1, "id": 1, "op": "hello", "args": []}, "BAD_ARGS"),
        ({"v": 2, "id": 1, "op": "hello", "args": {}}, "VERSION_MISMATCH"),
        ({"v": 1, "id": "1", "op": "hello"}, "BAD_MESSAGE"),
        ([1, 2], "BAD_MESSAGE"),
    ],
)
def test_bad_requests_are_refused(obj: object, name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        protocol.decode_request(json.dumps(obj).encode())
    assert info.value.name == name


def test_no_op_evaluates_code() -> None:
    assert {
        "hello",
        "status",
        "lock",
        "backup",
        "renew",
        "release",
        "restore",
        "unlock",
        "rollback",
        "hccl_root",
        "hccl_rebuild",
        "copy_wait",
    } == protocol.OPS


def test_not_json() -> None:
    with pytest.raises(ProtocolError) as info:
        protocol.decode_request(b"\xff{")
    assert info.value.name == "BAD_JSON"


def test_line_buffer_splits_and_limits() -> None:
    buf = protocol.LineBuffer(max_line=16)
    buf.feed(b"abc\ndef")
    assert buf.next_line() == b"abc"
    assert buf.next_line() is None
    buf.feed(b"\n")
    assert buf.next_line() == b"def"
    buf.feed(b"x" * 17)
    with pytest.raises(ProtocolError) as info:
        buf.next_line()
    assert info.value.name == "LINE_TOO_LONG"


def test_oversized_message_is_refused_when_encoding() -> None:
    with pytest.raises(ProtocolError):
        protocol.encode_result(1, {"blob": "x" * protocol.MAX_LINE})
