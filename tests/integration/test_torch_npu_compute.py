"""The real torch_npu wheel computes right on the simulated NPU, with the CPU build of torch as the
oracle (the simulated device never calls torch).

The per-operator checkers (tests/torch_npu/check_*.py) compare every implemented operator's
forward and backward with the CPU on non-contiguous views, in float32, float16 and bfloat16, and
rerun each case to require identical bits; the generation checker decodes greedily with a small
GPT built in the process and must match the CPU token for token. The training tests run the
attention block of npusnap_cli/workloads/torch_npu_block.py (embedding, LayerNorm, causal attention, GELU MLP,
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
BLOCK = str(REPO / "npusnap_cli" / "workloads" / "torch_npu_block.py")
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
