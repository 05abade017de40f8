"""criuplugin: a plugin's CR_PLUGIN_DESC read from the ELF file, compared with the CRIU in use;
the post-dump checks of Huawei's orchestrator. Fake plugins are compiled here with cc."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from npusnap_cli.host import criuplugin

PLUGIN = r"""
typedef struct {
    const char *name;
    int (*init)(int stage);
    void (*exit)(int stage, int ret);
    unsigned int version;
    unsigned int max_hooks;
    void *hooks[HOOKS];
} cr_plugin_desc_t;
static int init(int stage) { (void)stage; return 0; }
__attribute__((visibility("default"))) cr_plugin_desc_t CR_PLUGIN_DESC = {
    .name = "npu_fake", .init = init, .version = 0x200, .max_hooks = HOOKS,
};
"""


def build(tmp_path: Path, hooks: int, with_desc: bool = True) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / f"p{hooks}.c"
    src.write_text(PLUGIN if with_desc else "int nothing_here(void) { return 0; }\n")
    out = tmp_path / f"plugin{hooks}{'' if with_desc else '-bare'}.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-DHOOKS={hooks}", "-o", str(out), str(src)], check=True)
    return str(out)


def test_reads_name_version_and_max_hooks(tmp_path: Path) -> None:
    desc = criuplugin.read_plugin_desc(build(tmp_path, 13))
    assert desc is not None
    assert (desc.name, desc.version, desc.max_hooks) == ("npu_fake", 0x200, 13)
    assert criuplugin.read_plugin_desc(build(tmp_path, 13, with_desc=False)) is None


def test_max_hooks_from_a_header() -> None:
    header = """
    enum {
        CR_PLUGIN_HOOK__DUMP_UNIX_SK = 0,
        CR_PLUGIN_HOOK__RESTORE_UNIX_SK = 1,
        CR_PLUGIN_HOOK__UPDATE_INETSK = 10,
        CR_PLUGIN_HOOK__MAX
    };"""
    assert criuplugin.max_hooks_from_header(header) == 11
    assert criuplugin.max_hooks_from_header("no enum") is None


def test_abi_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(criuplugin, "criu_max_hooks", lambda version: (13, "test header"))
    ok = criuplugin.check_abi(build(tmp_path, 13), "4.2.1")
    assert ok.ok is True and "matches CRIU 4.2.1" in ok.detail
    bad = criuplugin.check_abi(build(tmp_path, 16), "4.2.1")
    assert bad.ok is False and "16 plugin hooks" in bad.detail and "CRIU 4.2.1 has 13" in bad.detail
    assert "rebuild the plugin" in bad.fix
    bare = criuplugin.check_abi(build(tmp_path, 13, with_desc=False), "4.2.1")
    assert bare.ok is False and "CR_PLUGIN_DESC" in bare.detail
    monkeypatch.setattr(criuplugin, "criu_max_hooks", lambda version: (None, "no header"))
    assert criuplugin.check_abi(build(tmp_path, 13), "9.9").ok is None


def test_known_criu_releases() -> None:
    value, source = criuplugin.criu_max_hooks("4.2.1")
    assert value == 13, source


def test_scan_dump(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text("(00.1) Dumping finished successfully\n")
    assert criuplugin.scan_dump(log, tmp_path) == [
        f"the NPU plugin wrote no davinci-dev-*.img into {tmp_path}"
    ]
    (tmp_path / "davinci-dev-0.img").write_bytes(b"x")
    assert criuplugin.scan_dump(log, tmp_path) == []
    log.write_text("(00.2) [npu-plugin fini-dump err] ret -1\n")
    problems = criuplugin.scan_dump(log, tmp_path)
    assert len(problems) == 1 and "fini-dump err" in problems[0]


def test_check_and_dump_preflight_refuse_a_plugin_of_another_criu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from npusnap_cli.errors import PreflightError
    from npusnap_cli.host import preflight
    from npusnap_cli.host.proctree import ProcInfo
    from npusnap_cli.pipelines import dump

    plugins = tmp_path / "criu-plugins"
    plugins.mkdir()
    # Where npusnap's CRIU loads plugins from (npusnap hands CRIU its own directory).
    monkeypatch.setenv("CRIU_LIBS_DIR", str(plugins))
    monkeypatch.setattr(criuplugin, "criu_max_hooks", lambda version: (13, "test header"))
    shutil.copy(build(tmp_path, 16), plugins / "npu_plugin.so")  # built against the fork's header
    item = preflight.check_npu_plugin(simulated=False)
    assert item.status == preflight.PROBLEM and "16 plugin hooks" in item.detail and item.fix
    tree = (
        ProcInfo(
            pid=1,
            ppid=0,
            depth=0,
            uid=0,
            name="job",
            cmdline=("job",),
            agent_socket=None,
            acl_library=None,
            device_files=("/dev/davinci_manager",),
        ),
    )
    with pytest.raises(PreflightError) as info:
        dump._check_npu_plugin(tree)
    assert "does not fit this CRIU" in info.value.message
    shutil.copy(build(tmp_path, 13), plugins / "npu_plugin.so")
    assert preflight.check_npu_plugin(simulated=False).status == preflight.OK
    dump._check_npu_plugin(tree)  # no error


def test_scan_dump_of_the_simulated_device(tmp_path: Path) -> None:
    sim = criuplugin.SIMULATED
    log = tmp_path / "dump.log"
    log.write_text("(00.1) npusim-plugin: socket 7: device connection ... recorded\n")
    (tmp_path / "davinci-dev-0.img").write_bytes(b"x")  # another kind's image does not count
    assert criuplugin.scan_dump(log, tmp_path, sim, 1) == [
        f"the simulated NPU's plugin wrote no npusim-dev-*.img into {tmp_path}"
    ]
    assert criuplugin.scan_dump(log, tmp_path, sim, 0) == []  # no device handle: the log only
    (tmp_path / "npusim-dev-7.img").write_text("{}")
    assert criuplugin.scan_dump(log, tmp_path, sim, 1) == []
    assert criuplugin.scan_dump(log, tmp_path, sim, 2) == [
        f"the simulated NPU's plugin wrote 1 npusim-dev-*.img into {tmp_path}, for 2 device handles"
    ]
    log.write_text("(00.2) npusim-plugin: the dump failed (-1) ... [npusim-plugin fini-dump err]\n")
    problems = criuplugin.scan_dump(log, tmp_path, sim, 1)
    assert len(problems) == 1 and "[npusim-plugin fini-dump err]" in problems[0]
    # Huawei's mark is not the simulator's, and the other way round.
    assert criuplugin.scan_dump(log, tmp_path) == []


def test_check_finds_the_simulated_devices_plugin_where_criu_loads_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from npusnap_cli import criu
    from npusnap_cli.host import preflight

    monkeypatch.setattr(criuplugin, "criu_max_hooks", lambda version: (13, "test header"))
    monkeypatch.setattr(criu, "find_criu", lambda: type("B", (), {"version": "4.2.1"})())
    plugins = tmp_path / "libdir"
    plugins.mkdir()
    monkeypatch.setenv("CRIU_LIBS_DIR", str(plugins))
    missing = preflight.check_npu_plugin(simulated=True)
    assert missing.status == preflight.PROBLEM and "npusim_plugin.so" in missing.detail
    assert str(plugins) in missing.detail and "setup.sh" in missing.fix
    # A plugin named like Huawei's is not the simulator's.
    shutil.copy(build(tmp_path, 13), plugins / "npu_plugin.so")
    assert preflight.check_npu_plugin(simulated=True).status == preflight.PROBLEM
    shutil.copy(build(tmp_path, 13), plugins / "npusim_plugin.so")
    ok = preflight.check_npu_plugin(simulated=True)
    assert ok.status == preflight.OK, ok
    assert ok.data["kind"] == "simulated" and ok.data["max_hooks"] == 13
    assert ok.data["path"] == str(plugins / "npusim_plugin.so")
    shutil.copy(build(tmp_path, 16), plugins / "npusim_plugin.so")
    bad = preflight.check_npu_plugin(simulated=True)
    assert bad.status == preflight.PROBLEM and bad.data["max_hooks"] == 16 and "setup.sh" in bad.fix
