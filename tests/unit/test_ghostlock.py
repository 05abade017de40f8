"""The per-ghost-path lock that makes overlapping CRIU restores of one image take turns."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from npusnap_cli.errors import BusyError, ExitCode, PreflightError
from npusnap_cli.host import ghostlock


def test_no_ghosts_takes_no_lock(tmp_path: Path) -> None:
    with ghostlock.held([], lambda _m: None, directory=tmp_path / "locks"):
        pass
    assert not (tmp_path / "locks").exists()


def test_a_second_holder_waits_for_the_first(tmp_path: Path) -> None:
    ghosts = ["/tmp/a.cr.1.ghost", "/tmp/b.cr.2.ghost"]
    notes: list[str] = []
    order: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with ghostlock.held(ghosts, notes.append, directory=tmp_path):
            inside.set()
            time.sleep(0.3)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(5)
    with ghostlock.held(ghosts, notes.append, directory=tmp_path):
        order.append("second in")
    t.join()
    assert order == ["first out", "second in"]
    assert len(notes) == 1 and f"pid {os.getpid()}" in notes[0] and "/tmp/a.cr.1.ghost" in notes[0], notes


def test_a_holder_past_the_deadline_is_reported_busy(tmp_path: Path) -> None:
    ghosts = ["/tmp/a.cr.1.ghost"]
    first = ghostlock.held(ghosts, lambda _m: None, directory=tmp_path)
    second = ghostlock.held(ghosts, lambda _m: None, directory=tmp_path, wait_s=0.2)
    with first, pytest.raises(BusyError) as exc, second:
        pass
    assert exc.value.exit_code == ExitCode.BUSY and "/tmp/a.cr.1.ghost" in str(exc.value)
    # released and removed: no lock file outlives its holder
    assert list(tmp_path.iterdir()) == []


def test_the_lock_is_exclusive_while_holders_remove_its_file(tmp_path: Path) -> None:
    """Each holder removes the lock file when it is done, while others wait on the name: one
    holder at a time all the same, and nothing left in the directory at the end."""
    ghosts = ["/tmp/a.cr.1.ghost"]
    inside: list[int] = []
    overlaps: list[int] = []
    guard = threading.Lock()

    def turn(k: int) -> None:
        for _ in range(20):
            with ghostlock.held(ghosts, lambda _m: None, directory=tmp_path):
                with guard:
                    inside.append(k)
                    if len(inside) > 1:
                        overlaps.append(k)
                time.sleep(0.001)
                with guard:
                    inside.remove(k)

    threads = [threading.Thread(target=turn, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert overlaps == [] and inside == []
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_someone_holds_keeps_others_out(tmp_path: Path) -> None:
    """A holder of an older npusnap (which left its file in place) still excludes this one."""
    ghosts = ["/tmp/a.cr.1.ghost"]
    with ghostlock.held(ghosts, lambda _m: None, directory=tmp_path):
        (lock,) = list(tmp_path.iterdir())
    fd = os.open(tmp_path / lock.name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with (
            pytest.raises(BusyError),
            ghostlock.held(ghosts, lambda _m: None, directory=tmp_path, wait_s=0.2),
        ):
            pass
    finally:
        os.close(fd)


def test_a_leftover_ghost_file_is_refused_with_its_path(tmp_path: Path) -> None:
    ghost = tmp_path / "x.cr.1.ghost"
    ghost.write_bytes(b"left by a killed restore")
    with (
        pytest.raises(PreflightError) as exc,
        ghostlock.held([str(ghost)], lambda _m: None, directory=tmp_path / "l"),
    ):
        pass
    assert f"rm {ghost}" in (exc.value.fix or "") and ghost.exists()


def test_a_planted_symlink_is_never_followed(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    ghosts = ["/tmp/x.cr.1.ghost"]
    with ghostlock.held(ghosts, lambda _m: None, directory=locks):
        (lock,) = list(locks.iterdir())
    assert not lock.exists()
    lock.symlink_to(victim)
    with (
        pytest.raises(PreflightError, match="ghost-file lock"),
        ghostlock.held(ghosts, lambda _m: None, directory=locks),
    ):
        pass
    assert victim.read_text() == "keep me\n"
