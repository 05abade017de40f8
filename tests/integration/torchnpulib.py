"""Where the torch_npu tests find torch_npu: the virtualenv scripts/setup-torch-npu.sh links at
.build/torch-npu (scripts/test.sh runs it), apart from .build/torch, which stays CPU-only.

A test that needs it takes the ``torch_npu_python`` fixture (tests/integration/conftest.py): it
skips with the reason when the venv is missing, except under ``CI=true``, where a missing venv
means setup failed and the test fails with the reason instead of passing unnoticed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from tests.integration.dumplib import REPO

TORCH_NPU = Path(os.environ.get("NPUSNAP_BUILD_DIR") or REPO / ".build") / "torch-npu"
PYTHON = TORCH_NPU / "bin" / "python"


def missing_reason() -> Optional[str]:
    """Why torch_npu cannot be run here, or None."""
    if os.environ.get("NPUSNAP_NO_TORCH") == "1":
        return "NPUSNAP_NO_TORCH=1"
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON} is missing: run scripts/setup-torch-npu.sh (scripts/test.sh does)"
    spec = TORCH_NPU / ".npusnap-ok"
    if not spec.is_file():
        return f"{TORCH_NPU} was not finished by scripts/setup-torch-npu.sh (no {spec.name}): run it again"
    return None


def require() -> str:
    """The torch_npu venv's python; skips the test when there is none (fails under CI=true)."""
    reason = missing_reason()
    if reason is None:
        return str(PYTHON)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and torch_npu is not available: {reason}", pytrace=False)
    pytest.skip(reason)


def run(
    python: str, code: str, env: dict[str, str], timeout: float = 240.0, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the torch_npu venv's python in ``env`` (a simulator's `sim env` plus extras)."""
    return subprocess.run(
        [python, "-c", code, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
