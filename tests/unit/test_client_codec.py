"""The agent's C client codec (native/agent/client.c: what the CRIU plugin speaks through) against
the CLI's Python codec (npusnap_cli/device/protocol.py).

Every well-formed request of the protocol transcripts (tests/data/protocol/*.jsonl), and a set of
responses, good and malformed, go through both: the C side must send the same request or refuse
it with the same error name, and read a response as the Python side does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.device import protocol

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "protocol"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc): scripts/setup.sh installs one to build native/")
    exe = tmp_path_factory.mktemp("codec") / "client_codec"
    agent = REPO / "native" / "agent"
    sources = [DATA / "client_codec.c", agent / "client.c", agent / "proto.c", agent / "json.c"]
    flags = [
        "-std=gnu11",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{agent}",
        f"-I{REPO / 'native' / 'include'}",
    ]
    subprocess.run([cc, *flags, *map(str, sources), "-lm", "-o", str(exe)], check=True, timeout=120)
    return exe


def run(driver: Path, commands: list[list[Any]]) -> list[dict[str, Any]]:
    text = "".join(json.dumps(c) + "\n" for c in commands)
    out = subprocess.run([str(driver)], input=text, capture_output=True, text=True, timeout=30, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def transcript_requests() -> list[tuple[int, str, dict[str, Any]]]:
    reqs = []
    for path in sorted(DATA.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            send = json.loads(line).get("send")
            if not isinstance(send, dict) or send.get("v") != 1 or not isinstance(send.get("op"), str):
                continue
            msg_id, args = send.get("id"), send.get("args", {})
            if isinstance(msg_id, int) and not isinstance(msg_id, bool) and isinstance(args, dict):
                reqs.append((msg_id, send["op"], args))
    return reqs


EXTRA_REQUESTS: list[tuple[int, str, dict[str, Any]]] = [
    (1, "lock", {"lease_s": 30, "owner": {"command": "criu-plugin", "pid": 7}, "device_memory": "app"}),
    (2, "lock", {"device_memory": "keep"}),
    (3, "backup", {"lease_s": 0, "token": "ab"}),
    (4, "backup", {"lease_s": 30.5, "token": "x" * 65}),
    (5, "restore", {"token": "t", "device_memory_file": "relative/path"}),
    (6, "rollback", {"force": True}),
    (7, "rollback", {"force": 1}),
    (8, "unlock", {"token": None}),
    (9, "status", {"token": "t"}),
]


def test_requests_agree(driver: Path) -> None:
    reqs = transcript_requests() + EXTRA_REQUESTS
    assert len(reqs) > 20
    answers = run(driver, [["req", i, op, args] for i, op, args in reqs])
    for (msg_id, op, args), got in zip(reqs, answers, strict=True):
        try:
            line = protocol.encode_request(msg_id, op, args)
        except protocol.ProtocolError as exc:
            assert got.get("refused") == exc.name, (op, args, got)
            continue
        assert "line" in got, (op, args, got)
        assert json.loads(got["line"]) == json.loads(line), (op, args)
        assert protocol.decode_request(got["line"].encode()) == (msg_id, op, args)


RESPONSES = [
    protocol.encode_result(7, {"token": "ab" * 16}),
    protocol.encode_error(
        8, protocol.make_error(protocol.ERR_STATE, "ALREADY_LOCKED", "held", owner={"pid": 1})
    ),
    protocol.encode_error(
        9, protocol.make_error(protocol.ERR_ACL, "ACL_ERROR_SNAPSHOT_LOCK_FAILED", "m", 507906)
    ),
    b'{"v":1,"id":1,"ok":true}',
    b'{"v":1,"id":1,"ok":"yes","result":{}}',
    b'{"v":1,"id":1,"ok":false,"error":{"type":"state","message":"no name"}}',
    b'{"v":2,"id":1,"ok":true,"result":{}}',
    b'{"v":1,"id":"1","ok":true,"result":{}}',
    b'{"v":1,"id":1,"ok":true,"result":[]}',
    b"[1,2]",
    b"not json",
]


def test_responses_agree(driver: Path) -> None:
    answers = run(driver, [["resp", line.rstrip(b"\n").decode()] for line in RESPONSES])
    for line, got in zip(RESPONSES, answers, strict=True):
        try:
            msg_id, ok, body = protocol.decode_response(line.rstrip(b"\n"))
        except protocol.ProtocolError as exc:
            assert got.get("malformed", "").startswith(exc.name + ":"), (line, got)
            continue
        want = {"ok": ok, "id": msg_id, "type": "", "name": "", "message": ""}
        if not ok:
            want.update(type=body["type"], name=body["name"], message=body["message"])
        assert got == want, line
