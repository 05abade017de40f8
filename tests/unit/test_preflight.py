"""Preflight helpers that do not need root or CRIU."""

from __future__ import annotations

import os

from npusnap_cli import preflight


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
