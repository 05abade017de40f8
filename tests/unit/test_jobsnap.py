"""Job snapshots without processes: the barriers, the job manifest, --rank-netns, /proc/net/tcp."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from npusnap_cli.commands.jobcmd import parse_rank_netns
from npusnap_cli.errors import ImageError, UsageError
from npusnap_cli.host import tcpunlock
from npusnap_cli.image import job as imgjob
from npusnap_cli.pipelines.jobsnap import barriers, jobdump


def _run_ranks(
    coord: barriers.JobCoordinator, n: int, fail_rank: int = -1, fail_phase: str = ""
) -> dict[int, str]:
    outcome: dict[int, str] = {}

    def rank(i: int) -> None:
        try:
            for phase in barriers.PHASES:
                if i == fail_rank and phase == fail_phase:
                    raise RuntimeError("boom")
                coord.sync(phase)
            outcome[i] = "done"
        except barriers.JobAbortedError as exc:
            outcome[i] = f"aborted at {exc.details['phase']}"
        except RuntimeError:
            coord.abort("boom", i)
            outcome[i] = "failed"

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return outcome


def test_every_rank_passes_every_phase_and_the_job_commits_once() -> None:
    commits: list[int] = []
    coord = barriers.JobCoordinator(3, timeout_s=5, on_commit=lambda: commits.append(1))
    assert _run_ranks(coord, 3) == {0: "done", 1: "done", 2: "done"}
    assert commits == [1]


def test_a_failed_rank_releases_the_others_with_an_error_and_nothing_commits() -> None:
    commits: list[int] = []
    coord = barriers.JobCoordinator(3, timeout_s=5, on_commit=lambda: commits.append(1))
    out = _run_ranks(coord, 3, fail_rank=2, fail_phase="criu")
    assert out[2] == "failed"
    assert out[0] == out[1] == "aborted at criu"  # waiting for rank 2 at the end of "criu"
    assert commits == [] and coord.failed_rank == 2 and coord.reason == "boom"


def test_a_failed_commit_fails_every_rank() -> None:
    def commit() -> None:
        raise ImageError("disk full")

    coord = barriers.JobCoordinator(2, timeout_s=5, on_commit=commit)
    errors: list[BaseException] = []

    def rank() -> None:
        try:
            for phase in barriers.PHASES:
                coord.sync(phase)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 2
    assert any(isinstance(e, ImageError) for e in errors)
    assert any(isinstance(e, barriers.JobAbortedError) for e in errors)


def test_a_rank_that_never_arrives_times_the_barrier_out() -> None:
    coord = barriers.JobCoordinator(2, timeout_s=0.3)
    with pytest.raises(barriers.JobAbortedError):
        coord.sync("preflight")
    assert coord.reason is not None and "within" in coord.reason


def _job(tmp: Path, sha: str, rank_dir: str = "rank-0") -> Path:
    (tmp / "rank-0").mkdir()
    (tmp / "rank-0" / "npusnap.json").write_text("{}")
    manifest = {
        "schema": imgjob.JOB_SCHEMA,
        "created_at": "now",
        "tool": "x",
        "leave_running": False,
        "ranks": [{"rank": 0, "dir": rank_dir, "pid": 1, "npu_pids": [1], "manifest_sha256": sha}],
    }
    (tmp / imgjob.JOB_MANIFEST).write_text(json.dumps(manifest))
    return tmp


def test_a_replaced_rank_manifest_is_refused(tmp_path: Path) -> None:
    _job(tmp_path, "0" * 64)
    assert imgjob.is_job_image(tmp_path)
    with pytest.raises(ImageError, match=r"rank 0's manifest .* is not the one the job recorded"):
        imgjob.verify_job(tmp_path)


@pytest.mark.parametrize("bad", ["../x", "a/b", ""])
def test_a_rank_directory_outside_the_job_is_refused(tmp_path: Path, bad: str) -> None:
    _job(tmp_path, "0" * 64, rank_dir=bad)
    with pytest.raises(ImageError, match="not a valid job manifest"):
        imgjob.load_job_manifest(tmp_path)


def test_a_missing_job_manifest_is_named(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match=r"npusnap-job\.json is missing"):
        imgjob.load_job_manifest(tmp_path)


def test_rank_netns_parsing() -> None:
    assert parse_rank_netns(["0=/run/netns/a", "1=/proc/9/ns/net"]) == {
        0: "/run/netns/a",
        1: "/proc/9/ns/net",
    }
    for bad in ("x=/a", "1", "1="):
        with pytest.raises(UsageError):
            parse_rank_netns([bad])


def test_proc_net_tcp_addresses() -> None:
    assert tcpunlock._hex_addr("0100007F:1BBC") == ("127.0.0.1", 7100)
    assert tcpunlock._hex_addr("0000000000000000FFFF00000100007F:0050") == ("127.0.0.1", 80)
    assert tcpunlock._hex_addr("00000000000000000000000001000000:0016") == ("::1", 22)


def test_a_rank_inside_another_ranks_tree_is_refused() -> None:
    import os

    with pytest.raises(UsageError, match="is in the process tree of pid"):
        jobdump._check_disjoint([os.getppid(), os.getpid()])
    jobdump._check_disjoint([os.getpid()])
