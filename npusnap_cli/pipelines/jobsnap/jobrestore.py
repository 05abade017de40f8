"""A job restore: the restore's steps once per rank, in threads, with barriers between them
(``RANK_STEPS``); and ``restore --wait``."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criu
from npusnap_cli.device.devicegroup import DeviceGroup
from npusnap_cli.errors import InterruptedError_, NpusnapError, PreflightError, StateUnknownError, UsageError
from npusnap_cli.host import procfs, proctree, tcpunlock
from npusnap_cli.image import layout
from npusnap_cli.image.job import RankEntry, check_rank_manifest, load_job_manifest
from npusnap_cli.image.manifest import load_manifest
from npusnap_cli.pipelines import engine, netcoord, restore, restoreguard
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.jobsnap.barriers import (
    RESTORE_PHASES,
    JobAbortedError,
    JobCoordinator,
    _describe,
    _rank_callbacks,
    run_ranks,
)
from npusnap_cli.pipelines.jobsnap.netns import in_netns


@dataclass(frozen=True)
class JobRestoreOutcome:
    image: str
    ranks: tuple[dict[str, Any], ...]  # rank, root_pid, pids, npu_pids, netns, criu_log
    verify_s: float
    criu_restore_s: float
    device_restore_s: float
    total_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "ranks": list(self.ranks),
            "timings": {
                "verify_s": round(self.verify_s, 6),
                "criu_restore_s": round(self.criu_restore_s, 6),
                "device_restore_s": round(self.device_restore_s, 6),
                "total_s": round(self.total_s, 6),
            },
        }


def _target_netns(r: RankEntry, overrides: dict[int, str]) -> Optional[str]:
    if r.rank in overrides:
        return overrides[r.rank]
    if r.netns is None:
        return None
    if r.netns_path and os.path.exists(r.netns_path):
        return r.netns_path
    raise PreflightError(
        f"rank {r.rank} was dumped in another network namespace ({r.netns_path or r.netns}), "
        "and that namespace does not exist here",
        why="its TCP connections and addresses belong to that namespace",
        fix=f"create it (e.g. `ip netns add {Path(r.netns_path).name}` with the same addresses) "
        if r.netns_path
        else f"pass --rank-netns {r.rank}=/run/netns/NAME (a namespace with the rank's addresses)",
        details={"rank": r.rank, "netns": r.netns, "netns_path": r.netns_path},
    )


def _kill_tree(root: int) -> None:
    every = proctree.tree_pids(root)
    proctree.signal_tree(every, signal.SIGKILL)
    proctree.wait_gone(every)
    with contextlib.suppress(ChildProcessError):  # our (subreaped) child: collect it, its pid is free
        os.waitpid(root, os.WNOHANG)


@dataclass
class RankState(restore.RestoreState):
    """One rank's restore: the single restore's state, and what only a job has."""

    rank: int = 0
    netns: Optional[str] = None  # the network namespace the rank is restored into (None: ours)
    hold: Optional[tcpunlock.ResetHold] = None
    group: Optional[DeviceGroup] = None
    killed: bool = False

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        super().close()


# The job's own steps, between the single restore's.


def _hold_resets(st: RankState) -> None:
    """Drop the resets this rank's network namespace would send on its connections until every
    rank (on every node) is restored (tcpunlock.ResetHold)."""
    if not st.manifest.criu_options.get("tcp_established"):
        return
    try:
        st.hold = tcpunlock.ResetHold(tcpunlock.image_connections(str(layout.criu_dir(st.image))))
    except OSError as exc:
        st.cb.note(
            f"cannot hold TCP resets during the restore ({exc}): "
            "a rank restored first may lose its connections"
        )


def _release_resets(st: RankState) -> None:
    if st.hold is not None:
        with contextlib.suppress(OSError):
            st.hold.release()


def _kill_restored(st: RankState, _err: BaseException) -> None:
    """All or nothing: a restored rank dies when any rank failed."""
    if st.tree.result is not None:
        _kill_tree(st.tree.result.pid)
        st.killed = True


def _device_restore_locked(st: RankState) -> None:
    """Every NPU process gets its device state back and stays locked until every rank has it."""
    if st.npu_pids:
        st.group = DeviceGroup(
            st.npu_pids,
            lease_s=st.options.lease_s,
            command="restore",
            interrupted=restoreguard.DeviceWait(st.npu_pids, st.guard),
        )
        # The restored agents still record the dump as their lock's owner: present its tokens.
        st.group.set_tokens({p.pid: p.lock_token for p in st.manifest.npu_processes if p.lock_token})
        st.group.restore(st.host.device_memory_files)


def _unlock(st: RankState) -> None:
    if st.group is not None:
        st.group.unlock()
    st.device.device_done = time.monotonic()


# The single restore's steps (restore.STEPS), with barriers between them, and these in between:
# TCP resets held until every rank is restored, a restored rank killed when any rank fails
# (the CRIU step is the job's commit no longer), and the device state of every rank restored
# before any rank is unlocked.
RANK_STEPS: tuple[engine.Step[RankState], ...] = (
    restore.VERIFY,
    restore.PREFLIGHT,
    restore.OPEN_FILES,
    engine.Step("hold resets", _hold_resets, lambda st, _e: _release_resets(st), barrier="verified"),
    restore.HOST_NODES,
    restore.PUT_BACK,
    # (no restore.DEVICE_VIEW: --device-map is refused for job images)
    restore.PID_NS_VIEW,
    restore.LAZY_DAEMON,
    restore.STOP_GUARD,
    engine.Step("criu restore", restore.CRIU_RESTORE.do, _kill_restored, barrier="criu-restored"),
    engine.Step("release resets", _release_resets),
    restore.RELEASE,
    engine.Step("device restore", _device_restore_locked, phase="device restore", barrier="device-restored"),
    engine.Step("unlock", _unlock, phase="unlock"),
    engine.Step("settle", restore.settle, barrier="settled"),
)


def restore_job(
    directory: Path,
    options: restore.RestoreOptions,
    callbacks: PipelineCallbacks = PipelineCallbacks(),
    *,
    rank_netns: Optional[dict[int, str]] = None,
    net: Optional[netcoord.NetLink] = None,
) -> JobRestoreOutcome:
    """Restore every rank with CRIU, then release them together; all or nothing.

    Each rank runs the restore's steps (RANK_STEPS) in a thread of its own, inside its network
    namespace; a JobCoordinator holds them at RESTORE_PHASES. With ``net`` (netcoord.NetLink)
    every node verifies, CRIU-restores and restores the device state of its ranks in step with
    the others; any node's failure kills the restored ranks on every node.
    """
    try:
        return _restore_job(directory, options, callbacks, rank_netns or {}, net)
    except BaseException as exc:
        if net is not None:
            net.abort(_describe(exc), getattr(exc, "exit_code", None))
        raise


def _restore_job(
    directory: Path,
    options: restore.RestoreOptions,
    callbacks: PipelineCallbacks,
    overrides: dict[int, str],
    net: Optional[netcoord.NetLink],
) -> JobRestoreOutcome:
    start = time.monotonic()
    final = Path(os.path.abspath(directory))
    job = load_job_manifest(final)
    unknown = sorted(set(overrides) - {r.rank for r in job.ranks})
    if unknown:
        raise UsageError(f"--rank-netns names rank(s) {unknown} that the job does not have")
    if options.pidfile is not None:
        raise UsageError(
            "--pidfile is for single images", fix="a job restore prints every rank's root pid instead"
        )
    if options.pipe_to is not None:
        raise UsageError(
            "--pipe-to is not supported for job images yet", fix="dump the job without --external-pipes"
        )
    binary = criu.find_criu()
    coord = JobCoordinator(len(job.ranks), phases=RESTORE_PHASES, net=net)
    states: dict[int, RankState] = {}
    out_lock = threading.Lock()

    with engine.SignalGuard(callbacks.note, what="job restore") as guard:

        def run_rank(r: RankEntry) -> None:
            cb = _rank_callbacks(callbacks, r.rank, out_lock)
            rank_image = final / r.dir
            check_rank_manifest(final, r)
            manifest = load_manifest(rank_image)
            target = _target_netns(r, overrides)
            if target is not None and not os.path.exists(target):
                raise PreflightError(
                    f"network namespace {target} does not exist",
                    fix="create it, or name another with --rank-netns RANK=PATH",
                )
            logs = None if options.logs is None else Path(options.logs) / r.dir
            st = RankState(
                rank_image,
                manifest,
                # A job is restored onto the devices it was dumped on.
                replace(options, logs=logs, device_map=()),
                cb,
                guard,
                start=start,
                overlap=False,
                checks=restore.Checked(binary=binary),
                rank=r.rank,
                netns=target,
            )
            states[r.rank] = st
            try:
                with in_netns(target):
                    pipeline = engine.Pipeline("job restore", RANK_STEPS, cb=cb, guard=guard, barrier=coord)
                    pipeline.run(st)
            finally:
                st.close()

        errors = run_ranks({r.rank: r for r in job.ranks}, run_rank, coord, guard, "npusnap-restore")
    if errors:
        raise _job_restore_error(errors, states, guard, coord.passed("verified"))
    if guard.received is not None:
        callbacks.note(f"{guard.name} was received after every rank was restored; the restore was completed")
    ranks = [states[r.rank] for r in job.ranks]
    # Every rank runs: the communicators between them are made anew (those with ranks on other
    # nodes are given up, with a note); until then their collectives wait.
    restore.rebuild_communicators(
        tuple(p for st in ranks for p in st.npu_pids), ranks[0].restored.pid, callbacks.note
    )
    verified = max(st.verifying.verified_at for st in ranks)
    criu_done = max(st.tree.criu_done for st in ranks)
    device_done = max(st.device.device_done for st in ranks)
    return JobRestoreOutcome(
        image=str(final),
        ranks=tuple(
            {
                "rank": st.rank,
                "root_pid": st.restored.pid,
                "pids": [p.pid for p in st.manifest.processes],
                "npu_pids": list(st.npu_pids),
                "netns": st.netns,
                "criu_log": st.restored.log_path,
                "device_memory": st.checked.device_memory,
            }
            for st in ranks
        ),
        verify_s=verified - start,
        criu_restore_s=criu_done - verified,
        device_restore_s=device_done - criu_done,
        total_s=device_done - start,
    )


def _job_restore_error(
    errors: dict[int, BaseException],
    states: dict[int, RankState],
    guard: engine.SignalGuard,
    verified: bool,
) -> NpusnapError:
    """The first rank's own failure (not its abort by another); once every rank was verified
    (``verified``), it says that nothing runs."""
    for st in states.values():  # a rank whose steps all completed before another failed
        if st.tree.result is not None and not st.killed:
            _kill_tree(st.tree.result.pid)
            st.killed = True
    roots = sorted(st.tree.result.pid for st in states.values() if st.tree.result is not None)
    unknown = [i for i, e in sorted(errors.items()) if isinstance(e, StateUnknownError)]
    primary = [i for i, e in sorted(errors.items()) if not isinstance(e, JobAbortedError)]
    err: NpusnapError
    if unknown or primary:
        i = (unknown or primary)[0]
        first = errors[i]
        err = first if isinstance(first, NpusnapError) else NpusnapError(
            f"restore failed: {_describe(first)}",
            why="unexpected error in npusnap",
            fix="rerun with -v and report it",
        )  # fmt: skip
        if not err.message.startswith(f"rank {i}"):
            err.message = f"rank {i}: {err.message}"
        err.details["rank"] = i
    elif guard.received is not None:
        err = InterruptedError_(f"job restore interrupted by {guard.name}", why="Ctrl-C or SIGTERM")
    else:
        first = next(iter(errors.values()))
        err = first if isinstance(first, NpusnapError) else NpusnapError(_describe(first))
    if not verified:
        return err  # nothing was touched
    if roots:
        err.message += (
            f" — every restored rank was killed (root pids {roots}): nothing runs; "
            "the image is unchanged, restore it again once the cause is fixed"
        )
    else:
        err.message += " — no rank was restored; the image is unchanged"
    err.details["killed_root_pids"] = roots
    err.fix = err.fix or "fix the cause and restore again"
    return err


# --------------------------------------------------------------------------------------------
# restore --wait: stay the restored processes' parent (Slurm tracks a step's descendants)
# --------------------------------------------------------------------------------------------

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def wait_for_exit(roots: list[int], note: Callable[[str], None] = lambda _s: None) -> dict[int, int]:
    """Wait until every restored root exits; forward SIGTERM/SIGINT/SIGHUP/SIGUSR1/2 to them.

    npusnap restore is the subreaper of what it restores (restore.become_subreaper), so the
    roots are our children once CRIU exits: run inside a Slurm step (`srun --overlap npusnap
    restore DIR --wait`), they are that step's descendants, tracked, signalled and accounted by
    Slurm. Returns each root's exit code (negative: killed by that signal).
    """
    remaining = set(roots)
    codes: dict[int, int] = {}

    def forward(signum: int, _frame: Any) -> None:
        note(f"{signal.Signals(signum).name} received: forwarded to pid(s) {sorted(remaining)}")
        for pid in remaining:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    old = (
        {s: signal.signal(s, forward) for s in FORWARDED}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        while remaining:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                # Not (or no longer) our children: watch them through /proc instead.
                for p in [p for p in remaining if not procfs.is_alive(p)]:
                    remaining.discard(p)
                    codes[p] = -1
                time.sleep(0.2)
                continue
            except InterruptedError:
                continue
            if pid in remaining:
                remaining.discard(pid)
                codes[pid] = os.waitstatus_to_exitcode(status)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return codes
