"""The JSON records parsed in one place: good input, a missing key, a wrong type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npusnap_cli.errors import ImageError
from npusnap_cli.image import containers
from npusnap_cli.image import job as imgjob
from npusnap_cli.image.imagestore import _OwnRecord
from npusnap_cli.jsontypes import ShapeError
from npusnap_cli.pipelines import netcoord

RANK = {"rank": 0, "dir": "rank-0", "pid": 7, "npu_pids": [7], "manifest_sha256": "0" * 64, "netns": None}
JOB = {"schema": imgjob.JOB_SCHEMA, "created_at": "now", "tool": "x", "leave_running": False, "ranks": [RANK]}


def test_a_job_manifest_reads_and_writes_back() -> None:
    m = imgjob.JobManifest.from_json(JOB)
    assert m.ranks[0].npu_pids == (7,) and m.node == 0 and m.nodes == 1
    assert imgjob.JobManifest.from_json(json.loads(json.dumps(m.to_dict()))) == m


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"created_at": None}, "'created_at' is missing"),
        ({"ranks": [{k: v for k, v in RANK.items() if k != "pid"}]}, "'pid' is missing"),
        ({"ranks": [{**RANK, "pid": "7"}]}, "'pid' is a str, not an integer"),
        ({"ranks": [{**RANK, "npu_pids": [True]}]}, "'npu_pids' holds a bool"),
        ({"ranks": "rank-0"}, "'ranks' is a str, not an array"),
        ({"nodes": 1.5}, "'nodes' is a float"),
    ],
)
def test_a_malformed_job_manifest_is_an_image_error(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    data = {k: v for k, v in {**JOB, **change}.items() if v is not None}
    (tmp_path / imgjob.JOB_MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ImageError, match=f"not a valid job manifest: {message}"):
        imgjob.load_job_manifest(tmp_path)


STATE = {
    "kind": containers.KIND,
    "format": containers.STATE_FORMAT,
    "created": "now",
    "lease_s": 60,
    "processes": [{"pid": 5, "ns_pid": 1, "agent_socket": "/s", "lock_token": "t"}],
    "files": [{"path": "a.img", "size": 3, "sha256": "ab"}],
}


def test_a_plugin_state_reads() -> None:
    state = containers._parse_state("src", json.dumps(STATE).encode())
    assert state.files == (containers.PluginFile("a.img", 3, "ab"),) and state.processes[0].pid == 5
    assert state.job is None and state.lease_s == 60


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"files": [{"path": "a.img", "sha256": "ab"}]}, "'size' is missing"),
        ({"files": [{"path": "a.img", "size": "3", "sha256": "ab"}]}, "'size' is a str"),
        ({"processes": [{"pid": "5"}]}, "'pid' is a str"),
        ({"processes": ["x"]}, "an entry of 'processes' is a str"),
        ({"job": [1]}, "'job' is a list"),
    ],
)
def test_a_malformed_plugin_state_is_an_image_error(change: dict[str, object], message: str) -> None:
    with pytest.raises(ImageError, match=message):
        containers._parse_state("src", json.dumps({**STATE, **change}).encode())


def test_an_own_image_record_needs_every_field() -> None:
    rec = {"path": "/i", "dev": 1, "ino": 2, "uid": 0, "time": 3}
    assert _OwnRecord.from_json(rec).to_json() == {**rec, "time": 3.0}
    with pytest.raises(ShapeError, match="'ino' is missing"):
        _OwnRecord.from_json({k: v for k, v in rec.items() if k != "ino"})
    with pytest.raises(ShapeError, match="'dev' is a str"):
        _OwnRecord.from_json({**rec, "dev": "1"})


def test_a_coordinator_message_keeps_what_it_can_follow() -> None:
    assert netcoord._message({"arrive": "locked"}) == {"arrive": "locked"}
    assert netcoord._message({"abort": "x", "node": 2, "exit_code": 9}) == {
        "abort": "x",
        "node": 2,
        "exit_code": 9,
    }
    assert netcoord._message({"arrive": 5, "node": "1", "exit_code": "9"}) == {}  # out of step
    assert netcoord._message({"abort": None}) == {"abort": ""}  # an abort without a reason
    assert netcoord._message([1]) is None
