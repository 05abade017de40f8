"""Fixtures shared by the agent tests (built on tests/conftest.py's ``sim_env``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration import torchnpulib
from tests.integration.agentlib import Sim, Workload


@pytest.fixture
def sim(sim_env: dict[str, str]) -> Sim:
    return Sim(sim_env)


@pytest.fixture
def workloads() -> Iterator[list[Workload]]:
    """Workloads a test started; killed at the end whatever happened."""
    started: list[Workload] = []
    yield started
    for w in started:
        w.kill()


@pytest.fixture(scope="session")
def torch_npu_python() -> str:
    """The python of the torch_npu venv (.build/torch-npu); a skip with the reason when it is
    missing, a failure under CI=true (tests/integration/torchnpulib.py)."""
    return torchnpulib.require()
