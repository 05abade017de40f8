"""Every `--option` that an error's fix names exists on some npusnap command.

A fix is the one line an operator acts on; naming an option that does not exist sends them to a
usage error. This scans every ``fix=`` argument in the source of the product and of its stand-ins
(whose `npusnap sim` and `npusnap demo` errors an operator meets too), strings and f-strings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click

from tests.unit.test_cli import all_commands

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [REPO / name for name in ("npusnap_cli", "npusnap_sim", "npusnap_workloads")]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Options of other programs that a fix may name, with the program it belongs to in the text.
FOREIGN = {
    "--cap-add": "container",  # docker/podman run --cap-add
    "--compress": "podman",  # podman container checkpoint --export --compress
    "--ppid": "ps ",  # procps ps --ppid
    "--rdzv-conf": "torchrun",  # torchrun --rdzv-conf
}


def _strings(node: ast.AST) -> list[str]:
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.append(sub.value)
    return out


def _fix_texts() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(p for package in PACKAGES for p in package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "fix":
                        found += [(path.name, node.lineno, s) for s in _strings(kw.value)]
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id.endswith("_FIX") for t in node.targets
            ):
                found += [(path.name, node.lineno, s) for s in _strings(node.value)]
    return found


def _all_options() -> set[str]:
    opts = {"--help", "--version", "--json", "--verbose"}
    for _, cmd in all_commands():
        for param in cmd.params:
            if isinstance(param, click.Option):
                opts.update(o for o in param.opts + param.secondary_opts if o.startswith("--"))
    return opts


def test_every_option_in_a_fix_exists() -> None:
    texts = _fix_texts()
    assert len(texts) > 50  # the scan finds the fixes
    known = _all_options()
    wrong = []
    for where, line, text in texts:
        for opt in OPTION.findall(text):
            if opt in known or (opt in FOREIGN and FOREIGN[opt] in text):
                continue
            wrong.append(f"{where}:{line}: {opt} in {text!r}")
    assert not wrong, "fixes name options no command has:\n" + "\n".join(wrong)
