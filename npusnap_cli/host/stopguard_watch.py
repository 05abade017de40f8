"""The watcher behind ``stopguard``: resumes a tree that CRIU left stopped if npusnap died.

Run as a separate, detached process (``python -I -S stopguard_watch.py PID:START ...``) with a
pipe from npusnap on stdin. npusnap writes ``done`` before it exits in any orderly way (success,
error, rollback). If stdin reaches EOF without it, npusnap died (SIGKILL, OOM) while the tree
may be stopped: wait until CRIU has let go of each process (TracerPid 0) and send it SIGCONT.
The agents' leases then roll the device side back, so the job runs on.

Standard library only and no imports from npusnap: it must start fast and cannot fail on a
broken environment.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.1
SETTLE_S = 5.0  # a process seen running and untraced this long is safe
GIVE_UP_S = 3600.0  # CRIU holding a process longer than this is beyond our help


def _status(pid: int, start: str) -> tuple[str, int] | None:
    """(state letter, TracerPid) of ``pid`` if it is still the process we were given."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[19] != start:
                return None  # the pid was reused
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


KILL_GIVE_UP_S = 120.0  # restore: CRIU finishes (and lets the tree go) well within this


def _start_time(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def kill_new(pids: list[int], since: int) -> None:
    """restore: npusnap died while CRIU's restored tree was (to be) left stopped, unverified.
    Kill every process with one of ``pids`` that started after the watcher (the restored ones:
    the image is intact, a new restore brings the job back) once CRIU has let it go."""
    deadline = time.monotonic() + KILL_GIVE_UP_S
    left = set(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            start = _start_time(pid)
            if start is None or start < since:
                continue  # not restored (yet), or not one of ours
            st = _status(pid, str(start))
            if st is None or st[1]:
                continue  # CRIU still holds it
            os.kill(pid, signal.SIGKILL)
            left.discard(pid)
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    kill = bool(argv) and argv[0] == "--kill-new"
    if kill:
        argv = argv[1:]
    since = _start_time("self") or 0
    targets = {int(p): s for p, s in (a.split(":", 1) for a in argv)}
    data = sys.stdin.buffer.read()  # returns at EOF: npusnap exited, one way or another
    if data.strip().endswith(b"done"):
        return 0
    if kill:
        kill_new(sorted(targets), since)
    else:
        watch(targets)
    # "rm PATH" lines: npusnap's work areas (a dump's partial image), of no use to anyone now.
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("rm /") and ".npusnap-tmp-" in line:
            import shutil

            shutil.rmtree(line[3:], ignore_errors=True)  # fd-relative, never follows a symlink
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
