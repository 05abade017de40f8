"""Exit codes are a public interface: this test freezes them and their documentation."""

from __future__ import annotations

import re
from pathlib import Path

from npusnap_cli import errors
from npusnap_cli.errors import ExitCode
from tests import replies

FROZEN = {
    "OK": 0,
    "INTERNAL": 1,
    "USAGE": 2,
    "PREFLIGHT": 3,
    "TARGET": 4,
    "AGENT": 5,
    "CRIU": 6,
    "DEVICE": 7,
    "IMAGE": 8,
    "STATE_UNKNOWN": 9,
    "CONTINUITY": 10,
    "BUSY": 11,
    "IMAGE_INCOMPATIBLE": 12,
    "INTERRUPTED": 130,
}

DOC = Path(__file__).resolve().parents[2] / "docs" / "exit-codes.md"


def test_exit_codes_are_frozen() -> None:
    assert {c.name: int(c) for c in ExitCode} == FROZEN


def test_every_code_is_documented_with_its_name() -> None:
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*([A-Z_]+)\s*\|", DOC.read_text(), re.MULTILINE)
    assert {name: int(code) for code, name in rows} == FROZEN


def test_every_error_class_maps_to_a_documented_code() -> None:
    classes = [
        obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, errors.NpusnapError)
    ]
    assert len(classes) >= 13
    for cls in classes:
        assert cls.exit_code in ExitCode
        err = cls("m", why="w", fix="f", details={"k": 1})
        d = err.to_dict()
        assert d == {"kind": cls.kind, "exit_code": int(cls.exit_code), "message": "m", "why": "w",
                     "fix": "f", "details": {"k": 1}}  # fmt: skip


def test_error_round_trips_through_its_dict_form() -> None:
    for cls in (errors.CriuError, errors.StateUnknownError, errors.DeviceError):
        back = errors.from_dict(cls("boom", why="w", fix="f", details={"x": 1}).to_dict(), prefix="dump: ")
        assert type(back) is cls and back.exit_code == cls.exit_code
        assert (back.message, back.why, back.fix, back.details) == ("dump: boom", "w", "f", {"x": 1})
    assert type(errors.from_dict({"kind": "nonsense", "message": "m"})) is errors.NpusnapError


def test_a_failed_device_memory_copy_says_why_and_how_to_go_on() -> None:
    """The agent's DEVICE_MEMORY_SAVE_FAILED (its code: -errno) maps to a why and a fix by cause."""
    from npusnap_cli.device.agent_client import AgentClient

    c = AgentClient.__new__(AgentClient)
    c.pid = 4242
    full = c._error("lock", replies.error("state", "DEVICE_MEMORY_SAVE_FAILED", code=-28))
    assert "filled up" in full.why and "free space" in full.fix and "4242" in full.message
    other = c._error("lock", replies.error("state", "DEVICE_MEMORY_SAVE_FAILED", code=-5))
    assert "could not copy" in other.why and "nothing was locked" in other.fix
