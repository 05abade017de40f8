"""The training loop of train.py plus one host-side resource that real jobs hold.

Real jobs are not a lone process writing to a file: they serve metrics on a TCP port, talk to
their peers over TCP, use UDP, run a ``multiprocessing`` pool (spawn start method, as JAX asks),
keep data in ``/dev/shm``. Each ``--with`` adds one of them, used on every step, and its result
joins the step's line, so that a run dumped and restored midway must print exactly the lines of
an uninterrupted run (the tests compare them)::

    python3 hostjob.py --with tcp-listen --with udp --with spawn-pool --steps 50
    python3 hostjob.py --with forkserver-pool --steps 50
    python3 hostjob.py --with shm:/npusnap-test-1 --steps 50
    python3 hostjob.py --with tcp-peer:10.231.0.2:7000 --steps 50    # an echo server there
    python3 hostjob.py --with mp-listener --with fifo --steps 50     # /tmp/pymp-*/, a named pipe

Runs on any Python 3.9+, standard library only.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
import zlib
from typing import Any, Callable, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train import AclFailure, Trainer, load_acl  # type: ignore[import-not-found]
else:
    from npusnap_workloads.train import AclFailure, Trainer, load_acl


def square_plus(x: int) -> int:
    """The pool's work: module-level so that spawned workers can import it."""
    return x * x + 1


class TcpListen:
    """A listening TCP socket (a metrics server); each step a client of ours connects to it."""

    def __init__(self) -> None:
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)

    def step(self, n: int) -> str:
        with socket.create_connection(self.srv.getsockname(), timeout=10) as c:
            conn, _ = self.srv.accept()
            with conn:
                c.sendall(f"ping {n}".encode())
                got = conn.recv(64).decode()
        return f"tcp {got}"


class Udp:
    """A bound UDP socket that sends a datagram to itself each step."""

    def __init__(self) -> None:
        self.sk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sk.bind(("127.0.0.1", 0))
        self.sk.settimeout(10)

    def step(self, n: int) -> str:
        self.sk.sendto(f"dgram {n}".encode(), self.sk.getsockname())
        return "udp " + self.sk.recv(64).decode()


class UnixPair:
    """A connected unix socket pair inside the process (a worker's control channel)."""

    def __init__(self) -> None:
        self.a, self.b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def step(self, n: int) -> str:
        self.a.sendall(f"unix {n}".encode())
        return self.b.recv(64).decode()


class TcpPeer:
    """An established TCP connection to an echo server (another rank, a parameter server)."""

    def __init__(self, where: str) -> None:
        host, port = where.rsplit(":", 1)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.sk = socket.create_connection((host, int(port)), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.buf = b""

    def step(self, n: int) -> str:
        self.sk.sendall(f"msg {n}\n".encode())
        while b"\n" not in self.buf:
            chunk = self.sk.recv(4096)
            if not chunk:
                raise OSError("the peer closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return "peer " + line.decode()


class SpawnPool:
    """A multiprocessing Pool and Lock with the spawn (or forkserver) start method: their
    semaphores live in /dev/shm, already unlinked."""

    def __init__(self, method: str = "spawn") -> None:
        ctx = multiprocessing.get_context(method)
        self.lock = ctx.Lock()
        self.pool = ctx.Pool(2)

    def step(self, n: int) -> str:
        with self.lock:
            total = sum(self.pool.map(square_plus, range(n, n + 4)))
        return f"pool {total}"


class Shm:
    """A named POSIX shared-memory segment (/dev/shm) holding a counter updated every step."""

    def __init__(self, name: str) -> None:
        from multiprocessing import resource_tracker, shared_memory

        self.name = name.lstrip("/")
        try:
            self.seg = shared_memory.SharedMemory(name=self.name, create=True, size=4096)
            self._buf()[:8] = (0).to_bytes(8, "little")
        except FileExistsError:
            self.seg = shared_memory.SharedMemory(name=self.name)
        # The segment outlives this process on purpose (the tests remove it): do not let
        # Python's resource tracker (another process) unlink it behind our back.
        resource_tracker.unregister(self.seg._name, "shared_memory")  # type: ignore[attr-defined]

    def _buf(self) -> memoryview:
        buf = self.seg.buf
        assert buf is not None
        return buf

    def step(self, n: int) -> str:
        value = int.from_bytes(bytes(self._buf()[:8]), "little") * 3 + n
        value &= (1 << 63) - 1
        self._buf()[:8] = value.to_bytes(8, "little")
        return f"shm {zlib.crc32(value.to_bytes(8, 'little')):08x}"


class MpListener:
    """A multiprocessing listener bound under /tmp/pymp-*/ (as DataLoader workers keep one):
    Python removes that directory when the process exits. Each step a client of ours talks to it."""

    def __init__(self) -> None:
        from multiprocessing.connection import Listener

        self.listener = Listener(family="AF_UNIX")

    def step(self, n: int) -> str:
        from multiprocessing.connection import Client

        with Client(self.listener.address, family="AF_UNIX") as c, self.listener.accept() as conn:
            c.send(("mp", n))
            got = conn.recv()
        return f"mp-listener {got[0]} {got[1]}"


class Fifo:
    """A named pipe in a private directory of its own, removed when the process exits."""

    def __init__(self) -> None:
        import atexit
        import shutil
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="npusnap-fifo-")
        atexit.register(shutil.rmtree, self.dir, True)
        path = os.path.join(self.dir, "fifo")
        os.mkfifo(path, 0o600)
        self.fd = os.open(path, os.O_RDWR)

    def step(self, n: int) -> str:
        os.write(self.fd, f"fifo {n}".encode())
        return os.read(self.fd, 64).decode()


class LockFile:
    """A lock file (flock) holding our pid in a private directory, removed when the process
    exits; each step checks that the file is still there and still ours."""

    def __init__(self) -> None:
        import atexit
        import fcntl
        import shutil
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="npusnap-lock-")
        atexit.register(shutil.rmtree, self.dir, True)
        self.path = os.path.join(self.dir, "job.lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self.fd, b"locked\n")

    def step(self, n: int) -> str:
        same = os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        return f"lock {n} {'held' if same else 'LOST'}"


def make(spec: str) -> Any:
    kind, _, arg = spec.partition(":")
    factories: dict[str, Callable[[], Any]] = {
        "tcp-listen": TcpListen,
        "udp": Udp,
        "unix-pair": UnixPair,
        "tcp-peer": lambda: TcpPeer(arg),
        "spawn-pool": SpawnPool,
        "forkserver-pool": lambda: SpawnPool("forkserver"),
        "shm": lambda: Shm(arg or "npusnap-hostjob"),
        "mp-listener": MpListener,
        "fifo": Fifo,
        "lockfile": LockFile,
    }
    if kind not in factories:
        raise ValueError(f"unknown --with {spec!r} (one of: {', '.join(factories)})")
    return factories[kind]()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with", dest="resources", action="append", default=[], help="a host resource")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--param-bytes", type=int, default=65536)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        trainer = Trainer(load_acl(), args.device, args.param_bytes, args.seed)
        resources = [make(spec) for spec in args.resources]
        for n in range(1, args.steps + 1):
            parts = [trainer.step(n)] + [r.step(n) for r in resources]
            sys.stdout.write(" | ".join(parts) + "\n")
            sys.stdout.flush()
            if n < args.steps:
                time.sleep(args.interval)
        trainer.close()
    except (AclFailure, OSError, ValueError) as exc:
        print(f"hostjob: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
