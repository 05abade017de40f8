"""procfs: the one parser of /proc/PID/stat, against real processes and awkward command names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from npusnap_cli.host import procfs


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields() -> None:
    line = b"4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 0 0\n"
    st = procfs.parse_stat(line)
    assert (st.pid, st.comm, st.state, st.ppid, st.pgrp, st.session) == (4242, "a) b (c)", "S", 1, 4242, 4242)
    assert st.start_time == 987654


@pytest.mark.parametrize("line", [b"", b"12 no parentheses S 1", b"12 (short) S 1 2 3\n"])
def test_a_line_that_is_not_a_stat_line_is_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        procfs.parse_stat(line)


def test_own_and_a_thread_stat_agree_with_the_kernel() -> None:
    st = procfs.read_stat(os.getpid())
    assert (st.pid, st.ppid, st.pgrp, st.session) == (os.getpid(), os.getppid(), os.getpgrp(), os.getsid(0))
    assert st.state == "R"
    assert procfs.read_stat(os.getpid(), os.getpid()).start_time == st.start_time
    assert procfs.start_time("self") == st.start_time


def test_a_stopped_child_then_a_gone_one() -> None:
    stop_self = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"
    child = subprocess.Popen([sys.executable, "-c", stop_self])
    try:
        os.waitpid(child.pid, os.WUNTRACED)
        assert procfs.state(child.pid) == "T"
        assert procfs.stat(child.pid) is not None
    finally:
        child.kill()
        child.wait()
    assert procfs.state(child.pid) is None
    assert procfs.stat(child.pid) is None and procfs.start_time(child.pid) is None
    with pytest.raises(FileNotFoundError):
        procfs.read_stat(child.pid)
