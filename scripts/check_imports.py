#!/usr/bin/env python3
"""Lint: npusnap modules are imported at module level, not inside functions.

A function-local ``from npusnap_cli... import`` hides a module's dependencies and papers over
import cycles; where one is really needed it says why on the same line, with a marker comment
``# lazy: <why>`` (what the CLI's start-up must not pay for; the agent's workloads import the agent
only where ``npusnap run`` put it on the path). The product (npusnap_cli) and the stand-ins beside
it (npusnap_sim, npusnap_workloads) are held to this for their imports of any of the three.
Imports under ``if TYPE_CHECKING:`` at module level are not function-local and are allowed.

    scripts/check_imports.py            fail (exit 1) on each unmarked function-local import
    scripts/check_imports.py --costs    what each marked import would add to `npusnap --help`
                                        (median of fresh interpreters, after the --help imports)

Run by `make lint` and scripts/test.sh. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("npusnap_cli", "npusnap_sim", "npusnap_workloads")
MARKER = "# lazy:"


def _ours(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules (or packages) of PACKAGES ``node`` imports, [] for anything else."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return [node.module or "."]
        mod = node.module or ""
        if mod.split(".")[0] not in PACKAGES:
            return []
        # `from npusnap_cli.host import procfs` imports the module npusnap_cli.host.procfs
        return [f"{mod}.{a.name}" if _is_module(f"{mod}.{a.name}") else mod for a in node.names]
    return [a.name for a in node.names if a.name.split(".")[0] in PACKAGES]


def _is_module(dotted: str) -> bool:
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def local_imports(path: Path) -> list[tuple[int, list[str], bool]]:
    """(line, modules, marked) of every function-local import of PACKAGES in ``path``."""
    source = path.read_text()
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                modules = _ours(child)
                if modules:
                    end = child.end_lineno or child.lineno
                    marked = any(MARKER in lines[i - 1] for i in range(child.lineno, end + 1))
                    found.append((child.lineno, modules, marked))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source, str(path)), False)
    return found


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def check() -> int:
    bad = []
    marked_count = 0
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        for line, modules, marked in local_imports(path):
            if marked:
                marked_count += 1
                continue
            bad.append(f"{rel}:{line}: function-local import of {', '.join(modules)}")
    for entry in bad:
        print(entry)
    if bad:
        print(
            f"{len(bad)} function-local import(s) of npusnap modules: move them to the top of the module "
            f"(fix an import cycle by moving the definition down a layer), or say why on the line "
            f"with '{MARKER} <why>'",
            file=sys.stderr,
        )
        return 1
    print(f"check_imports: ok ({marked_count} function-local imports, each with its reason)")
    return 0


_COST = """
import importlib, sys, time
from npusnap_cli import cli
cli.build_app()
t = time.perf_counter()
importlib.import_module(sys.argv[1])
print((time.perf_counter() - t) * 1000)
"""


def costs(runs: int) -> int:
    """The import time each marked import would add to `npusnap --help`, most expensive first."""
    where: dict[str, list[str]] = {}
    for path in _sources():
        for line, modules, marked in local_imports(path):
            for m in modules if marked else ():
                where.setdefault(m, []).append(f"{path.relative_to(REPO).as_posix()}:{line}")
    rows = []
    for module, places in where.items():
        ms = []
        for _ in range(runs):
            run = subprocess.run([sys.executable, "-c", _COST, module], capture_output=True, text=True)
            if run.returncode != 0:  # importable only in its own context (a target's PYTHONPATH)
                break
            ms.append(float(run.stdout))
        rows.append((statistics.median(ms) if ms else float("nan"), module, places))
    rows.sort(key=lambda r: -r[0] if r[0] == r[0] else 0.0)
    for median, module, places in rows:
        print(f"{median:7.1f} ms  {module:40s} {', '.join(places)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", action="store_true", help="measure what each marked import costs --help")
    ap.add_argument("--runs", type=int, default=7, help="fresh interpreters per module (--costs)")
    args = ap.parse_args()
    return costs(args.runs) if args.costs else check()


if __name__ == "__main__":
    raise SystemExit(main())
