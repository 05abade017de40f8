"""torch_npu's ProcessGroupHCCL on the simulated NPU: two ranks on two simulated devices.

The scripts under tests/torch_npu run the jobs and check them (exit 0 and a line starting "OK"):
DDP over hccl against the same job over gloo on the CPU, step by step within 1e-4 relative and
bit-identical across reruns (one tree from torch.multiprocessing, and torchrun); every collective
DDP and FSDP use against computed values; an FSDP-style sharded job (all-gather the weight,
reduce-scatter the gradient) against one CPU process; a rank killed mid-run makes the other
rank's watchdog take its process down as on hardware; after a snapshot Restore the
communicators answer HCCL_E_UNAVAIL, which the watchdog sees, and reinit_process_group rebuilds
them.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import requires_root
from tests.integration.dumplib import REPO

pytestmark = [pytest.mark.integration, requires_root]

SCRIPTS = REPO / "tests" / "torch_npu"


@pytest.mark.parametrize(
    "script,args",
    [
        ("ddp_hccl_vs_gloo.py", ["--launcher", "spawn"]),
        ("ddp_hccl_vs_gloo.py", ["--launcher", "torchrun"]),
        ("hccl_collectives.py", []),
        ("hccl_sharded_job.py", []),
        ("hccl_watchdog_kill.py", []),
        ("hccl_restore_watchdog.py", []),
    ],
    ids=["ddp-spawn", "ddp-torchrun", "collectives", "sharded", "watchdog-kill", "restore-watchdog"],
)
def test_hccl_job(script: str, args: list[str], torch_npu_python: str, sim_env: dict[str, str]) -> None:
    env = dict(sim_env, NPUSIM_KERNEL_BLOCK_US="0")
    done = subprocess.run(
        [torch_npu_python, str(SCRIPTS / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    tail = f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, tail
    assert any(ln.startswith("OK") for ln in done.stdout.splitlines()), tail
