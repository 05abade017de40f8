"""How `npusnap run` starts a program with the agent: environment and exec.

Any dynamically linked program gets the native agent: ``LD_PRELOAD`` names
``libnpusnap_agent.so``, whose constructor starts the agent thread when ``NPUSNAP_AGENT=1``
(inherited by the whole tree, exec'd children included). Python interpreters also get the
bootstrap, so that the agent's Python face (hooks, interpreter info) is set up there: the
bootstrap directory (``agent/bootstrap``, holding an env-gated ``sitecustomize.py``) goes
first on PYTHONPATH; ``NPUSNAP_AGENT=1`` switches it on; ``NPUSNAP_PKG_PARENT`` tells it where
this copy of ``npusnap_cli`` lives, so the target imports the agent of the same npusnap version
as the CLI, whatever Python (3.9+) the target runs.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from npusnap_cli.agent import native
from npusnap_cli.errors import PreflightError, TargetError, UsageError

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
PKG_PARENT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    executable: str
    env: dict[str, str] = field(repr=False)

    def to_dict(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "argv": self.argv,
            "executable": self.executable,
            "env": {
                k: self.env[k] for k in ("NPUSNAP_AGENT", "NPUSNAP_PKG_PARENT", "PYTHONPATH", "LD_PRELOAD")
            },
        }


def agent_environment(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``base`` (default: os.environ) plus what the bootstrap needs."""
    env = dict(os.environ if base is None else base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOTSTRAP_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *parts])
    env["NPUSNAP_AGENT"] = "1"
    env["NPUSNAP_PKG_PARENT"] = str(PKG_PARENT)
    lib = native.library_path(include_mapped=False)
    if lib is None:
        raise PreflightError(
            f"the native agent library {native.LIBRARY_NAME} is not built",
            why="looked at " + ", ".join(str(p) for p in native.candidates()),
            fix="run scripts/setup.sh (or `make -C native`) in the npusnap checkout",
        )
    # ld.so splits LD_PRELOAD at spaces and colons: a path with either cannot be preloaded.
    if any(c in str(lib) for c in " :"):
        raise PreflightError(
            f"cannot preload {lib}: its path contains a space or a colon",
            why="ld.so splits LD_PRELOAD at spaces and colons",
            fix="install npusnap under a path without spaces or colons",
        )
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p and p != str(lib)]
    env["LD_PRELOAD"] = " ".join([str(lib), *preload])
    return env


def statically_linked(path: str) -> bool:
    """True for an ELF executable without an interpreter (PT_INTERP): ld.so never runs for it,
    so LD_PRELOAD cannot give it an agent. Scripts and unreadable files count as not static."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
                return False
            end = "<" if head[5] == 1 else ">"
            phoff = struct.unpack_from(end + "Q", head, 0x20)[0]
            phentsize, phnum = struct.unpack_from(end + "HH", head, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError:
        return False
    types = [struct.unpack_from(end + "I", table, i)[0] for i in range(0, len(table) - 3, phentsize)]
    return 3 not in types  # PT_INTERP


def prepare(argv: list[str], base_env: Optional[dict[str, str]] = None) -> LaunchPlan:
    if not argv:
        raise UsageError("no command given", fix="npusnap run -- python train.py")
    env = agent_environment(base_env)
    exe = shutil.which(argv[0], path=env.get("PATH"))
    if exe is None:
        raise TargetError(
            f"command not found: {argv[0]}",
            why="it is not an executable file and not on PATH",
            fix="give the full path of the program",
        )
    return LaunchPlan(argv=list(argv), executable=exe, env=env)


def leave_foreign_session() -> Optional[str]:
    """Start a new session when this one's leader is outside our pid namespace; what was done.

    CRIU cannot dump a process whose session leader it cannot see (getsid reads 0: the job was
    started by `docker exec`, `nsenter` or a CI runner from outside the namespace), not even as a
    shell job. Such a session gives no job control from inside anyway, so a job started through
    `npusnap run` gets a session of its own, which makes it dumpable. None: nothing to do.
    """
    if os.getsid(0) != 0:
        return None
    try:
        os.setsid()
    except PermissionError:
        # Already a process group leader (setsid(2) refuses those): the pid must stay, no fork.
        return (
            "this session's leader is outside the pid namespace and the program leads its own "
            "process group, so it keeps that session: it cannot be dumped; start it with `setsid`"
        )
    return (
        "this session's leader is outside the pid namespace (CRIU could not dump the program in "
        "it): the program runs in a new session of its own"
    )


def exec_plan(plan: LaunchPlan) -> None:
    """Replace this process with the program (same pid). Returns only by raising."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.executable, plan.argv, plan.env)
    except OSError as exc:
        raise TargetError(
            f"cannot execute {plan.argv[0]}: {exc.strerror}",
            why="the file is not executable or its interpreter is missing",
            fix=f"check `ls -l {plan.executable}`",
        ) from None
