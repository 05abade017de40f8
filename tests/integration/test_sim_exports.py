"""Nothing the simulated CANN tree exports answers "success" without doing the work.

Every function a library of every simulated tree exports (read from the built libraries with
`nm -D`) must be one of:
  - a deliberate failure, listed in native/npusim/failures.toml (code + error-manager text),
  - implemented and referenced by a test (its name appears in tests/), or called by the layer
    above it (an undefined name of another library of the tree: rt* behind acl*, hal* behind rt*),
    whose tests exercise it,
  - an operator or collective of the libraries native/npusim/ops builds, as that side's table
    says (``ops_table_implemented``).
The ACL surface that torch_npu's initialisation and error paths need is called here through
ctypes (sim_helpers/acl_surface.py) and its answers asserted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import tomllib

from npusnap_cli import contract, paths

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
FAILURES = REPO / "native" / "npusim" / "failures.toml"
SURFACE = Path(__file__).parent / "sim_helpers" / "acl_surface.py"
TREES = ("cann", "cann-9.0", "cann-9.2", "cann-strict")
OPS_LIBRARIES = ("libopapi.so", "libhccl.so")  # built by native/npusim/ops/ops.mk


def ops_table_implemented(library: str, name: str) -> bool:
    """Whether the operator side (native/npusim/ops) implements ``name`` of ``library``.

    The operator library's table is that side's to keep: point this at it. Meanwhile every
    aclnn operator of libopapi.so counts, with the tensor API around them (aclCreate*/aclDestroy*/
    aclGet*), and every Hccl* name of libhccl.so."""
    if library == "libopapi.so":
        return name.startswith(("aclnn", "aclCreate", "aclDestroy", "aclGet"))
    if library == "libhccl.so":
        return name.startswith("Hccl")
    return False


def nm(lib: Path, *flags: str) -> set[str]:
    out = subprocess.run(["nm", "-D", *flags, str(lib)], capture_output=True, text=True, check=True).stdout
    return {f[-1].split("@")[0] for f in (ln.split() for ln in out.splitlines()) if f}


def functions(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {f[2] for f in (ln.split() for ln in out.stdout.splitlines()) if len(f) == 3 and f[1] in "TtWi"}


@cache
def imported_by_any_tree() -> set[str]:
    """The names some library imports, in any tree (the trees build the same sources with other
    options: the 9.2 tree's runtime calls driver functions the others do not)."""
    libs = [lib for t in TREES for lib in (paths.sim_cann_dir() / t / "lib64").glob("*.so")]
    return set().union(*(nm(lib, "--undefined-only") for lib in libs))


@cache
def corpus_of_tests() -> str:
    me = Path(__file__).resolve()
    files = [p for p in TESTS.rglob("*") if p.suffix in (".py", ".c", ".h") and p.resolve() != me]
    return "\n".join(p.read_text(errors="replace") for p in files)


def referenced_by_a_test(name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", corpus_of_tests()) is not None


def failure_rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = tomllib.loads(FAILURES.read_text())["failure"]
    return rows


@pytest.mark.parametrize("tree", TREES)
def test_every_export_is_implemented_or_a_listed_failure(tree: str) -> None:
    lib64 = paths.build_dir() / tree / "lib64"
    libs = sorted(lib64.glob("*.so"))
    assert libs, f"{lib64} has no libraries: run make -C native"
    failing = {str(r["name"]) for r in failure_rows()}
    called_by_another_layer = imported_by_any_tree()
    unaccounted: dict[str, list[str]] = {}
    for lib in libs:
        for name in sorted(functions(lib)):
            if name in failing or ops_table_implemented(lib.name, name):
                continue
            if name in called_by_another_layer or referenced_by_a_test(name):
                continue
            unaccounted.setdefault(lib.name, []).append(name)
    assert unaccounted == {}, (
        "exported, but neither a listed failure (native/npusim/failures.toml) nor used by a test "
        f"or another layer: {unaccounted}"
    )


def test_the_failure_table_names_only_exports_and_generates_fresh_stubs() -> None:
    """Every row is exported by the library it names (the generator and the build agree), and
    the committed C stubs are what the table gives."""
    lib64 = paths.sim_cann_dir() / "cann-strict" / "lib64"
    where = {
        "acl": ["libacl_rt.so", "libascendcl.so"],
        "ascendcl": ["libascendcl.so"],
        "acl_op_compiler": ["libacl_op_compiler.so"],
        "runtime": ["libruntime.so"],
        "profapi": ["libprofapi.so"],
    }
    for row in failure_rows():
        for lib in where[str(row["library"])]:
            assert row["name"] in functions(lib64 / lib), (row["name"], lib)
        assert int(str(row["code"])) != 0, row["name"]
    check = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "genstubs.py"), "--check"], capture_output=True
    )
    assert check.returncode == 0, check.stderr


@pytest.fixture(scope="module")
def surface(sim_env: dict[str, str]) -> dict[str, object]:
    env = dict(sim_env, ASCEND_SLOG_PRINT_TO_STDOUT="1")
    env.pop("NPUSIM_SOC_VERSION", None)
    proc = subprocess.run([sys.executable, str(SURFACE)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    got: dict[str, object] = json.loads(lines[-1])
    got["stdout"] = lines[:-1]
    return got


def test_torch_npu_init_answers(surface: dict[str, object]) -> None:
    """What torch_npu's NpuSysCtrl and its callers depend on (shared/torch-npu.md)."""
    assert surface["init"] == 0
    assert surface["get_device_before_set"] == 107002  # torch_npu then sets device 0
    assert surface["msg_after_quiet_get_device"] == ""  # no stale text for the next failure
    assert surface["soc"] == "Ascend910B1"
    assert surface["set_device"] == 0 and surface["get_device"] == [0, 0]
    assert surface["sys_opt_default"] == [0, 0]  # ACL_OPT_DETERMINISTIC: readable, 0 by default
    assert surface["sys_opt_set"] == 0 and surface["sys_opt_after_set"] == [0, 1]
    assert surface["ctx_opt_set"] == 0 and surface["ctx_opt_get"] == [0, 1]
    assert surface["sat_infnan"] == 0 and surface["sat_get"] == [0, 1]
    assert surface["op_timeout"] == 0 and surface["op_timeout_get_ms"] == [0, 10000]
    assert surface["op_timeout_v2"] == [0, 5000000] and surface["op_wait_timeout"] == 0
    assert surface["capture_info"] == [0, 0] and surface["capture_model_null"] is True  # no capture
    assert surface["cann_attr_inf_nan"] == [0, 1] and surface["cann_attr_bf16"] == [0, 0]
    assert surface["overflow_switch"] == 0 and surface["failure_mode"] == 0
    assert surface["destroy_stream_force"] == 0
    assert surface["cann_version"] == [0, "9.1.0", "9"]
    assert surface["version_str_ops_math"] == [0, "9.1.0"]
    assert surface["capability_aicore"] == [0, 24]
    assert surface["jit_size"] == 256 and surface["jit_default"] == [0, "disable"]
    assert surface["jit_set"] == 0 and surface["jit_after_set"] == [0, "enable"]
    assert surface["precision_set"] == 0 and surface["precision_size"] == len("allow_fp32_to_fp16") + 1
    assert surface["precision_get"] == 200001 and surface["unset_size"] == 0  # ACL_ERROR_API_NOT_SUPPORT
    assert surface["peer"] == [0, 0]  # simulated devices reach each other through the host only
    assert surface["bare_tgid"] == [0, True]
    assert surface["prof_register_null"] == -1 and surface["prof_register"] == 0
    assert surface["prof_cycles_advance"] is True and surface["prof_hash"] == 0
    lines = surface["stdout"]
    assert isinstance(lines, list) and any("APP(" in ln and "app log line" in ln for ln in lines)


def test_host_objects_keep_what_was_set(surface: dict[str, object]) -> None:
    assert surface["data_buffer"] == [0x1000, 64, 0]
    assert surface["desc"] == [0, 2, 2, 0, 3]  # float, ND, 2 dims, dim 1 == 3
    assert surface["desc_set"] == [0, 3, 0, 29, 0, 100000]
    assert surface["attrs"] == [0] * 9
    assert surface["malloc_align32"] == 0 and surface["align32_roundtrip"] is True
    assert surface["free_align32"] == 0 and surface["malloc_cached"] == 0 and surface["free_cached"] == 0
    assert surface["context"] == [0, 0] and surface["events"] == [0] * 5
    assert surface["sync_device_timeout"] == 0


def test_failures_return_a_code_and_leave_a_message(surface: dict[str, object]) -> None:
    """Each failing call returns a real code and leaves its text for aclGetRecentErrMsg, per
    thread; reading it clears it."""
    for key in ("sys_opt_bad", "cann_attr_bad", "overflow_switch_bad", "capability_bad_device"):
        assert surface[key] == 100000, key
    assert surface["sys_opt_bad_msg"] == "EE9999: aclrtGetSysParamOpt failed (error code 100000)"
    assert surface["sat_saturation"] == 207000 and "saturation" in str(surface["sat_saturation_msg"])
    assert surface["peek_last_error"] == 100000 and surface["get_last_error"] == [100000, 0]
    assert surface["data_buffer_destroy_null"] == 100000 and surface["desc_dim_out_of_range"] == 100000
    assert surface["attr_null_name"] == 100000 and surface["peer_same_device"] == 100000
    assert surface["aclop"] == 100039  # ACL_ERROR_COMPILING_STUB_MODE
    assert "aclopCompileAndExecute" in str(surface["aclop_msg"]) and "Erfinv" in str(surface["aclop_msg"])
    assert surface["msg_read_twice"] == ""
    assert surface["export_handle"] == 207000 and "not simulated" in str(surface["export_handle_msg"])
    assert surface["rt_kernel_launch"] == 207000 and "rtKernelLaunch" in str(surface["rt_kernel_launch_msg"])
    assert surface["prof_report_api"] == -1
    assert surface["binary_unload_null"] == 107000
    assert "aclrtGetSysParamOpt" in str(surface["other_thread_msg"]) and surface["this_thread_msg"] == ""


def test_the_products_binaries_reach_no_simulator_name() -> None:
    """npusnap's agent, attach payload and CRIU plugin use what a real node offers: no function of
    the simulator's own (npusim*) is linked or looked up by name, and no simulator path or socket
    is written into them. The one name of the simulator they know is the spec's label of its
    device memory among the device mappings (contract DEVICE_MAPPING_PREFIXES), which is data:
    on a real node no mapping has it."""
    built = REPO / ".build"
    binaries = [
        built / "agent" / "libnpusnap_agent.so",
        built / "attach" / "libnpusnap_attach.so",
        built / "criu-plugin" / "npusnap_plugin.so",
    ]
    allowed = {p for p in contract.DEVICE_MAPPING_PREFIXES if "npusim" in p}
    for lib in binaries:
        assert lib.is_file(), f"{lib} is not built (make -C native)"
        linked = {n for n in nm(lib, "--undefined-only") if "npusim" in n.lower()}
        assert not linked, f"{lib.name} links simulator functions: {sorted(linked)}"
        text = subprocess.run(["strings", "-a", str(lib)], capture_output=True, text=True, check=True).stdout
        named = {s for s in text.splitlines() if "npusim" in s.lower()} - allowed
        assert not named, f"{lib.name} names the simulator: {sorted(named)}"
