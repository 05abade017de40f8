"""The barriers of a coordinated snapshot across nodes: one npusnap per node, over TCP.

Node 0's npusnap serves (``CoordServer``) on ``--coordinator HOST:PORT``; every node's npusnap,
node 0's included, connects (``NetLink``). For each phase, in order, every node sends
``{"arrive": PHASE}`` once all its local ranks got there (the local barrier's action), and the
server answers ``{"go": PHASE}`` to all when every node arrived. A node that fails sends
``{"abort": REASON}`` (or its connection drops, or it does not arrive in time): the server sends
``{"abort": REASON, "node": K}`` to every node, whose ranks then roll back. One JSON object per
line. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from typing import Optional, TypedDict

from npusnap_cli.errors import ExitCode, NpusnapError, PreflightError, UsageError

CONNECT_S = 60.0


class NodeAborted(NpusnapError):
    """Another node failed (or the coordinator is gone): this node rolls back."""

    kind = "job-aborted"


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"--coordinator {text!r} is not HOST:PORT", fix="e.g. --coordinator 10.0.0.1:7711")
    return host, int(port)


class Message(TypedDict, total=False):
    """One line of the protocol, as sent and read (the plugin, C, speaks it too): ``node`` (hello),
    ``arrive`` or ``go`` (a phase), ``abort`` (a reason; with the ``node`` that failed and its
    ``exit_code`` when known)."""

    node: int
    arrive: str
    go: str
    abort: str
    exit_code: Optional[int]


def _message(data: object) -> Optional[Message]:
    """``data`` as a Message; None if it is not a JSON object. A field of the wrong type is left
    out (the message then asks nothing this side follows: out of step); an ``abort`` reason of any
    type is kept as its text."""
    if not isinstance(data, dict):
        return None
    msg = Message()
    node, code = data.get("node"), data.get("exit_code")
    if isinstance(node, int) and not isinstance(node, bool):
        msg["node"] = node
    if isinstance(data.get("arrive"), str):
        msg["arrive"] = data["arrive"]
    if isinstance(data.get("go"), str):
        msg["go"] = data["go"]
    if "abort" in data:  # present, even empty: an abort ("" reads as "out of step")
        msg["abort"] = str(data["abort"]) if data["abort"] else ""
    if isinstance(code, int) and not isinstance(code, bool):
        msg["exit_code"] = code
    return msg


class _Conn:
    def __init__(self, sk: socket.socket) -> None:
        self.sk = sk
        self.buf = b""

    def send(self, obj: Message) -> None:
        self.sk.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout: float) -> Optional[Message]:
        """The next message, or None on EOF; socket.timeout when none came in time."""
        self.sk.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sk.recv(4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return _message(json.loads(line))


class CoordServer:
    """Node 0's barrier server for ``nodes`` nodes and ``phases`` (thread; ``close()`` ends it)."""

    def __init__(self, addr: tuple[str, int], nodes: int, phases: tuple[str, ...], timeout_s: float) -> None:
        self.nodes, self.phases, self.timeout_s = nodes, phases, timeout_s
        self.srv = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.srv.bind(addr)
        except OSError as exc:
            self.srv.close()
            raise PreflightError(
                f"cannot serve the job coordinator on {addr[0]}:{addr[1]}: {exc.strerror}",
                fix="choose a free port on an address of this node (--coordinator HOST:PORT)",
            ) from None
        self.srv.listen(nodes)
        self.conns: dict[int, _Conn] = {}
        # How the barriers ended: "ok" after the last phase's go, else the abort reason sent.
        self.outcome: Optional[str] = None
        self._closed = False
        self.decided = threading.Event()  # set once the outcome is final
        self.thread = threading.Thread(target=self._serve, name="npusnap-coord", daemon=True)
        self.thread.start()

    def _broadcast(self, obj: Message) -> None:
        if "abort" in obj and self.outcome is None:
            self.outcome = obj["abort"]
        for c in list(self.conns.values()):
            with contextlib.suppress(OSError):
                c.send(obj)

    def _serve(self) -> None:
        try:
            self._run()
        finally:
            self.decided.set()
        if self.outcome != "ok":
            self._refuse_late()

    def _refuse_late(self) -> None:
        """After an abort, a node that connects late is told so at once, not left waiting."""
        while not self._closed:
            try:
                self.srv.settimeout(0.2)
                sk, _ = self.srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with contextlib.suppress(OSError):
                sk.sendall(json.dumps({"abort": self.outcome}).encode() + b"\n")
                sk.close()

    def _run(self) -> None:
        try:
            self.srv.settimeout(CONNECT_S)
            while len(self.conns) < self.nodes:
                sk, _ = self.srv.accept()
                c = _Conn(sk)
                hello = c.recv(CONNECT_S)
                if hello is None or not isinstance(hello.get("node"), int):
                    sk.close()
                    continue
                self.conns[int(hello["node"])] = c
                if self.outcome is not None:  # aborted from outside meanwhile
                    c.send({"abort": self.outcome})
        except (OSError, ValueError):
            self._broadcast({"abort": f"not every node connected within {CONNECT_S:.0f}s"})
            return
        inbox: queue.Queue[tuple[int, Optional[Message]]] = queue.Queue()

        def reader(node: int, c: _Conn) -> None:
            while True:
                try:
                    msg = c.recv(self.timeout_s * len(self.phases) + CONNECT_S)
                except (OSError, ValueError):
                    msg = None
                inbox.put((node, msg))
                if msg is None:
                    return

        for node, c in self.conns.items():
            threading.Thread(target=reader, args=(node, c), daemon=True).start()
        for phase in self.phases:
            arrived: set[int] = set()
            deadline = time.monotonic() + self.timeout_s
            while len(arrived) < self.nodes:
                try:
                    node, msg = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    late = sorted(set(self.conns) - arrived)
                    self._broadcast({"abort": f"node(s) {late} did not reach '{phase}' in time"})
                    return
                if msg is None:
                    self._broadcast({"abort": f"node {node}'s npusnap went away", "node": node})
                    return
                if "abort" in msg or msg.get("arrive") != phase:
                    reason = str(msg.get("abort") or f"node {node} is out of step")
                    self._broadcast({"abort": reason, "node": node, "exit_code": msg.get("exit_code")})
                    return
                arrived.add(node)
            if self.outcome is not None:  # aborted from outside: never a go after an abort
                return
            self._broadcast({"go": phase})
        self.outcome = "ok"

    def abort(self, reason: str) -> None:
        """Abort from outside (a member's runtime failed before its plugin could say so): every
        member connected now gets the abort, and so does one that connects later."""
        self._broadcast({"abort": reason})

    def close(self) -> None:
        self._closed = True
        self.srv.close()
        self.thread.join(1.0)
        for c in self.conns.values():
            with contextlib.suppress(OSError):
                c.sk.close()


class NetLink:
    """This node's connection to the coordinator."""

    def __init__(self, addr: tuple[str, int], node: int, timeout_s: float) -> None:
        self.node, self.timeout_s = node, timeout_s
        deadline = time.monotonic() + CONNECT_S
        while True:
            try:
                sk = socket.create_connection(addr, timeout=5)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise PreflightError(
                        f"cannot reach the job coordinator at {addr[0]}:{addr[1]}: {exc.strerror or exc}",
                        why="node 0's npusnap serves it; it must run and be reachable from here",
                        fix="start the same command on node 0 (--node 0), check the address",
                    ) from None
                time.sleep(0.2)
        self.conn = _Conn(sk)
        self.conn.send({"node": node})
        self.aborted: Optional[str] = None

    def sync(self, phase: str) -> None:
        if self.aborted is not None:
            raise self._error(phase, self.aborted)
        try:
            self.conn.send({"arrive": phase})
            msg = self.conn.recv(self.timeout_s + 10)
        except (OSError, ValueError) as exc:
            msg = {"abort": f"lost the coordinator: {exc}"}
        if msg is None:
            msg = {"abort": "the coordinator closed the connection"}
        if msg.get("go") == phase:
            return
        self.aborted = str(msg.get("abort") or "out of step")
        err = self._error(phase, self.aborted)
        code = msg.get("exit_code")
        if isinstance(code, int) and code in {int(c) for c in ExitCode} and code > 1:
            err.exit_code = ExitCode(code)
        raise err

    def abort(self, reason: str, exit_code: Optional[int] = None) -> None:
        if self.aborted is None:
            self.aborted = reason
            with contextlib.suppress(OSError):
                self.conn.send({"abort": f"node {self.node}: {reason}", "exit_code": exit_code})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.sk.close()

    def _error(self, phase: str, reason: str) -> NodeAborted:
        return NodeAborted(
            f"the job stopped at '{phase}': {reason}",
            why="a coordinated snapshot across nodes is all nodes or none",
            fix="see the failing node's npusnap output",
            details={"phase": phase},
        )
