"""The dump pipeline's pieces that need no root: signal handling, simulator status parsing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode, InterruptedError_, PreflightError
from npusnap_cli.pipelines import dump


def test_signal_guard_defers_then_raises_and_restores_handlers() -> None:
    notes: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with dump.SignalGuard(notes.append) as guard:
        guard.check("before", "nothing")  # nothing received: no error
        os.kill(os.getpid(), signal.SIGTERM)  # handled: we are still here
        assert guard.received == signal.SIGTERM
        assert notes and "SIGTERM received" in notes[0]
        with pytest.raises(InterruptedError_) as exc:
            guard.check("during lock+backup", "rolled back")
    assert exc.value.exit_code == ExitCode.INTERRUPTED
    assert "dump interrupted by SIGTERM during lock+backup" in exc.value.message
    assert signal.getsignal(signal.SIGTERM) == before


def test_sim_device_usage_reads_live_owners(monkeypatch: pytest.MonkeyPatch) -> None:
    status = {
        "owners": [
            {"pid": 10, "alive": True, "bytes": 4096, "devices": [1]},
            {"pid": 11, "alive": False, "bytes": 99, "devices": [0]},
        ]
    }
    monkeypatch.setattr(dump, "sim_status", lambda: status)
    assert dump.sim_device_usage() == {10: ([1], 4096)}
    monkeypatch.setattr(dump, "sim_status", lambda: None)
    assert dump.sim_device_usage() is None


def test_free_space_check_names_sizes(tmp_path: Path) -> None:
    target = tmp_path / "img"
    with pytest.raises(PreflightError) as exc:
        dump._check_space_and_memory(target, 1 << 62, 0)
    assert "not enough free space" in exc.value.message
    assert exc.value.details["needed_bytes"] > exc.value.details["free_bytes"]
    dump._check_space_and_memory(target, 1024, 0)  # a small image fits
