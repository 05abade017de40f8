"""The native agent's line reader against garbage: every line gets an answer (or the connection
is dropped for a line too long), and the agent keeps serving and the job keeps computing."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

from tests.integration.agentlib import Sim, Workload, start_agent_workload

pytestmark = pytest.mark.integration

SEEDS = [
    b"{",
    b"}",
    b'{"v":1,"id":1,"op":"status","args":{"a":' + b"[" * 5000 + b"]" * 5000 + b"}}",
    b'{"v":1,"id":1,"op":"' + b"\\u0000" * 10 + b'"}',
    b'{"v":1,"id":99999999999999999999999,"op":"status"}',
    b'{"v":1,"id":-1,"op":"status","args":{"lease_s":1e999}}',
    b'{"v":1.0,"id":3,"op":"status"}',
    b'"\\ud800"',
    b"\xff\xfe\x00",
    b'{"v":1,"id":4,"op":"lock","args":{"owner":{"command":"x","pid":1.5}}}',
    b'{"v":1,"id":5,"op":"status","args":{}, "v": 2}',
    b"nul\x00l",
]


def read_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return buf
        buf += chunk
    return buf


def test_garbage_lines_get_answers_and_the_agent_survives(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    rng = random.Random(7)
    lines = list(SEEDS)
    alphabet = b'{}[]":,0123456789.eE+-truefalsnul \\/abcdefghv'
    for _ in range(300):
        lines.append(bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 80))))
        lines.append(bytes(rng.randrange(1, 256) for _ in range(rng.randint(1, 40))).replace(b"\n", b" "))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(runtime_dir / f"{w.pid}.sock"))
    try:
        for line in lines:
            sock.sendall(line + b"\n")
            reply = json.loads(read_line(sock))
            assert reply["v"] == 1 and isinstance(reply["ok"], bool), (line, reply)
            if not reply["ok"]:
                assert reply["error"]["type"] in ("protocol", "state", "acl"), (line, reply)
        sock.sendall(b'{"v":1,"id":7,"op":"status"}\n')
        status = json.loads(read_line(sock))
        assert status["id"] == 7 and status["result"]["state"] == "RUNNING"
    finally:
        sock.close()
    w.wait_steps(3)
    w.assert_correct()
