"""Shared fixtures. See docs/internals.md ("Test fixtures")."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from npusnap_cli import contract
from npusnap_sim.daemon import REFUSALS_FILE_ENV
from tests.hostile_user import HostileUser
from tests.node import isolate_node

REPO = Path(__file__).resolve().parent.parent


def is_root() -> bool:
    return os.geteuid() == 0


requires_root = pytest.mark.skipif(not is_root(), reason="needs root (CRIU dump/restore and /run/npusnap)")

# This checkout's CRIU plugins (native/criu-plugin): npusnap_plugin.so and npusim_plugin.so, the
# simulated NPU's device-connection plugin without which CRIU cannot dump a simulated NPU process.
CRIU_PLUGIN_BUILD_DIR = REPO / ".build" / "criu-plugin"
SIM_PLUGIN = CRIU_PLUGIN_BUILD_DIR / "npusim_plugin.so"


def pytest_configure(config: pytest.Config) -> None:
    """Every CRIU the tests start (directly, or through npusnap, which hands on its environment)
    loads this checkout's plugins, not whatever /usr/lib/criu holds (CRIU_LIBS_DIR; a test that
    wants another set passes -L or its own CRIU_LIBS_DIR). A worker of a parallel run (pytest -n)
    gets a node of its own (tests/node.py). Every simulator daemon the tests start writes the
    connections of npusnap's it refused into one file of this process (NPUSIM_REFUSALS_FILE),
    which ``_npusnap_never_reached_the_simulator`` watches."""
    fd, refusals = tempfile.mkstemp(prefix="npusim-refusals-", suffix=".jsonl")
    os.close(fd)
    os.environ[REFUSALS_FILE_ENV] = refusals
    if CRIU_PLUGIN_BUILD_DIR.is_dir():
        os.environ.setdefault("CRIU_LIBS_DIR", str(CRIU_PLUGIN_BUILD_DIR))
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        # A worker is started with COLUMNS=80 and LINES=24 in its environment, which every
        # npusnap the tests start would take for a terminal's size (tables folded at 80
        # columns): the tests see what a pipe gets, as in a run without workers.
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)
        config.stash[_WORKER_DIR] = isolate_node(worker)


# The longest test files, longest first: a parallel run hands files to its workers in collection
# order (--dist loadfile), and these, collected last by name, left one worker running the torch_npu
# files alone at the end. Started first, they end while the short files fill the other worker.
LONG_FILES = (
    "test_torch_npu_ddp.py",
    "test_torch_npu_snapshot.py",
    "test_dump_failures.py",
    "test_torch_npu_hccl.py",
    "test_incremental.py",
    "test_real_jobs.py",
    "test_torch_npu_compute.py",
    "test_dump_verify.py",
    "test_dump_restore.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: order kept


def pytest_unconfigure(config: pytest.Config) -> None:
    path = os.environ.get(REFUSALS_FILE_ENV)
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
    base = config.stash.get(_WORKER_DIR, None)
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)


_WORKER_DIR = pytest.StashKey[Path]()


def plugin_dir_with(base: Path, *names: str) -> Path:
    """A CRIU plugin directory holding only the named plugins of this checkout (symlinks)."""
    d = base / ("criu-plugins-" + "-".join(n.split("_")[0] for n in names) if names else "criu-no-plugins")
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        src = CRIU_PLUGIN_BUILD_DIR / name
        assert src.is_file(), f"{src} is not built: run ./scripts/setup.sh (or make -C native)"
        link = d / name
        if not link.exists():
            link.symlink_to(src)
    return d


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


@pytest.fixture(scope="session")
def sim_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A private simulated NPU for the session (2 devices of 1 GiB): the environment for child
    processes (ASCEND_HOME_PATH, LD_LIBRARY_PATH, NPUSIM_SOCKET); the daemon stops at the end."""
    from tests.integration.dumplib import private_sim

    with private_sim(devices=2, capacity_bytes=1 << 30) as env:
        yield env


@pytest.fixture(scope="session", autouse=True)
def hostile_user() -> Iterator[Optional[HostileUser]]:
    """Another local user plants symlinks, squatted directories, fake agent sockets, a hostile
    job name, a fake image and hard links in the shared directories for the whole session
    (tests/hostile_user.py); at the end nothing may have been written through them. Needs root
    (a uid of its own); NPUSNAP_TEST_HOSTILE=0 leaves it out (say so when you do)."""
    if not is_root() or os.environ.get("NPUSNAP_TEST_HOSTILE") == "0":
        yield None
        return
    user = HostileUser()
    user.start()
    try:
        yield user
    finally:
        problems = user.stop()
    assert not problems, "what the session wrote through the hostile user's names:\n" + "\n".join(problems)


@pytest.fixture(autouse=True)
def _hostile_bait_untouched(hostile_user: Optional[HostileUser]) -> Iterator[None]:
    """The test that wrote through one of the hostile user's names fails itself, by name."""
    seen = len(hostile_user.tripped()) if hostile_user is not None else 0
    yield
    if hostile_user is not None:
        state = hostile_user.bait_state()
        if state != "ok":
            hostile_user.wait_replanted()
            pytest.fail(f"this test wrote through the hostile user's names: its bait is {state}")
        new = hostile_user.tripped()[seen:]  # what the planter saw and put back meanwhile
        if new:
            pytest.fail(f"this test wrote through the hostile user's names: {new}")


def _refusals_size() -> int:
    try:
        return os.stat(os.environ[REFUSALS_FILE_ENV]).st_size
    except (KeyError, OSError):
        return 0


@pytest.fixture(autouse=True)
def _npusnap_never_reached_the_simulator() -> Iterator[None]:
    """npusnap works with what a real node offers: the simulator's daemon (the node's driver)
    refuses every connection of npusnap's CLI and records it (npusnap_sim/daemon.py), and the
    test during which one was refused fails here, even where npusnap swallowed the error."""
    seen = _refusals_size()
    yield
    if _refusals_size() > seen:
        with open(os.environ[REFUSALS_FILE_ENV], "rb") as f:
            f.seek(seen)
            new = f.read().decode(errors="replace")
        pytest.fail(f"npusnap talked to the simulator's daemon during this test:\n{new}")


def _root_runtime_entries() -> set[str]:
    try:
        return set(os.listdir(contract.AGENT_SOCKET_ROOT_DIR))
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def _root_runtime_dir_untouched() -> Iterator[None]:
    """A test's jobs keep their sockets and logs in the test's own runtime directory: what
    appears in root's (/run/npusnap, the node's real one) is named, with the test that was
    running (in a parallel run, another worker's test may be the one)."""
    before = _root_runtime_entries()
    yield
    new = sorted(_root_runtime_entries() - before)
    if new:
        warnings.warn(f"new in {contract.AGENT_SOCKET_ROOT_DIR}: {' '.join(new)}", stacklevel=1)
