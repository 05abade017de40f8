"""The benchmark's hold on the VM's free page reporting (bench/pagereport.py), on stand-in files."""

from __future__ import annotations

from pathlib import Path

from bench.pagereport import HOLD_MS, Hold, current


def _params(tmp_path: Path, min_free_ms: str = "0", max_waiting_mib: str = "1024") -> Path:
    for name, value in (("min_free_ms", min_free_ms), ("max_waiting_mib", max_waiting_mib)):
        (tmp_path / name).write_text(f"{value}\n")
    return tmp_path


def _values(params: Path) -> tuple[str, str]:
    return (params / "min_free_ms").read_text().strip(), (params / "max_waiting_mib").read_text().strip()


def test_reporting_is_held_during_the_run_released_for_the_cold_case_and_put_back(tmp_path: Path) -> None:
    params = _params(tmp_path)
    hold = Hold(params, memory_mib=24104)
    note = hold.start()
    assert _values(params) == (str(HOLD_MS), "24104"), note
    assert "min_free_ms 0, max_waiting_mib 1024; held at min_free_ms 60000, max_waiting_mib 24104" in note
    assert current(params) == "min_free_ms 60000, max_waiting_mib 24104"
    with hold.released():
        assert _values(params) == ("0", "1024")  # the machine's own values for the cold case
    assert _values(params) == (str(HOLD_MS), "24104")
    assert hold.stop() is None
    assert _values(params) == ("0", "1024")
    assert hold.stop() is None  # once only


def test_a_machine_without_reporting_or_already_holding_is_left_alone(tmp_path: Path) -> None:
    missing = Hold(tmp_path / "absent", memory_mib=1024)
    assert "no free page reporting" in missing.start() and missing.stop() is None
    assert current(tmp_path / "absent") == "no free page reporting module"
    params = _params(tmp_path, "60000", "32768")
    hold = Hold(params, memory_mib=24104)
    assert "(freed memory stays backed for that long" in hold.start()
    with hold.released():
        assert _values(params) == ("60000", "32768")
    assert hold.stop() is None and _values(params) == ("60000", "32768")


def test_an_older_module_without_max_waiting_holds_what_it_has(tmp_path: Path) -> None:
    (tmp_path / "min_free_ms").write_text("0\n")
    hold = Hold(tmp_path, memory_mib=4096)
    assert "held at min_free_ms 60000" in hold.start()
    assert hold.stop() is None and (tmp_path / "min_free_ms").read_text().strip() == "0"


def test_a_value_that_cannot_be_written_is_said_and_nothing_is_left_raised(tmp_path: Path) -> None:
    params = _params(tmp_path)
    (params / "max_waiting_mib").unlink()
    (params / "max_waiting_mib").mkdir()  # unreadable as a number: treated as absent
    hold = Hold(params, memory_mib=1)
    assert "held at min_free_ms 60000" in hold.start()  # what can be held is
    assert hold.stop() is None and (params / "min_free_ms").read_text().strip() == "0"
    param = tmp_path / "other" / "min_free_ms"
    param.parent.mkdir()
    param.mkdir()  # neither readable as a number nor writable: treated as absent
    assert "no free page reporting" in Hold(param.parent).start()
