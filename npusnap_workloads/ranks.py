"""One rank of a distributed training job: train.py's device loop plus a collective every step.

Rank 0 listens on ``--master HOST:PORT``; every other rank connects to it. Each step, every rank
runs its device step and sends its checksum to rank 0, which answers every rank with the XOR of
all of them (an all-reduce). The line printed for step ``n`` holds both, so the output of every
rank depends on every other rank's device state at the same step::

    python3 ranks.py --rank 0 --world 2 --master 127.0.0.1:7100 --device 0 --steps 40
    python3 ranks.py --rank 1 --world 2 --master 127.0.0.1:7100 --device 1 --steps 40

``--rebuild-comm`` does what an HCCL job must do around a snapshot (docs/distributed.md): an
npusnap ``pre_lock`` hook asks the job to stop at the next step boundary; the request travels
with the step's collective, so that every rank stops after the *same* step; the connections (the
"communicator") are closed; ``post_unlock`` (after a restore, or after a rollback) has them
built again, and the loop goes on. The snapshot then holds no connection at all.

``--fail-hook STAGE[:once]`` registers an npusnap hook that raises at STAGE (the first time only
with ``:once``; tests of a rank failing);
``--slow-hook STAGE:S`` one that sleeps S seconds there (tests of a signal mid-dump).

Runs on any Python 3.9+, standard library only.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from typing import List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train import AclFailure, Trainer, load_acl  # type: ignore[import-not-found]
else:
    from npusnap_workloads.train import AclFailure, Trainer, load_acl

CONNECT_S = 60.0
PAUSE_WAIT_S = 30.0


def _recv_line(sk: socket.socket, buf: bytearray) -> str:
    while b"\n" not in buf:
        chunk = sk.recv(4096)
        if not chunk:
            raise OSError("a peer closed the connection")
        buf += chunk
    i = buf.index(b"\n")
    line = bytes(buf[:i]).decode()
    del buf[: i + 1]
    return line


class Comm:
    """The communicator: rank 0 holds one connection per other rank, the others one to rank 0."""

    def __init__(self, rank: int, world: int, master: str) -> None:
        host, port = master.rsplit(":", 1)
        self.rank, self.world, self.addr = rank, world, (host, int(port))
        self.peers: List[socket.socket] = []
        self.bufs: List[bytearray] = []
        self.listener: Optional[socket.socket] = None

    def build(self) -> None:
        deadline = time.monotonic() + CONNECT_S
        if self.rank == 0:
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(self.addr)
            srv.listen(self.world)
            srv.settimeout(CONNECT_S)
            by_rank: dict[int, tuple[socket.socket, bytearray]] = {}
            try:
                while len(by_rank) < self.world - 1:
                    c, _ = srv.accept()
                    c.settimeout(None)
                    buf = bytearray()
                    by_rank[int(_recv_line(c, buf))] = (c, buf)
            finally:
                srv.close()
            self.peers = [by_rank[r][0] for r in sorted(by_rank)]
            self.bufs = [by_rank[r][1] for r in sorted(by_rank)]
            return
        while True:
            try:
                sk = socket.create_connection(self.addr, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        sk.settimeout(None)
        sk.sendall(f"{self.rank}\n".encode())
        self.peers, self.bufs = [sk], [bytearray()]

    def close(self) -> None:
        for sk in self.peers:
            sk.close()
        self.peers, self.bufs = [], []

    def allreduce(self, value: int, pause: bool) -> tuple[int, bool]:
        """XOR of every rank's ``value``; whether any rank asked to pause after this step."""
        mine = f"{value:08x} {int(pause)}\n".encode()
        if self.rank == 0:
            total, any_pause = value, pause
            for sk, buf in zip(self.peers, self.bufs):
                v, p = _recv_line(sk, buf).split()
                total ^= int(v, 16)
                any_pause = any_pause or p == "1"
            reply = f"{total:08x} {int(any_pause)}\n".encode()
            for sk in self.peers:
                sk.sendall(reply)
            return total, any_pause
        self.peers[0].sendall(mine)
        v, p = _recv_line(self.peers[0], self.bufs[0]).split()
        return int(v, 16), p == "1"


class Pauser:
    """The pre_lock / post_unlock hooks and the step loop agree on a step boundary."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.paused = threading.Event()
        self.resume = threading.Event()

    def pre_lock(self) -> None:
        if self.paused.is_set():
            return
        self.requested.set()
        if not self.paused.wait(PAUSE_WAIT_S):
            raise RuntimeError(f"the job did not reach a step boundary within {PAUSE_WAIT_S:.0f}s")

    def post_unlock(self) -> None:
        self.resume.set()


def _register_hooks(rebuild: bool, fail: Optional[str], slow: Optional[str], pauser: Pauser) -> None:
    if not rebuild and not fail and not slow:
        return
    import npusnap_cli.agent as agent  # lazy: importable only under `npusnap run` (its PYTHONPATH)

    if rebuild:
        agent.register_hook("pre_lock", pauser.pre_lock, name="ranks.pause_comm")
        agent.register_hook("post_unlock", pauser.post_unlock, name="ranks.rebuild_comm")
    if fail:
        stage, _, once = fail.partition(":")
        failed: List[int] = []

        def failing() -> None:
            if once == "once" and failed:
                return
            failed.append(1)
            raise RuntimeError(f"injected failure at {stage}")

        agent.register_hook(stage, failing, name="ranks.injected_failure")
    if slow:
        stage, _, seconds = slow.partition(":")

        def sleeping() -> None:
            time.sleep(float(seconds or 1))

        agent.register_hook(stage, sleeping, name="ranks.slow_hook")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--master", required=True, help="HOST:PORT of rank 0")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--param-bytes", type=int, default=65536)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rebuild-comm", action="store_true", help="close and rebuild connections around a snapshot"
    )
    ap.add_argument("--fail-hook", default=None, help="an npusnap hook stage that raises (tests)")
    ap.add_argument("--slow-hook", default=None, help="STAGE:SECONDS, an npusnap hook that sleeps (tests)")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    pauser = Pauser()
    try:
        trainer = Trainer(load_acl(), args.device, args.param_bytes, args.seed + args.rank)
        _register_hooks(args.rebuild_comm, args.fail_hook, args.slow_hook, pauser)
        comm = Comm(args.rank, args.world, args.master)
        comm.build()
        for n in range(1, args.steps + 1):
            line = trainer.step(n)
            checksum = int(line.rsplit(" ", 1)[1], 16)
            total, pause = comm.allreduce(checksum, pauser.requested.is_set())
            sys.stdout.write(f"[rank {args.rank}] {line} | allreduce {total:08x}\n")
            sys.stdout.flush()
            if pause and n < args.steps:
                # Every rank stops after this same step: tear the communicator down, wait for
                # npusnap's post_unlock (restore or rollback), build it again.
                comm.close()
                pauser.resume.clear()
                pauser.paused.set()
                pauser.requested.clear()
                while not pauser.resume.wait(1.0):
                    pass
                pauser.paused.clear()
                comm.build()
            if n < args.steps:
                time.sleep(args.interval)
        comm.close()
        trainer.close()
    except (AclFailure, OSError, ValueError, RuntimeError) as exc:
        print(f"[rank {args.rank}] ranks: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
