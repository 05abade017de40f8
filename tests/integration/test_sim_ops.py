"""aclnn operators (libopapi.so), HCCL (libhccl.so) and the npu_train job on the simulated NPU.

Each operator runs on the device through its two phases and the runtime's kernel launch, and is
compared with a Python reference computed from the same inputs; the first phase's argument checks
answer the real aclnn codes; two ranks in two processes all-reduce through HCCL; the training job
prints the same lines run after run, single- and two-rank, and under `npusnap run` with a Lock
that holds its operators.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.device.agent_client import AgentClient
from npusnap_workloads import script_path
from tests.integration.agentlib import (
    PY,
    Sim,
    Workload,
    kill_pid,
    python_versions,
    wait_socket,
    workload_env,
)

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "sim_helpers" / "ops_driver.py"
JOB = script_path("npu_train")
ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
HCCL_E_PARA = 1
HCCL_E_NOT_SUPPORT = 5
HCCL_E_UNAVAIL = 7
ACL_ERROR_RT_AICORE_EXCEPTION = 507015
FAST = {"NPUSIM_KERNEL_BLOCK_US": "0", "HCCL_EXEC_TIMEOUT": "60", "HCCL_CONNECT_TIMEOUT": "60"}


def _env(sim: Sim, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPUSNAP_")}
    env.update(sim.env)
    env.update(FAST)
    env.update(extra)
    return env


def _mm(a: list[float], b: list[float], m: int, k: int, n: int, a_strides: tuple[int, int]) -> list[float]:
    return [
        sum(a[i * a_strides[0] + j * a_strides[1]] * b[j * n + c] for j in range(k))
        for i in range(m)
        for c in range(n)
    ]


def _reference(case: dict[str, Any]) -> list[float]:
    name, inp = case["case"], case["inputs"]
    if name in ("matmul", "mm"):
        return _mm(inp["a"], inp["b"], 5, 7, 3, (7, 1))
    if name == "matmul_transposed":
        return _mm(inp["a"], inp["c"], 7, 5, 3, (1, 7))
    if name == "add_broadcast":
        return [x + case["alpha"] * inp["bias"][i % 3] for i, x in enumerate(inp["x"])]
    if name == "inplace_add":
        return [y + case["alpha"] * z for y, z in zip(inp["y"], inp["z"])]
    if name == "mul":
        return [x * y for x, y in zip(inp["x"], inp["x2"])]
    if name in ("inplace_muls", "muls"):
        return [x * case["scale"] for x in inp["x"]]
    if name == "relu":
        return [max(x, 0.0) for x in inp["x"]]
    if name == "threshold_backward":
        return [g if x > 0 else 0.0 for g, x in zip(inp["g"], inp["x"])]
    if name == "reduce_sum_dim0":
        return [sum(inp["x"][r * 3 + c] for r in range(4)) for c in range(3)]
    if name == "reduce_sum_dim1_keepdim":
        return [sum(inp["x"][r * 3 : r * 3 + 3]) for r in range(4)]
    if name == "mse_loss":
        sq = [(x - t) ** 2 for x, t in zip(inp["x"], inp["t"])]
        return sq if case["reduction"] == 0 else [sum(sq) / (len(sq) if case["reduction"] == 1 else 1)]
    if name == "mse_loss_backward":
        return [2.0 / 12 * (x - t) * case["grad"] for x, t in zip(inp["x"], inp["t"])]
    raise AssertionError(f"no reference for {name}")


@pytest.fixture(scope="module")
def op_results(sim_env: dict[str, str]) -> list[dict[str, Any]]:
    sim = Sim(sim_env)
    done = subprocess.run(
        [PY, str(DRIVER), "ops", "0"], env=_env(sim), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _round_to(dtype: str, x: float) -> float:
    """x (a float32 value) rounded to nearest even in float16 or bfloat16, as the kernel stores it."""
    if dtype == "f16":
        return float(struct.unpack("e", struct.pack("e", x))[0])
    (w,) = struct.unpack("I", struct.pack("f", x))
    w = (w + 0x7FFF + ((w >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("f", struct.pack("I", w))[0])


def _mm_f32(a: list[float], b: list[float], shape: list[int], b_strides: list[int]) -> list[float]:
    """A product as one fp32 GEMM thread sums it: from 0.0 in k order, every product and every sum
    rounded to float32 (Python's doubles round each exactly once more: harmless for one fp32 + or *)."""
    m, k, n = shape
    out = []
    for i in range(m):
        for c in range(n):
            acc = 0.0
            for j in range(k):
                acc = _f32(acc + _f32(a[i * k + j] * b[j * b_strides[0] + c * b_strides[1]]))
            out.append(acc)
    return out


def test_matrix_products_are_the_bits_of_one_fp32_gemm_thread(op_results: list[dict[str, Any]]) -> None:
    """The simulated matmul's result is exactly reproducible: the same bits as a scalar loop summing in
    k order, whatever its blocking and whether b is read in place (row-major or transposed)."""
    cases = [c for c in op_results if c["case"].startswith("matmul_bits")]
    assert {c["case"] for c in cases} == {
        "matmul_bits_3",
        "matmul_bits_wt_3",
        "matmul_bits_11",
        "matmul_bits_wt_11",
        "matmul_bits_f16_11",
        "matmul_bits_f16_wt_11",
        "matmul_bits_bf16_11",
        "matmul_bits_bf16_wt_11",
    }
    for case in cases:
        inp = case["inputs"]
        want = _mm_f32(inp["a"], inp["b"], inp["shape"], inp["b_strides"])
        if "dtype" in inp:  # float16 / bfloat16: the float sums rounded once to the output's dtype
            want = [_round_to(inp["dtype"], x) for x in want]
        assert case["out"] == want, case["case"]


def test_every_operator_matches_a_python_reference(op_results: list[dict[str, Any]]) -> None:
    cases = [c for c in op_results if c["case"] != "codes" and not c["case"].startswith("matmul_bits")]
    names = {c["case"] for c in cases}
    assert {
        "matmul",
        "matmul_transposed",
        "mm",
        "add_broadcast",
        "inplace_add",
        "mul",
        "muls",
        "inplace_muls",
        "relu",
        "threshold_backward",
        "reduce_sum_dim0",
        "reduce_sum_dim1_keepdim",
        "mse_loss",
        "mse_loss_backward",
    } <= names
    for case in cases:
        want = _reference(case)
        got = case["out"]
        assert len(got) == len(want), case["case"]
        for i, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= 1e-4 * max(1.0, abs(w)), f"{case['case']}[{i}]: device {g}, reference {w}"


def test_two_phase_errors_are_the_real_codes(op_results: list[dict[str, Any]]) -> None:
    codes = next(c["codes"] for c in op_results if c["case"] == "codes")
    assert codes == {
        "matmul_inner_mismatch": ACLNN_ERR_PARAM_INVALID,
        "matmul_out_mismatch": ACLNN_ERR_PARAM_INVALID,
        "matmul_null": ACLNN_ERR_PARAM_NULLPTR,
        "add_not_broadcastable": ACLNN_ERR_PARAM_INVALID,
        "add_null_alpha": ACLNN_ERR_PARAM_NULLPTR,
        "relu_fp16": ACLNN_ERR_PARAM_INVALID,
        "reduce_dim_out_of_range": ACLNN_ERR_PARAM_INVALID,
        "mse_bad_reduction": ACLNN_ERR_PARAM_INVALID,
        "launch_other_operators_executor": ACLNN_ERR_PARAM_INVALID,
        "launch_null_executor": ACLNN_ERR_PARAM_NULLPTR,
        "workspace_size": 0,
    }


def test_a_copy_taken_mid_kernel_sees_a_half_written_output(sim_env: dict[str, str]) -> None:
    """Kernels compute block by block and write as they go (8 blocks of 2 rows, 0.15 s each)."""
    sim = Sim(sim_env)
    env = _env(sim, NPUSIM_KERNEL_BLOCK_US="150000", TORN_AFTER_S="0.5")
    done = subprocess.run(
        [PY, str(DRIVER), "torn", "0"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout)
    assert set(res["mid_rows"]) == {8.0, -1.0}, res  # some rows computed (8 = 1 x 1 summed 8 times), some not
    assert res["mid_rows"] == sorted(res["mid_rows"], reverse=True), "blocks run in order"
    assert res["final"] == [8.0]


def test_hccl_all_reduce_and_broadcast_of_two_ranks_in_two_processes(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    sim = Sim(sim_env)
    count = 3 * (1 << 20) // 4 + 5  # more than one 1 MiB staging slot, and not a multiple of it
    env = _env(sim, HCCL_BUFFSIZE="1")
    procs = [
        subprocess.Popen(
            [PY, str(DRIVER), "allreduce", str(r), "2", str(r), str(tmp_path), str(count)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out))
    v0, v1 = outs[0]["values"], outs[1]["values"]
    for o in outs:
        assert o["codes"] == {
            "bad_dtype": HCCL_E_NOT_SUPPORT,
            "bad_op": HCCL_E_PARA,
            "broadcast_bad_root": HCCL_E_PARA,
        }
        r = o["results"]
        for k in range(len(o["idx"])):
            want = struct.unpack("f", struct.pack("f", v0[k] + v1[k]))[0]  # the sum rounded to fp32
            assert r["sum"]["at"][k] == want
            assert r["max"]["at"][k] == max(v0[k], v1[k])
            assert r["inplace_sum"]["at"][k] == want
            assert r["broadcast_from_1"]["at"][k] == v1[k]
    assert outs[0]["results"] == outs[1]["results"], "every rank must hold the same bits"
    assert not list(tmp_path.glob("*.sock")), "the rendezvous socket must be gone after init"


def test_a_restore_invalidates_hccl_communicators_and_a_new_one_works(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """HCCL's own RESTORE_POST callback marks its communicators invalid (they are not part of a
    backup); the application destroys them and builds new ones, as vllm-ascend does. A collective
    whose launch waited at the lock fails on its stream, without touching memory."""
    sim = Sim(sim_env)
    procs = [
        subprocess.Popen(
            [PY, str(DRIVER), "restore", str(r), "2", str(r), str(tmp_path)],
            env=_env(sim),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out) == {
            "before": 0,
            "before_sum": 3.0,
            "Lock": 0,
            "late_call_waits": True,
            "Backup": 0,
            "Restore": 0,
            "Unlock": 0,
            # Launched before the restore, run after it: fails on the stream, says why.
            "late_call": 0,
            "late_sync": ACL_ERROR_RT_AICORE_EXCEPTION,
            "async_error_rc": 0,
            "async_error": HCCL_E_UNAVAIL,
            "after_restore": HCCL_E_UNAVAIL,
            "rank_size_after_restore": HCCL_E_UNAVAIL,
            "resume_after_restore": HCCL_E_UNAVAIL,
            "destroy": 0,
            "rebuilt": 0,
            "rebuilt_sum": 3.0,
        }


def test_hccl_comm_init_root_info_config_as_torch_npu_calls_it(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """The configuration's magic word is checked; its buffer size (MiB per rank) sizes the window
    and its name is what HcclGetCommName answers; prod takes no bfloat16, as on Atlas A2/A3."""
    sim = Sim(sim_env)
    procs = [
        subprocess.Popen(
            [PY, str(DRIVER), "config", str(r), "2", str(r), str(tmp_path)],
            env=_env(sim, HCCL_BUFFSIZE="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out) == {
            "capability": 3,  # buffer size, deterministic, comm name: torch_npu then sets the name
            "bad_magic": HCCL_E_PARA,
            "init": 0,
            "window_bytes": [8192 + 2 * 3 * (1 << 20)],
            "name_rc": 0,
            "name": "group_name_7",
            "allreduce": 0,
            "sum": 3.0,
            "prod_bf16": HCCL_E_NOT_SUPPORT,
            "destroy": 0,
        }


def test_hccl_v_collectives_with_counts_that_differ_per_rank(sim_env: dict[str, str], tmp_path: Path) -> None:
    sim = Sim(sim_env)
    procs = [
        subprocess.Popen(
            [PY, str(DRIVER), "vcoll", str(r), "2", str(r), str(tmp_path)],
            env=_env(sim, HCCL_BUFFSIZE="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out))

    def vals(r: int, n: int) -> list[float]:
        return [float(r * 1000 + i % 1000) for i in range(n)]

    def crc(xs: list[float]) -> int:
        return zlib.crc32(struct.pack(f"{len(xs)}f", *xs))

    counts = [5, 300005]
    gathered = vals(0, 5) + [-1.0] * 7 + vals(1, 300005)
    n = 200003
    for r, o in enumerate(outs):
        full = [a + b for a, b in zip(vals(0, 2 * (n + 11)), vals(1, 2 * (n + 11)))]
        want = full[r * (n + 11) : r * (n + 11) + n]
        assert o == {
            "allgatherv": 0,
            "allgatherv_crc": crc(gathered),
            "reducescatterv": 0,
            "reducescatterv_crc": crc(want),
            "reducescatterv_uneven": HCCL_E_PARA,  # blocks of different sizes cannot be reduced
        }, (r, counts)


def test_destroying_a_communicator_ends_a_collective_whose_peer_left(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    sim = Sim(sim_env)
    procs = [
        subprocess.Popen(
            [PY, str(DRIVER), "abandoned", str(r), "2", str(r), str(tmp_path)],
            env=_env(sim),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out))
    assert outs[0] == {
        "allreduce": 0,
        "destroy": 0,
        "destroy_within_5s": True,  # HCCL_EXEC_TIMEOUT is 60 s here
        "sync": ACL_ERROR_RT_AICORE_EXCEPTION,  # the collective failed on its stream
    }


def _job(sim: Sim, *args: str, python: str = PY, timeout: float = 120) -> list[str]:
    done = subprocess.run(
        [python, str(JOB), *args], env=_env(sim), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_job_prints_the_same_lines_every_run(sim_env: dict[str, str]) -> None:
    sim = Sim(sim_env)
    first = _job(sim, "--steps", "12", "--hidden", "16")
    second = _job(sim, "--steps", "12", "--hidden", "16")
    assert first == second
    assert [ln.split()[:2] for ln in first] == [["step", str(n)] for n in range(1, 13)]
    losses = [float(ln.split()[3]) for ln in first]
    assert losses[-1] < losses[0], f"the MLP does not learn: {losses}"
    assert len({ln.split()[5] for ln in first}) == 12, "the parameters must change every step"


def test_the_job_runs_on_python_3_9(sim_env: dict[str, str]) -> None:
    py39 = python_versions().get("3.9")
    if py39 is None:
        pytest.skip("no pyenv Python 3.9 on this host (~/.pyenv/versions/3.9.*)")
    sim = Sim(sim_env)
    assert _job(sim, "--steps", "3", "--hidden", "8", python=py39) == _job(
        sim, "--steps", "3", "--hidden", "8"
    )


def test_two_ranks_all_reduce_their_gradients(sim_env: dict[str, str]) -> None:
    sim = Sim(sim_env)
    first = _job(sim, "--steps", "6", "--hidden", "16", "--ranks", "2")
    second = _job(sim, "--steps", "6", "--hidden", "16", "--ranks", "2")
    by_rank = [sorted(ln for ln in first if ln.startswith(f"[rank {r}] ")) for r in (0, 1)]
    assert all(len(lines) == 6 for lines in by_rank), first
    assert sorted(first) == sorted(second)
    # Data parallel: each rank its own data (its own loss), the same parameters after every step.
    for a, b in zip(*by_rank):
        assert a.split()[-1] == b.split()[-1]
    assert [a.split()[5] for a in by_rank[0]] != [b.split()[5] for b in by_rank[1]]


def test_the_job_runs_under_npusnap_run_and_its_operators_wait_at_a_lock(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    sim = Sim(sim_env)
    steps = "40"
    reference = _job(sim, "--steps", steps, "--hidden", "16")
    env = workload_env(sim, runtime_dir, **FAST)
    argv = [PY, "-m", "npusnap_cli", "run", "--", PY, str(JOB), "--steps", steps, "--hidden", "16"]
    w = Workload([*argv, "--interval", "0.05"], env, tmp_path, name="npu_train")
    try:
        w.wait_for("step 3 ", timeout=60)
        wait_socket(runtime_dir, w.pid)
        with AgentClient(w.pid) as c:
            assert c.hello().acl.loaded is True
            assert c.lock(lease_s=30).state == "LOCKED"
            time.sleep(0.5)  # a step already past the gate may finish
            held = len(w.lines())
            time.sleep(1.0)
            assert len(w.lines()) == held, "aclnn launches and copies must wait while the process is locked"
            assert c.unlock().state == "RUNNING"
        assert w.proc.wait(timeout=120) == 0, w.stderr()[-3000:]
        assert [ln for ln in w.lines() if ln.startswith("step ")] == reference
    finally:
        kill_pid(w.pid, "npu_train.py")
