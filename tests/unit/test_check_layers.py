"""scripts/check_layers.py: floors, arrows up, cycles, and the drawing in docs/internals.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def layers(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import check_layers  # type: ignore[import-not-found]

    return check_layers


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "npusnap_cli"
    for name, text in {"__init__.py": "", **files}.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_an_arrow_up_a_cycle_and_a_module_on_no_floor_are_found(
    layers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = _package(
        tmp_path,
        {
            "errors.py": "from npusnap_cli import cli\n",  # foundation -> front
            "image/__init__.py": "",
            "image/a.py": "def f():\n    from npusnap_cli.image import b\n",  # lazy, still an arrow
            "image/b.py": "from npusnap_cli.image import a\n",
            "image/c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from npusnap_cli import cli\n"
            ),
            "cli.py": "from npusnap_cli import errors\n",
            "stray.py": "",
        },
    )
    monkeypatch.setattr(layers, "PACKAGE", pkg)
    mods = layers.modules()
    found = layers.problems(mods, layers.imports(mods))
    assert "errors (foundation) imports cli (front): an arrow back up" in found
    assert "import cycle: image.a <-> image.b" in found
    assert "import cycle: cli <-> errors" in found
    assert "stray: on no floor (add it to FLOORS in scripts/check_layers.py)" in found
    assert not any(line.startswith("image.c") for line in found)  # a type is no arrow


def test_the_product_imports_no_stand_in_in_any_way(
    layers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = _package(
        tmp_path,
        {
            "cli.py": (
                "import importlib\n"
                'COMMANDS = {"sim": ("npusnap_sim.cli", "The simulated NPU.")}\n'  # data, not an import
                "def load(name):\n    return importlib.import_module(name)\n"
            ),
            "paths.py": "import npusnap_sim.daemon\n",
            "acl.py": "def f():\n    from npusnap_workloads import demo  # lazy: still an import\n",
            "units.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from npusnap_sim import wire\n"
            ),
            "errors.py": "import importlib\nimportlib.import_module('npusnap_workloads.cli')\n",
            "elf.py": "__import__('npusnap_sim')\nimport npusnap_simulated\n",  # another name: not a stand-in
        },
    )
    monkeypatch.setattr(layers, "PACKAGE", pkg)
    found = layers.stand_in_imports(layers.modules())
    assert [line.split(" imports ")[0] for line in found] == [
        "npusnap_cli/acl.py:2: acl",
        "npusnap_cli/elf.py:1: elf",
        "npusnap_cli/errors.py:2: errors",
        "npusnap_cli/paths.py:1: paths",
        "npusnap_cli/units.py:3: units",
    ]


def test_the_house_holds_and_internals_md_shows_it() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_layers.py"), "--check-doc"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check_layers: ok" in done.stdout
