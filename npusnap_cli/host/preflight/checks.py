"""The rest of `npusnap check` (CANN, the session, the runtime directory, what npusnap left on the
host) and ``run_checks``, which runs every check in order."""

from __future__ import annotations

import os
from typing import Optional

from npusnap_cli import acl, paths
from npusnap_cli.host import hostclean, qualifyreport
from npusnap_cli.host.preflight.criucheck import check_criu
from npusnap_cli.host.preflight.items import OK, PROBLEM, WARNING, CheckItem, CheckReport
from npusnap_cli.host.preflight.plugins import check_npu_plugin, plugin_dirs_item
from npusnap_cli.host.preflight.privileges import check_privileges
from npusnap_cli.jsontypes import JSONObject


def check_cann(ascend_home: Optional[str] = None) -> list[CheckItem]:
    try:
        install = acl.find_cann(ascend_home)
    except acl.AclError as err:
        return [CheckItem("cann", PROBLEM, err.meaning, err.hint, data={"error": err.to_dict()})]
    data: JSONObject = {
        "home": install.home,
        "source": install.source,
        "version": install.version,
        "library": install.acl_library,
        "runtime_library": install.runtime_library,
        "simulated": install.simulated,
        "symbols": dict(install.symbols),
    }
    label = " (simulated NPU)" if install.simulated else ""
    items = [
        CheckItem(
            "cann",
            OK,
            f"{install.home} (from {install.source}), version {install.version or 'unknown'}{label}",
            data=data,
        )
    ]
    core = ("aclrtSnapShotProcessLock", "aclrtSnapShotProcessBackup", "aclrtSnapShotProcessRestore",
            "aclrtSnapShotProcessUnlock")  # fmt: skip
    missing = [s for s in core if not install.symbols.get(s)]
    items.append(
        CheckItem(
            "snapshot-symbols",
            PROBLEM if missing else OK,
            f"{install.acl_library}: "
            + (f"missing {', '.join(missing)}" if missing else "all four snapshot functions"),
            "upgrade CANN to 8.5 or newer (the snapshot API appeared there)" if missing else "",
            data={"library": install.acl_library, "missing": missing},
        )
    )
    items.append(check_npu_plugin(install.simulated))
    items.append(qualifyreport.check_item(install))
    return items


def check_session() -> CheckItem:
    """Whether jobs started from here can be dumped as they are: CRIU cannot record a session
    whose leader is outside the dumped processes' pid namespace (getsid reads 0 then)."""
    sid = os.getsid(0)
    if sid == 0:
        return CheckItem(
            "session",
            WARNING,
            "this shell's session leader is outside this pid namespace (docker exec, nsenter, a CI "
            "runner): a job started from here without `setsid` cannot be dumped",
            "start jobs with `npusnap run -- CMD...` (here it gives them a session of their own) or `setsid`",
            data={"sid": sid},
        )
    return CheckItem(
        "session",
        OK,
        f"session leader {sid} is in this pid namespace (a job sharing it is dumped with --shell-job)",
        data={"sid": sid},
    )


def check_runtime_dir() -> CheckItem:
    """The agents' runtime directory is private to this user (or does not exist yet)."""
    where = paths.agent_runtime_dir()
    problem = paths.runtime_dir_problem()
    if problem:
        return CheckItem(
            "runtime-dir",
            PROBLEM,
            f"agents cannot listen: {problem}",
            f"remove {where} if it is not yours, or set NPUSNAP_RUNTIME_DIR to a private directory",
        )
    return CheckItem("runtime-dir", OK, f"{where} (private, or created 0700 by the first agent)")


def check_debris() -> CheckItem:
    """What npusnap left on this host: stale agent sockets, failure logs, demo directories."""

    debris = hostclean.debris_report()
    data = debris.to_dict()
    parts = []
    if debris.stale_sockets:
        where = paths.agent_runtime_dir()
        parts.append(f"{len(debris.stale_sockets)} stale agent socket(s) in {where}")
    if debris.stale_tokens:
        where = paths.agent_runtime_dir()
        pids = ", ".join(str(t.pid) for t in debris.stale_tokens[:5])
        parts.append(f"{len(debris.stale_tokens)} lock token(s) of dead processes in {where} (pids {pids})")
    if debris.demo_dirs:
        parts.append(f"{len(debris.demo_dirs)} demo work dir(s) ({', '.join(debris.demo_dirs[:3])})")
    logs = (
        f"{len(debris.failure_logs)} failure log dir(s) in {hostclean.log_base()} "
        f"(the newest {hostclean.KEEP_LOGS} are kept)"
    )
    if not parts:
        return CheckItem("debris", OK, f"no stale agent sockets or demo dirs; {logs}", data=data)
    return CheckItem(
        "debris",
        WARNING,
        "; ".join(parts) + f"; {logs}",
        "stale sockets and lock tokens are removed by the next `npusnap status` or `npusnap dump`; "
        "remove demo dirs "
        "with rm -r (`npusnap demo` removes its own unless --keep)",
        data=data,
    )


def run_checks(ascend_home: Optional[str] = None) -> CheckReport:
    items = (
        check_criu() + check_privileges() + [check_session(), check_runtime_dir()] + check_cann(ascend_home)
    )
    items.append(plugin_dirs_item())
    items.append(check_debris())
    return CheckReport(tuple(items))
