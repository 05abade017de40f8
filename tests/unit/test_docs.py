"""Documentation hygiene: relative links resolve, and the README keeps its two commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


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


# --------------------------------------------------------------------------------------------
# Fenced blocks, as a CommonMark renderer sees them (markdown-it-py)
# --------------------------------------------------------------------------------------------

LANGS = {"bash", "sh", "shell", "text", "json", "python", "c", "toml", "yaml", "ini", "console"}


def _runbooks() -> Any:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import runbooks
    finally:
        sys.path.pop(0)
    return runbooks


def _all_blocks() -> list[tuple[Path, Any]]:
    rb = _runbooks()
    return [(md, b) for md in markdown_files() for b in rb.blocks(md.read_text())]


def test_every_fence_closes_where_it_appears_to() -> None:
    """A line that starts with ``` inside a block is a fence a reader sees closed and CommonMark
    does not (text after the closing backticks): the prose after it renders as code, and a shell
    block would run it."""
    bad = [
        f"{md.relative_to(REPO)}:{b.line}"
        for md, b in _all_blocks()
        if any(line.lstrip().startswith("```") for line in b.content.splitlines())
    ]
    assert bad == []


def test_every_fence_names_its_language() -> None:
    bad = [f"{md.relative_to(REPO)}:{b.line} ({b.lang!r})" for md, b in _all_blocks() if b.lang not in LANGS]
    assert bad == []


def test_shell_blocks_parse() -> None:
    """Every shell block, run in CI or marked <!-- not run in CI: ... -->, is valid bash."""
    bad = []
    for md, b in _all_blocks():
        if b.lang in {"bash", "sh", "shell"}:
            proc = subprocess.run(
                ["bash", "-n"], input=b.content, capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                bad.append(f"{md.relative_to(REPO)}:{b.line}: {proc.stderr.strip()}")
    assert bad == []


def test_python_and_json_blocks_parse() -> None:
    bad = []
    for md, b in _all_blocks():
        where = f"{md.relative_to(REPO)}:{b.line}"
        if b.lang == "python":
            try:
                compile(b.content, where, "exec")
            except SyntaxError as exc:
                bad.append(f"{where}: {exc}")
        elif b.lang == "json" and "..." not in b.content and "…" not in b.content:
            try:
                json.loads(b.content)
            except ValueError as exc:
                bad.append(f"{where}: {exc}")
    assert bad == []


def test_shell_blocks_run_or_say_why_not() -> None:
    """Each shell block is run by CI: a runbook's by its script, another page's by
    tests/integration/test_runbooks.py; one that cannot run on a test machine says why."""
    rb = _runbooks()
    runnable_pages = {*rb.pages(), *(rb.RUNBOOKS / n for n in rb.HAND_WRITTEN), *rb.doc_pages()}
    bad = [
        f"{md.relative_to(REPO)}:{b.line}"
        for md, b in _all_blocks()
        if b.runnable and md not in runnable_pages
    ]
    assert bad == []
    marked = [b for _, b in _all_blocks() if b.not_run is not None]
    assert all(b.not_run.strip() for b in marked)


def test_quickstart_runs_the_simulator_before_check() -> None:
    """`npusnap check` before `sim env` tells a new user that nothing works."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    assert text.index('eval "$(npusnap sim env)"') < text.index("npusnap check")


def test_the_threat_model_names_code_that_exists() -> None:
    """docs/security.md says which function checks each boundary: each (file, function) it names
    is there, so the page cannot outlive a rename; README and agent.md link to it."""
    text = (REPO / "docs" / "security.md").read_text()
    named = re.findall(r"`(npusnap_cli/[\w/]+\.py)`, `(\w+)`(?:, `(\w+)`)?", text)
    assert len(named) >= 8, named
    for path, *funcs in named:
        source = (REPO / path).read_text()
        for func in filter(None, funcs):
            assert re.search(rf"^\s*def {func}\(", source, re.MULTILINE), f"{path} has no {func}()"
    for fn in re.findall(r"`safefs\.(\w+)`", text):
        assert re.search(rf"^def {fn}\(", (REPO / "npusnap_cli" / "safefs.py").read_text(), re.MULTILINE), fn
    for doc in ("README.md", "docs/agent.md"):
        assert "security.md" in (REPO / doc).read_text(), doc
