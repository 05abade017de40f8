"""criu.py against real CRIU and real (non-NPU) processes: dump, restore, refusal with log lines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from npusnap_cli import criu
from npusnap_cli.errors import CriuError
from npusnap_cli.host import procfs
from npusnap_cli.host.procfs import is_alive
from tests.conftest import requires_root
from tests.integration.dumplib import wait_until

pytestmark = [pytest.mark.integration, requires_root]

COUNTER = """
import sys, time
i = 0
while True:
    print("tick", i, flush=True)
    i += 1
    time.sleep(0.05)
"""

TCP_CLIENT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
while True:
    time.sleep(0.05)
"""


def _start(tmp_path: Path, code: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """A detached process (own session, stdin /dev/null, output appended to a file): restorable."""
    log = tmp_path / "out.txt"
    script = tmp_path / "prog.py"
    script.write_text(code)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return proc, log


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines()


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    img, work = tmp_path / "img", tmp_path / "work"
    img.mkdir()
    work.mkdir()
    yield img, work


def test_dump_leave_stopped_then_restore_continues(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    img, work = dirs
    proc, log = _start(tmp_path, COUNTER)
    restored = 0
    try:
        wait_until(lambda: len(_lines(log)) >= 3, 10.0, "3 lines of output")
        res = criu.dump(proc.pid, str(img), str(work), options=criu.CriuOptions(leave_stopped=True))
        assert Path(res.log_path).is_file()
        assert res.stats is not None and res.stats.pages_written > 0
        assert res.stats.frozen_time_us > 0
        # leave_stopped: the original is still there, stopped, until we kill it.
        assert procfs.state(proc.pid) == "T"
        n = len(_lines(log))
        proc.kill()
        proc.wait()
        rres = criu.restore(str(img), str(work))
        restored = rres.pid
        assert restored == proc.pid  # CRIU restores the same pid
        assert rres.stats is not None and rres.stats.pages_restored > 0
        wait_until(lambda: len(_lines(log)) >= n + 3, 10.0, "3 more lines after the restore")
        lines = _lines(log)
        # The restored process continues exactly where the dump froze it.
        assert lines == [f"tick {i}" for i in range(len(lines))]
    finally:
        for pid in (restored, proc.pid):
            if pid and is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_dump_refused_for_established_tcp_reports_log_lines(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    img, work = dirs
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    proc, log = _start(tmp_path, TCP_CLIENT, str(listener.getsockname()[1]))
    conn = None
    try:
        conn, _ = listener.accept()
        wait_until(lambda: "connected" in log.read_text(), 10.0, "the connection")
        with pytest.raises(CriuError) as exc:
            criu.dump(proc.pid, str(img), str(work))
        err = exc.value
        assert err.details["criu_log"] == str(work / "dump.log")
        excerpt = err.details["criu_log_excerpt"]
        assert any("Error" in line for line in excerpt)
        assert "Connected TCP socket" in err.message
        assert "--tcp-established" in err.fix
        # CRIU let the process run on.
        time.sleep(0.2)
        assert is_alive(proc.pid)
    finally:
        if conn is not None:
            conn.close()
        listener.close()
        proc.kill()
        proc.wait()


def test_restore_failure_is_a_criu_error(dirs: tuple[Path, Path]) -> None:
    img, work = dirs
    with pytest.raises(CriuError) as exc:
        criu.restore(str(img), str(work))  # an empty directory is no CRIU image
    assert exc.value.details["criu_log_excerpt"]
    assert "restore" in exc.value.message
