"""The dump in order (``STEPS``), each step's undo its share of the rollback, and the two calls
that run it: ``dump`` and ``dry_run``."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from npusnap_cli import criu
from npusnap_cli.errors import ImageError, NpusnapError
from npusnap_cli.host import hostclean, hostres, procfs, proctree
from npusnap_cli.host.stopguard import StopGuard
from npusnap_cli.image import layout
from npusnap_cli.jsontypes import JSONObject
from npusnap_cli.pipelines import checks
from npusnap_cli.pipelines.dump.agents import (
    _connect,
    _disconnect,
    _hello,
    _lock,
    _roll_back_devices,
    _unlock,
)
from npusnap_cli.pipelines.dump.checks import (
    ATTACH_CHECKS,
    CHECKS,
    INPUT_CHECKS,
    PREFLIGHT_CHECKS,
    TARGET_CHECKS,
    _without_agent,
)
from npusnap_cli.pipelines.dump.criudump import _criu, _resume
from npusnap_cli.pipelines.dump.devmemory import _close_streams
from npusnap_cli.pipelines.dump.manifest import _checksums, _publish
from npusnap_cli.pipelines.dump.options import DumpCallbacks, DumpOptions, DumpOutcome
from npusnap_cli.pipelines.dump.state import DumpState
from npusnap_cli.pipelines.dump.target import attach_missing
from npusnap_cli.pipelines.engine import Barrier, Pipeline, SignalGuard, Step


def _resolve(s: DumpState) -> None:
    checks.run_in_order(INPUT_CHECKS, s)
    s.area.leftovers = tuple(
        left.message for left in layout.remove_stale_temps(s.final) if left.action != "kept"
    )
    for message in s.area.leftovers:
        s.cb.note(message)
    checks.run_in_order(TARGET_CHECKS, s)


def _preflight(s: DumpState) -> None:
    checks.run_in_order(PREFLIGHT_CHECKS, s)


def _attach(s: DumpState) -> None:
    checks.run_in_order(ATTACH_CHECKS[:1], s)
    s.resolved.found = attach_missing(s.target, s.cb.note)
    checks.run_in_order(ATTACH_CHECKS[1:], s)


# -- the work directory -------------------------------------------------------------------------


def _work_area(s: DumpState) -> None:
    # CRIU will leave the tree stopped until it is published and killed; should this process
    # die in between, the guard resumes it (and the leases roll the devices back).
    s.locked.stop_guard = StopGuard(
        [] if s.options.leave_running else [p.pid for p in s.target.tree if p.pid not in s.target.stopped]
    )
    try:
        s.area.tmp = layout.create_temp_image(s.final)
    except OSError as exc:
        raise ImageError(
            f"cannot create the image's work directory next to {s.final}: {exc.strerror}",
            fix="check the directory's permissions and free space",
        ) from None
    s.locked.stop_guard.remove_on_death(s.area.tmp)  # a killed dump leaves no work area
    s.area.started = True


def _discard(s: DumpState, _err: BaseException) -> None:
    """Remove the partial image, keeping its logs elsewhere (``failure_logs``)."""
    for h in (s.saved.hasher, s.devmem.device_hasher, s.devmem.device_writeback, s.devmem.chunk_writer):
        if h is not None:
            h.stop()
    _close_streams(s)
    if s.area.tmp is None:
        return
    logs = hostclean.save_failure_logs(s.area.tmp, "dump")
    layout.remove_tree(s.area.tmp)
    s.end.failure_logs = str(logs) if logs else None


# -- the original killed, the outcome -----------------------------------------------------------


def _stop_original(s: DumpState) -> None:
    pids = s.saved.stopped_pids or proctree.tree_pids(s.target.root_pid)
    if s.locked.lease is not None:
        try:
            s.locked.lease.check_before_kill(pids)
        except NpusnapError:
            layout.remove_tree(s.final)  # not an image of a locked job: never leave it
            raise
    proctree.signal_tree(pids, signal.SIGKILL)
    left = proctree.wait_gone(pids)
    s.saved.stopped_pids = []
    if left:
        s.cb.note(f"pid(s) {left} did not exit after SIGKILL")


def _finish(s: DumpState) -> None:
    assert s.end.manifest is not None
    # CRIU's link-remap files leave the host once the image holds them (or the dump failed):
    # left there, a later dump whose file ids match fails on them.
    hostres.drop_remaps(s.saved.host_files)
    publish_s = s.timings.get("checksums", 0.0) + s.timings.get("publish", 0.0)
    timings = replace(s.end.manifest.timings, publish_s=publish_s, total_s=time.monotonic() - s.start)
    s.end.outcome = DumpOutcome(
        image=str(s.final),
        manifest=replace(s.end.manifest, timings=timings),
        attached=s.target.attached,
        logs=str(layout.logs_dir(s.final)) if s.options.keep else None,
        attach_stopped_s=s.target.attach_stopped_s,
    )


# -- a failure on its way out -------------------------------------------------------------------


def _failed(s: DumpState, err: NpusnapError, undone: bool) -> NpusnapError:
    """Say where the discarded image's logs went and what runs now (every undo has run)."""
    if not s.area.started:
        return err  # nothing was changed
    logs = s.end.failure_logs
    if logs:
        old = err.details.get("criu_log")
        if isinstance(old, str):
            moved = str(Path(logs) / Path(old).name)
            err.details["criu_log"] = moved
            err.fix = err.fix.replace(old, moved)
        err.details["logs"] = logs
    err.details["partial_image_removed"] = True
    if undone and s.locked.locking:
        npu = s.target.npu_pids
        # Never "is running" for a process that died meanwhile (killed during the dump).
        gone = [p for p in npu if not procfs.is_alive(p)]
        err.details["rolled_back"] = [p for p in npu if p not in gone]
        if gone:
            err.details["exited"] = gone
            if len(gone) == len(npu):
                err.message += f" (pid(s) {gone} exited during the dump: nothing is left running)"
            else:
                err.message += f" (pid(s) {gone} exited during the dump; the others were rolled back)"
        elif "rolled back" not in err.message:
            err.message += " (every process was rolled back and is running)"
    return err


NOTHING_CHANGED = ("before anything was changed", "nothing was changed")
NOTHING_LOCKED = ("before anything was locked", "nothing was locked")
UNPUBLISHED = ("before the image was published", "rolled back")


def _running_on(s: DumpState) -> bool:
    return s.options.leave_running


def _killed(s: DumpState) -> bool:
    return not s.options.leave_running


# design.md §3, in order. The undo of each step is the rollback of what it did; the engine runs
# them in reverse: the stopped tree resumed, the devices rolled back, the work directory removed.
STEPS: list[Step[DumpState]] = [
    Step("resolve", _resolve, phase="resolve", checkpoint=NOTHING_CHANGED),
    Step("preflight", _preflight, phase="preflight", checkpoint=NOTHING_CHANGED),
    Step("attach", _attach, checkpoint=NOTHING_LOCKED, barrier="preflight"),
    Step("work area", _work_area, undo=_discard, checkpoint=NOTHING_LOCKED),
    Step("connect", _connect, undo=_disconnect, checkpoint=NOTHING_LOCKED),
    Step("hello", _hello, checkpoint=NOTHING_LOCKED),
    Step("lock+backup", _lock, undo=_roll_back_devices, phase="lock+backup", barrier="backup"),
    Step(
        "criu",
        _criu,
        undo=_resume,
        phase="criu dump",
        barrier="criu",
        checkpoint=("during the CRIU dump", "rolled back"),
    ),
    Step("unlock", _unlock, phase="unlock", when=_running_on, checkpoint=UNPUBLISHED),
    Step("checksums", _checksums, phase="publish", checkpoint=UNPUBLISHED),
    # A job commits at its "publish" barrier: the originals are killed only after that. From here
    # on a signal no longer throws the image away; a failure still rolls everything back.
    Step("publish", _publish, barrier="publish", finishing=True),
    Step("stop original", _stop_original, phase="stop original", when=_killed, commit=True),
    Step("finish", _finish, commit=True),
]


@dataclass(frozen=True)
class DryRunOutcome:
    """What `dump --dry-run` found: every check's result (nothing was touched)."""

    image: str
    results: tuple[checks.CheckResult, ...]
    pids: tuple[int, ...]
    npu_pids: tuple[int, ...]
    would_attach: tuple[int, ...]

    @property
    def exit_code(self) -> int:
        return checks.first_problem(self.results)

    def to_dict(self) -> JSONObject:
        return {
            "image": self.image,
            "ready": self.exit_code == 0,
            "checks": [r.to_dict() for r in self.results],
            "pids": list(self.pids),
            "npu_pids": list(self.npu_pids),
            "would_attach": list(self.would_attach),
        }


def dry_run(
    pid: int, directory: Path, options: DumpOptions, callbacks: DumpCallbacks = DumpCallbacks()
) -> DryRunOutcome:
    """Every check of a dump of ``pid`` into ``directory`` (``CHECKS``), also after a problem,
    touching nothing: no stale work area removed, no agent attached (a process without one is
    what the dump would attach to; the agents' check then does not apply), no lock, no freeze."""
    final = Path(os.path.abspath(directory))
    try:
        check: Optional[criu.CriuCheck] = criu.CriuCheck(criu.find_criu())
    except NpusnapError:
        check = None
    try:
        # No handlers installed: nothing is held, so Ctrl-C may stop the dry run anywhere.
        state = DumpState(
            pid=pid,
            final=final,
            options=options,
            cb=callbacks,
            guard=SignalGuard(callbacks.note),
            check=check,
            in_job=False,
            start=time.monotonic(),
            published=final,
        )
        results = checks.run_all(CHECKS, state)
    finally:
        if check is not None:
            check.cancel()
    tree = state.resolved.found.tree if state.resolved.found is not None else ()
    return DryRunOutcome(
        image=str(final),
        results=tuple(results),
        pids=tuple(p.pid for p in tree),
        npu_pids=state.resolved.found.npu_pids if state.resolved.found is not None else (),
        would_attach=_without_agent(state) if state.resolved.found is not None else (),
    )


def dump(
    pid: int,
    directory: Path,
    options: DumpOptions = DumpOptions(),
    callbacks: DumpCallbacks = DumpCallbacks(),
    coordinator: Optional[Barrier] = None,
    published: Optional[Path] = None,
) -> DumpOutcome:
    """Run the whole dump pipeline (see the package's docstring); raise NpusnapError on failure.

    ``coordinator`` (jobsnap.JobCoordinator) makes this one rank of a coordinated job dump: its
    ``sync(phase)`` blocks at each phase boundary until every rank got there, and raises an
    NpusnapError (this rank then rolls back like any failure) when another rank failed.
    ``published``: where DIRECTORY will be once the caller has published it (a rank's image
    inside a job's work directory), if not DIRECTORY itself.
    """
    final = Path(os.path.abspath(directory))
    start = time.monotonic()
    # `criu check` runs while the target is resolved and checked; preflight reads its answer.
    # Without a usable CRIU, preflight says so in its turn (after the checks of the input).
    try:
        check: Optional[criu.CriuCheck] = criu.CriuCheck(criu.find_criu())
    except NpusnapError:
        check = None
    try:
        with SignalGuard(callbacks.note) as guard:
            state = DumpState(
                pid=pid,
                final=final,
                options=options,
                cb=callbacks,
                guard=guard,
                check=check,
                in_job=coordinator is not None,
                start=start,
                published=Path(os.path.abspath(published or directory)),
            )
            pipeline = Pipeline(
                "dump",
                STEPS,
                cb=callbacks,
                guard=guard,
                barrier=coordinator,
                on_failure=_failed,
                timings=state.timings,
            )
            try:
                pipeline.run(state)
            finally:
                if state.locked.stop_guard is not None:
                    state.locked.stop_guard.finish()
    finally:
        if check is not None:
            check.cancel()  # only still running when the dump failed before preflight read it
    assert state.end.outcome is not None
    return replace(state.end.outcome, leftovers=state.area.leftovers)
