"""The torch_npu tests' fixture: a skip with the reason without the venv, a failure under CI=true
(a setup that could not provide torch_npu must not pass as skipped tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import torchnpulib


def _no_venv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torchnpulib, "TORCH_NPU", tmp_path / "torch-npu")
    monkeypatch.setattr(torchnpulib, "PYTHON", tmp_path / "torch-npu" / "bin" / "python")
    monkeypatch.delenv("NPUSNAP_NO_TORCH", raising=False)


def test_missing_venv_skips_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_venv(monkeypatch, tmp_path)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"setup-torch-npu\.sh"):
        torchnpulib.require()


def test_missing_venv_fails_under_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_venv(monkeypatch, tmp_path)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and torch_npu is not available"):
        torchnpulib.require()


def test_an_unfinished_venv_counts_as_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_venv(monkeypatch, tmp_path)
    python = tmp_path / "torch-npu" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert "was not finished" in str(torchnpulib.missing_reason())
    (tmp_path / "torch-npu" / ".npusnap-ok").write_text("torch-npu==2.13.0\n")
    assert torchnpulib.missing_reason() is None
