"""Shared fixtures. See docs/internals.md ("Test fixtures")."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def is_root() -> bool:
    return os.geteuid() == 0


requires_root = pytest.mark.skipif(not is_root(), reason="needs root (CRIU dump/restore and /run/npusnap)")


@pytest.fixture
def runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private agent socket directory (NPUSNAP_RUNTIME_DIR), so tests never touch /run/npusnap."""
    # Short path: AF_UNIX paths are limited to 108 bytes.
    base = Path(tmp_path_factory.mktemp("rt", numbered=True))
    d = base / "npusnap"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("NPUSNAP_RUNTIME_DIR", str(d))
    yield d
    shutil.rmtree(base, ignore_errors=True)
