"""`npusnap sim start|status|env|stop` and the manager: idempotent, race-safe start, env for eval,
the daemon's bandwidth cap. Each test runs its own daemon on a private socket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from npusnap_workloads import script_path

pytestmark = pytest.mark.integration
NPUSNAP = [sys.executable, "-m", "npusnap_cli"]


@pytest.fixture
def private_socket() -> Iterator[dict[str, str]]:
    d = Path(tempfile.mkdtemp(prefix="npusim-cli-"))
    env = dict(os.environ, NPUSIM_SOCKET=str(d / "npusim.sock"))
    yield env
    subprocess.run([*NPUSNAP, "sim", "stop"], env=env, capture_output=True, timeout=30, check=False)
    shutil.rmtree(d, ignore_errors=True)


def npusnap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NPUSNAP, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_start_status_env_stop(private_socket: dict[str, str]) -> None:
    env = private_socket
    first = npusnap(env, "sim", "start", "--json", "--devices", "3", "--capacity", "256MiB")
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)["result"]
    assert doc["started"] is True and doc["simulated"] is True
    assert [d["capacity"] for d in doc["devices"]] == [256 << 20] * 3
    again = json.loads(npusnap(env, "sim", "start", "--json").stdout)["result"]
    assert again["started"] is False and again["daemon_pid"] == doc["daemon_pid"]

    exports = npusnap(env, "sim", "env").stdout
    lines = dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())
    assert set(lines) == {"ASCEND_HOME_PATH", "ASCEND_OPP_PATH", "LD_LIBRARY_PATH", "NPUSIM_SOCKET"}
    assert lines["NPUSIM_SOCKET"] == env["NPUSIM_SOCKET"]
    assert lines["ASCEND_OPP_PATH"] == lines["ASCEND_HOME_PATH"] + "/opp"  # torch_npu's import needs it
    # the exports are all a program needs: run a workload in a shell that evals them
    shell = subprocess.run(
        ["bash", "-c", f'eval "$({" ".join(NPUSNAP)} sim env)" && exec python3 {script_path("train")} '
         "--steps 2 --interval 0 --param-bytes 4096 --device 2"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shell.returncode == 0, shell.stderr
    assert [line.split()[:2] for line in shell.stdout.splitlines()] == [["step", "1"], ["step", "2"]]

    status = json.loads(npusnap(env, "sim", "status", "--json").stdout)
    assert status["ok"] and status["result"]["running"] and status["result"]["bytes_used"] == 0

    stop = json.loads(npusnap(env, "sim", "stop", "--json").stdout)
    assert stop["result"]["stopped"] is True
    assert json.loads(npusnap(env, "sim", "status", "--json").stdout)["result"]["running"] is False
    assert not Path(env["NPUSIM_SOCKET"]).exists()


def test_concurrent_starts_make_one_daemon(private_socket: dict[str, str]) -> None:
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: npusnap(private_socket, "sim", "start", "--json"), range(4)))
    docs = [json.loads(r.stdout)["result"] for r in results]
    assert sum(d["started"] for d in docs) == 1
    assert len({d["daemon_pid"] for d in docs}) == 1


def test_bad_capacity_is_a_usage_error(private_socket: dict[str, str]) -> None:
    res = npusnap(private_socket, "sim", "start", "--capacity", "lots")
    assert res.returncode == 2 and "not a size" in res.stderr


def test_daemon_bandwidth_cap_slows_copies(private_socket: dict[str, str]) -> None:
    env = private_socket
    assert npusnap(env, "sim", "start", "--bandwidth-mbps", "20").returncode == 0
    env.update(json.loads(npusnap(env, "sim", "env", "--json").stdout)["result"])
    t0 = time.monotonic()
    cmd = [sys.executable, str(script_path("train")), "--steps", "1", "--interval", "0"]
    res = subprocess.run(
        [*cmd, "--param-bytes", str(4 << 20)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    # 3 copies of 4 MiB (init H2D, step D2H + H2D) at 20 MB/s take at least ~0.6 s
    assert took >= 0.6


# The operators the attention block (npusnap_workloads/torch_npu_block.py) and a small training step use
# (the torch_npu notes' list): `sim ops` must count every one as implemented, or the job could not run.
# fmt: off
BLOCK_OPS = [
    "Add", "Adds", "InplaceAdd", "InplaceAdds", "Mul", "Muls", "InplaceMul", "InplaceMuls", "Subs",
    "Divs", "Sub", "Div", "Matmul", "Mm", "Addmm", "ReduceSum", "Mean", "Tril",
    "InplaceMaskedFillScalar", "BitwiseNot", "Softmax", "SoftmaxBackward", "Gelu", "GeluBackward",
    "Embedding", "EmbeddingDenseBackward", "LayerNorm", "LayerNormBackward", "LogSoftmax",
    "NLLLoss", "NLLLossBackward", "InplaceCopy", "InplaceAddcmul", "InplaceAddcdiv",
    "ForeachAddListV2", "ForeachLerpScalar", "ForeachNorm", "BatchMatMul",
]
# fmt: on


def test_sim_ops_compares_the_wheels_lookups_with_the_simulators_exports(
    private_socket: dict[str, str], torch_npu_python: str, tmp_path: Path
) -> None:
    """`npusnap sim ops` reads the wheel's aclnn names and libopapi.so's exports (no daemon needed):
    the counts add up, the lists agree with `nm -D`, --missing prints the rest, and the generated
    page (docs/simulator-ops.md) is current."""
    env = private_socket
    done = npusnap(env, "sim", "ops", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)["result"]
    implemented, missing = set(doc["implemented"]), set(doc["missing"])
    assert doc["looked_up_count"] == len(implemented) + len(missing) > 800  # 2.13.0: 915
    assert doc["implemented_count"] == len(implemented) and doc["missing_count"] == len(missing)
    assert not implemented & missing
    assert not [
        n for n in implemented | missing if n.endswith("GetWorkspaceSize") or not n.startswith("aclnn")
    ]
    assert {f"aclnn{op}" for op in BLOCK_OPS} <= implemented
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", doc["opapi"]], capture_output=True, text=True, check=True
    )
    exported = {ln.split()[-1] for ln in nm.stdout.splitlines() if ln.split()[-1].startswith("aclnn")}
    assert implemented <= exported and not missing & exported
    assert set(doc["extra"]) == {n for n in exported if not n.endswith("GetWorkspaceSize")} - implemented

    listed = npusnap(env, "sim", "ops", "--missing")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == doc["missing"]
    assert f"missing      {len(missing)}" in listed.stderr
    # the venv's own python directory is as good as the default site-packages
    venv = Path(torch_npu_python).parent.parent
    assert npusnap(env, "sim", "ops", "--torch-npu", str(venv)).stdout.split() == doc["implemented"]

    absent = npusnap(env, "sim", "ops", "--torch-npu", str(tmp_path))
    assert absent.returncode == 3, absent.stderr  # preflight
    said = " ".join(absent.stderr.split())  # the console wraps a long path
    assert f"no torch_npu wheel at {tmp_path}" in said and "setup-torch-npu.sh" in said

    page = subprocess.run(
        [sys.executable, str(Path(__file__).parents[2] / "scripts" / "gensimops.py"), "--check"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert page.returncode == 0, page.stderr
