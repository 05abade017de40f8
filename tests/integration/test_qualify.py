"""`npusnap qualify` on the simulated NPU: every check passes on the faithful node, and each check
fails, alone, on a node with the fault that breaks its assumption.

The faults are the simulated node's own (the daemon's NPUSIM_NODE_FAULT, docs/simulator.md),
which only the daemon's environment gets: qualify has no way to know of them but what the node
does. The plugin check's fault is a plugin directory holding a plugin built for another CRIU's
hook table.
"""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.pipelines import qualify
from npusnap_sim import wire
from tests.conftest import requires_root
from tests.integration.dumplib import PY, TRAIN, TRAIN_ARGS, Job, cli, private_sim

pytestmark = [pytest.mark.integration, requires_root]

CHECKS = [name for name, _what, _relied in qualify.CHECKS]


def _qualify(
    tmp_path: Path, runtime_dir: Path, fault: Optional[str], **extra: str
) -> tuple[int, dict[str, Any], Path]:
    state = tmp_path / "state"
    with private_sim(devices=1, capacity_bytes=1 << 30, fault=fault) as env:
        env = dict(env, NPUSNAP_RUNTIME_DIR=str(runtime_dir), NPUSNAP_STATE_DIR=str(state), **extra)
        assert wire.NODE_FAULT_ENV not in env  # only the daemon has it
        code, envelope, stderr = cli(env, "qualify", "--report", str(tmp_path / "report.json"), timeout=300)
        _check_env.clear()
        _check_env.update(env)
    assert envelope is not None, stderr
    return code, envelope, state


_check_env: dict[str, str] = {}


def _check_row() -> tuple[int, dict[str, Any]]:
    """`npusnap check`'s qualify row, in the environment of the last qualify."""
    code, envelope, stderr = cli(_check_env, "check")
    assert envelope is not None, stderr
    return code, next(c for c in envelope["result"]["checks"] if c["name"] == "qualify")


def _verdicts(envelope: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in envelope["result"]["checks"]}


def test_every_check_passes_on_the_faithful_node(tmp_path: Path, runtime_dir: Path) -> None:
    code, envelope, state = _qualify(tmp_path, runtime_dir, None)
    assert code == ExitCode.OK, envelope
    assert _verdicts(envelope) == dict.fromkeys(CHECKS, "pass")
    result = envelope["result"]
    assert result["passed"] is True and result["failed"] == []
    assert result["cann"]["simulated"] is True and result["cann"]["version"]
    assert result["driver"]["hal_library"].endswith("libascend_hal.so") and result["driver"]["hal_sha256"]
    report = state / qualify.REPORT_NAME
    assert stat.S_IMODE(report.stat().st_mode) == 0o600
    assert json.loads(report.read_text())["checks"] == result["checks"]
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is True
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == 0o600
    code, row = _check_row()
    assert row["status"] == "ok", row


@pytest.mark.parametrize(
    ("fault", "check"),
    [
        ("mapname", "mappings"),
        ("dropcopy", "locked-copy"),
        ("movevmm", "vmm-address"),
        ("untracked", "coverage"),
    ],
)
def test_each_fault_of_the_node_fails_exactly_its_check(
    tmp_path: Path, runtime_dir: Path, fault: str, check: str
) -> None:
    code, envelope, state = _qualify(tmp_path, runtime_dir, fault)
    assert code == qualify.FAILED_EXIT, envelope
    verdicts = _verdicts(envelope)
    assert verdicts == {name: "fail" if name == check else "pass" for name in CHECKS}, envelope
    assert envelope["result"]["failed"] == [check]
    assert check in envelope["result"]["failed"]
    report = json.loads((state / qualify.REPORT_NAME).read_text())
    assert report["passed"] is False and report["failed"] == [check]
    if fault == "movevmm":  # `check` refuses a node whose report failed
        code, row = _check_row()
        assert code == ExitCode.PREFLIGHT and row["status"] == "problem" and check in row["detail"], row


_WRONG_PLUGIN = r"""
/* A CRIU plugin descriptor with another hook table than the CRIU npusnap runs (as Huawei's fork
 * numbers its hooks), under the simulated device's plugin name. */
typedef struct {
    const char *name;
    int (*init)(int);
    void (*exit)(int, int);
    unsigned int version;
    unsigned int max_hooks;
    void *hooks[11];
} desc_t;
__attribute__((visibility("default"))) desc_t CR_PLUGIN_DESC = {"npusim_plugin", 0, 0, 2, 11, {0}};
"""


def test_a_plugin_of_another_hook_table_fails_the_plugin_check(tmp_path: Path, runtime_dir: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    src = tmp_path / "wrong.c"
    src.write_text(_WRONG_PLUGIN)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(plugins / "npusim_plugin.so"), str(src)], check=True)
    code, envelope, _state = _qualify(tmp_path, runtime_dir, None, CRIU_LIBS_DIR=str(plugins))
    assert code == qualify.FAILED_EXIT, envelope
    assert _verdicts(envelope) == {name: "fail" if name == "criu-plugin" else "pass" for name in CHECKS}
    plugin = next(c for c in envelope["result"]["checks"] if c["name"] == "criu-plugin")
    assert "11 plugin hooks" in plugin["detail"], plugin


def test_a_busy_device_is_refused_before_the_probe_starts(tmp_path: Path, runtime_dir: Path) -> None:
    with private_sim(devices=1, capacity_bytes=1 << 30) as env:
        env = dict(env, NPUSNAP_RUNTIME_DIR=str(runtime_dir), NPUSNAP_STATE_DIR=str(tmp_path / "state"))
        job = Job(tmp_path, env, [PY, TRAIN, *TRAIN_ARGS])
        try:
            job.wait_lines(2)
            code, envelope, stderr = cli(env, "qualify")
        finally:
            job.cleanup()
    assert code == ExitCode.BUSY, (envelope, stderr)
    assert envelope is not None and envelope["error"]["details"]["pids"] == [job.pid]
    assert not (tmp_path / "state" / qualify.REPORT_NAME).exists()


def test_dump_and_restore_refuse_a_node_whose_report_failed(tmp_path: Path, runtime_dir: Path) -> None:
    """On a node whose driver drops part of a copy made while locked, a dump would write an image
    with garbage in it and exit 0. Once qualify has found that, dump and restore refuse there,
    before touching anything; the job runs on."""
    state = tmp_path / "state"
    with private_sim(devices=2, capacity_bytes=1 << 30, fault="dropcopy") as env:
        env = dict(env, NPUSNAP_RUNTIME_DIR=str(runtime_dir), NPUSNAP_STATE_DIR=str(state))
        job = Job(tmp_path, env, [PY, TRAIN, "--steps", "4000", *TRAIN_ARGS, "--device", "1"])
        try:
            job.wait_lines(2)
            code, envelope, stderr = cli(
                env, "dump", "--leave-running", str(job.pid), str(tmp_path / "before")
            )
            assert code == ExitCode.OK, (envelope, stderr)  # no report yet: the simulator needs none
            code, envelope, stderr = cli(env, "qualify", "--device", "0", timeout=300)
            assert code == qualify.FAILED_EXIT and envelope is not None, stderr
            assert envelope["result"]["failed"] == ["locked-copy"]

            code, envelope, stderr = cli(env, "dump", str(job.pid), str(tmp_path / "after"))
            assert code == ExitCode.PREFLIGHT and envelope is not None, stderr
            assert "locked-copy" in envelope["error"]["message"], envelope["error"]
            assert "npusnap qualify" in envelope["error"]["fix"]
            assert not (tmp_path / "after").exists()
            seen = len(job.lines())
            job.wait_lines(seen + 2)  # never locked: it ran on
            code, envelope, _ = cli(env, "status", str(job.pid))
            assert code == 0 and envelope is not None
            npu = [p for p in envelope["result"]["processes"] if p["uses_npu"]]
            assert npu and {p["status"]["state"] for p in npu} == {"RUNNING"}

            code, envelope, stderr = cli(env, "dump", "--dry-run", str(job.pid), str(tmp_path / "dry"))
            assert code == ExitCode.PREFLIGHT and envelope is not None, stderr
            row = next(c for c in envelope["result"]["checks"] if c["name"] == "qualified")
            assert row["status"] == "problem" and "locked-copy" in row["detail"], row

            code, envelope, stderr = cli(env, "restore", "--dry-run", str(tmp_path / "before"))
            assert envelope is not None, stderr
            row = next(c for c in envelope["result"]["checks"] if c["name"] == "qualified")
            assert row["status"] == "problem" and "locked-copy" in row["detail"], row
        finally:
            job.cleanup()
        code, envelope, stderr = cli(env, "restore", str(tmp_path / "before"))
        assert code == ExitCode.PREFLIGHT and envelope is not None, stderr
        assert "locked-copy" in envelope["error"]["message"], envelope["error"]
