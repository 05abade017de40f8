"""Output that tells what happens: stale copy sockets found, `ps` naming only images that exist,
a missing argument named, a read-only filesystem named, progress lines off a terminal, `status`
naming the dump that holds a busy agent, and phases named for what they time."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli import errors, ui
from npusnap_cli.cli import main
from npusnap_cli.host import hostclean, oplog, preflight


def _socket_file(path: Path, *, age_s: float) -> None:
    """A socket file nothing listens on any more (a killed copy's)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_check_finds_the_sockets_of_copies_that_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    monkeypatch.setenv("NPUSNAP_RUNTIME_DIR", str(rt))
    dead = rt / "4242-0123abcd.sock"
    young = rt / "4343-0123abcd.sock"  # a copy being restored right now may not listen yet
    _socket_file(dead, age_s=3600)
    _socket_file(young, age_s=0)
    live = rt / "4444-89abcdef.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(live))
    server.listen(1)
    os.utime(live, (time.time() - 3600, time.time() - 3600))
    try:
        assert [s.path for s in hostclean.stale_copy_sockets()] == [str(dead)]
        item = preflight.check_debris()
        assert item.status == preflight.WARNING and "1 stale agent socket(s)" in item.detail, item.detail
        removed = hostclean.remove_stale_agent_sockets()
        assert [e.path for e in removed] == [str(dead)]
        assert not dead.exists() and young.exists() and live.exists()
    finally:
        server.close()


def test_last_snapshot_names_only_images_that_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path / "state"))
    kept, gone = tmp_path / "kept", tmp_path / "gone"
    kept.mkdir()
    pid = os.getpid()
    for image in (kept, gone):
        with oplog.operation("dump", [pid], str(image)):
            pass
    (entry,) = [e for (p, _), e in oplog.last_snapshots().items() if p == pid]
    assert entry.image == str(kept)


def test_a_dump_without_arguments_names_the_missing_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "dump"]) == errors.ExitCode.USAGE
    envelope = json.loads(capsys.readouterr().out)
    assert "'DIR'" in envelope["error"]["message"], envelope


def test_a_read_only_filesystem_is_named_not_an_internal_error() -> None:
    err = errors.settle_permission(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/img"))
    assert err is not None and err.exit_code == errors.ExitCode.PREFLIGHT
    assert "read-only filesystem (EROFS)" in err.message and "/mnt/ro/img" in err.message


def test_progress_off_a_terminal_is_a_line_every_few_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    lines: list[str] = []
    bar = ui._LineProgress("device memory copy", 4 << 30, lines.append)
    bar.update(1 << 30)
    assert lines == []  # a short work prints nothing
    for _ in range(9):
        clock[0] += 1.0
        bar.update(bar._done + (256 << 20))
    bar.finish()
    assert len(lines) == 4, lines  # one per 3 s over 9 s, and the end
    assert lines[0].startswith("… device memory copy: ") and "%" in lines[0]


def test_status_names_the_dump_that_keeps_an_agent_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from npusnap_cli.host import proctree

    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("NPUSNAP_RUNTIME_DIR", str(tmp_path / "rt"))
    target = 4242
    entry: dict[str, Any] = {
        "pid": target,
        "ppid": 1,
        "depth": 0,
        "uid": 0,
        "name": "python3",
        "cmdline": ["python3", "train.py"],
        "agent_socket": "/run/npusnap/4242.sock",
        "acl_library": "libascendcl.so",
        "device_files": [],
        "uses_npu": True,
        "readable": True,
        "zombie": False,
        "hello": None,
        "status": None,
        "agent_error": {"kind": "agent", "message": "timed out waiting for the agent"},
    }
    monkeypatch.setattr(proctree, "tree_status", lambda pid: {"pid": pid, "processes": [entry], "hints": []})
    # A dump of that pid runs in another process (this one's parent stands in for it).
    holder = os.getppid()
    running = tmp_path / "state" / oplog.RUNNING
    running.mkdir(parents=True)
    (running / f"{holder}.json").write_text(
        json.dumps(
            {"op": "dump", "pid": holder, "start": oplog.start_time(holder), "pids": [target], "since": "now"}
        )
    )
    assert main(["status", str(target)]) == 0
    err = capsys.readouterr().err
    assert f"a dump holds the lock (npusnap pid {holder}" in err, err
    assert "does not see its device memory" not in err and "timed out" not in err, err


def test_the_phase_tables_name_the_copy_apart_from_the_runtimes_lock() -> None:
    """`dump` and `inspect --stats` show a dump's phases through one renderer, which names npusnap's
    copy of the device memory apart from CANN's Lock and Backup."""
    import dataclasses

    from npusnap_cli.commands._progress import dump_phase_rows
    from npusnap_cli.image import manifest

    fields = manifest.Timings.__dataclass_fields__
    assert "device_copy_s" in fields
    t = manifest.Timings(**{name: None for name in fields})
    t = dataclasses.replace(t, lock_s=0.001, device_copy_s=2.5, backup_s=0.002)
    rows = dict(dump_phase_rows(t))
    assert rows["runtime Lock"] == "0.001s" and rows["runtime Backup"] == "0.002s"
    assert rows["device memory copy (npusnap, locked)"] == "2.500s"
    assert not any("device backup" in label for label in rows)
    root = Path(__file__).resolve().parents[2] / "npusnap_cli" / "commands"
    for name in ("dump.py", "inspect.py"):
        assert "dump_phase_rows(t)" in (root / name).read_text(), name


def test_replica_names_are_numbered_plain_words() -> None:
    from npusnap_cli.pipelines import replicas

    assert replicas.names_for(replicas.DEFAULT_NAME, 2) == ["replica-0", "replica-1"]
    assert replicas.names_for("trainer-{n}", 2) == ["trainer-0", "trainer-1"]
    assert replicas.names_for("copy", 2) == ["copy-0", "copy-1"]  # never two copies of one name
    with pytest.raises(errors.UsageError):
        replicas.names_for("../{n}", 1)  # a name is a directory and a suffix, never a path
