"""The restore is one list of steps: the dry run shows its preflight, a job runs it per rank."""

from __future__ import annotations

from npusnap_cli.pipelines import restore, restorecheck
from npusnap_cli.pipelines.jobsnap import barriers, jobrestore


def test_the_dry_run_shows_the_restores_own_preflight_in_its_order() -> None:
    names = [c.name for c in restorecheck.CHECKS]
    assert names[:2] == ["structure", "checksums"]
    assert names[2:] == [c.name for c in restore.CHECKS]
    assert [c.run for c in restorecheck.CHECKS[2:]] == [c.run for c in restore.CHECKS]


def test_a_job_rank_runs_the_restores_steps_with_the_jobs_barriers_in_order() -> None:
    used = {s.do for s in jobrestore.RANK_STEPS}
    shared = [s for s in restore.STEPS if s.do in used]
    # Everything a single restore does up to the device step, a rank does too, in the same order.
    assert [s.name for s in shared] == [
        "verify",
        "preflight",
        "open files",
        "host nodes",
        "put back files",
        "pid-ns view",
        "lazy-pages daemon",
        "stop guard",
        "criu restore",
        "release",
    ]
    order = [s.do for s in jobrestore.RANK_STEPS if s.do in {x.do for x in shared}]
    assert order == [s.do for s in shared]
    phases = [s.barrier for s in jobrestore.RANK_STEPS if s.barrier is not None]
    assert tuple(phases) == barriers.RESTORE_PHASES
    # No rank commits: a failure anywhere undoes every rank's CRIU restore (kills its tree).
    criu_step = next(s for s in jobrestore.RANK_STEPS if s.do is restore.CRIU_RESTORE.do)
    assert not criu_step.commit and criu_step.undo is not None and restore.CRIU_RESTORE.commit
