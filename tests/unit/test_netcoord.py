"""The barriers across nodes (netcoord.py) on loopback, with threads as nodes."""

from __future__ import annotations

import socket
import threading

import pytest

from npusnap_cli.errors import ExitCode, UsageError
from npusnap_cli.pipelines import netcoord


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nodes(n: int, phases: tuple[str, ...], body: object, timeout_s: float = 5.0) -> dict[int, str]:
    addr = ("127.0.0.1", _port())
    server = netcoord.CoordServer(addr, n, phases, timeout_s)
    out: dict[int, str] = {}

    def node(k: int) -> None:
        link = netcoord.NetLink(addr, k, timeout_s)
        try:
            out[k] = body(k, link)  # type: ignore[operator]
        except netcoord.NodeAborted as exc:
            out[k] = f"aborted at {exc.details['phase']}: {exc.message} [{int(exc.exit_code)}]"
        finally:
            link.close()

    threads = [threading.Thread(target=node, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    server.close()
    return out


def test_every_node_passes_every_phase() -> None:
    def body(_k: int, link: netcoord.NetLink) -> str:
        for phase in ("a", "b", "c"):
            link.sync(phase)
        return "done"

    assert _nodes(3, ("a", "b", "c"), body) == {0: "done", 1: "done", 2: "done"}


def test_one_node_aborting_stops_every_node_with_its_exit_code() -> None:
    def body(k: int, link: netcoord.NetLink) -> str:
        link.sync("a")
        if k == 2:
            link.abort("rank 0: CRIU failed", int(ExitCode.CRIU))
            return "failed"
        link.sync("b")
        return "done"

    out = _nodes(3, ("a", "b"), body)
    assert out[2] == "failed"
    for k in (0, 1):
        assert out[k].startswith("aborted at b: the job stopped at 'b': node 2: rank 0: CRIU failed"), out[k]
        assert out[k].endswith("[6]")


def test_a_node_that_never_arrives_times_the_phase_out() -> None:
    def body(k: int, link: netcoord.NetLink) -> str:
        if k == 1:
            threading.Event().wait(1.5)  # longer than the phase timeout, then gone
            return "late"
        link.sync("a")
        return "done"

    out = _nodes(2, ("a",), body, timeout_s=0.5)
    assert out[0].startswith("aborted at a:") and "did not reach 'a' in time" in out[0], out[0]


def test_coordinator_addresses() -> None:
    assert netcoord.parse_addr("10.0.0.1:7711") == ("10.0.0.1", 7711)
    for bad in ("10.0.0.1", ":7711", "host:port"):
        with pytest.raises(UsageError):
            netcoord.parse_addr(bad)
