"""The generated contract (native/contract/npusnap.toml -> contract.h and npusnap_cli/contract.py).

Every constant, table and struct layout that C and Python share is written once in the spec and
generated into both; these tests check that the committed outputs are what the spec gives and that
the C compiler lays out and evaluates the header as the Python module says.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npusnap_cli import contract

REPO = Path(__file__).resolve().parents[2]


def test_generated_files_are_fresh() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gencontract.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc): scripts/setup.sh installs one to build native/")
    exe = tmp_path_factory.mktemp("contract") / "layout"
    subprocess.run(
        [cc, "-std=gnu11", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'native' / 'include'}",
         str(REPO / "native" / "contract" / "layout.c"), "-o", str(exe)],
        check=True, timeout=120,
    )  # fmt: skip
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    result: dict[str, dict[str, object]] = json.loads(out)
    return result


def test_c_struct_layouts_match(compiled: dict[str, dict[str, object]]) -> None:
    python = {
        name: {"size": size, "offsets": offsets}
        for name, (packed, size, offsets, cls) in contract.LAYOUTS.items()
    }
    assert compiled["structs"] == python
    for _name, (packed, size, offsets, cls) in contract.LAYOUTS.items():
        assert packed.size == size
        fields = getattr(cls, "_fields_")  # noqa: B009
        assert [f[0] for f in fields] == list(offsets)


def test_c_constants_match(compiled: dict[str, dict[str, object]]) -> None:
    assert compiled["ints"] == {k: int(v) for k, v in contract.C_INTS.items()}
    assert compiled["strings"] == contract.C_STRINGS


def test_stale_output_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--check fails on a generated file that is not what the spec gives (a hand edit), and a
    run without it writes the file again."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gencontract  # type: ignore[import-not-found]

    monkeypatch.setattr(gencontract, "ROOT", tmp_path)
    monkeypatch.setattr(gencontract, "HEADER", tmp_path / "contract.h")
    monkeypatch.setattr(gencontract, "MODULE", tmp_path / "contract.py")
    assert gencontract.main([]) == 0
    assert gencontract.main(["--check"]) == 0
    header = tmp_path / "contract.h"
    header.write_text(
        header.read_text().replace(
            "ACL_ERROR_SNAPSHOT_LOCK_FAILED 507906", "ACL_ERROR_SNAPSHOT_LOCK_FAILED 1"
        )
    )
    assert gencontract.main(["--check"]) == 1
    assert gencontract.main([]) == 0
    assert "ACL_ERROR_SNAPSHOT_LOCK_FAILED 507906" in header.read_text()


def test_a_spec_that_repeats_a_number_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gencontract

    spec = gencontract.tomllib.loads(gencontract.SPEC.read_text())
    gencontract.validate(spec)
    spec["exit_codes"][3]["code"] = spec["exit_codes"][2]["code"]
    with pytest.raises(gencontract.SpecError, match="exit_codes: value repeated"):
        gencontract.validate(spec)
