"""ui.Output: data on stdout, diagnostics on stderr; NO_COLOR means no styling at all; cells fold."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from npusnap_cli.host import hostclean
from npusnap_cli.ui import Output


def _render(capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    out = Output("test")
    out.table("a title", ["path"], [["/a/very/long/path/" + "x" * 150 + "/end"]])
    out.warn("careful")
    out.ok("done")
    out.data("/the/image")
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_no_color_disables_every_style(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # as if on a terminal
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("NO_COLOR", raising=False)
    styled_out, styled_err = _render(capsys)
    assert "\x1b[" in styled_out and "\x1b[" in styled_err  # the check below means something
    assert "\x1b[3m" in styled_out  # rich's italic table title
    monkeypatch.setenv("NO_COLOR", "1")
    out, err = _render(capsys)
    assert "\x1b[" not in out and "\x1b[" not in err  # no colour, no bold, no italics, no dim


def test_data_on_stdout_diagnostics_on_stderr_and_paths_fold(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    out, err = _render(capsys)
    assert "a title" in out and "/the/image" in out.splitlines()[-1]
    assert "careful" in err and "done" in err and "careful" not in out
    # The long path is folded over several lines, never cut with an ellipsis.
    assert "…" not in out and "/end" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_failure_logs_are_bounded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    base = hostclean.log_base()
    base.mkdir()
    now = time.time()
    for i in range(hostclean.KEEP_LOGS + 5):
        d = base / f"dump-{i:03d}"
        d.mkdir()
        os.utime(d, (now - 1000 + i, now - 1000 + i))
    old = base / "dump-ancient"
    old.mkdir()
    os.utime(old, (now - hostclean.MAX_LOG_AGE_S - 10, now - hostclean.MAX_LOG_AGE_S - 10))
    new = hostclean.new_log_dir("restore")  # creating one prunes the others first
    left = {p.name for p in base.iterdir()}
    assert new.name in left and "dump-ancient" not in left
    assert len(left) == hostclean.KEEP_LOGS + 1
    assert {f"dump-{i:03d}" for i in range(5)}.isdisjoint(left)  # the oldest went


HOSTILE = "job [/] [bold]x[/bold] \x1b[2J\x1b[31mred\x07 two\nlines\r\u202eevil"


def test_every_user_supplied_field_is_printed_as_escaped_plain_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A command line another user chose: rich markup is text (no MarkupError), an ANSI escape
    cannot repaint the terminal, a newline or CR cannot forge a line, in every kind of output."""
    from npusnap_cli import ui
    from npusnap_cli.errors import TargetError

    assert ui.safe_text("a\x1b[31m\nb\u202e[/]") == "a\\x1b[31m\\nb\\u202e[/]"
    out = ui.Output("ps")
    out.table(HOSTILE, ["pid", HOSTILE], [[1, HOSTILE]], styles=["red"])
    out.kv(HOSTILE, {HOSTILE: HOSTILE})
    out.tree(HOSTILE, [(0, HOSTILE), (1, HOSTILE)])
    out.line(HOSTILE)
    out.warn(HOSTILE)
    out.info(HOSTILE)
    with out.phase(HOSTILE):
        pass
    out.error(TargetError(HOSTILE, why=HOSTILE, fix=HOSTILE, details={"cmd": HOSTILE, "cmds": [HOSTILE]}))
    captured = capsys.readouterr()
    for text in (captured.out, captured.err):
        assert "[/]" in text and "[bold]x[/bold]" in text
        assert not any(c in text for c in "\x1b\x07\r\u202e")
        assert "lines" in text and not any(line.startswith("lines") for line in text.splitlines())
        assert "\\x1b[2J" in text and "two\\nlines" in text
