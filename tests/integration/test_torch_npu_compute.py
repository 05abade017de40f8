"""The real torch_npu wheel computes right on the simulated NPU, with the CPU build of torch as the
oracle (the simulated device never calls torch).

The per-operator checkers (tests/torch_npu/check_*.py) compare every implemented operator's
forward and backward with the CPU on non-contiguous views, in float32, float16 and bfloat16, and
rerun each case to require identical bits; the generation checker decodes greedily with a small
GPT built in the process and must match the CPU token for token. The training tests run the
attention block of npusnap_workloads/torch_npu_block.py (embedding, LayerNorm, causal attention, GELU MLP,
cross-entropy, AdamW or SGD with their default foreach settings, gradient clipping) for 20 steps
and compare every loss with the CPU's, in every task-queue mode and with expandable segments.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.integration.dumplib import REPO

pytestmark = [pytest.mark.integration, requires_root]

SCRIPTS = REPO / "tests" / "torch_npu"
# The attention block is the demo's workload too: one definition, in the package.
BLOCK = str(REPO / "npusnap_workloads" / "torch_npu_block.py")
FAST = {"NPUSIM_KERNEL_BLOCK_US": "0"}


def _run(python: str, env: dict[str, str], script: str, *args: str, timeout: float = 600) -> str:
    """Run a checker of SCRIPTS by name, or a script by its absolute path."""
    done = subprocess.run(
        [python, str(SCRIPTS / script), *args],
        env=dict(env, **FAST),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize("script", ["check_ops_nn.py", "check_ops_math.py", "check_generate.py"])
def test_operators_match_the_cpu(script: str, torch_npu_python: str, sim_env: dict[str, str]) -> None:
    out = _run(torch_npu_python, sim_env, script)
    assert "FAIL" not in out, out[-6000:]


def _losses(lines: str) -> list[float]:
    return [float(ln.split()[3]) for ln in lines.splitlines() if ln.startswith("step")]


@pytest.mark.parametrize(
    "name,extra,args",
    [
        ("adamw", {}, []),
        ("sgd", {}, ["--optimizer", "sgd"]),
        ("expandable", {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}, []),
        ("task-queue-0", {"TASK_QUEUE_ENABLE": "0"}, []),
        ("task-queue-2", {"TASK_QUEUE_ENABLE": "2"}, []),
    ],
)
def test_the_attention_block_trains_like_the_cpu(
    name: str, extra: dict[str, str], args: list[str], torch_npu_python: str, sim_env: dict[str, str]
) -> None:
    steps = ["--steps", "20", *args]
    npu = _run(torch_npu_python, dict(sim_env, **extra), BLOCK, *steps)
    cpu_env = dict(sim_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    cpu = _run(torch_npu_python, cpu_env, BLOCK, "--device", "cpu", *steps)
    got, want = _losses(npu), _losses(cpu)
    assert len(got) == len(want) == 20, npu + cpu
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-4 * abs(w), f"step {step}: npu {g} cpu {w}\n{npu}\n{cpu}"
    again = _run(torch_npu_python, dict(sim_env, **extra), BLOCK, *steps)
    assert again == npu, "a second run on the simulated NPU differs: not deterministic"


def test_scripts_are_all_run() -> None:
    """Every script under tests/torch_npu is run by some test (none left behind unrun)."""
    here = Path(__file__).parent
    mentioned = "".join(p.read_text() for p in here.glob("test_*.py"))
    missing = [p.name for p in SCRIPTS.glob("*.py") if p.name not in mentioned]
    assert not missing, f"scripts no test runs: {missing}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_trains_like_cpu_autocast(
    dtype: str, torch_npu_python: str, sim_env: dict[str, str]
) -> None:
    """torch.autocast on the simulated NPU against torch.autocast on the CPU (same dtype): every
    loss within 2e-2 relative, and within 5e-2 of the CPU's float32 run. Where the two autocast
    policies keep different precisions per op (the CPU's autocast lists fewer ops), the
    difference stays inside these bounds."""
    steps = ["--steps", "20"]
    npu = _losses(_run(torch_npu_python, sim_env, BLOCK, *steps, "--autocast", dtype))
    cpu_env = dict(sim_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    cpu = _losses(_run(torch_npu_python, cpu_env, BLOCK, "--device", "cpu", *steps, "--autocast", dtype))
    fp32 = _losses(_run(torch_npu_python, cpu_env, BLOCK, "--device", "cpu", *steps))
    assert len(npu) == len(cpu) == len(fp32) == 20
    for step, (g, c, f) in enumerate(zip(npu, cpu, fp32)):
        assert abs(g - c) <= 2e-2 * abs(c), f"step {step}: npu {g}, cpu autocast {c}"
        assert abs(g - f) <= 5e-2 * abs(f), f"step {step}: npu {g}, cpu float32 {f}"


def test_a_half_model_infers_like_the_cpu(torch_npu_python: str, sim_env: dict[str, str]) -> None:
    """model.half(): every op in float16 on both sides; losses within 1e-3 relative."""
    npu = _losses(_run(torch_npu_python, sim_env, BLOCK, "--steps", "10", "--half"))
    cpu_env = dict(sim_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    cpu = _losses(_run(torch_npu_python, cpu_env, BLOCK, "--device", "cpu", "--steps", "10", "--half"))
    assert len(npu) == len(cpu) == 10
    for step, (g, c) in enumerate(zip(npu, cpu)):
        assert abs(g - c) <= 1e-3 * abs(c), f"step {step}: npu {g}, cpu {c}"


PAD = """
import torch, torch_npu, torch.nn.functional as F
x = torch.randn(3, 4, 5)
for pad in [(1, 2), (1, 2, 0, 3), (-1, 2, 1, 1, 2, 0), (0, 0)]:
    a = F.pad(x.npu().transpose(0, 2), pad, value=1.5).cpu()
    b = F.pad(x.transpose(0, 2), pad, value=1.5)
    assert a.shape == b.shape and torch.equal(a, b), pad
xi = torch.arange(6).reshape(2, 3)
assert torch.equal(F.pad(xi.npu(), (1, 1), value=7).cpu(), F.pad(xi, (1, 1), value=7))
print("ok")
"""


def test_constant_pad_matches_the_cpu(torch_npu_python: str, sim_env: dict[str, str]) -> None:
    """aclnnConstantPadNd: F.pad in constant mode (crops too), on a transposed view and on int64."""
    done = subprocess.run(
        [torch_npu_python, "-c", PAD], env=dict(sim_env, **FAST), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stdout + done.stderr[-3000:]
