"""`npusnap qualify`'s verdicts and report, from cheap parts (tests/integration/test_qualify.py runs
it against the simulated node and its faults)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from npusnap_cli import acl, contract, paths
from npusnap_cli.agent import qualifyprobe
from npusnap_cli.device import occupancy
from npusnap_cli.errors import BusyError, ExitCode, PreflightError
from npusnap_cli.host import preflight, qualifyreport
from npusnap_cli.host.preflight.items import CheckItem
from npusnap_cli.pipelines import qualify
from npusnap_cli.pipelines.qualify import FAIL, PASS, SKIP, Growth, Mapping, Report, Verdict
from npusnap_sim import wire

MiB = 1 << 20


def _report(*verdicts: Verdict) -> Report:
    return Report(device=0, cann={"version": "9.1.0"}, driver={}, verdicts=list(verdicts))


def test_the_report_passes_only_when_every_relied_on_check_passed() -> None:
    every = [Verdict(name, PASS, "ok") for name, _what, _relied in qualify.CHECKS]
    assert _report(*every).passed and _report(*every).exit_code() == ExitCode.OK
    for i, (name, _what, _relied) in enumerate(qualify.CHECKS):
        for bad in (FAIL, SKIP):
            verdicts = list(every)
            verdicts[i] = Verdict(name, bad, "no")
            report = _report(*verdicts)
            assert not report.passed and report.failed() == [name]
            assert report.exit_code() == qualify.FAILED_EXIT == ExitCode.PREFLIGHT
    assert not _report().passed  # nothing shown is not a pass


def test_the_report_names_the_cann_and_driver_it_was_made_for() -> None:
    report = _report(Verdict("coverage", FAIL, "behind the agent's back", {"allocations": []}))
    report.driver = {"version": "25.0", "hal_sha256": "ab"}
    doc = report.to_dict()
    assert doc["format"] == qualify.REPORT_FORMAT and doc["cann"]["version"] == "9.1.0"
    assert doc["driver"]["version"] == "25.0" and doc["failed"] == ["coverage"]
    (check,) = doc["checks"]
    assert check["relied_on"] is True and check["assumption"] and check["verdict"] == "fail"
    json.dumps(doc)


def test_the_report_is_written_0600_into_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path / "state"))
    report = _report(Verdict("cann", PASS, "ok"))
    written = qualify.write_report(report, tmp_path / "copy.json")
    assert written == str(tmp_path / "state" / qualify.REPORT_NAME)
    for path in (Path(written), tmp_path / "copy.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert json.loads(path.read_text())["report"] == written


def test_mappings_recognised_by_npusnaps_classifier_pass() -> None:
    before = [Mapping(0x1000, 0x2000, "/usr/lib/libc.so.6")]
    after = [*before, Mapping(139637976727552, 139637980921856, "/memfd:npusim-dev0 (deleted)")]
    verdict = qualify.judge_mappings(before, after, {0x7F0000000000: "rd wr sh mr mw me ms sd"})
    assert verdict.verdict == PASS
    assert verdict.data["recognised"] == [
        {
            "path": "/memfd:npusim-dev0 (deleted)",
            "start": "0x7f0000000000",
            "size": 4 * MiB,
            "vm_flags": "rd wr sh mr mw me ms sd",
        }
    ]


def test_mappings_under_another_name_fail_and_say_what_appeared() -> None:
    before = [Mapping(0x1000, 0x2000, "/usr/lib/libc.so.6")]
    after = [*before, Mapping(139637976727552, 139637980921856, "/dev/hbm_map0")]
    verdict = qualify.judge_mappings(before, after, {0x7F0000000000: "rd wr mr mw me io pf"})
    assert verdict.verdict == FAIL
    assert "/dev/hbm_map0" in verdict.detail
    assert verdict.data["new_unrecognised"][0]["vm_flags"] == "rd wr mr mw me io pf"  # type: ignore[index]


def test_a_device_mapping_under_an_unknown_name_fails_by_its_vm_flags() -> None:
    """Known device mappings are not enough: one that appeared under another name with a device's
    VmFlags (VM_PFNMAP|VM_IO) is device memory npusnap would not count. Plain new mappings and
    known ones with those flags pass."""
    before = [Mapping(0x1000, 0x2000, "/usr/lib/libc.so.6")]
    svm = Mapping(0x100000000000, 0x100040000000, "/dev/svm0")
    other = Mapping(0x7F0000000000, 0x7F0000400000, "/dev/hbm_map0")
    heap = Mapping(0x7E0000000000, 0x7E0000100000, "")
    device = "rd wr sh mr mw me ms pf io dd sd"
    flags = {svm.start: device, other.start: device, heap.start: "rd wr mr mw me ac sd"}
    verdict = qualify.judge_mappings(before, [*before, svm, other, heap], flags)
    assert verdict.verdict == FAIL
    assert "/dev/hbm_map0" in verdict.detail and "VmFlags io pf" in verdict.detail
    assert qualify.judge_mappings(before, [*before, svm, heap], flags).verdict == PASS
    assert not qualify.device_flagged(None) and not qualify.device_flagged("rd wr pf")


def _stream(*allocs: tuple[int, bytes]) -> bytes:
    hdr = contract.DEVMEM_FILE_HEADER
    rec = contract.DEVMEM_FILE_RECORD
    out = hdr.pack(contract.DEVMEM_FILE_MAGIC, len(allocs), sum(len(b) for _p, b in allocs))
    out += b"".join(rec.pack(ptr, len(data), 0, 0) for ptr, data in allocs)
    return out + b"".join(data for _p, data in allocs)


def test_the_locked_copy_is_found_by_its_address_and_compared() -> None:
    want = qualifyprobe.pattern(1, 64 * 1024)
    stream = _stream((0x10000, b"x" * 4096), (0x20000, want))
    assert qualify.stream_allocation(stream, 0x20000) == want
    assert qualify.stream_allocation(stream, 0x30000) is None
    assert qualify.judge_copy(qualify.stream_allocation(stream, 0x20000), want, 0x20000).verdict == PASS
    dropped = want[: len(want) // 2] + bytes(len(want) // 2)
    verdict = qualify.judge_copy(dropped, want, 0x20000)
    assert verdict.verdict == FAIL and verdict.data["first_difference"] == len(want) // 2
    assert qualify.judge_copy(None, want, 0x20000).verdict == FAIL
    with pytest.raises(ValueError):
        qualify.stream_allocation(b"not a stream" * 4, 0x20000)


def test_the_pattern_is_the_same_on_both_sides_and_never_flat() -> None:
    a = qualifyprobe.pattern(7, 1 << 16)
    assert a == qualifyprobe.pattern(7, 1 << 16) and a != qualifyprobe.pattern(8, 1 << 16)
    assert len(set(a[:4096])) > 200


def test_coverage_fails_on_an_allocation_the_agent_did_not_track() -> None:
    good = [Growth(name, 8 * MiB, 8 * MiB, 8 * MiB) for _p, name in qualify.POLICIES]
    assert qualify.judge_coverage(good, True).verdict == PASS
    # the driver's own pages beside an allocation are within the tolerance
    assert qualify.judge_coverage([Growth("huge-first", 8 * MiB, 8 * MiB, 10 * MiB)], True).verdict == PASS
    missed = [*good[:1], Growth("huge-only", 8 * MiB, 0, 8 * MiB)]
    verdict = qualify.judge_coverage(missed, True)
    assert verdict.verdict == FAIL and "huge-only" in verdict.detail and "huge-first" not in verdict.detail
    assert qualify.judge_coverage([Growth("x", 8 * MiB, 8 * MiB, 12 * MiB)], True).verdict == FAIL
    assert qualify.judge_coverage(good, False).verdict == FAIL


def test_the_plugin_verdict_is_checks_row() -> None:
    assert qualify.judge_plugin(CheckItem("criu-npu-plugin", preflight.OK, "fits")).verdict == PASS
    bad = qualify.judge_plugin(CheckItem("criu-npu-plugin", preflight.PROBLEM, "11 hooks", "rebuild it"))
    assert bad.verdict == FAIL and bad.data["fix"] == "rebuild it"
    assert (
        qualify.judge_plugin(CheckItem("criu-npu-plugin", preflight.WARNING, "cannot tell")).verdict == SKIP
    )


def test_the_cann_check_needs_the_snapshot_api() -> None:
    install = acl.CannInstall(
        home="/c",
        source="t",
        version="8.5.0",
        acl_library="/c/lib64/libacl_rt.so",
        runtime_library=None,
        simulated=False,
        symbols=dict.fromkeys(acl.SNAPSHOT_FUNCTIONS, True),
    )
    assert qualify.judge_cann(install).verdict == PASS
    install.symbols["aclrtSnapShotProcessRestore"] = False
    verdict = qualify.judge_cann(install)
    assert verdict.verdict == FAIL and "aclrtSnapShotProcessRestore" in verdict.detail


def test_qualify_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qualify.os, "geteuid", lambda: 1000)
    with pytest.raises(PreflightError) as err:
        qualify.run(0)
    assert err.value.exit_code == ExitCode.PREFLIGHT


def test_qualify_refuses_a_busy_device(monkeypatch: pytest.MonkeyPatch) -> None:
    install = acl.CannInstall("/c", "t", "9.1.0", "/c/lib64/libacl_rt.so", None, True)
    users = [occupancy.DeviceUse(4242, None, (1,)), occupancy.DeviceUse(4343, None, None)]
    monkeypatch.setattr(qualify.occupancy, "device_users", lambda home, simulated: users)
    monkeypatch.setattr(qualify, "physical_device", lambda device, simulated: device)
    with pytest.raises(BusyError) as err:
        qualify.require_idle(install, 0)
    assert err.value.details["pids"] == [4343]  # its devices are unknown: it may use device 0
    with pytest.raises(BusyError) as err:
        qualify.require_idle(install, 1)
    assert err.value.details["pids"] == [4242, 4343]
    monkeypatch.setattr(qualify.occupancy, "device_users", lambda home, simulated: users[:1])
    qualify.require_idle(install, 0)


def test_the_simulators_node_faults_are_known_by_name() -> None:
    assert wire.node_faults("") == 0
    assert (
        wire.node_faults("mapname, movevmm")
        == contract.SIM_CONFIG_FAULT_MAPNAME | contract.SIM_CONFIG_FAULT_MOVEVMM
    )
    with pytest.raises(ValueError):
        wire.node_faults("slowcopy")


def _install(tmp_path: Path, simulated: bool = False, version: str = "8.5.0") -> acl.CannInstall:
    return acl.CannInstall(str(tmp_path / "cann"), "t", version, "/c/lib64/libacl_rt.so", None, simulated)


def _written(tmp_path: Path, install: acl.CannInstall, passed: bool, hal: Path) -> Path:
    report = _report(
        *[Verdict(n, PASS if passed or n != "coverage" else FAIL, "") for n, _w, _r in qualify.CHECKS]
    )
    report.cann = {"home": install.home, "version": install.version, "simulated": install.simulated}
    report.driver = qualify.driver_identity(str(hal))
    report.created_at = "2026-12-05T11:00:00Z"
    qualify.write_report(report)
    return qualifyreport.report_path()


def test_check_reads_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path / "state"))
    hal = tmp_path / "libascend_hal.so"
    hal.write_bytes(b"driver 1")
    install = _install(tmp_path)
    assert qualifyreport.check_item(install).status == preflight.WARNING  # never qualified
    assert qualifyreport.check_item(_install(tmp_path, simulated=True)).status == preflight.INFO
    _written(tmp_path, install, True, hal)
    assert qualifyreport.check_item(install).status == preflight.OK
    _written(tmp_path, install, False, hal)
    item = qualifyreport.check_item(install)
    assert item.status == preflight.PROBLEM and "coverage" in item.detail
    # another CANN, another driver: the report no longer speaks for the node
    upgraded = qualifyreport.check_item(_install(tmp_path, version="9.0.0"))
    assert upgraded.status == preflight.WARNING and "9.0.0" in upgraded.detail
    hal.write_bytes(b"driver 2")
    item = qualifyreport.check_item(install)
    assert item.status == preflight.WARNING and "changed" in item.detail and "again" in item.fix


def test_a_report_of_another_owner_or_format_is_none(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"format": "something else"}))
    assert qualifyreport.load(path) is None
    path.write_text("{")
    assert qualifyreport.load(path) is None
    path.write_text(json.dumps({"format": qualifyreport.REPORT_FORMAT}))
    assert qualifyreport.load(path) == {"format": qualifyreport.REPORT_FORMAT}
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert qualifyreport.load(link) is None


def test_the_copy_of_a_piece_of_a_larger_allocation_is_found() -> None:
    want = qualifyprobe.pattern(2, 8192)
    stream = _stream((0x1000, b"\0" * 4096 + want + b"\1" * 100))
    assert qualify.stream_allocation(stream, 0x2000) == want + b"\1" * 100
    assert qualify.judge_copy(qualify.stream_allocation(stream, 0x2000), want, 0x2000).verdict == PASS


def test_the_gate_refuses_a_failed_report_and_tells_an_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What dump and restore make of the report (their check `qualified`)."""
    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(qualifyreport, "driver_version", lambda *a: None)
    cann = qualifyreport.SeenCann(home="/opt/cann", version="9.1.0", simulated=False)
    told: list[str] = []
    qualifyreport.gate(cann, told.append)  # no report on real hardware: told, not refused
    assert len(told) == 1 and "never qualified" in told[0]
    report = _report(Verdict("locked-copy", FAIL, "half the bytes"))
    report.cann = {"home": "/opt/cann", "version": "9.1.0"}
    qualify.write_report(report, None)
    with pytest.raises(PreflightError, match="locked-copy") as err:
        qualifyreport.gate(cann, told.append)
    assert "npusnap qualify" in err.value.fix
    upgraded = qualifyreport.SeenCann(home="/opt/cann", version="9.2.0", simulated=False)
    assert "out of date" in qualifyreport.gate(upgraded, told.append) and "9.2.0" in told[-1]


def test_a_user_reads_the_nodes_report_that_root_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qualify runs as root; a user's dump or check reads root's report unless the user has one."""
    monkeypatch.delenv("NPUSNAP_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert qualifyreport.report_for_node() == paths.ROOT_STATE_DIR / qualifyreport.REPORT_NAME
    own = tmp_path / "npusnap" / qualifyreport.REPORT_NAME
    own.parent.mkdir()
    own.write_text("{}")
    assert qualifyreport.report_for_node() == own
