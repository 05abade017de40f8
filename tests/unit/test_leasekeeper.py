"""LeaseKeeper's rule: a dump still holds its locks only if the tree froze (or stays stopped)
before the last renewal plus the lease; an agent that said its lease is gone ends it at once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from npusnap_cli.device import leasekeeper
from npusnap_cli.device.agent_client import AgentBusyError, AgentOpError
from npusnap_cli.device.leasekeeper import LeaseKeeper, LockLostError
from npusnap_cli.host import procfs
from npusnap_cli.replies import ErrorReply


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _keeper(pid: int, renewed_ago: float, lease: float = 2.0) -> LeaseKeeper:
    k = LeaseKeeper({pid: "0" * 32}, lease)
    k.renewed_at = time.monotonic() - renewed_ago
    return k


def test_a_freeze_within_the_lease_keeps_the_lock(sleeper: int) -> None:
    k = _keeper(sleeper, 0.5)
    k.frozen_at = time.monotonic()
    k.check("during the test")


def test_a_freeze_after_the_lease_may_have_run_out_fails(sleeper: int) -> None:
    k = _keeper(sleeper, 3.0)
    k.frozen_at = time.monotonic()
    with pytest.raises(LockLostError) as exc:
        k.check("before CRIU froze the tree")
    assert exc.value.exit_code == 7 and "lost its lock" in exc.value.message
    assert exc.value.details["renew_to_freeze_s"] >= 3.0


def test_never_renewed_or_refused_fails(sleeper: int) -> None:
    k = LeaseKeeper({sleeper: "0" * 32}, 60.0)
    with pytest.raises(LockLostError):
        k.check("x")
    k = _keeper(sleeper, 0.1, lease=60.0)
    k.lost = "pid 1: NO_LEASE"
    with pytest.raises(LockLostError) as exc:
        k.check("x")
    assert "NO_LEASE" in exc.value.why


def test_at_the_kill_a_tree_still_stopped_is_still_locked(sleeper: int) -> None:
    k = _keeper(sleeper, 10.0)
    with pytest.raises(LockLostError):
        k.check_before_kill([sleeper])  # running after the lease: its lease may have run out
    os.kill(sleeper, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while procfs.state(sleeper) != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    k.check_before_kill([sleeper])  # stopped: its lease does not run


def test_no_lease_no_rule() -> None:
    LeaseKeeper({}, 2.0).check("x")
    LeaseKeeper({1: "0" * 32}, None).check("x")


def test_a_busy_agent_said_nothing_of_its_lease(monkeypatch: pytest.MonkeyPatch, sleeper: int) -> None:
    """An agent still serving another connection answers BUSY: the lease is not renewed now, and
    not lost either (the time rule decides); a NO_LEASE answer ends the dump at once."""

    def answer(error: AgentOpError) -> None:
        class Client:
            def __init__(self, *a: object, **kw: object) -> None:
                self.token = ""

            def __enter__(self) -> Client:
                return self

            def __exit__(self, *a: object) -> None:
                return None

            def renew(self, lease_s: float) -> None:
                raise error

        monkeypatch.setattr(leasekeeper, "AgentClient", Client)

    monkeypatch.setattr(leasekeeper, "BUSY_RETRY_S", 0.2)
    k = _keeper(sleeper, 0.2, lease=60.0)
    busy = ErrorReply(code=0, message="another client", name="BUSY", type="protocol")
    answer(AgentBusyError("the agent is busy", pid=sleeper, op="renew", error=busy))
    assert k.renew() is False and k.lost is None
    k.renew_or_fail("before CRIU started")  # not a loss
    k.frozen_at = time.monotonic()
    k.check("x")  # within the lease renewed before
    gone = ErrorReply(code=0, message="no lease is active", name="NO_LEASE", type="state")
    answer(AgentOpError("no lease is active", pid=sleeper, op="renew", error=gone))
    with pytest.raises(LockLostError):
        k.renew_or_fail("before CRIU started")


def test_a_lock_still_ours_after_an_unsure_time_rule_is_rolled_back_by_us(
    monkeypatch: pytest.MonkeyPatch, sleeper: int
) -> None:
    """The time rule fired, but the agent says the lock is this process's, under a lease that is
    still running (a lapsed lease rolls back and ends): gave_up leaves the rollback to the dump,
    which unlocks with its token, instead of waiting for a rollback that will not come."""
    # The members gave_up reads of the agent's status reply.
    status = SimpleNamespace(
        state="BACKED_UP",
        lease=SimpleNamespace(active=True),
        owner=SimpleNamespace(command="dump", pid=os.getpid()),
    )

    class Client:
        def __init__(self, *a: object, **kw: object) -> None:
            pass

        def __enter__(self) -> Client:
            return self

        def __exit__(self, *a: object) -> None:
            return None

        def status(self) -> SimpleNamespace:
            return status

    monkeypatch.setattr(leasekeeper, "AgentClient", Client)
    k = _keeper(sleeper, 120.0)
    err = k._error("before CRIU froze the tree", time.monotonic())
    t0 = time.monotonic()
    assert k.gave_up(err, timeout=10.0) is False
    assert time.monotonic() - t0 < 2.0
