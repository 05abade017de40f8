"""Documentation hygiene: relative links resolve, and the README keeps its two commands."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_relative_links_resolve() -> None:
    broken = [
        f"{md.relative_to(REPO)} -> {m.group(1)}"
        for md in markdown_files()
        for m in LINK.finditer(md.read_text())
        if not m.group(1).startswith(("http://", "https://", "mailto:"))
        and not (md.parent / m.group(1)).exists()
    ]
    assert broken == []


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()
