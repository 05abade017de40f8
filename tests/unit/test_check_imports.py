"""scripts/check_imports.py: finds function-local imports of npusnap_cli, honours the marker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def check_imports(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import check_imports  # type: ignore[import-not-found]

    return check_imports


def test_local_imports_are_found_and_the_marker_is_honoured(check_imports: Any, tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from __future__ import annotations\n"
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "from npusnap_cli import paths\n"
        "if TYPE_CHECKING:\n"
        "    from npusnap_cli.ui import Output\n"
        "def f() -> None:\n"
        "    import json\n"
        "    from npusnap_cli.host import procfs\n"
        "    from npusnap_cli.errors import (\n"
        "        UsageError,  # lazy: a reason on any line of the statement\n"
        "    )\n"
        "    class C:\n"
        "        def g(self) -> None:\n"
        "            import npusnap_cli.acl\n"
    )
    found = check_imports.local_imports(src)
    assert found == [
        (9, ["npusnap_cli.host.procfs"], False),
        (10, ["npusnap_cli.errors"], True),
        (15, ["npusnap_cli.acl"], False),
    ]


def test_the_package_passes() -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_imports.py")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
