"""npusnap never reaches the simulated node's driver: its daemon refuses npusnap's CLI.

On a real node npusnap has no way to the driver but the runtime inside the job. The simulator's
daemon stands for that driver, so it refuses every connection of an npusnap CLI process (any
command but the stand-ins' `sim` and `demo`), logs it, lists it in its status and records it in
NPUSIM_REFUSALS_FILE, which tests/conftest.py watches: every test of the suite fails if npusnap
reached the daemon during it. Here the refusal itself is shown, with a program that presents
itself as npusnap (its script is named `npusnap`) and connects as npusnap would have to.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from npusnap_cli import paths
from npusnap_sim import wire
from npusnap_sim.daemon import REFUSALS_FILE_ENV, npusnap_command
from tests.integration.dumplib import private_sim

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# Asks the daemon for its status over the socket of NPUSIM_SOCKET, as any client of it does.
_CLIENT = """\
import os, sys
sys.path.insert(0, os.environ["REPO"])
from npusnap_cli import paths
from npusnap_sim import wire
sock = wire.connect(os.environ["NPUSIM_SOCKET"])
try:
    status, _value, _payload = wire.request(sock, wire.OP_STATUS)
    print("served", status)
except (ConnectionError, OSError) as exc:
    print("refused", type(exc).__name__)
"""


def test_an_npusnap_command_line_is_told_from_a_job_s() -> None:
    venv = "/opt/npusnap/versions/1/bin"
    assert npusnap_command([f"{venv}/python", f"{venv}/npusnap", "dump", "7"]) == "dump"
    argv = ["python3", "-X", "importtime", "-m", "npusnap_cli", "--json", "restore"]
    assert npusnap_command(argv) == "restore"
    assert npusnap_command(["python3", "-mnpusnap_cli", "sim", "status"]) == "sim"
    assert npusnap_command(["npusnap"]) == ""
    assert npusnap_command(["python3", "train.py", "--out", "/tmp/npusnap"]) is None  # an argument
    assert npusnap_command(["python3", "-c", "pass", "/tmp/npusnap"]) is None
    assert npusnap_command(["python3", "-m", "npusnap_sim.daemon"]) is None
    assert npusnap_command(["criu", "restore", "-D", "img"]) is None
    assert npusnap_command(["python3", "/w/npusnap_cli/agent/qualifyprobe.py", "libascendcl.so"]) is None
    assert npusnap_command([]) is None


def test_the_simulated_driver_refuses_npusnap_but_serves_sim_and_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusals = tmp_path / "refusals.jsonl"
    monkeypatch.setenv(REFUSALS_FILE_ENV, str(refusals))  # this test's own: the refusal is wanted here
    fake = tmp_path / "bin" / "npusnap"
    fake.parent.mkdir()
    fake.write_text(_CLIENT)
    job = tmp_path / "job.py"
    job.write_text(_CLIENT)
    with private_sim(devices=1, capacity_bytes=64 << 20) as env:
        env = {**env, "REPO": str(REPO)}

        def run(*argv: str) -> str:
            done = subprocess.run(
                [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60, check=True
            )
            return done.stdout.strip()

        as_dump = run(str(fake), "dump", "1234")
        as_sim = run(str(fake), "sim", "status")
        as_job = run(str(job), "--steps", "3")
        with wire.connect(env["NPUSIM_SOCKET"]) as sock:
            status, _value, payload = wire.request(sock, wire.OP_STATUS)
        assert status == 0
        listed = json.loads(payload)["refused_npusnap"]
    assert as_dump.startswith("refused"), as_dump
    assert as_sim == "served 0"
    assert as_job == "served 0"
    recorded = [json.loads(line) for line in refusals.read_text().splitlines()]
    assert [r["cmdline"][1:] for r in recorded] == [[str(fake), "dump", "1234"]]
    assert [r["cmdline"] for r in listed] == [r["cmdline"] for r in recorded]


_ROGUE = """\
#include <stdint.h>
int npusimGetOpenDevices(int32_t *ids, int max);
int rogue(void) {
    int32_t ids[4];
    return npusimGetOpenDevices(ids, 4);
}
"""
_MAIN = """\
#include <stdio.h>
int rogue(void);
int main(void) {
    printf("returned %d\\n", rogue());
    return 0;
}
"""


@pytest.mark.parametrize("library", ["libnpusnap_probe.so", "libjob.so"])
def test_a_simulator_private_function_aborts_when_npusnap_s_binary_calls_it(
    tmp_path: Path, library: str
) -> None:
    """The simulator's own exports (npusim*) abort when called from an object named like
    npusnap's (its agent libnpusnap_agent.so, its CRIU plugin npusnap_plugin.so): the same call
    from a job's library returns."""
    lib64 = paths.sim_cann_home() / "lib64"
    (tmp_path / "rogue.c").write_text(_ROGUE)
    (tmp_path / "main.c").write_text(_MAIN)
    cc = ["gcc", "-O2", "-Wall", f"-Wl,-rpath-link,{lib64}"]
    rogue = [str(tmp_path / "rogue.c"), f"-L{lib64}", "-lascendcl"]
    subprocess.run([*cc, "-shared", "-fPIC", "-o", str(tmp_path / library), *rogue], check=True, timeout=120)
    name = library.removeprefix("lib").removesuffix(".so")
    main = [str(tmp_path / "main.c"), f"-L{tmp_path}", f"-l{name}"]
    subprocess.run([*cc, "-o", str(tmp_path / "main"), *main], check=True, timeout=120)
    env = {"LD_LIBRARY_PATH": f"{tmp_path}:{lib64}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(tmp_path / "main")], env=env, capture_output=True, text=True, timeout=60)
    if library.startswith("libnpusnap"):
        assert done.returncode == -signal.SIGABRT, (done.returncode, done.stdout, done.stderr)
        assert f"npusimGetOpenDevices() called from {tmp_path / library}" in done.stderr
        assert "only what a real node offers" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout == "returned 0\n"  # no device opened in this process
