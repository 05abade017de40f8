"""A process tree of N ranks for the scale benchmark: this process starts N copies of a command.

    python3 bench/tree.py --ranks 4 --out-dir DIR -- python3 bigalloc.py --device-mib 64 ...

Rank R runs the command with ``RANK=R`` in its environment, every ``{rank}`` in its arguments
replaced by R (e.g. ``--device {rank}``), and its stdout and stderr in ``DIR/rankR.out``. The
root holds no device and no memory of its own; it waits for its children and exits with the
first non-zero status (killing the others), so a tree dumped and restored by npusnap or raw CRIU
keeps its shape: one root, N workers. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, required=True, help="how many children (ranks) to start")
    ap.add_argument("--out-dir", required=True, help="rank R writes DIR/rankR.out")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    ns = ap.parse_args(argv)
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if ns.ranks < 1 or not cmd:
        ap.error("--ranks must be >= 1 and a command must follow --")
    pids: List[int] = []
    for rank in range(ns.ranks):
        out = os.open(
            os.path.join(ns.out_dir, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        pid = os.fork()
        if pid == 0:
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.environ["RANK"] = str(rank)
            try:
                argv = [arg.replace("{rank}", str(rank)) for arg in cmd]
                os.execvp(argv[0], argv)
            finally:
                os._exit(127)
        os.close(out)
        pids.append(pid)
    status = 0
    while pids:
        pid, st = os.wait()
        if pid not in pids:
            continue
        pids.remove(pid)
        code = os.waitstatus_to_exitcode(st)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    sys.exit(main())
