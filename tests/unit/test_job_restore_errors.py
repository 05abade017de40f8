"""What a failed job restore says: the failing rank's own error, and whether anything ran."""

from __future__ import annotations

import signal

from npusnap_cli.errors import CriuError, ImageError, InterruptedError_, PreflightError
from npusnap_cli.pipelines.engine import SignalGuard
from npusnap_cli.pipelines.jobsnap import barriers, jobrestore


def test_before_every_rank_was_verified_the_ranks_own_error_is_reported_as_is() -> None:
    errors: dict[int, BaseException] = {
        0: barriers.JobAbortedError("stopped before the end of 'verified'"),
        1: ImageError("rank 1's manifest /x/rank-1/npusnap.json is not the one the job recorded"),
    }
    err = jobrestore._job_restore_error(errors, {}, SignalGuard(), verified=False)
    assert err is errors[1]
    assert err.message == "rank 1's manifest /x/rank-1/npusnap.json is not the one the job recorded"
    assert err.details["rank"] == 1 and "killed_root_pids" not in err.details

    missing = PreflightError("network namespace /run/netns/n1 does not exist")
    err = jobrestore._job_restore_error({1: missing}, {}, SignalGuard(), verified=False)
    assert err.message == "rank 1: network namespace /run/netns/n1 does not exist"


def test_after_the_ranks_were_verified_the_error_says_that_nothing_runs() -> None:
    errors: dict[int, BaseException] = {
        0: barriers.JobAbortedError("stopped before the end of 'criu-restored'"),
        1: CriuError("CRIU restore failed"),
    }
    err = jobrestore._job_restore_error(errors, {}, SignalGuard(), verified=True)
    assert err.message == "rank 1: CRIU restore failed — no rank was restored; the image is unchanged"
    assert err.details["killed_root_pids"] == [] and err.details["rank"] == 1


def test_a_signal_that_aborted_every_rank_is_the_error() -> None:
    guard = SignalGuard()
    guard.received = signal.SIGTERM
    errors: dict[int, BaseException] = {
        0: barriers.JobAbortedError("stopped"),
        1: barriers.JobAbortedError("stopped"),
    }
    err = jobrestore._job_restore_error(errors, {}, guard, verified=True)
    assert isinstance(err, InterruptedError_)
    assert err.message.startswith("job restore interrupted by SIGTERM — no rank was restored")
