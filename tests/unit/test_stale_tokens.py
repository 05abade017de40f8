"""Lock tokens left for `npusnap thaw` by processes that are gone are removed and reported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from npusnap_cli.host import hostclean, preflight

DEAD_PID = 999_999_999  # above any pid_max: never alive


def test_stale_lock_tokens_are_reported_and_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    monkeypatch.setenv("NPUSNAP_RUNTIME_DIR", str(rt))
    dead = rt / f"{DEAD_PID}.lock-token"
    live = rt / f"{os.getpid()}.lock-token"
    for p in (dead, live):
        p.write_text("0" * 32 + "\n")
        p.chmod(0o600)
    assert [t.pid for t in hostclean.stale_lock_tokens()] == [DEAD_PID]
    item = preflight.check_debris()
    assert item.status == preflight.WARNING and "lock token(s) of dead processes" in item.detail
    assert item.data["stale_lock_tokens"][0]["pid"] == DEAD_PID
    removed = hostclean.remove_stale_agent_sockets()
    assert [e.pid for e in removed] == [DEAD_PID]
    assert not dead.exists() and live.exists()
