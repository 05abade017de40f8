"""A hostile second user for the whole test session (tests/conftest.py starts it when the suite
runs as root).

An unprivileged uid that has no business with npusnap keeps planting, before and during every
command of the suite, what any local user can put in the directories everyone shares
(docs/security.md, "any other local user"):

* the fixed names npusnap or the simulator might make there, taken first: a symbolic link to a
  directory of the user's (the bait) or a world-writable directory of the user's;
* fake agent sockets, ``<pid>.sock`` named after root's processes, in an ``npusnap*`` directory of
  the user's, which listen and never answer;
* a job with a hostile command line (markup, an escape sequence, a newline) that listens as an
  agent and never answers;
* a fake image (a forged ``npusnap.json``) and hard links to the bait.

At the end of the session the suite must have written nothing through any of it (the bait is as
planted; nothing in the user's directories belongs to anyone else), and the user's things are
removed, so that the session leaves nothing behind in the shared directories.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

# No account: a uid nobody on the machine uses (the attack tests' own user is another one), one per
# session, so that two sessions on one machine (two pytest runs) neither remove nor check each
# other's things: each removes and checks only what its own uid owns.
UID_BASE = 60000
UID_SPAN = 5000
SHARED = ("/tmp", "/var/tmp", "/dev/shm")
HOSTILE_NAME = "[/]\x1b[31m[bold]x[/bold]\x1b[0m\nnpusnap-fake-job"
CANARY = "planted by the hostile user\n"

# Runs as the hostile user under the system's python3 (the venv's is in root-only directories).
PLANTER = r"""
import json, os, socket, sys, threading, time

home, bait = sys.argv[1], sys.argv[2]
squats = sys.argv[4:]  # (argv[3], the hostile name, is there to be seen in its command line)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

os.makedirs(home, exist_ok=True)
os.chmod(home, 0o755)
os.makedirs(bait, exist_ok=True)
os.chmod(bait, 0o777)
CANARY = @CANARY@


def canary_state():
    try:
        with open(os.path.join(bait, "canary")) as f:
            return "ok" if f.read() == CANARY else "changed"
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e})"


def plant_canary():
    os.makedirs(bait, exist_ok=True)
    os.chmod(bait, 0o777)
    tmp = os.path.join(bait, ".canary")
    with open(tmp, "w") as f:
        f.write(CANARY)
    os.replace(tmp, os.path.join(bait, "canary"))


plant_canary()


def listen(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(16)  # the kernel accepts; nobody ever answers
    return s


socks = {"self": listen(f"{home}/{os.getpid()}.sock")}
fake = os.path.join(home, "image")
os.makedirs(os.path.join(fake, "criu"), exist_ok=True)
with open(os.path.join(fake, "npusnap.json"), "w") as f:
    json.dump({"format": 1, "pids": [1], "kind": "dump", "created": "2999-01-01T00:00:00"}, f)


def roots_processes():
    pids = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                if os.stat(f"/proc/{e}").st_uid == 0:
                    with open(f"/proc/{e}/cmdline", "rb") as f:
                        if b"python" in f.read(200):
                            pids.append(int(e))
            except OSError:
                pass
    return sorted(pids)[-12:]


open(os.path.join(home, "ready"), "w").close()
while not stop.wait(0.25):
    state = canary_state()
    if state != "ok":
        # what was done to it goes on record (the suite's check after each test reads it), and
        # it is put back, to catch the next one
        with open(os.path.join(home, "tripped"), "a") as f:
            f.write(f"{time.time():.3f} canary {state}\n")
        plant_canary()
    for i, path in enumerate(squats):
        if not os.path.lexists(path):
            try:
                if i % 2:
                    os.mkdir(path)
                    os.chmod(path, 0o777)
                    os.link(os.path.join(bait, "canary"), os.path.join(path, "canary"))
                else:
                    os.symlink(bait, path)
            except OSError:
                pass
    live = roots_processes()
    for pid in live:
        if pid not in socks:
            try:
                socks[pid] = listen(f"{home}/{pid}.sock")
            except OSError:
                pass
    for pid in [p for p in socks if p != "self" and p not in live]:
        socks.pop(pid).close()
        try:
            os.unlink(f"{home}/{pid}.sock")
        except OSError:
            pass
"""


def squats() -> list[str]:
    """The names in the shared directories that npusnap or its simulator may use themselves."""
    # (npusnap-demo-*: `npusnap check` reports the demo work directories of that prefix)
    names = ["npusnap-logs", "npusnap-0", "npusim-0", "npusnap-ghosts", "npusnap-demo-x", "npusnap-state"]
    return [f"{d}/{n}" for d in SHARED for n in names]


class HostileUser:
    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.uid = UID_BASE + os.getpid() % UID_SPAN
        self.home = f"/tmp/npusnap-hostile-{self.uid}"  # its own agent-looking directory
        self.bait = f"{self.home}-bait"

    def start(self) -> None:
        python = shutil.which("python3", path="/usr/bin:/bin")
        if python is None:
            raise RuntimeError("the hostile user needs a python3 of the system's (/usr/bin or /bin)")
        self._remove_all()
        planter = PLANTER.replace("@CANARY@", repr(CANARY))
        self.proc = subprocess.Popen(
            [python, "-c", planter, self.home, self.bait, HOSTILE_NAME, *squats()],
            user=self.uid,
            group=self.uid,
            extra_groups=[],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",
        )
        deadline = time.monotonic() + 20
        while not os.path.exists(f"{self.home}/ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the hostile user did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def stop(self) -> list[str]:
        """Stop planting; what the session did through the planted things (empty: nothing)."""
        problems = self._written_through()
        if self.proc is not None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                problems.append("the hostile user did not stop within 10 s")
        self._remove_all()
        return problems

    def bait_state(self) -> str:
        """ "ok" while the bait is as planted; else what happened to it."""
        try:
            text = (Path(self.bait) / "canary").read_text()
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            return f"unreadable ({exc})"
        return "ok" if text == CANARY else "changed"

    def wait_replanted(self, timeout: float = 5.0) -> None:
        """The planter puts its bait back within a round: wait for it (so the next test starts
        with it intact)."""
        deadline = time.monotonic() + timeout
        while self.bait_state() != "ok" and time.monotonic() < deadline:
            time.sleep(0.05)

    def tripped(self) -> list[str]:
        """What the hostile user has seen done to its bait so far, one line each time."""
        try:
            return Path(f"{self.home}/tripped").read_text().splitlines()
        except FileNotFoundError:
            return []

    def _written_through(self) -> list[str]:
        problems = [f"{self.bait}/{line}" for line in self.tripped()]
        if self.bait_state() != "ok":
            problems.append(f"{self.bait}/canary is {self.bait_state()}")
        for where in [self.bait, self.home, *squats()]:
            with contextlib.suppress(OSError):
                # only what the user made (a name root took first is root's own business)
                if os.lstat(where).st_uid != self.uid or os.path.islink(where) or not os.path.isdir(where):
                    continue
            for root, dirs, files in os.walk(where):
                for name in dirs + files:
                    p = os.path.join(root, name)
                    with contextlib.suppress(OSError):
                        uid = os.lstat(p).st_uid
                        if uid != self.uid:
                            problems.append(f"{p} (uid {uid}) was made in the hostile user's {where}")
        return problems

    def _remove_all(self) -> None:
        """Everything this uid owns in the shared directories (also what a crashed earlier session
        with the same uid left)."""
        for d in SHARED:
            with contextlib.suppress(OSError):
                for name in os.listdir(d):
                    p = os.path.join(d, name)
                    with contextlib.suppress(OSError):
                        if os.lstat(p).st_uid != self.uid:
                            continue
                        if os.path.isdir(p) and not os.path.islink(p):
                            shutil.rmtree(p, ignore_errors=True)
                        else:
                            os.unlink(p)
