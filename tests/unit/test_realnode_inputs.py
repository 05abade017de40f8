"""npusnap's decisions for a process of a real Ascend node, from /proc inputs of such a node
(tests/data/realnode: derived from the CANN documents, not recorded; its README says from what)
and from CRIU plugins as the vendor builds them: the branch that never runs on the simulator."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from npusnap_cli import criu
from npusnap_cli.errors import PreflightError
from npusnap_cli.host import criuplugin, devmaps
from npusnap_cli.host.proctree import ProcInfo
from npusnap_cli.pipelines.dump import treechecks

DATA = Path(__file__).resolve().parents[1] / "data" / "realnode"
JOB, PLAIN = 3810, 3811


def _proc(tmp_path: Path) -> str:
    """A /proc of two processes: JOB as the node's files describe it, PLAIN without the NPU."""
    root = tmp_path / "proc"
    job = root / str(JOB)
    (job / "fd").mkdir(parents=True)
    shutil.copy(DATA / "maps", job / "maps")
    for line in (DATA / "fds").read_text().splitlines():
        fd, _, target = line.partition(" -> ")
        os.symlink(target, job / "fd" / fd)
    plain = root / str(PLAIN)
    (plain / "fd").mkdir(parents=True)
    kept = [ln for ln in (DATA / "maps").read_text().splitlines() if "/dev/" not in ln]
    (plain / "maps").write_text("\n".join(kept) + "\n")
    for fd, target in (("0", "/dev/pts/0"), ("3", "/dev/null"), ("4", "socket:[1]")):
        os.symlink(target, plain / "fd" / fd)
    return str(root)


def test_device_memory_is_the_svm_and_davinci_manager_mappings(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    dm = devmaps.device_memory(JOB, proc)
    assert dm is not None and dm.present
    assert dm.mappings == 3  # two /dev/svm0 spans and one /dev/davinci_manager mapping
    assert dm.bytes == 2 * 0x40000000 + 0x200000
    plain = devmaps.device_memory(PLAIN, proc)
    assert plain is not None and not plain.present
    assert devmaps.device_memory(99999, proc) is None  # unreadable: no answer, not "none"


def test_the_device_files_a_job_holds_are_the_driver_s_nodes(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    assert devmaps.device_files(JOB, proc) == ["/dev/davinci_manager", "/dev/hisi_hdc", "/dev/svm0"]
    assert devmaps.device_files(PLAIN, proc) == []
    assert devmaps.device_files(99999, proc) is None


def _tree(files: tuple[str, ...]) -> tuple[ProcInfo, ...]:
    lib = "/usr/local/Ascend/ascend-toolkit/8.5.0/aarch64-linux/lib64/libascendcl.so"
    return (ProcInfo(JOB, 1, 0, 0, "python3", ("python3", "train.py"), None, lib, files),)


def _plugin(where: Path, hooks: int) -> Path:
    """A plugin's descriptor as CRIU's and Huawei's fork's plugins declare it (cr_plugin_desc_t:
    name, init, exit, version, max_hooks, hooks)."""
    src = where / f"plugin{hooks}.c"
    src.write_text(
        "struct desc { const char *name; void *init, *exit; unsigned version, max_hooks; "
        f"void *hooks[{hooks}]; }};\n"
        '__attribute__((visibility("default"))) struct desc CR_PLUGIN_DESC = '
        f'{{"npu_plugin", 0, 0, 1, {hooks}, {{0}}}};\n'
    )
    where.mkdir(exist_ok=True)
    so = where / "npu_plugin.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True, timeout=120)
    return so


def _criu_hooks() -> int:
    try:
        version = criu.find_criu().version
    except Exception as exc:  # whatever makes CRIU unusable is the skip's reason
        pytest.skip(f"no usable CRIU to judge a plugin against: {exc}")
    have, source = criuplugin.criu_max_hooks(version)
    if have is None:
        pytest.skip(f"CRIU {version}'s hook count is not known here: {source}")
    return have


def test_the_npu_plugin_decides_a_dump_of_device_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device files open: no plugin in npusnap's CRIU plugin directory refuses the dump; the
    vendor fork's plugin (another hook count than this CRIU's) refuses it too; one built for this
    CRIU passes. A tree without device files needs none."""
    hooks = _criu_hooks()
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    monkeypatch.setenv("CRIU_LIBS_DIR", str(plugins))
    files = ("/dev/davinci_manager", "/dev/hisi_hdc", "/dev/svm0")
    with pytest.raises(PreflightError, match="Ascend device files open but CRIU has no NPU plugin") as none:
        treechecks._check_npu_plugin(_tree(files))
    assert none.value.details["device_files"] == list(files)
    _plugin(plugins, 16 if hooks != 16 else 17)
    with pytest.raises(PreflightError, match="does not fit this CRIU"):
        treechecks._check_npu_plugin(_tree(files))
    _plugin(plugins, hooks)
    treechecks._check_npu_plugin(_tree(files))
    (plugins / "npu_plugin.so").unlink()
    treechecks._check_npu_plugin(_tree(()))
