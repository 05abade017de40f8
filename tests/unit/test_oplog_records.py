"""The operations log's records: a history line and a running file, parsed in one place."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from npusnap_cli.host import oplog

LINE = {
    "time": "2024-01-01T00:00:00+00:00",
    "op": "dump",
    "pids": [12, 13],
    "starts": {"12": 100.5, "13": None},
    "image": "/images/a",
    "user": "root(uid 0)",
    "npusnap_pid": 99,
    "exit_code": 0,
    "result": "ok",
    "error": None,
    "duration_s": 1.25,
}


def test_a_history_line_reads_and_writes_back_the_same() -> None:
    rec = oplog.HistoryRecord.from_json(json.loads(json.dumps(LINE)))
    assert rec.pids == (12, 13) and rec.start_of(12) == 100.5 and rec.start_of(13) is None and rec.ok
    assert json.dumps(rec.to_json(), sort_keys=True) == json.dumps(LINE, sort_keys=True)


def test_an_older_line_without_the_optional_fields_reads() -> None:
    rec = oplog.HistoryRecord.from_json({"op": "freeze", "pids": [5], "exit_code": 0})
    assert rec.starts == {} and rec.image is None and rec.start_of(5) is None


@pytest.mark.parametrize("key", ["op", "pids", "exit_code"])
def test_a_line_without_a_required_field_is_malformed(key: str) -> None:
    data = {k: v for k, v in LINE.items() if k != key}
    if key == "pids":
        data["pids"] = None  # null is "no pids" for an older line; a missing op/exit_code is not
        assert oplog.HistoryRecord.from_json(data).pids == ()
        return
    with pytest.raises(oplog.MalformedRecord, match=key):
        oplog.HistoryRecord.from_json(data)


@pytest.mark.parametrize(
    ("key", "value"),
    [("op", 3), ("pids", ["12"]), ("pids", [True]), ("exit_code", "0"), ("exit_code", False),
     ("starts", {"12": "x"}), ("starts", []), ("image", 1), ("duration_s", "1")],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_malformed(key: str, value: object) -> None:
    with pytest.raises(oplog.MalformedRecord):
        oplog.HistoryRecord.from_json({**LINE, key: value})


def test_history_skips_malformed_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path))
    lines = [json.dumps(LINE), "not json", "[1, 2]", json.dumps({**LINE, "exit_code": "0"}), json.dumps(LINE)]
    (tmp_path / oplog.HISTORY).write_text("\n".join(lines) + "\n")
    assert [r.op for r in oplog.history()] == ["dump", "dump"]


def test_a_recorded_operation_is_one_line_with_sorted_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("NPUSNAP_SYSLOG_SOCKET", str(tmp_path / "no-syslog"))
    entry, sent = oplog.record("thaw", pids=[1], image=None, exit_code=3, error="boom", starts={1: 2.0})
    assert not sent and entry.result == "failed"
    (line,) = (tmp_path / oplog.HISTORY).read_text().splitlines()
    data = json.loads(line)
    assert list(data) == sorted(data) and data["starts"] == {"1": 2.0} and "syslog" not in data
    assert oplog.HistoryRecord.from_json(data) == entry


def test_a_running_file_round_trips_in_its_key_order() -> None:
    data = {"op": "dump", "pid": os.getpid(), "start": 1.5, "pids": [4], "since": "now"}
    rec = oplog.RunningRecord.from_json(data)
    assert rec.pids == (4,) and list(rec.to_json().items()) == list(data.items())
    with pytest.raises(oplog.MalformedRecord, match="pid"):
        oplog.RunningRecord.from_json({k: v for k, v in data.items() if k != "pid"})
    with pytest.raises(oplog.MalformedRecord, match="op"):
        oplog.RunningRecord.from_json({**data, "op": None})
