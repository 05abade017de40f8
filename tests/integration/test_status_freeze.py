"""`npusnap status`, `npusnap freeze` / `thaw` through the real CLI, and DeviceGroup's all-or-nothing."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.device.devicegroup import DeviceGroup
from npusnap_cli.errors import BusyError
from tests.integration.agentlib import (
    PY,
    REPO,
    Sim,
    Workload,
    kill_pid,
    start_agent_workload,
)

pytestmark = pytest.mark.integration


def npusnap(*args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [PY, "-m", "npusnap_cli", *args, "--json"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    try:
        envelope = json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"not one JSON envelope: {done.stdout!r} {done.stderr!r}") from None
    return done.returncode, envelope


def by_pid(env: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """``result.processes`` is a list of objects with ``pid`` in every command's JSON."""
    return {int(p["pid"]): p for p in env["result"]["processes"]}


def state_of(pid: int) -> str:
    with AgentClient(pid) as c:
        return str(c.status().state)


def test_status_shows_the_tree_and_who_lacks_an_agent(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads, WL_FORK="1")
    child = int(w.wait_for("child").split()[1])
    try:
        rc, env = npusnap("status", str(w.pid))
        assert rc == 0, env
        procs = {p["pid"]: p for p in env["result"]["processes"]}
        assert set(procs) == {w.pid, child}
        parent = procs[w.pid]
        assert parent["hello"]["pid"] == w.pid and parent["hello"]["acl"]["loaded"] is True
        assert parent["status"]["state"] == "RUNNING"
        assert procs[child]["agent_socket"] is None and procs[child]["uses_npu"] is True
        assert procs[child]["depth"] == 1
        assert any(f"npusnap attach {child}" in h for h in env["result"]["hints"])
    finally:
        kill_pid(child)


def test_status_of_a_missing_pid_is_a_target_error() -> None:
    rc, env = npusnap("status", "999999999")
    assert rc == 4 and env["error"]["kind"] == "target"


def test_freeze_and_thaw(sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    w.wait_steps(2)
    rc, env = npusnap("freeze", str(w.pid), "--no-backup")
    assert rc == 0, env
    assert by_pid(env)[w.pid]["state"] == "LOCKED"
    assert env["result"]["lease_s"] == 300
    at = w.last_step()
    time.sleep(0.5)
    assert w.last_step() <= at + 1
    rc, env = npusnap("status", str(w.pid))
    assert env["result"]["processes"][0]["status"]["state"] == "LOCKED"
    rc, env = npusnap("thaw", str(w.pid))
    assert rc == 0, env
    result = by_pid(env)[w.pid]
    assert (result["before"], result["actions"], result["state"]) == ("LOCKED", ["unlock"], "RUNNING")
    w.wait_steps(3)
    w.assert_correct()
    rc, env = npusnap("thaw", str(w.pid))  # thawing a running process is a no-op
    assert rc == 0 and by_pid(env)[w.pid]["actions"] == []


def test_freeze_backup_without_lease_then_thaw(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    rc, env = npusnap("freeze", str(w.pid), "--no-lease")  # backs up by default
    assert rc == 0, env
    assert by_pid(env)[w.pid]["state"] == "BACKED_UP"
    assert by_pid(env)[w.pid]["lease"]["active"] is False
    rc, env = npusnap("thaw", str(w.pid))
    assert rc == 0 and by_pid(env)[w.pid]["actions"] == ["unlock"]
    w.wait_steps(3)
    w.assert_correct()


def test_freeze_lease_thaws_by_itself(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads)
    rc, env = npusnap("freeze", str(w.pid), "--lease", "1")
    assert rc == 0, env
    deadline = time.monotonic() + 10
    while state_of(w.pid) != "RUNNING":
        assert time.monotonic() < deadline, "the lease did not thaw the process"
        time.sleep(0.2)
    w.wait_steps(3)
    w.assert_correct()


def test_freeze_refuses_an_npu_process_without_agent(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    w = start_agent_workload(sim, runtime_dir, tmp_path, workloads, WL_FORK="1")
    child = int(w.wait_for("child").split()[1])
    try:
        rc, env = npusnap("freeze", str(w.pid))
        assert rc == 4, env
        assert str(child) in env["error"]["message"] and f"npusnap attach {child}" in env["error"]["fix"]
        assert state_of(w.pid) == "RUNNING"  # nothing was locked
    finally:
        kill_pid(child)


def test_devicegroup_rolls_back_everyone_when_one_fails(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    a = start_agent_workload(sim, runtime_dir, tmp_path, workloads, name="a")
    b = start_agent_workload(sim, runtime_dir, tmp_path, workloads, name="b")
    with AgentClient(b.pid) as c:
        c.lock(command="freeze")  # b is locked by someone else: the group's Lock of b is refused
    with DeviceGroup([a.pid, b.pid], lease_s=30) as group, pytest.raises(BusyError) as info:
        group.lock_and_backup()
    assert info.value.details["pid"] == b.pid and info.value.details["owner"]["command"] == "freeze"
    assert set(info.value.details["failures"]) == {str(b.pid)}
    assert "rolled back" in info.value.message
    # Issue 14: the group rolls back only what it locked; b's owner keeps its lock.
    assert state_of(a.pid) == "RUNNING" and state_of(b.pid) == "LOCKED"
    with DeviceGroup([b.pid]) as group, pytest.raises(BusyError):
        group.rollback()  # not the owner: refused, nothing changed
    assert state_of(b.pid) == "LOCKED"
    with DeviceGroup([b.pid]) as group:
        group.rollback(force=True)
    assert state_of(b.pid) == "RUNNING"
    with DeviceGroup([a.pid, b.pid], lease_s=30) as group:
        results = group.lock_and_backup()
        assert {r.state for r in results.values()} == {"BACKED_UP"}
        group.close()  # as before a CRIU dump
        group.reconnect()
        assert {r.state for r in group.unlock().values()} == {"RUNNING"}
    a.wait_steps(3)
    b.wait_steps(3)
    a.assert_correct()
    b.assert_correct()


def test_rollback_counts_a_process_that_died_as_rolled_back(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload]
) -> None:
    """Regression: a worker killed mid-dump made the rollback fail ("state unknown", exit 9)
    although a dead process holds no lock; the others must be rolled back and that is all."""
    a = start_agent_workload(sim, runtime_dir, tmp_path, workloads, name="a")
    b = start_agent_workload(sim, runtime_dir, tmp_path, workloads, name="b")
    with DeviceGroup([a.pid, b.pid], lease_s=30) as group:
        group.lock_and_backup()
        kill_pid(b.pid)  # not reaped: a zombie, as a killed worker is until its launcher waits
        results = group.rollback()
    assert results[b.pid].state == "GONE"
    assert results[a.pid].state == "RUNNING"
    a.wait_steps(3)
    a.assert_correct()
