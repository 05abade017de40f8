"""A job image: one ordinary image per rank under one directory, named by ``npusnap-job.json``.

Written by ``npusnap dump PID PID ... DIR`` (pipelines/jobsnap/), read here::

    DIR/npusnap-job.json   {"schema": "npusnap-job/1", "ranks": [{"rank": 0, "dir": "rank-0", ...}]}
    DIR/rank-0/            an ordinary image (npusnap.json, criu/, ...)
    DIR/rank-1/

The job manifest records each rank's manifest sha256: ``verify_job`` refuses a rank image that was
replaced, then verifies each rank as an ordinary image.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from npusnap_cli.errors import ImageError
from npusnap_cli.image import digest as dg
from npusnap_cli.image import integrity
from npusnap_cli.image.layout import manifest_path
from npusnap_cli.jsontypes import (
    JSONObject,
    JSONValue,
    ShapeError,
    as_record,
    int_list,
    opt_bool,
    opt_int,
    opt_str,
    req_int,
    req_list,
    req_str,
)

JOB_MANIFEST = "npusnap-job.json"
JOB_SCHEMA = "npusnap-job/1"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank}"


def is_job_image(directory: Path) -> bool:
    return (Path(directory) / JOB_MANIFEST).is_file()


@dataclass(frozen=True)
class RankEntry:
    rank: int
    dir: str
    pid: int
    npu_pids: tuple[int, ...]
    manifest_sha256: str
    netns: Optional[str] = None  # net:[inode] at dump time, when not npusnap's own
    netns_path: Optional[str] = None  # its /run/netns name at dump time, if it had one

    def to_dict(self) -> JSONObject:
        return {
            "rank": self.rank,
            "dir": self.dir,
            "pid": self.pid,
            "npu_pids": list(self.npu_pids),
            "manifest_sha256": self.manifest_sha256,
            "netns": self.netns,
            "netns_path": self.netns_path,
        }

    @classmethod
    def from_json(cls, value: JSONValue, index: int) -> RankEntry:
        """Rank ``index``'s entry of the job manifest; ShapeError if it is not one."""
        r = as_record(value, f"rank entry {index}")
        d = req_str(r, "dir")
        if req_int(r, "rank") != index or "/" in d or d in ("", ".", ".."):
            raise ShapeError(f"rank entry {index} is malformed")
        return cls(
            rank=index,
            dir=d,
            pid=req_int(r, "pid"),
            npu_pids=int_list(r, "npu_pids", optional=True),
            manifest_sha256=req_str(r, "manifest_sha256"),
            netns=opt_str(r, "netns"),
            netns_path=opt_str(r, "netns_path"),
        )


@dataclass(frozen=True)
class JobManifest:
    created_at: str
    ranks: tuple[RankEntry, ...]
    leave_running: bool
    tool: str
    node: int = 0  # this part's node, in a job dumped across nodes (--coordinator)
    nodes: int = 1

    def to_dict(self) -> JSONObject:
        return {
            "schema": JOB_SCHEMA,
            "created_at": self.created_at,
            "tool": self.tool,
            "leave_running": self.leave_running,
            "node": self.node,
            "nodes": self.nodes,
            "ranks": [r.to_dict() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, value: JSONValue) -> JobManifest:
        """The job manifest's content; ShapeError naming what is wrong."""
        data = as_record(value, "the job manifest")
        if data.get("schema") != JOB_SCHEMA:
            raise ShapeError(f"schema {data.get('schema')!r}, expected {JOB_SCHEMA!r}")
        ranks = tuple(RankEntry.from_json(r, i) for i, r in enumerate(req_list(data, "ranks")))
        if not ranks:
            raise ShapeError("no ranks")
        return cls(
            created_at=req_str(data, "created_at"),
            ranks=ranks,
            leave_running=bool(opt_bool(data, "leave_running")),
            tool=opt_str(data, "tool") or "",
            node=opt_int(data, "node") or 0,
            nodes=1 if data.get("nodes") is None else req_int(data, "nodes"),
        )


def load_job_manifest(directory: Path) -> JobManifest:
    path = Path(directory) / JOB_MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ImageError(
            f"{directory} is not a job image: {JOB_MANIFEST} is missing",
            fix="name the directory written by `npusnap dump PID PID ... DIR`",
        ) from None
    except (OSError, ValueError) as exc:
        raise ImageError(f"cannot read {path}: {exc}", fix="the job image is damaged; dump again") from None
    try:
        return JobManifest.from_json(data)
    except ShapeError as exc:
        raise ImageError(
            f"{path} is not a valid job manifest: {exc}",
            fix="the job image is damaged or from another tool; dump again",
        ) from None


@dataclass(frozen=True)
class JobVerifyResult:
    image: str
    ranks: tuple[Any, ...]  # integrity.VerifyResult per rank

    def to_dict(self) -> JSONObject:
        return {"image": self.image, "ranks": [r.to_dict() for r in self.ranks]}


def check_rank_manifest(final: Path, r: RankEntry) -> None:
    """Rank ``r``'s image is present in the job image ``final`` and its manifest is the one the
    job names (sha256); ImageError otherwise."""
    rank_image = final / r.dir
    mpath = manifest_path(rank_image)
    try:
        digest = dg.of_file(mpath, "sha256")
    except OSError as exc:
        raise ImageError(
            f"rank {r.rank}'s image {rank_image} is missing or unreadable: {exc.strerror or exc}",
            fix="the job image is incomplete; dump the job again",
            details={"rank": r.rank},
        ) from None
    if digest != r.manifest_sha256:
        raise ImageError(
            f"rank {r.rank}'s manifest {mpath} is not the one the job recorded",
            why="its sha256 differs from the job manifest's: the rank image was replaced or modified",
            fix="restore only job images as `npusnap dump` wrote them; dump the job again",
            details={"rank": r.rank, "expected": r.manifest_sha256, "found": digest},
        )


def verify_job(
    directory: Path, *, checksums: bool = True, require_signature: Optional[Path] = None
) -> tuple[JobManifest, JobVerifyResult]:
    """Every rank image present, its manifest the one the job names (sha256), and verified."""
    final = Path(os.path.abspath(directory))
    job = load_job_manifest(final)
    results = []
    for r in job.ranks:
        rank_image = final / r.dir
        check_rank_manifest(final, r)
        try:
            results.append(
                integrity.verify(rank_image, checksums=checksums, require_signature=require_signature)
            )
        except ImageError as err:
            err.message = f"rank {r.rank}: {err.message}"
            err.details["rank"] = r.rank
            raise
    return job, JobVerifyResult(image=str(final), ranks=tuple(results))
