"""The real torch_npu wheel on the simulated NPU: it loads, initialises, copies, allocates, and
fails loudly where the simulator does not compute.

Each test runs a short script with the torch_npu venv's python (.build/torch-npu, built by
scripts/setup-torch-npu.sh) in the session's private simulator, with the environment
`npusnap sim env` gives and nothing else, and asserts on the JSON it prints. The numbers come
from the CPU (the values copied in), never from torch itself on the device.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from npusnap_cli import paths
from tests.integration import torchnpulib

pytestmark = pytest.mark.integration

SOC_910B = "Ascend910B1"  # the simulator's default: op-plugin may fall back to aclop
SOC_950 = "Ascend950PR_9599"  # torch_npu's "aclnn only" SoC family (NpuVariables.cpp IsAclnnOnly)
MiB = 1 << 20


def _env(sim_env: dict[str, str], **extra: str) -> dict[str, str]:
    """The simulator's environment for a torch_npu child: `sim env`, no npusnap agent."""
    env = {k: v for k, v in sim_env.items() if not k.startswith(("NPUSNAP_", "PYTORCH_NPU_", "TASK_QUEUE"))}
    env.pop("NPUSIM_SOC_VERSION", None)
    env.update(extra)
    return env


def _run(python: str, code: str, env: dict[str, str]) -> dict[str, object]:
    proc = torchnpulib.run(python, code, env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    got: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def _opapi_exports() -> set[str]:
    lib = paths.sim_cann_dir() / "cann" / "lib64" / "libopapi.so"
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {f[2] for f in (ln.split() for ln in out.stdout.splitlines()) if len(f) == 3}


ROUNDTRIP = r"""
import json, torch, torch_npu
out = {"count": torch.npu.device_count(), "soc": torch.npu.get_device_name(0)}
cpu = torch.arange(24, dtype=torch.float32).reshape(4, 6) * 0.5
dev = cpu.to("npu")
out["device"] = str(dev.device)
out["roundtrip"] = dev.cpu().tolist() == cpu.tolist()
pinned = torch.arange(4096, dtype=torch.float32).pin_memory()
target = torch.empty(4096, device="npu")
target.copy_(pinned, non_blocking=True)  # aclrtMemcpyAsync on the task-queue thread
torch.npu.synchronize()
out["pinned_roundtrip"] = bool(torch.equal(target.cpu(), pinned))
big = torch.empty(3 << 20, dtype=torch.uint8, device="npu")  # 3 MiB: the large pool
stats = torch.npu.memory_stats()
out["allocated"] = stats["allocated_bytes.all.current"]
out["reserved"] = stats["reserved_bytes.all.current"]
out["alloc_count"] = stats["allocation.all.current"]
del dev, target, big
torch.npu.synchronize()
out["allocated_after_free"] = torch.npu.memory_stats()["allocated_bytes.all.current"]
torch.npu.empty_cache()
out["reserved_after_empty_cache"] = torch.npu.memory_stats()["reserved_bytes.all.current"]
try:
    z = torch.zeros(5, device="npu")
    out["zeros"] = z.cpu().tolist()
except RuntimeError as e:
    out["zeros_error"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("tree", ["cann", "cann-strict"])
def test_import_init_copies_and_memory_stats(
    torch_npu_python: str, sim_env: dict[str, str], tree: str
) -> None:
    """Also on the strict tree, whose libraries export real CANN names only."""
    home = paths.build_dir() / tree
    env = _env(sim_env, ASCEND_HOME_PATH=str(home), ASCEND_OPP_PATH=str(home / "opp"))
    env["LD_LIBRARY_PATH"] = str(home / "lib64")
    got = _run(torch_npu_python, ROUNDTRIP, env)
    assert got["count"] == 2  # the session's daemon has two devices
    assert got["soc"] == SOC_910B
    assert got["device"] == "npu:0"
    assert got["roundtrip"] is True and got["pinned_roundtrip"] is True
    assert got["alloc_count"] == 3
    assert int(str(got["allocated"])) >= 96 + 4096 * 4 + (3 << 20)
    assert (
        int(str(got["reserved"])) >= int(str(got["allocated"])) and int(str(got["reserved"])) % (2 * MiB) == 0
    )
    assert got["allocated_after_free"] == 0
    assert int(str(got["reserved_after_empty_cache"])) <= 2 * MiB  # all but the small segment
    # torch.zeros is aclnnInplaceZero: computed when the operator library has it, else a loud
    # aclop failure (the ZerosLike fallback) -- never zeros nobody wrote
    if {"aclnnInplaceZero", "aclnnInplaceZeroGetWorkspaceSize"} <= _opapi_exports():
        assert got["zeros"] == [0.0] * 5
    else:
        assert "aclopCompileAndExecute" in str(got["zeros_error"]), got


EXPANDABLE = r"""
import json, torch, torch_npu
out = {}
sizes = (10, 300_000, 3_000_000, 9_000_000)
xs = [torch.arange(n, dtype=torch.float32).to("npu") for n in sizes]
out["values"] = [float(x[-1].cpu()) for x in xs]
segs = torch.npu.memory_snapshot()
out["expandable"] = [s["is_expandable"] for s in segs]
out["segment_sizes"] = [s["total_size"] for s in segs]
out["reserved"] = torch.npu.memory_stats()["reserved_bytes.all.current"]
del xs
torch.npu.empty_cache()
out["reserved_after_empty_cache"] = torch.npu.memory_stats()["reserved_bytes.all.current"]
again = torch.arange(1000, dtype=torch.float32).to("npu")  # the range is mapped again
out["again"] = float(again[-1].cpu())
print(json.dumps(out))
"""


def test_expandable_segments_map_and_unmap(torch_npu_python: str, sim_env: dict[str, str]) -> None:
    """expandable_segments:True: the 512-byte probe reserve (flags=1) passes, each pool reserves
    1.125 x the device memory and maps 2 MiB / 20 MiB physical chunks; empty_cache unmaps them."""
    env = _env(sim_env, PYTORCH_NPU_ALLOC_CONF="expandable_segments:True")
    got = _run(torch_npu_python, EXPANDABLE, env)
    assert got["values"] == [9.0, 299_999.0, 2_999_999.0, 8_999_999.0]
    assert got["expandable"] and all(got["expandable"]), got  # type: ignore[arg-type]
    assert all(int(s) % (2 * MiB) == 0 for s in got["segment_sizes"])  # type: ignore[attr-defined]
    assert int(str(got["reserved"])) >= 4 * (10 + 300_000 + 3_000_000 + 9_000_000)
    assert got["reserved_after_empty_cache"] == 0
    assert got["again"] == 999.0


@pytest.fixture(scope="module")
def vmm_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sim_helpers/vmm_trace.c, an LD_PRELOAD interposer logging torch_npu's allocation calls."""
    out = tmp_path_factory.mktemp("vmm") / "vmm_trace.so"
    src = Path(__file__).parent / "sim_helpers" / "vmm_trace.c"
    subprocess.run(["cc", "-O1", "-Wall", "-fPIC", "-shared", "-o", str(out), str(src), "-ldl"], check=True)
    return out


def _trace(lines: list[str], kind: str) -> list[dict[str, int]]:
    """The calls of one kind, as {field: value} (rc included)."""
    calls = []
    for ln in lines:
        words = ln.split()
        if words and words[0] == kind:
            calls.append({k: int(v) for k, v in (w.split("=") for w in words[1:] if "=" in w)})
    return calls


@pytest.mark.parametrize("expandable", [True, False])
def test_allocator_calls_as_torch_npu_makes_them(
    torch_npu_python: str, sim_env: dict[str, str], vmm_trace: Path, tmp_path: Path, expandable: bool
) -> None:
    """What torch_npu's caching allocator asks of the runtime (shared/torch-npu.md, Allocator),
    seen by an interposer: the default allocator takes 2 MiB / 20 MiB segments from
    aclrtMallocAlign32; expandable segments probe with a 512-byte reserve (flags=1), reserve
    1.125 x the device memory per pool, map 2 MiB / 20 MiB physical chunks, and on empty_cache
    unmap, free and release them all. Every call succeeds."""
    trace = tmp_path / "trace.txt"
    env = _env(sim_env, LD_PRELOAD=str(vmm_trace), VMM_TRACE_FILE=str(trace))
    if expandable:
        env["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"
    got = _run(torch_npu_python, EXPANDABLE, env)
    assert got["values"] == [9.0, 299_999.0, 2_999_999.0, 8_999_999.0]
    lines = trace.read_text().splitlines()
    assert lines and all(ln.endswith(" rc=0") for ln in lines), lines
    if not expandable:
        sizes = {c["size"] for c in _trace(lines, "malloc_align32")}
        assert sizes and sizes <= {2 * MiB, 20 * MiB} | {n * 2 * MiB for n in range(11, 64)}, sizes
        assert not _trace(lines, "reserve") and not _trace(lines, "malloc")
        return
    reserves = _trace(lines, "reserve")
    assert lines[0] == "reserve size=512 flags=1 rc=0" and lines[1].startswith("release")  # the probe
    total = _trace(lines, "meminfo")[0]["total"]
    pools = reserves[1:]
    assert pools and all(total * 9 // 8 <= r["size"] < total * 9 // 8 + 20 * MiB for r in pools), (
        total,
        pools,
    )
    physical = {c["size"] for c in _trace(lines, "physical")}
    assert physical <= {2 * MiB, 20 * MiB} and physical, physical
    maps = _trace(lines, "map")
    assert len(maps) == len(_trace(lines, "physical")) == len(_trace(lines, "unmap")) + 1  # `again` stays
    assert len(_trace(lines, "free_physical")) == len(_trace(lines, "unmap"))
    assert len(_trace(lines, "release")) >= len(pools)  # each pool's range went back on empty_cache


COPIES = r"""
import json, torch, torch_npu
out = {}
a = torch.linspace(-1, 1, 1000)
d = a.to("npu", non_blocking=True)
b = torch.empty(1000, device="npu")
b.copy_(d)  # device to device, same device
out["h2d_d2d_d2h"] = bool(torch.equal(b.cpu(), a))
h = torch.empty(1000).pin_memory()
h.copy_(b, non_blocking=True)
torch.npu.current_stream().synchronize()
out["d2h_async"] = bool(torch.equal(h, a))
s = torch.npu.Stream()
with torch.npu.stream(s):
    c = a.to("npu", non_blocking=True)
s.synchronize()
out["side_stream"] = bool(torch.equal(c.cpu(), a))
torch.npu.set_device(1)
e = (a * 2).to("npu")
out["device1"] = [str(e.device), bool(torch.equal(e.cpu(), a * 2)), torch.npu.current_device()]
out["device0_still"] = bool(torch.equal(d.cpu(), a))
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["0", "1", "2"])
def test_copies_in_every_task_queue_mode(torch_npu_python: str, sim_env: dict[str, str], mode: str) -> None:
    """Host/device copies, a side stream and a second device in one process, with the task queue
    off (0), on (1, the default) and with the workspace phase on it too (2)."""
    got = _run(torch_npu_python, COPIES, _env(sim_env, TASK_QUEUE_ENABLE=mode))
    assert got["h2d_d2d_d2h"] is True
    assert got["d2h_async"] is True
    assert got["side_stream"] is True
    assert got["device1"] == ["npu:1", True, 1]
    assert got["device0_still"] is True


ACLOP = r"""
import json, sys, torch, torch_npu
op = sys.argv[1]
x = torch.empty(8, device="npu")  # no copy: on the 950 SoC every copy is an aclnn operator too
out = {"op": op}
try:
    y = getattr(torch, op)(*([x] * int(sys.argv[2])))
    torch.npu.synchronize()
    out["result"] = y.cpu().tolist()
except RuntimeError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""

# Operators with no aclnn implementation in the simulator, each routed through aclop on a
# 910B-class SoC (op-plugin's DO_COMPATIBILITY fallback): (torch function, arity, aclnn name).
UNIMPLEMENTED = [("selu", 1, "Elu"), ("celu", 1, "Elu")]  # both reach the Elu operator


def _unimplemented_op() -> tuple[str, int, str]:
    have = _opapi_exports()
    for op, arity, aclnn in UNIMPLEMENTED:
        if f"aclnn{aclnn}" not in have:
            return op, arity, aclnn
    raise AssertionError(f"libopapi.so implements all of {UNIMPLEMENTED}: name another operator it lacks")


@pytest.mark.parametrize(("soc", "task_queue"), [(SOC_910B, "1"), (SOC_910B, "0"), (SOC_950, "1")])
def test_an_operator_without_aclnn_raises(
    torch_npu_python: str, sim_env: dict[str, str], soc: str, task_queue: str
) -> None:
    """On a 910B-class SoC op-plugin falls back to aclopCompileAndExecute, which fails with its
    text (read on the thread that launched it: the task queue's, or the caller's with the queue
    off); on an Ascend950 SoC torch_npu refuses the missing aclnn operator itself. Either way the
    job raises instead of reading outputs nobody computed."""
    op, arity, aclnn = _unimplemented_op()
    env = _env(sim_env, NPUSIM_SOC_VERSION=soc, TASK_QUEUE_ENABLE=task_queue)
    proc = torchnpulib.run(torch_npu_python, ACLOP, env, args=(op, str(arity)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "result" not in got, got
    if soc == SOC_910B:
        assert "aclopCompileAndExecute" in got["error"] and aclnn in got["error"], got
        assert "error code 100039" in got["error"]
    else:
        assert f"aclnn{aclnn}" in got["error"] and "only support aclnn" in got["error"], got


def test_the_cpu_torch_venv_stays_without_torch_npu() -> None:
    """.build/torch is the CPU-only venv of the torchrun tests: torch 2.13 would auto-load a
    torch_npu installed next to it."""
    cpu_python = paths.build_dir() / "torch" / "bin" / "python"
    if not os.access(cpu_python, os.X_OK):
        pytest.skip(f"{cpu_python} is missing: run scripts/setup-torch.sh")
    probe = "import importlib.util as u; print(u.find_spec('torch_npu') is None)"
    out = subprocess.run([str(cpu_python), "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    assert Path(os.path.realpath(paths.build_dir() / "torch")) != Path(
        os.path.realpath(torchnpulib.TORCH_NPU)
    )
