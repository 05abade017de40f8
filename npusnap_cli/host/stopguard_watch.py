"""The watcher behind ``stopguard``: resumes a tree that CRIU left stopped if npusnap died.

Run as a separate, detached process (``python -I -S stopguard_watch.py PID:START ...``) with a
pipe from npusnap on stdin. npusnap writes ``done`` before it exits in any orderly way (success,
error, rollback). If stdin reaches EOF without it, npusnap died (SIGKILL, OOM) while the tree
may be stopped: wait until CRIU has let go of each process (TracerPid 0) and send it SIGCONT.
The agents' leases then roll the device side back, so the job runs on.

Standard library only, and of npusnap only ``host.procfs`` (itself standard library only): it
must start fast and cannot fail on a broken environment.
"""

from __future__ import annotations

import os
import signal
import sys
import time

if not __package__:
    # Run as a script under ``-I -S``: neither the script's directory nor site-packages is on
    # sys.path, so put the directory that holds the package there to import procfs.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from npusnap_cli.host import procfs

POLL_S = 0.1
SETTLE_S = 5.0  # a process seen running and untraced this long is safe
GIVE_UP_S = 3600.0  # CRIU holding a process longer than this is beyond our help


def _status(pid: int, start: str) -> tuple[str, int] | None:
    """(state letter, TracerPid) of ``pid`` if it is still the process we were given."""
    st = procfs.stat(pid)
    if st is None or str(st.start_time) != start:
        return None  # gone, or the pid was reused
    try:
        state, tracer = "", 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    state = line.split()[1]
                elif line.startswith("TracerPid:"):
                    tracer = int(line.split()[1])
        return state, tracer
    except (OSError, IndexError, ValueError):
        return None


def watch(targets: dict[int, str]) -> None:
    settled_since: dict[int, float] = {}
    deadline = time.monotonic() + GIVE_UP_S
    while targets and time.monotonic() < deadline:
        now = time.monotonic()
        for pid, start in list(targets.items()):
            st = _status(pid, start)
            if st is None:
                del targets[pid]
                continue
            state, tracer = st
            if tracer:
                settled_since.pop(pid, None)  # CRIU still holds it: wait
                continue
            if state in ("T", "t"):
                os.kill(pid, signal.SIGCONT)
                settled_since.pop(pid, None)
                continue
            first = settled_since.setdefault(pid, now)
            if now - first >= SETTLE_S:
                del targets[pid]
        time.sleep(POLL_S)


KILL_GIVE_UP_S = 60.0  # restore: an orphaned CRIU ends (or is ended) well within this


def _children(pids: set[int]) -> set[int]:
    """Every descendant of ``pids`` (one pass over /proc per level)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = procfs.stat(name)
            if st is not None:
                parents[int(name)] = st.ppid
    found: set[int] = set()
    frontier = set(pids)
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier and p not in found}
        found |= frontier
    return found


def kill_restored(criu: dict[int, str], restored: dict[int, str]) -> None:
    """restore: npusnap died while its CRIU restored the tree, or before it released the tree
    that CRIU left stopped and unverified. End both: the CRIU (its restored tasks die with it
    while it restores: PR_SET_PDEATHSIG) and every process of the tree it made, which is known by
    pid and start time (``restored``, sent by npusnap once CRIU answered) or as that CRIU's
    children. The image is intact: a new restore brings the job back."""
    deadline = time.monotonic() + KILL_GIVE_UP_S
    tree = {p: s for p, s in restored.items() if _status(p, s) is not None}
    for pid, start in criu.items():
        if _status(pid, start) is None:
            continue
        for kid in _children({pid}):
            if (s := procfs.start_time(kid)) is not None:
                tree.setdefault(kid, str(s))
        os.kill(pid, signal.SIGKILL)
    while tree and time.monotonic() < deadline:
        for kid in _children(set(tree)):
            if (s := procfs.start_time(kid)) is not None:
                tree.setdefault(kid, str(s))
        for pid, start in list(tree.items()):
            st = _status(pid, start)
            if st is None:
                del tree[pid]
            elif not st[1]:  # not (or no longer) traced: ours to end
                os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    kill = bool(argv) and argv[0] == "--kill-restored"
    if kill:
        argv = argv[1:]
    targets = {int(p): s for p, s in (a.split(":", 1) for a in argv)}
    data = sys.stdin.buffer.read()  # returns at EOF: npusnap exited, one way or another
    if data.strip().endswith(b"done"):
        return 0
    lines = data.decode("utf-8", "replace").splitlines()
    if kill:
        # "criu PID:START" (the CRIU restoring the tree), "tree PID:START" (what it restored)
        named = {k: {} for k in ("criu", "tree")}  # type: dict[str, dict[int, str]]
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind in named and ":" in rest:
                pid, start = rest.split(":", 1)
                named[kind][int(pid)] = start
        kill_restored(named["criu"], named["tree"])
    else:
        watch(targets)
    # "rm PATH" lines: npusnap's work areas (a dump's partial image), of no use to anyone now.
    for line in lines:
        if line.startswith("rm /") and ".npusnap-tmp-" in line:
            import shutil

            shutil.rmtree(line[3:], ignore_errors=True)  # fd-relative, never follows a symlink
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
