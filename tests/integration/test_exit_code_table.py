"""docs/exit-codes.md is the rule: for every failure class of its table, a failure of that class is
injected into a real command, and the command must exit with the code the table gives that class
(read from the page, not from ExitCode) and name the class as the table does (`error.kind`).

A job that a dump failed on runs on afterwards (the rollback), unlocked."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from npusnap_cli.image import layout, publishing
from tests.conftest import REPO, requires_root
from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    TRAIN,
    TRAIN_ARGS,
    Job,
    agent_state,
    cli,
    crashing_criu,
    job_env,
    wait_until,
)
from tests.unit.test_image import _build, _manifest

pytestmark = [pytest.mark.integration, requires_root]

DOC = REPO / "docs" / "exit-codes.md"
RANKS = str(REPO / "npusnap_workloads" / "ranks.py")

# Classes of the table no outside action can bring about, and why.
NOT_INJECTED = {
    "internal": "a bug in npusnap: an unexpected exception, which no input is meant to cause",
    "continuity": "only `npusnap demo` reports it, when a restore did not continue identically",
}


def table() -> dict[str, int]:
    """kind -> code, as the page's table has them (the OK row has no kind)."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*[A-Z_]+\s*\|\s*([a-z-]*)\s*\|", DOC.read_text(), re.MULTILINE)
    return {kind: int(code) for code, kind in rows if kind}


Outcome = tuple[int, Optional[str]]  # exit code, error.kind of the JSON envelope


def _kind(envelope: Optional[dict[str, Any]]) -> Optional[str]:
    """The envelope's error kind; for a --dry-run, that of the first check that failed."""
    if not envelope:
        return None
    if envelope.get("error"):
        return str(envelope["error"]["kind"])
    for check in (envelope.get("result") or {}).get("checks") or []:
        if check.get("error"):
            return str(check["error"]["kind"])
    return None


class Setup:
    """The session's simulator, a private runtime directory and a long-running training job whose
    simulated device faults come from a file."""

    def __init__(self, sim_env: dict[str, str], base: Path) -> None:
        self.base = base
        self.faults = base / "faults"
        self.faults.write_text("")
        runtime = base / "npusnap-rt"  # (npusnap*: the agent_state of this test process finds it)
        runtime.mkdir(mode=0o700)
        self.env = job_env(sim_env, runtime, NPUSIM_FAULT_FILE=str(self.faults))
        self.job = Job(base, self.env, [PY, TRAIN, "--steps", "100000", *TRAIN_ARGS, "--device", "0"])
        self.job.wait_lines(2)
        self.n = 0

    def img(self) -> Path:
        self.n += 1
        return self.base / f"img{self.n}"

    def dump(self, *extra: str, env: Optional[dict[str, str]] = None) -> Outcome:
        rc, out, _ = cli(env or self.env, "dump", str(self.job.pid), str(self.img()), *extra)
        return rc, _kind(out)


@pytest.fixture(scope="module")
def setup(sim_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(sim_env, tmp_path_factory.mktemp("codes"))
    try:
        yield s
    finally:
        s.job.cleanup()


def _usage(s: Setup) -> Outcome:
    rc, out, _ = cli(s.env, "dump", str(s.job.pid), str(s.img()), "--lease", "-3")
    return rc, _kind(out)


def _preflight(s: Setup) -> Outcome:
    return s.dump(env={**s.env, "NPUSNAP_CRIU": str(s.base / "no-such-criu")})


def _target(s: Setup) -> Outcome:
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: nothing has that pid now
    rc, out, _ = cli(s.env, "dump", str(p.pid), str(s.img()))
    return rc, _kind(out)


def _agent(s: Setup) -> Outcome:
    """An application hook of the job raises during the dump (a one-rank job of ranks.py)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = s.base / f"rank{s.n}"
    d.mkdir()
    args = ["--rank", "0", "--world", "1", "--master", f"127.0.0.1:{port}", "--device", "1"]
    args += ["--steps", "100000", "--interval", "0.05", "--fail-hook", "post_backup"]
    job = Job(d, s.env, [PY, RANKS, *args])
    job.marker = RANKS
    try:
        job.wait_lines(2, timeout=60)
        rc, out, _ = cli(s.env, "dump", str(job.pid), str(s.img()))
        assert agent_state(job.pid) == "RUNNING", job.text()[-2000:]
        return rc, _kind(out)
    finally:
        job.cleanup()


def _criu(s: Setup) -> Outcome:
    return s.dump(env={**s.env, "NPUSNAP_CRIU": str(crashing_criu(s.base / "criu-crash"))})


def _device(s: Setup) -> Outcome:
    s.faults.write_text("NPUSIM_FAULT_BACKUP=1\n")
    try:
        return s.dump()
    finally:
        s.faults.write_text("")


def _published(s: Setup) -> Path:
    """A small published image, intact, of a job dumped with CRIU 4.1.1 (tests/unit/test_image.py)."""
    tmp, final = _build(s.base, f"synthetic{s.n}")
    s.n += 1
    publishing.publish(tmp, final, _manifest(tuple(publishing.file_entries(tmp))))
    return final


def _image(s: Setup) -> Outcome:
    final = _published(s)
    pages = layout.criu_dir(final) / "pages-1.img"
    pages.write_bytes(b"\x02" + pages.read_bytes()[1:])
    rc, out, _ = cli(s.env, "verify", str(final))
    return rc, _kind(out)


def _image_incompatible(s: Setup) -> Outcome:
    """An intact image of another CRIU than this host's: restore refuses it (--dry-run: it
    restores nothing, and runs every check a restore runs)."""
    from npusnap_cli.criu import find_criu

    assert find_criu().version != "4.1.1"
    rc, out, _ = cli(s.env, "restore", "--dry-run", str(_published(s)))
    return rc, _kind(out)


def _state_unknown(s: Setup) -> Outcome:
    s.faults.write_text("NPUSIM_FAULT_UNLOCK=1\n")
    try:
        return s.dump("--leave-running")
    finally:
        s.faults.write_text("")
        rc, _, err = cli(s.env, "thaw", str(s.job.pid))
        assert rc == 0, err


def _busy(s: Setup) -> Outcome:
    rc, _, err = cli(s.env, "freeze", str(s.job.pid))
    assert rc == 0, err
    try:
        return s.dump()
    finally:
        rc, _, err = cli(s.env, "thaw", str(s.job.pid))
        assert rc == 0, err


def _interrupted(s: Setup) -> Outcome:
    s.faults.write_text("NPUSIM_BACKUP_HANG_MS=1500\n")
    img = s.img()
    try:
        dump = subprocess.Popen(
            [NPUSNAP, "dump", str(s.job.pid), str(img), "--json"],
            env=s.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        wait_until(lambda: bool(layout.temp_siblings(img)) or dump.poll() is not None, 20, "the dump to lock")
        dump.send_signal(signal.SIGINT)
        stdout, _ = dump.communicate(timeout=60)
    finally:
        s.faults.write_text("")
    return dump.returncode, _kind(json.loads(stdout) if stdout.strip() else None)


INJECT: dict[str, Callable[[Setup], Outcome]] = {
    "usage": _usage,
    "preflight": _preflight,
    "target": _target,
    "agent": _agent,
    "criu": _criu,
    "device": _device,
    "image": _image,
    "state-unknown": _state_unknown,
    "busy": _busy,
    "image-incompatible": _image_incompatible,
    "interrupted": _interrupted,
}


def test_every_class_of_the_table_is_injected_or_says_why_not() -> None:
    assert set(table()) == set(INJECT) | set(NOT_INJECTED)


@pytest.mark.parametrize("kind", sorted(INJECT))
def test_a_failure_of_each_class_exits_with_the_tables_code(setup: Setup, kind: str) -> None:
    rc, said = INJECT[kind](setup)
    assert rc == table()[kind], (kind, rc, said)
    if said is not None:
        assert said == kind
    # whatever failed, the job runs on, unlocked
    assert agent_state(setup.job.pid) == "RUNNING"
