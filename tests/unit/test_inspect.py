"""`npusnap inspect` and `npusnap verify` on an image built by npusnap_cli.image (no root, no CRIU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npusnap_cli.cli import main
from npusnap_cli.errors import ExitCode
from npusnap_cli.image import layout, publishing
from tests.unit.test_image import _build, _manifest


def _image(tmp_path: Path) -> Path:
    tmp, final = _build(tmp_path)
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    return final


def test_inspect_json_is_the_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = _image(tmp_path)
    assert main(["inspect", str(final), "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["ok"] is True and env["command"] == "inspect"
    res = env["result"]
    assert res["root_pid"] == 1234
    assert [p["pid"] for p in res["processes"]] == [1234, 1235]
    assert res["processes"][1]["devices"] == [1]
    assert res["timings"]["frozen_s"] == 0.8
    assert {f["path"] for f in res["files"]} == {"criu/pages-1.img", "criu/core-1235.img"}


def test_inspect_human_shows_tree_and_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = _image(tmp_path)
    assert main(["inspect", str(final), "--stats", "--ps-tree"]) == 0
    captured = capsys.readouterr()
    out = captured.out  # data on stdout (`npusnap inspect DIR | grep ...`), hints on stderr
    assert "1235  python3 worker.py" in out
    assert "NPU: device 1" in out
    assert "runtime Backup" in out and "0.200s" in out
    assert "npusnap verify" in captured.err and "npusnap verify" not in out


def test_verify_ok_and_tampered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = _image(tmp_path)
    assert main(["verify", str(final), "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["result"]["files_checked"] == 2

    (layout.criu_dir(final) / "core-1235.img").write_bytes(b"CORE")
    assert main(["verify", str(final)]) == ExitCode.IMAGE
    err = capsys.readouterr().err
    assert "criu/core-1235.img does not match its blake3 checksum" in err
    # --no-checksums checks structure only: same size, so it passes.
    assert main(["verify", str(final), "--no-checksums"]) == 0


def test_inspect_missing_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope"), "--json"]) == ExitCode.IMAGE
    env = json.loads(capsys.readouterr().out)
    assert env["ok"] is False and env["error"]["kind"] == "image"


def test_inspect_is_short_by_default_and_filters_like_checkpointctl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = _image(tmp_path)
    assert main(["inspect", str(final)]) == 0
    short = capsys.readouterr()
    assert "1235  python3 worker.py" in short.out  # the process tree
    assert "timings" not in short.out and "open files" not in short.out
    assert "--files" in short.err and "--all" in short.err  # how to see the rest
    assert main(["inspect", str(final), "--files"]) == 0
    files = capsys.readouterr()
    assert "open files" in files.out and "1235  python3 worker.py" not in files.out
    assert "timings" not in files.out
    assert main(["inspect", str(final), "--all"]) == 0
    everything = capsys.readouterr().out
    assert "open files" in everything and "timings" in everything and "worker.py" in everything
    # JSON always has everything, whatever the filters.
    assert main(["inspect", str(final), "--files", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["result"]
    assert res["processes"] and res["timings"] and "criu" in res
