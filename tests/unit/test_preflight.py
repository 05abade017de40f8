"""Preflight helpers that do not need root or CRIU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode, PreflightError
from npusnap_cli.host import preflight, procfs, proctree
from npusnap_cli.pipelines import dump


def test_own_processes_never_need_cap_sys_resource() -> None:
    assert preflight.other_user_problem([os.geteuid(), os.geteuid()]) is None
    assert preflight.other_user_problem([]) is None


def test_another_users_process_needs_cap_sys_resource() -> None:
    other = os.geteuid() + 4242
    problem = preflight.other_user_problem([os.geteuid(), other])
    if preflight.effective_capabilities() >> preflight.CAP_SYS_RESOURCE & 1:
        assert problem is None
    else:
        assert problem is not None and problem.status == preflight.PROBLEM
        assert str(other) in problem.detail and "CAP_SYS_RESOURCE" in problem.detail


def test_privileges_report_names_the_capabilities() -> None:
    items = {i.name: i for i in preflight.check_privileges()}
    assert set(items["privileges"].data["capabilities"]) == {
        "CAP_SYS_ADMIN",
        "CAP_CHECKPOINT_RESTORE",
        "CAP_SYS_PTRACE",
    }
    assert items["other-users"].status in (preflight.OK, preflight.WARNING)


def _info(pid: int) -> proctree.ProcInfo:
    return proctree.ProcInfo(
        pid=pid,
        ppid=1,
        depth=0,
        uid=0,
        name="python3",
        cmdline=("python3",),
        agent_socket=None,
        acl_library=None,
    )


def test_session_id_reads_this_process() -> None:
    assert procfs.session_id(os.getpid()) == os.getsid(0)
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert procfs.session_id(child.pid) == child.pid
    finally:
        child.kill()
        child.wait()
    assert procfs.session_id(child.pid) is None  # gone


def test_session_leader_outside_the_namespace_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """getsid() reads 0 when the session leader is in a parent pid namespace (a CI runner, docker
    exec): CRIU refuses that even with --shell-job, so preflight does, before any lock."""
    monkeypatch.setattr(procfs, "session_id", lambda pid: 0 if pid == 12 else pid)
    with pytest.raises(PreflightError) as exc:
        dump._check_session((_info(11), _info(12)), shell_job=True)
    assert "outside this pid namespace" in exc.value.message and "12" in exc.value.message
    assert "setsid" in exc.value.fix
    assert exc.value.exit_code == ExitCode.PREFLIGHT


def test_shared_session_needs_shell_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procfs, "session_id", lambda pid: 5)
    with pytest.raises(PreflightError) as exc:
        dump._check_session((_info(11),), shell_job=False)
    assert "not a session leader" in exc.value.message and "--shell-job" in exc.value.fix
    dump._check_session((_info(11),), shell_job=True)  # allowed: CRIU dumps it as a shell job
    monkeypatch.setattr(procfs, "session_id", lambda pid: pid)
    dump._check_session((_info(11),), shell_job=False)  # its own session: nothing to say


def test_check_reports_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    assert preflight.check_session().status == preflight.OK or os.getsid(0) == 0
    monkeypatch.setattr(os, "getsid", lambda pid: 0)
    item = preflight.check_session()
    assert item.status == preflight.WARNING and "setsid" in item.fix


def test_an_unwanted_criu_check_is_ended_with_what_it_forked(tmp_path: Path) -> None:
    """A dump refused before it read `criu check`'s answer ends the check; a check that does not
    end on its own is killed with the helpers it forked, which would otherwise hold its output
    open (a dump hung there in CI, waiting for them)."""
    import time

    from npusnap_cli import criu

    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\n(sleep 30) &\nsleep 30\n")
    fake.chmod(0o755)
    check = criu.CriuCheck(criu.CriuBinary(path=str(fake), version="4.2.1"))
    start = time.monotonic()
    check.cancel(timeout=0.5)
    assert time.monotonic() - start < 5
    assert check.proc is not None and check.proc.returncode is not None
