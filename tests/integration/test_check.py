"""`npusnap check`: the preflight against this host's real CRIU and the simulated CANN tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SIM_PLUGIN, requires_root

NPUSNAP = str(Path(sys.executable).parent / "npusnap")


def check(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [NPUSNAP, "check", "--json", *args], env=env, capture_output=True, text=True, timeout=120
    )
    envelope = json.loads(proc.stdout)
    assert envelope["exit_code"] == proc.returncode
    return proc.returncode, {c["name"]: c for c in envelope["result"]["checks"]}


@pytest.mark.integration
@requires_root
def test_ready_with_the_simulated_npu(sim_env: dict[str, str]) -> None:
    code, checks = check(sim_env)
    assert code == 0, {k: v for k, v in checks.items() if v["status"] == "problem"}
    assert checks["criu"]["data"]["version"].startswith("4.")
    assert checks["criu-check"]["data"]["passed"] is True
    assert checks["pycriu"]["data"]["version"] == checks["criu"]["data"]["version"]
    assert checks["cann"]["data"]["simulated"] is True
    assert checks["cann"]["data"]["version"] == "9.1.0"
    assert checks["cann"]["data"]["library"].endswith("lib64/libacl_rt.so")
    assert checks["snapshot-symbols"]["data"]["missing"] == []
    plugin = checks["criu-npu-plugin"]
    assert plugin["status"] == "ok", plugin
    # The simulated device's CRIU plugin, where CRIU loads plugins, built for this CRIU.
    assert plugin["data"]["kind"] == "simulated"
    assert plugin["data"]["path"].endswith("/npusim_plugin.so")
    assert plugin["data"]["name"] == "npusim_plugin" and plugin["data"]["max_hooks"] == 13


@pytest.mark.integration
@requires_root
def test_a_simulated_device_plugin_of_another_criu_is_a_problem(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """A copy of npusim_plugin.so whose CR_PLUGIN_DESC says 16 hooks (as if built against another
    criu-plugin.h): `npusnap check` reads it from the file and says it does not fit."""
    import struct

    from npusnap_cli import elf
    from npusnap_cli.host import criuplugin

    plugins = tmp_path / "libdir"
    plugins.mkdir()
    patched = plugins / "npusim_plugin.so"
    shutil.copy(SIM_PLUGIN, patched)
    data = bytearray(patched.read_bytes())
    lib = elf.ElfFile(bytes(data))
    sym = lib.symbol(criuplugin.DESC_SYMBOL, (elf.SHT_SYMTAB, elf.SHT_DYNSYM))
    assert sym is not None
    off = lib.file_offset(sym.value)
    assert off is not None
    struct.pack_into("<I", data, off + 28, 16)  # cr_plugin_desc_t.max_hooks
    patched.write_bytes(bytes(data))
    code, checks = check(dict(sim_env, CRIU_LIBS_DIR=str(plugins)))
    item = checks["criu-npu-plugin"]
    assert code == 3 and item["status"] == "problem", item
    assert "16 plugin hooks" in item["detail"] and item["data"]["max_hooks"] == 16
    assert "setup.sh" in item["fix"]
    code, checks = check(dict(sim_env, CRIU_LIBS_DIR=str(tmp_path / "nothing")))
    assert code == 3 and "npusim_plugin.so" in checks["criu-npu-plugin"]["detail"]


@pytest.mark.integration
def test_no_cann_is_a_preflight_problem(sim_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in sim_env.items() if k != "ASCEND_HOME_PATH"}
    code, checks = check(env, "--ascend-home", str(tmp_path / "nothing-here"))
    assert code == 3
    assert checks["cann"]["status"] == "problem"
    assert checks["cann"]["fix"]


@pytest.mark.integration
def test_devlib_stub_is_rejected(sim_env: dict[str, str], tmp_path: Path) -> None:
    # A CANN tree whose only snapshot library sits in devlib/ (driver stubs) must not be accepted.
    home = tmp_path / "cann"
    real = Path(sim_env["ASCEND_HOME_PATH"])
    shutil.copytree(real / "share", home / "share")
    (home / "devlib").mkdir(parents=True)
    shutil.copy(real / "lib64" / "libacl_rt.so", home / "devlib" / "libacl_rt.so")
    code, checks = check({**os.environ}, "--ascend-home", str(home))
    assert code == 3
    assert checks["cann"]["status"] == "problem"
    assert "devlib" in checks["cann"]["detail"] + checks["cann"]["fix"]


@pytest.mark.integration
def test_missing_snapshot_symbols_are_reported(sim_env: dict[str, str], tmp_path: Path) -> None:
    # An older CANN whose runtime library lacks the snapshot API: found, but not usable.
    home = tmp_path / "cann"
    real = Path(sim_env["ASCEND_HOME_PATH"])
    shutil.copytree(real / "share", home / "share")
    (home / "lib64").mkdir()
    src = tmp_path / "old.c"
    src.write_text("int aclInit(const char *p) { (void)p; return 0; }\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(home / "lib64" / "libacl_rt.so"), str(src)], check=True
    )
    code, checks = check({**os.environ}, "--ascend-home", str(home))
    assert code == 3
    problem = [c for c in checks.values() if c["status"] == "problem"]
    assert problem, checks
    text = json.dumps(problem)
    assert "aclrtSnapShotProcessLock" in text or "snapshot" in text.lower()


FORK_PLUGIN_C = r"""
/* A plugin as Huawei's CRIU fork builds them: its own hook table (16 slots), as its npu_plugin.so
 * declares in CR_PLUGIN_DESC (cr_plugin_desc_t: name, init, exit, version, max_hooks, hooks). */
struct desc { const char *name; void *init, *exit; unsigned version, max_hooks; void *hooks[16]; };
__attribute__((visibility("default"))) struct desc CR_PLUGIN_DESC = {"npu_plugin", 0, 0, 1, 16, {0}};
"""


def _fork_abi_plugin(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    src = where.parent / "fork_plugin.c"
    src.write_text(FORK_PLUGIN_C)
    so = where / "npu_plugin.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so


@pytest.mark.integration
@requires_root
def test_setup_leaves_the_vendor_plugin_dir_alone_and_check_warns(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """A node whose shared CRIU plugin directory holds the vendor fork's plugin (16 hooks): setup
    installs npusnap's plugins into a directory of npusnap's own and touches nothing else, refuses a
    shared directory as its target, and `npusnap check` names the plugin that does not fit."""
    shared = tmp_path / "usr-lib-criu"
    fork = _fork_abi_plugin(shared)
    before = fork.read_bytes(), fork.stat().st_mtime_ns
    ours = tmp_path / "npusnap-plugins"
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NPUSNAP_CRIU_PLUGIN_DIR=str(ours), NPUSNAP_NO_SLURM="1")
    done = subprocess.run(
        ["make", "-s", "setup"], cwd=repo, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in ours.iterdir()) == ["npusim_plugin.so", "npusnap_plugin.so"]
    assert (fork.read_bytes(), fork.stat().st_mtime_ns) == before
    assert sorted(p.name for p in shared.iterdir()) == ["npu_plugin.so"]
    refused = subprocess.run(
        ["make", "-s", "setup"], cwd=repo, env=dict(env, NPUSNAP_CRIU_PLUGIN_DIR="/usr/lib/criu"),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert refused.returncode != 0 and "shared plugin directory" in refused.stderr

    env = dict(sim_env, CRIU_LIBS_DIR=str(ours), NPUSNAP_CRIU_SHARED_PLUGIN_DIRS=str(shared))
    code, checks = check(env)
    item = checks["criu-plugin-dirs"]
    assert code == 0 and item["status"] == "warning", item
    assert str(fork) in item["detail"] and "16 hooks" in item["detail"], item
    assert f"libdir {ours}" in item["fix"]
    assert checks["criu-npu-plugin"]["status"] == "ok"
    # The same plugin in the directory npusnap's CRIU loads is a problem, not a note.
    shutil.copy(fork, ours / "npu_plugin.so")
    code, checks = check(env)
    item = checks["criu-plugin-dirs"]
    assert code == 3 and item["status"] == "problem" and "16 hooks" in item["detail"], item
