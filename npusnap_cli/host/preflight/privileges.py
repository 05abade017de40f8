"""The privileges CRIU needs (root, or the capabilities), and another user's processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from npusnap_cli.errors import PreflightError
from npusnap_cli.host.preflight.items import OK, PROBLEM, WARNING, CheckItem

# Linux capability bit numbers (include/uapi/linux/capability.h).
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_CHECKPOINT_RESTORE = 40


def effective_capabilities(pid: str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> list[CheckItem]:
    caps = effective_capabilities()

    def has(bit: int) -> bool:
        return bool(caps >> bit & 1)

    euid = os.geteuid()
    resource = has(CAP_SYS_RESOURCE)
    cap_names = {
        "CAP_SYS_ADMIN": has(CAP_SYS_ADMIN),
        "CAP_CHECKPOINT_RESTORE": has(CAP_CHECKPOINT_RESTORE),
        "CAP_SYS_PTRACE": has(CAP_SYS_PTRACE),
    }
    enough = (cap_names["CAP_SYS_ADMIN"] or cap_names["CAP_CHECKPOINT_RESTORE"]) and cap_names[
        "CAP_SYS_PTRACE"
    ]
    have = ", ".join(k for k, v in cap_names.items() if v) or "none"
    items = [
        CheckItem(
            "privileges",
            OK if enough else PROBLEM,
            f"euid {euid}; capabilities: {have}",
            ""
            if enough
            else "run as root, or grant CAP_CHECKPOINT_RESTORE (or CAP_SYS_ADMIN) and CAP_SYS_PTRACE",
            data={"euid": euid, "capabilities": cap_names},
        ),
        CheckItem(
            "other-users",
            OK if resource else WARNING,
            "CAP_SYS_RESOURCE: processes of any user can be dumped"
            if resource
            else "no CAP_SYS_RESOURCE: only processes of uid "
            f"{euid} can be dumped (CRIU must read other users' rlimits)",
            "" if resource else "run the job as this user, or grant CAP_SYS_RESOURCE",
            data={"cap_sys_resource": resource},
        ),
    ]
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        scope = None
    if scope is None:
        items.append(CheckItem("ptrace-scope", OK, "Yama is not active", data={"ptrace_scope": None}))
    else:
        meaning = {
            0: "classic ptrace permissions",
            1: "restricted: only descendants, unless CAP_SYS_PTRACE",
            2: "admin-only: CAP_SYS_PTRACE needed",
            3: "no ptrace at all: CRIU and attach cannot work until reboot",
        }.get(scope, "unknown")
        status = PROBLEM if scope == 3 else (OK if scope == 0 or cap_names["CAP_SYS_PTRACE"] else WARNING)
        items.append(
            CheckItem(
                "ptrace-scope",
                status,
                f"kernel.yama.ptrace_scope = {scope} ({meaning})",
                "" if status == OK else "run as root (CAP_SYS_PTRACE), or start targets with `npusnap run`",
                data={"ptrace_scope": scope},
            )
        )
    return items


def require_privileges(command: str) -> None:
    """Refuse ``command`` (dump, restore) up front when this npusnap cannot run CRIU: as a user,
    everything after would fail on another path (root's /proc entries, root's image) and blame it."""
    problems = [i for i in check_privileges() if i.status == PROBLEM]
    if problems:
        raise PreflightError(
            f"{command} needs root: {problems[0].detail}",
            why=f"CRIU needs root (or CAP_CHECKPOINT_RESTORE + CAP_SYS_PTRACE) to {command} a process tree",
            fix=problems[0].fix or "run npusnap as root",
            details={"problems": [i.detail for i in problems]},
        )


def other_user_problem(uids: list[int]) -> Optional[CheckItem]:
    """A problem when the tree holds another user's process and CRIU could not read its rlimits.

    prlimit(2) on another user's process needs CAP_SYS_RESOURCE, even for root; without it CRIU
    fails late with "Can't get rlimit 0: Operation not permitted".
    """
    euid = os.geteuid()
    others = sorted({u for u in uids if u != euid})
    if not others or effective_capabilities() >> CAP_SYS_RESOURCE & 1:
        return None
    return CheckItem(
        "other-users",
        PROBLEM,
        f"the process tree has processes of uid {', '.join(map(str, others))}, and this npusnap "
        f"(uid {euid}) lacks CAP_SYS_RESOURCE",
        "dump as the job's user (same uid), or grant CAP_SYS_RESOURCE",
    )
