"""Every option of every command is in its reference page's options table, with its default."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import typer.main

from npusnap_cli.cli import build_app
from tests.unit.test_cli import all_commands

REPO = Path(__file__).resolve().parents[2]


def _commands() -> list[tuple[str, click.Command]]:
    """Every leaf command, and the root itself ("") for the global options."""
    return [("", typer.main.get_command(build_app())), *all_commands()]


def _page(name: str) -> Path:
    top = name.split()[0] if name else "README"
    return REPO / "docs" / "reference" / f"{top}.md"


def _rows(page: Path) -> list[str]:
    return [line for line in page.read_text().splitlines() if line.startswith("| `-")]


def _default_text(value: object) -> list[str]:
    """How a default may be written in the table: 60.0 as "60", strings as themselves."""
    if isinstance(value, float) and value.is_integer():
        return [str(int(value)), str(value)]
    return [str(value)]


@pytest.mark.parametrize(("name", "cmd"), _commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_option_has_a_row_with_its_default(name: str, cmd: click.Command) -> None:
    rows = _rows(_page(name))
    for param in cmd.params:
        if not isinstance(param, click.Option) or param.name == "help":
            continue
        flag = max(param.opts, key=len)  # the long form
        matching = [r for r in rows if f"`{flag}" in r.split("|")[1]]
        assert matching, (
            f"docs/reference/{_page(name).name}: no options-table row for {flag} (npusnap {name})"
        )
        for secondary in param.secondary_opts:
            assert any(secondary in r for r in matching), f"{_page(name).name}: {flag} row lacks {secondary}"
        default = param.default
        if param.is_flag or default is None or callable(default):
            continue
        cell = matching[0].split("|")[2]
        assert any(text in cell for text in _default_text(default)), (
            f"{_page(name).name}: the default of {flag} is {default!r}, the table says {cell.strip()!r}"
        )
