"""A job dump: the dump pipeline once per rank, in threads, held at the job's barriers, and the
job image committed with one rename."""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import psutil

from npusnap_cli import __version__
from npusnap_cli.errors import (
    ImageError,
    InterruptedError_,
    NpusnapError,
    StateUnknownError,
    TargetError,
    UsageError,
)
from npusnap_cli.host import pidns
from npusnap_cli.image import digest as dg
from npusnap_cli.image import layout, publishing
from npusnap_cli.image.job import JOB_MANIFEST, JobManifest, RankEntry, rank_dir_name
from npusnap_cli.image.manifest import load_manifest, now_iso
from npusnap_cli.pipelines import engine
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.dump import DumpOptions, DumpOutcome, dump
from npusnap_cli.pipelines.jobsnap.barriers import (
    DEFAULT_BARRIER_TIMEOUT_S,
    JobAbortedError,
    JobCoordinator,
    _describe,
    _rank_callbacks,
    run_ranks,
)
from npusnap_cli.pipelines.jobsnap.netns import in_netns, netns_id, netns_name
from npusnap_cli.pipelines.netcoord import NetLink


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
                    npu_pids=tuple(p.pid for p in load_manifest(rank_image).npu_processes),
                    manifest_sha256=dg.of_file(layout.manifest_path(rank_image), "sha256"),
                    netns=r.netns,
                    netns_path=r.netns_path,
                )
            )
        job = JobManifest(
            created_at=now_iso(),
            ranks=tuple(entries),
            leave_running=self.options.leave_running,
            tool=__version__,
            node=self.node,
            nodes=self.nodes,
        )
        self.job = job
        path = tmp / JOB_MANIFEST
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, layout.FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(job.to_dict(), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        publishing.fsync_tree(tmp)
        old: Optional[Path] = None
        if final.exists() and not layout.dir_is_empty(final):
            if not self.options.force:
                raise UsageError(
                    f"{final} appeared and is not empty",
                    why="something wrote into the target directory during the dump",
                    fix="dump into a new directory, or pass --force to replace it",
                )
            old = final.parent / f".{final.name}{layout.OLD_MARKER}{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if old is not None:
            layout.remove_tree(old)


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
    layout.check_dump_target(final, force=options.force)
    for stale in layout.remove_stale_temps(final):
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
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{final.name}{layout.TMP_MARKER}{os.getpid()}-", dir=str(final.parent))
    )
    os.chmod(tmp, layout.DIR_MODE)
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
            layout.remove_tree(tmp)
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
    summary = {str(i): _describe(e) for i, e in sorted(errors.items())}
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
