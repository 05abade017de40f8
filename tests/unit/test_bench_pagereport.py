"""The benchmark's hold on the VM's free page reporting (bench/pagereport.py), on a stand-in file."""

from __future__ import annotations

from pathlib import Path

from bench.pagereport import HOLD_MS, Hold


def test_reporting_is_held_during_the_run_released_for_the_cold_case_and_put_back(tmp_path: Path) -> None:
    param = tmp_path / "min_free_ms"
    param.write_text("0\n")
    hold = Hold(param)
    note = hold.start()
    assert param.read_text().strip() == str(HOLD_MS) and "held at 10000" in note, note
    with hold.released():
        assert param.read_text().strip() == "0"  # the machine's own value for the cold case
    assert param.read_text().strip() == str(HOLD_MS)
    assert hold.stop() is None
    assert param.read_text().strip() == "0"
    assert hold.stop() is None  # once only


def test_a_machine_without_reporting_or_already_holding_is_left_alone(tmp_path: Path) -> None:
    missing = Hold(tmp_path / "absent")
    assert "no free page reporting" in missing.start() and missing.stop() is None
    param = tmp_path / "min_free_ms"
    param.write_text("60000\n")
    hold = Hold(param)
    assert "60000" in hold.start()
    with hold.released():
        assert param.read_text().strip() == "60000"
    assert hold.stop() is None and param.read_text().strip() == "60000"


def test_a_value_that_cannot_be_written_is_said(tmp_path: Path) -> None:
    param = tmp_path / "min_free_ms"
    param.mkdir()  # neither readable as a number nor writable: treated as absent
    assert "no free page reporting" in Hold(param).start()
