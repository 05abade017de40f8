"""Replay the protocol transcripts (tests/data/protocol/*.jsonl) against the native agent.

Each transcript runs on a fresh workload on the simulated NPU, over one connection, byte for
byte as written; the requests are also fed to ``protocol.decode_request`` so the CLI's codec and
the agent agree on what is valid. See tests/data/protocol/README.md for the format.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.device import protocol
from tests.integration.agentlib import Sim, Workload, start_agent_workload

pytestmark = pytest.mark.integration

TRANSCRIPTS = sorted((Path(__file__).resolve().parents[1] / "data" / "protocol").glob("*.jsonl"))
PLACEHOLDERS = {
    "<any>": lambda v: True,
    "<str>": lambda v: isinstance(v, str),
    "<int>": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "<num>": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "<token>": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{32}", v) is not None,
    "<iso>": lambda v: isinstance(v, str) and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", v) is not None,
}


def substitute(obj: Any, saved: dict[str, Any]) -> Any:
    if isinstance(obj, str) and obj.startswith("$") and obj[1:] in saved:
        return saved[obj[1:]]
    if isinstance(obj, dict):
        return {k: substitute(v, saved) for k, v in obj.items()}
    if isinstance(obj, list):
        return [substitute(v, saved) for v in obj]
    return obj


def matches(expected: Any, actual: Any, where: str = "") -> None:
    if isinstance(expected, str) and expected in PLACEHOLDERS:
        assert PLACEHOLDERS[expected](actual), f"{where}: {actual!r} is not {expected}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected an object, got {actual!r}"
        for key, value in expected.items():
            assert key in actual, f"{where}: no member {key!r} in {actual}"
            matches(value, actual[key], f"{where}.{key}")
    else:
        assert expected == actual, f"{where}: {actual!r} != {expected!r}"


def dig(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part]
    return obj


class Conn:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.buf = b""

    def roundtrip(self, line: bytes) -> dict[str, Any]:
        try:
            self.sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at accept time (BUSY): the refusal line is still there to read
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "the agent closed the connection"
            self.buf += chunk
        reply, self.buf = self.buf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(reply)
        return result

    def close(self) -> None:
        self.sock.close()


def check_codec(line: bytes, expected: dict[str, Any]) -> None:
    """The Python codec accepts exactly the requests the agent accepts (protocol errors only)."""
    error = expected.get("error") or {}
    try:
        protocol.decode_request(line.rstrip(b"\n"))
    except protocol.ProtocolError as exc:
        assert error.get("type") == "protocol", f"protocol.py refused a valid request: {exc.name}"
        assert exc.name == error.get("name"), f"protocol.py says {exc.name}, the agent {error.get('name')}"
        if "message" in error:
            assert exc.message == error["message"]
    else:
        assert error.get("type") != "protocol", f"protocol.py accepted what the agent refuses: {error}"


@pytest.mark.parametrize("transcript", TRANSCRIPTS, ids=lambda p: p.stem)
def test_transcript(
    transcript: Path, sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    conn = Conn(runtime_dir / f"{w.pid}.sock")
    saved: dict[str, Any] = {"pid": w.pid}
    try:
        for n, raw in enumerate(transcript.read_text().splitlines(), 1):
            if not raw.strip():
                continue
            step = json.loads(raw)
            send = substitute(step["send"], saved)
            line = (
                send if isinstance(send, str) else json.dumps(send, separators=(",", ":"))
            ).encode() + b"\n"
            expected = substitute(step["expect"], saved)
            check_codec(line, expected)
            reply = conn.roundtrip(line)
            matches(expected, reply, f"{transcript.name}:{n} ({step.get('note', '')})")
            for name, path in step.get("save", {}).items():
                saved[name] = dig(reply, path)
    finally:
        conn.close()


def test_line_too_long_is_refused_and_dropped(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    conn = Conn(runtime_dir / f"{w.pid}.sock")
    try:
        reply = conn.roundtrip(b"x" * (protocol.MAX_LINE + 10))
        assert reply["ok"] is False and reply["error"]["name"] == "LINE_TOO_LONG"
        try:
            rest = conn.sock.recv(10)
        except ConnectionResetError:  # closed with our unread bytes still queued
            rest = b""
        assert rest == b"", "the connection must be closed after a line too long"
    finally:
        conn.close()


def test_partial_line_client_is_dropped_and_others_get_in(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    path = runtime_dir / f"{w.pid}.sock"
    stuck = Conn(path)
    try:
        stuck.sock.sendall(b'{"v": 1, "id": 1, "op": "hel')  # and then nothing
        time.sleep(0.3)
        other = Conn(path)
        busy = other.roundtrip(b'{"v":1,"id":2,"op":"status"}\n')
        other.close()
        assert busy["error"]["name"] == "BUSY"
        start = time.monotonic()
        assert stuck.sock.recv(10) == b"", "the idle partial client was not dropped"
        assert time.monotonic() - start < 5
        after = Conn(path)
        assert after.roundtrip(b'{"v":1,"id":3,"op":"status"}\n')["ok"] is True
        after.close()
    finally:
        stuck.close()
