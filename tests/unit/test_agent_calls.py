"""The C files of the agent and of npusnap's CRIU plugin call one way: which file calls which is
read from their objects (`nm`: what each defines, what each needs from the others), and no files
call round in a circle.

A circle makes every file of it part of every other's inside: none can be read, changed or
tested alone (docs/internals.md lists what each file is for).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "native" / "agent"
PLUGIN = REPO / "native" / "criu-plugin"

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("nm") is None or shutil.which("cc") is None,
    reason="needs make, cc and nm (binutils) to compile the agent's files one by one",
)


def calls_between_files(objdir: Path) -> dict[str, dict[str, set[str]]]:
    """file -> file it calls -> the names it needs from there."""
    defined: dict[str, str] = {}
    needed: dict[str, set[str]] = {}
    for obj in sorted(objdir.glob("*.o")):
        out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
        needed[obj.stem] = set()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBRCV":
                defined[parts[2]] = obj.stem
            elif len(parts) == 2 and parts[0] == "U":
                needed[obj.stem].add(parts[1])
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for f, names in needed.items():
        for name in names:
            owner = defined.get(name)
            if owner is not None and owner != f:
                edges[f][owner].add(name)
    return edges


def circles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected sets of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_one() -> None:
    edges: dict[str, dict[str, set[str]]] = {
        "a": {"b": {"f"}},
        "b": {"c": {"g"}},
        "c": {"a": {"h"}},
        "d": {"a": {"f"}},
    }
    assert circles(edges) == [["a", "b", "c"]]


def built_objects(directory: Path, build: Path) -> Path:
    """``make objects`` of a native directory into ``build``: its objects' directory."""
    made = subprocess.run(
        ["make", "-s", "-C", str(directory), "objects", f"BUILD={build}"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stdout + made.stderr
    return build / directory.name / "obj"


def assert_one_way(objdir: Path, root: str) -> None:
    edges = calls_between_files(objdir)
    assert edges[root], f"{root}.c calls nothing of the others: the objects were not read"
    found = circles(edges)
    detail = [
        f"{f} -> {g}: {sorted(edges[f][g])[:6]}"
        for part in found
        for f in part
        for g in edges[f]
        if g in part
    ]
    assert not found, f"files calling round in a circle: {found}\n" + "\n".join(detail)


def test_the_agent_files_call_one_way(tmp_path: Path) -> None:
    objdir = built_objects(AGENT, tmp_path)
    assert len(list(objdir.glob("*.o"))) == len(list(AGENT.glob("*.c")))
    assert_one_way(objdir, "core")


def test_the_criu_plugin_files_call_one_way(tmp_path: Path) -> None:
    probe = subprocess.run(["make", "-s", "-n", "-C", str(PLUGIN), "objects"], capture_output=True, text=True)
    if "criu-plugin.h not found" in probe.stdout + probe.stderr or probe.returncode != 0:
        pytest.skip("no criu-plugin.h here (scripts/setup.sh builds CRIU, whose source has it)")
    objdir = built_objects(PLUGIN, tmp_path)
    assert (objdir / "npusnap_plugin.o").exists()
    assert_one_way(objdir, "npusnap_plugin")
