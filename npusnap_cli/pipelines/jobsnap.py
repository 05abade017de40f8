"""Coordinated snapshots of a distributed job: every rank at the same logical moment, or none.

A *job* is several process trees (one per rank: ``npusnap dump PID PID ... DIR``). Each rank runs
the ordinary dump pipeline (dump/) in its own thread, and a ``JobCoordinator`` holds them at
the phase boundaries::

    preflight everywhere  | barrier "preflight"
    lock + backup         | barrier "backup"     (no rank is frozen by CRIU before all are backed up)
    CRIU dump             | barrier "criu"       (no rank is unlocked or killed before all are dumped)
    publish rank-N/       | barrier "publish"    (its action commits the job: one rename)
    kill (or unlock with --leave-running)

Any failure, in any rank and at any step (or a signal), aborts the barriers: every other rank
raises at its next boundary and rolls back exactly as a failed single dump does (running,
unlocked), and the job's work directory, with every rank image in it, is removed.

A rank whose root process lives in another network namespace (ranks on "nodes" simulated by
namespaces, or containers) is dumped by a thread that entered that namespace first: CRIU, which
the thread starts, then runs there, as it must for ``--tcp-established`` and its network lock.

Job image layout (docs/image-format.md)::

    DIR/npusnap-job.json   {"schema": "npusnap-job/1", "ranks": [{"rank": 0, "dir": "rank-0", ...}]}
    DIR/rank-0/            an ordinary image (npusnap.json, criu/, ...)
    DIR/rank-1/

Restore runs the single restore's steps (restore/) once per rank, each rank in a thread inside
its network namespace, with barriers between them (RESTORE_PHASES)::

    verify + preflight    | barrier "verified"        (nothing restored before every rank checked)
    CRIU restore          | barrier "criu-restored"   (every rank exists again, locked)
    device restore        | barrier "device-restored" (no rank unlocked before all have their state)
    unlock, settle        | barrier "settled"

If anything fails on the way, in any rank, every rank undoes its steps: a restored rank's tree is
killed (the undo of its CRIU step), nothing is left half-running, the image is intact.
While the ranks are being restored, the TCP resets their namespaces would send on the job's
connections are dropped (tcpunlock.ResetHold), so that the end restored first keeps them.

Across nodes (``--coordinator``), one npusnap per node runs the above for its ranks, and every
barrier's action also waits for every other node (netcoord.NetLink); see docs/distributed.md.

Core module: returns frozen dataclasses, never prints.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, TypeVar

import psutil

from npusnap_cli import __version__, criu
from npusnap_cli import image as img
from npusnap_cli.device.devicegroup import DeviceGroup
from npusnap_cli.errors import (
    ImageError,
    InterruptedError_,
    NpusnapError,
    PreflightError,
    StateUnknownError,
    TargetError,
    UsageError,
)
from npusnap_cli.host import pidns, procfs, proctree, tcpunlock
from npusnap_cli.image import digest as dg
from npusnap_cli.image.job import (
    JOB_MANIFEST,
    JobManifest,
    RankEntry,
    check_rank_manifest,
    load_job_manifest,
    rank_dir_name,
)
from npusnap_cli.pipelines import engine, netcoord, restore, restoreguard
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.dump import DumpOptions, DumpOutcome, dump
from npusnap_cli.pipelines.netcoord import NetLink

PHASES = ("preflight", "backup", "criu", "publish")
RESTORE_PHASES = ("verified", "criu-restored", "device-restored", "settled")
DEFAULT_BARRIER_TIMEOUT_S = 600.0
CLONE_NEWNET = 0x40000000


# --------------------------------------------------------------------------------------------
# Barriers
# --------------------------------------------------------------------------------------------


class JobAbortedError(NpusnapError):
    """This rank stopped because another rank (or a signal) failed the job; it rolled back."""

    kind = "job-aborted"


class JobCoordinator:
    """One barrier per phase for ``n`` ranks; ``abort(reason)`` releases every waiter with an error.

    ``on_commit`` runs once, in the last rank to reach "publish", before any rank goes on: the
    job is committed there. If it raises, the barrier breaks and every rank rolls back.
    """

    def __init__(
        self,
        n: int,
        *,
        timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
        on_commit: Optional[Callable[[], None]] = None,
        net: Optional[NetLink] = None,
        phases: tuple[str, ...] = PHASES,
    ) -> None:
        self.n = n
        self.net = net  # the same phases across nodes
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.reason: Optional[str] = None
        self.failed_rank: Optional[int] = None
        self.commit_error: Optional[BaseException] = None
        self.reached: dict[str, int] = {}
        self._passed: set[str] = set()
        self._on_commit = on_commit
        self._barriers = {p: threading.Barrier(n, action=self._action(p)) for p in phases}

    def _action(self, phase: str) -> Callable[[], None]:
        """Runs once per phase, in the last rank to arrive, before any rank is released."""

        def act() -> None:
            if self.net is not None:
                self.net.sync(phase)  # every node's ranks got here too (raises NodeAborted)
            if phase == "publish" and self._on_commit is not None:
                try:
                    self._on_commit()
                except BaseException as exc:
                    # The barrier breaks (every other rank raises); this rank gets ``exc``.
                    self.commit_error = exc
                    with self._lock:
                        if self.reason is None:
                            self.reason = f"committing the job failed: {_describe(exc)}"
                    raise
            self._passed.add(phase)

        return act

    def abort(self, reason: str, rank: Optional[int] = None, exit_code: Optional[int] = None) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
                self.failed_rank = rank
        if self.net is not None:
            self.net.abort(reason if rank is None else f"rank {rank}: {reason}", exit_code)
        for b in self._barriers.values():
            b.abort()

    def _error(self, phase: str) -> JobAbortedError:
        who = f"rank {self.failed_rank}" if self.failed_rank is not None else "the job"
        return JobAbortedError(
            f"stopped before the end of '{phase}': {who} failed ({self.reason or 'unknown'})",
            why="a coordinated snapshot is all ranks or none",
            fix="see the failed rank's error",
            details={"phase": phase, "failed_rank": self.failed_rank},
        )

    def passed(self, phase: str) -> bool:
        """Every rank reached ``phase`` (and went on)."""
        return phase in self._passed

    def sync(self, phase: str) -> None:
        """Block until every rank reached ``phase``; JobAbortedError if the job failed meanwhile."""
        barrier = self._barriers[phase]
        with self._lock:
            self.reached[phase] = self.reached.get(phase, 0) + 1
        try:
            barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            if phase in self._passed:
                return  # released, then aborted while leaving: the next phase reports it
            if self.reason is None:
                self.abort(f"a rank did not reach '{phase}' within {self.timeout_s:.0f}s")
            raise self._error(phase) from None


R = TypeVar("R")


def run_ranks(
    ranks: dict[int, R],
    body: Callable[[R], None],
    coord: JobCoordinator,
    guard: engine.SignalGuard,
    name: str,
) -> dict[int, BaseException]:
    """``body`` for every rank, each in a thread of its own (named NAME-RANK), joined: a rank's
    own failure aborts the others through ``coord`` (an abort by another rank does not abort
    again), and so does a signal ``guard`` caught. The failures by rank."""
    errors: dict[int, BaseException] = {}

    def run(rank: int, item: R) -> None:
        try:
            body(item)
        except BaseException as exc:
            errors[rank] = exc
            if not isinstance(exc, JobAbortedError):
                coord.abort(_describe(exc), rank, getattr(exc, "exit_code", None))

    threads = [threading.Thread(target=run, args=(i, x), name=f"{name}-{i}") for i, x in ranks.items()]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.1)
        if guard.received is not None and coord.reason is None:
            coord.abort(f"{guard.name} received")
    return errors


def _describe(exc: BaseException) -> str:
    if isinstance(exc, NpusnapError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------
# Network namespaces: a thread that enters one starts CRIU there
# --------------------------------------------------------------------------------------------


def netns_id(pid: Optional[int] = None) -> str:
    """``net:[inode]`` of ``pid`` (or of this thread)."""
    where = (
        f"/proc/{pid}/ns/net" if pid is not None else f"/proc/self/task/{threading.get_native_id()}/ns/net"
    )
    return os.readlink(where)


def netns_name(ns: str) -> Optional[str]:
    """The /run/netns path (``ip netns``) bound to namespace ``ns``, if any."""
    run = Path("/run/netns")
    with contextlib.suppress(OSError):
        for entry in sorted(run.iterdir()):
            with contextlib.suppress(OSError):
                if f"net:[{os.stat(entry).st_ino}]" == ns:
                    return str(entry)
    return None


@contextlib.contextmanager
def in_netns(path: Optional[str]) -> Iterator[None]:
    """Run the body (in this thread only) inside the network namespace at ``path``."""
    if path is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise PreflightError(
                f"cannot open the network namespace {path}: {exc.strerror}",
                fix="check the path (`ip netns list`; /proc/PID/ns/net of a process in it)",
            ) from None
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise PreflightError(
                    f"cannot enter the network namespace {path}: {os.strerror(err)}",
                    why="setns(CLONE_NEWNET) needs CAP_SYS_ADMIN",
                    fix="run npusnap as root",
                )
        finally:
            os.close(fd)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # pragma: no cover - our own namespace
                raise StateUnknownError(
                    "could not return to npusnap's own network namespace",
                    fix="rerun the command; the processes' states are reported above",
                )
    finally:
        os.close(own)


# --------------------------------------------------------------------------------------------
# Dump
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobDumpOutcome:
    image: str
    manifest: JobManifest
    ranks: tuple[DumpOutcome, ...]  # by rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "job": self.manifest.to_dict(),
            "ranks": [r.to_dict() for r in self.ranks],
        }


def _rank_callbacks(cb: PipelineCallbacks, rank: int, lock: threading.Lock) -> PipelineCallbacks:
    """Phases and notes prefixed with the rank; byte-level progress is not shown for jobs."""

    def phase(label: str) -> None:
        with lock:
            cb.phase(f"rank {rank}: {label}")

    def note(text: str) -> None:
        with lock:
            cb.note(f"rank {rank}: {text}")

    return PipelineCallbacks(phase=phase, progress=lambda *_a: None, note=note)


@dataclass(frozen=True)
class _Rank:
    """One rank of a job dump: the root of its tree, and its network namespace if not ours."""

    rank: int
    pid: int
    netns: Optional[str]
    netns_path: Optional[str]
    enter: Optional[str]  # the namespace to dump it from


class _Commit:
    """The job's commit, run once in the last rank to reach "publish" (JobCoordinator): the job
    manifest written, the work directory renamed into place. ``job`` is what it wrote."""

    def __init__(
        self, tmp: Path, final: Path, ranks: list[_Rank], options: DumpOptions, node: int, nodes: int
    ) -> None:
        self.tmp, self.final, self.ranks, self.options = tmp, final, ranks, options
        self.node, self.nodes = node, nodes
        self.job: Optional[JobManifest] = None

    def __call__(self) -> None:
        try:
            self._write_and_rename()
        except OSError as exc:
            raise ImageError(
                f"committing the job image failed: {exc.strerror or exc}",
                why="the disk is full or the filesystem refused a write",
                fix=f"free space in {self.final.parent} (or choose another place) and dump again",
                details={"errno": exc.errno, "path": getattr(exc, "filename", None)},
            ) from None

    def _write_and_rename(self) -> None:
        tmp, final = self.tmp, self.final
        entries = []
        for r in self.ranks:
            rank_image = tmp / rank_dir_name(r.rank)
            entries.append(
                RankEntry(
                    rank=r.rank,
                    dir=rank_dir_name(r.rank),
                    pid=r.pid,
                    npu_pids=tuple(p.pid for p in img.load_manifest(rank_image).npu_processes),
                    manifest_sha256=dg.of_file(img.manifest_path(rank_image), "sha256"),
                    netns=r.netns,
                    netns_path=r.netns_path,
                )
            )
        job = JobManifest(
            created_at=img.now_iso(),
            ranks=tuple(entries),
            leave_running=self.options.leave_running,
            tool=__version__,
            node=self.node,
            nodes=self.nodes,
        )
        self.job = job
        path = tmp / JOB_MANIFEST
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, img.FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(job.to_dict(), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        img.fsync_tree(tmp)
        old: Optional[Path] = None
        if final.exists() and not img.dir_is_empty(final):
            if not self.options.force:
                raise UsageError(
                    f"{final} appeared and is not empty",
                    why="something wrote into the target directory during the dump",
                    fix="dump into a new directory, or pass --force to replace it",
                )
            old = final.parent / f".{final.name}{img.OLD_MARKER}{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if old is not None:
            img.remove_tree(old)


def _check_disjoint(pids: list[int]) -> None:
    """No rank may be inside another rank's tree (it would be dumped twice)."""
    given = set(pids)
    for pid in pids:
        try:
            parents = {p.pid for p in psutil.Process(pid).parents()}
        except psutil.Error:
            continue  # resolve_target names a missing pid
        inside = sorted(parents & given)
        if inside:
            raise UsageError(
                f"pid {pid} is in the process tree of pid {inside[0]}, also given",
                why="each PID is the root of one rank's tree, and a tree is dumped with all its descendants",
                fix=f"drop pid {pid} (it is dumped with pid {inside[0]}'s tree)",
                details={"pid": pid, "ancestor": inside[0]},
            )


# A job whose ranks all-reduce: a rank locked while its all-reduce waits for a rank whose launch
# of it the other lock holds cannot drain (DEVICE_BUSY). Every rank is rolled back, and the whole
# job dump tries again, all ranks together, after a short random pause.
JOB_BUSY_RETRIES = 5
JOB_DRAIN_TIMEOUT_S = 3.0


def _device_busy(err: BaseException) -> bool:
    details = getattr(err, "details", None) or {}
    agent_error = details.get("agent_error") if isinstance(details, dict) else None
    return isinstance(agent_error, dict) and agent_error.get("name") == "DEVICE_BUSY"


def dump_job(
    pids: list[int],
    directory: Path,
    options: DumpOptions,
    callbacks: PipelineCallbacks = PipelineCallbacks(),
    *,
    barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
    net: Optional[NetLink] = None,
    node: int = 0,
    nodes: int = 1,
) -> JobDumpOutcome:
    """Dump every rank (one process tree per pid) as one job image; all or nothing.

    With ``net`` (netcoord.NetLink), this is node ``node`` of ``nodes``: every phase boundary is
    also a barrier across the nodes, and a failure on any node rolls back every node. On one
    node, a dump that failed only because a rank's devices did not drain after Lock (a collective
    straddling the ranks' locks) is tried again, every rank together, at most JOB_BUSY_RETRIES
    times; each rank's pipeline then does not retry by itself.
    """
    per_rank = replace(
        options,
        busy_retries=0 if net is None else None,
        drain_timeout_s=options.drain_timeout_s or JOB_DRAIN_TIMEOUT_S,
    )
    retries = JOB_BUSY_RETRIES if net is None else 0
    for attempt in range(retries + 1):
        try:
            return _dump_job_once(
                pids, directory, per_rank, callbacks, barrier_timeout_s=barrier_timeout_s, net=net, node=node,
                nodes=nodes,
            )  # fmt: skip
        except NpusnapError as err:
            if (
                attempt == retries
                or not _device_busy(err)
                or err.details.get("partial_image_removed") is False
            ):
                raise
            callbacks.note(
                "a rank's devices were still busy after Lock, every rank rolled back: trying again "
                f"({err.message})"
            )
            time.sleep(random.uniform(0.1, 0.5))
    raise AssertionError("unreachable")


def _dump_job_once(
    pids: list[int],
    directory: Path,
    options: DumpOptions,
    callbacks: PipelineCallbacks,
    *,
    barrier_timeout_s: float,
    net: Optional[NetLink],
    node: int,
    nodes: int,
) -> JobDumpOutcome:
    if len(set(pids)) != len(pids):
        raise UsageError("a pid was given twice", fix="name each rank's root pid once")
    _check_disjoint(pids)
    pidns.check_job_cwds(pids)
    final = Path(os.path.abspath(directory))
    img.check_dump_target(final, force=options.force)
    for stale in img.remove_stale_temps(final):
        callbacks.note(f"removed {stale}, left by an earlier dump that did not finish")
    own_ns = netns_id()
    ranks: list[_Rank] = []
    for i, pid in enumerate(pids):
        try:
            ns = netns_id(pid)
        except OSError:
            raise TargetError(
                f"no process with pid {pid} (rank {i})",
                why="it exited, or it lives in another PID namespace",
                fix="check the pids with `ps -p PID` and rerun",
            ) from None
        other = ns != own_ns
        ranks.append(
            _Rank(
                rank=i,
                pid=pid,
                netns=ns if other else None,
                netns_path=netns_name(ns) if other else None,
                enter=f"/proc/{pid}/ns/net" if other else None,
            )
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{img.TMP_MARKER}{os.getpid()}-", dir=str(final.parent)))
    os.chmod(tmp, img.DIR_MODE)
    commit = _Commit(tmp, final, ranks, options, node, nodes)
    coord = JobCoordinator(len(pids), timeout_s=barrier_timeout_s, on_commit=commit, net=net)
    outcomes: dict[int, DumpOutcome] = {}
    out_lock = threading.Lock()

    def run_rank(r: _Rank) -> None:
        i = r.rank
        with in_netns(r.enter):
            outcomes[i] = dump(
                r.pid,
                tmp / rank_dir_name(i),
                options,
                _rank_callbacks(callbacks, i, out_lock),
                coord,
                published=final / rank_dir_name(i),
            )

    with engine.SignalGuard(callbacks.note, what="job dump") as guard:
        errors = run_ranks({r.rank: r for r in ranks}, run_rank, coord, guard, "npusnap-rank")
    committed = not tmp.exists()
    if committed and not errors and guard.received is not None:
        callbacks.note(f"{guard.name} was received after the job was committed; the dump was completed")
    if errors or (guard.received is not None and not committed):
        if not committed:
            img.remove_tree(tmp)
        raise _job_error(errors, coord, guard, committed, final)
    job = commit.job
    assert job is not None  # committed
    return JobDumpOutcome(image=str(final), manifest=job, ranks=tuple(outcomes[i] for i in range(len(pids))))


def _job_error(
    errors: dict[int, BaseException],
    coord: JobCoordinator,
    guard: engine.SignalGuard,
    committed: bool,
    final: Path,
) -> NpusnapError:
    summary = {i: _describe(e) for i, e in sorted(errors.items())}
    unknown = [i for i, e in errors.items() if isinstance(e, StateUnknownError)]
    if unknown:
        err: NpusnapError = errors[unknown[0]]  # type: ignore[assignment]
        err.message = f"rank {unknown[0]}: {err.message}"
        err.details["ranks"] = summary
        return err
    primary = [i for i, e in sorted(errors.items()) if not isinstance(e, JobAbortedError)]
    state = (
        f"the job image was committed to {final} but a rank failed afterwards: the image is complete, "
        "check the ranks"
        if committed
        else "every rank was rolled back and is running; no image was written"
    )
    if primary:
        i = primary[0]
        first = errors[i]
        if isinstance(first, NpusnapError):
            first.message = f"rank {i}: {first.message} — {state}"
            first.details["ranks"] = summary
            first.details["failed_rank"] = i
            first.details["partial_image_removed"] = not committed
            return first
        return NpusnapError(
            f"rank {i} failed: {_describe(first)} — {state}",
            why="unexpected error in npusnap",
            fix="rerun with -v and report it",
            details={"ranks": summary, "failed_rank": i},
        )
    if guard.received is not None:
        return InterruptedError_(
            f"job dump interrupted by {guard.name} — {state}",
            why="Ctrl-C or SIGTERM",
            fix="rerun the dump when ready",
            details={"ranks": summary},
        )
    if coord.commit_error is not None and isinstance(coord.commit_error, NpusnapError):
        e = coord.commit_error
        e.message += f" — {state}"
        return e
    return NpusnapError(
        f"the job dump failed: {coord.reason} — {state}",
        why="a rank stopped the job",
        fix="see details.ranks",
        details={"ranks": summary},
    )


# --------------------------------------------------------------------------------------------
# Restore
# --------------------------------------------------------------------------------------------


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
        st.hold = tcpunlock.ResetHold(tcpunlock.image_connections(str(img.criu_dir(st.image))))
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
    if st.result is not None:
        _kill_tree(st.result.pid)
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
        st.group.restore(st.device_memory_files)


def _unlock(st: RankState) -> None:
    if st.group is not None:
        st.group.unlock()
    st.device_done = time.monotonic()


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
            manifest = img.load_manifest(rank_image)
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
                binary=binary,
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
    verified = max(st.verified_at for st in ranks)
    criu_done = max(st.criu_done for st in ranks)
    device_done = max(st.device_done for st in ranks)
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
        if st.result is not None and not st.killed:
            _kill_tree(st.result.pid)
            st.killed = True
    roots = sorted(st.result.pid for st in states.values() if st.result is not None)
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
