"""Fixtures shared by the agent tests (built on tests/conftest.py's ``sim_env``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
