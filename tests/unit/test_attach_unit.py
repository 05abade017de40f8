"""Unit tests of npusnap_cli.device.attach that need no ptrace: probing, bootstrap text, diagnostics."""

from __future__ import annotations

import glob
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npusnap_cli.device import attach
from npusnap_cli.errors import TargetError

# The module (the package exports its function of the same name, ``inject``).
injecting = importlib.import_module("npusnap_cli.device.attach.inject")


def test_probe_own_process_finds_version() -> None:
    target = attach.probe(os.getpid())
    assert target.version == sys.version_info[:2]
    assert target.method == ("remote_exec" if sys.version_info >= (3, 14) else "gdb")
    assert target.uid == os.geteuid()
    assert target.root == "/"


def test_probe_missing_pid() -> None:
    with pytest.raises(TargetError) as info:
        attach.probe(999_999_999)
    assert "no process" in info.value.message and info.value.fix


@pytest.mark.parametrize("version", ["3.9", "3.13"])
def test_bootstrap_runs_on_old_and_new_python(version: str, tmp_path: Path) -> None:
    """The bootstrap (with the agent body swapped for a marker) runs on the target's Python."""
    found = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python3")))
    if not found:
        pytest.skip(f"Python {version} is not installed under ~/.pyenv/versions")
    src = attach.bootstrap_source("_report({'ok': True, 'marker': 42})", str(tmp_path))
    (tmp_path / attach.BOOTSTRAP_NAME).write_text(src)
    subprocess.run([found[-1], "-I", str(tmp_path / attach.BOOTSTRAP_NAME)], check=True, timeout=30)
    status = (tmp_path / attach.STATUS_NAME).read_text()
    assert '"marker": 42' in status and '"ok": true' in status
    assert oct((tmp_path / attach.STATUS_NAME).stat().st_mode & 0o777) == "0o600"


def test_bootstrap_reports_exceptions(tmp_path: Path) -> None:
    src = attach.bootstrap_source("raise ValueError('boom')", str(tmp_path))
    (tmp_path / attach.BOOTSTRAP_NAME).write_text(src)
    subprocess.run([sys.executable, "-I", str(tmp_path / attach.BOOTSTRAP_NAME)], check=True, timeout=30)
    status = (tmp_path / attach.STATUS_NAME).read_text()
    assert '"ok": false' in status and "ValueError: boom" in status


def test_diagnose_describes_threads() -> None:
    info = attach.diagnose(os.getpid())
    assert info["alive"] is True
    assert info["state"] in ("R", "S")
    assert any(t["tid"] == os.getpid() for t in info["threads"])
    assert "ptrace_scope" in info and "gdb" in info


def test_diagnose_shows_what_gdb_saw_of_each_thread() -> None:
    report = {
        "ok": False,
        "method": "breakpoint:PyEval_SaveThread",
        "rounds": 3,
        "private": "not shown",
        "threads": [
            {
                "tid": os.getpid(),
                "syscall": "futex",
                "frames": [{"name": "f", "lib": "libc.so.6"}, {"name": "g"}],
            }
        ],
    }
    info = attach.diagnose(os.getpid(), report)
    me = next(t for t in info["threads"] if t["tid"] == os.getpid())
    assert me["syscall"] == "futex" and me["frames"] == ["f (libc.so.6)", "g"]
    assert info["gdb_report"] == {"ok": False, "method": "breakpoint:PyEval_SaveThread", "rounds": 3}


def test_status_and_report_files_must_hold_a_json_object(tmp_path: Path) -> None:
    good = tmp_path / "status.json"
    good.write_text('{"ok": true, "gil_s": 0.0125, "socket": "/run/x.sock"}')
    status = injecting._json_object(good)
    assert status == {"ok": True, "gil_s": 0.0125, "socket": "/run/x.sock"}
    result = injecting.InjectResult(1, "gdb", None, None, status, 0.5, ptrace_stopped_s=0.1)
    assert result.gil_s == 0.0125 and result.stopped_s == 0.113
    no_gil = injecting.InjectResult(1, "gdb", None, None, {"ok": True, "gil_s": "soon"}, 0.5)
    assert no_gil.gil_s is None and no_gil.stopped_s == 0.0
    wrong = tmp_path / "list.json"
    wrong.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        injecting._json_object(wrong)
    (tmp_path / "torn.json").write_text('{"ok": tr')
    with pytest.raises(ValueError):
        injecting._json_object(tmp_path / "torn.json")
