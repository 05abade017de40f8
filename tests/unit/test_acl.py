"""acl.py: CANN discovery, devlib rejection, version, symbol presence and error messages.

Uses the built simulator libraries as real ELF files in fake CANN trees; nothing is loaded and no
daemon is needed.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
from pathlib import Path

import pytest

from npusnap_cli import acl, paths
from npusnap_sim import manager


@pytest.fixture(scope="module")
def cann() -> Path:
    return manager.ensure_built()


def make_tree(
    root: Path, cann: Path, libs: dict[str, str], libdir: str = "lib64", version: str | None = "8.5.0"
) -> Path:
    """A fake CANN tree whose ``libdir/<name>`` is a copy of the built ``lib64/<source>``."""
    d = root / libdir
    d.mkdir(parents=True)
    for name, source in libs.items():
        shutil.copy(cann / "lib64" / source, d / name)
    if version is not None:
        vi = root / "share" / "info" / "runtime" / "version.info"
        vi.parent.mkdir(parents=True)
        vi.write_text(f"Version={version}\n")
    return root


FULL = {"libacl_rt.so": "libacl_rt.so", "libruntime.so": "libruntime.so"}


def test_env_points_at_the_simulator(cann: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    inst = acl.find_cann()
    assert inst.source == "ASCEND_HOME_PATH"
    assert inst.home == str(cann)
    assert inst.version == "9.1.0" and inst.simulated
    assert inst.acl_library == str(cann / "lib64" / "libacl_rt.so")
    assert inst.runtime_library == str(cann / "lib64" / "libruntime.so")
    assert all(inst.symbols.values()) and len(inst.symbols) == 7


def test_ascend_home_argument_wins_over_env(
    cann: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = make_tree(tmp_path / "cann", cann, FULL)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    inst = acl.find_cann(str(other))
    assert inst.source == "--ascend-home" and inst.home == str(other)
    assert inst.version == "8.5.0" and not inst.simulated


def test_explicit_home_that_does_not_exist_is_an_error_not_a_fallback(
    cann: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann))
    with pytest.raises(acl.CannNotFound) as exc:
        acl.find_cann(str(tmp_path / "nope"))
    assert "does not exist" in str(exc.value) and "--ascend-home" in str(exc.value)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "nope"))
    with pytest.raises(acl.CannNotFound, match="from ASCEND_HOME_PATH"):
        acl.find_cann()


def test_no_library_in_home(tmp_path: Path) -> None:
    (tmp_path / "lib64").mkdir()
    with pytest.raises(acl.CannNotFound, match=r"no libacl_rt\.so or libascendcl\.so"):
        acl.find_cann(str(tmp_path))


def test_devlib_stubs_are_rejected(cann: Path, tmp_path: Path) -> None:
    home = make_tree(tmp_path / "cann", cann, FULL, libdir="devlib")
    with pytest.raises(acl.CannNotFound) as exc:
        acl.find_cann(str(home))
    assert "stub" in str(exc.value) and "devlib" in str(exc.value)
    # a lib64 entry that is really a link into devlib is a stub too
    (home / "lib64").mkdir()
    os.symlink(home / "devlib" / "libacl_rt.so", home / "lib64" / "libacl_rt.so")
    with pytest.raises(acl.CannNotFound, match="devlib"):
        acl.find_cann(str(home))
    with pytest.raises(acl.CannNotFound, match="devlib"):
        acl.AclRuntime.load(str(home / "devlib" / "libacl_rt.so"))


def test_missing_snapshot_symbols_are_reported(cann: Path, tmp_path: Path) -> None:
    # libruntime.so under the ACL name: a real ELF library without the aclrtSnapShot* exports
    home = make_tree(tmp_path / "old", cann, {"libacl_rt.so": "libruntime.so"}, version="8.3.0")
    inst = acl.find_cann(str(home))
    assert inst.acl_library.endswith("libacl_rt.so")
    assert not any(inst.symbols[s] for s in acl.SNAPSHOT_FUNCTIONS)
    assert inst.runtime_library is None and inst.symbols[acl.GET_STATE_FUNCTION] is False


def test_libascendcl_is_used_when_it_is_the_one_with_the_symbols(cann: Path, tmp_path: Path) -> None:
    home = make_tree(
        tmp_path / "c", cann, {"libacl_rt.so": "libruntime.so", "libascendcl.so": "libascendcl.so"}
    )
    inst = acl.find_cann(str(home))
    assert inst.acl_library.endswith("libascendcl.so")
    assert all(inst.symbols[s] for s in acl.SNAPSHOT_FUNCTIONS + acl.CALLBACK_FUNCTIONS)


def test_arch_linux_lib64_layout_and_missing_version(cann: Path, tmp_path: Path) -> None:
    home = make_tree(tmp_path / "c", cann, FULL, libdir=f"{platform.machine()}-linux/lib64", version=None)
    inst = acl.find_cann(str(home))
    assert inst.acl_library.startswith(str(home / f"{platform.machine()}-linux"))
    assert inst.version is None and inst.symbols[acl.GET_STATE_FUNCTION]


def test_nothing_found_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setattr(acl, "DEFAULT_HOMES", (str(tmp_path / "a"), str(tmp_path / "b")))
    with pytest.raises(acl.CannNotFound) as exc:
        acl.find_cann()
    assert "npusnap sim env" in str(exc.value) and "set_env.sh" in str(exc.value)
    assert isinstance(exc.value, acl.AclError)


def test_elf_reader_rejects_non_elf(tmp_path: Path) -> None:
    (tmp_path / "x.so").write_text("not an ELF")
    assert acl.elf_defined_symbols(str(tmp_path / "x.so")) is None
    assert acl.elf_defined_symbols(str(tmp_path / "missing.so")) is None


def test_error_messages_name_code_meaning_and_next_step() -> None:
    e = acl.AclError(507906, call="aclrtSnapShotProcessLock", pid=42)
    assert (
        str(e) == "507906: lock failed — the process is already locked; "
        "run `npusnap status 42` to see its snapshot state"
    )
    assert (e.code, e.name, e.call) == (507906, "ACL_ERROR_SNAPSHOT_LOCK_FAILED", "aclrtSnapShotProcessLock")
    assert e.to_dict()["message"] == str(e)
    for code, (name, meaning, hint) in acl.ERRORS.items():
        if code == 0:
            continue
        msg = str(acl.AclError(code))
        assert msg.startswith(f"{code}: {meaning}") and name.startswith("ACL_ERROR")
        assert hint and "{pid}" not in msg
    unknown = acl.AclError(999999)
    assert unknown.name == "ACL_ERROR_UNKNOWN" and str(unknown).startswith("999999: unknown ACL error")


def test_error_table_matches_the_simulated_runtime() -> None:
    # npusim takes CANN's ACL_* names from the generated contract, not from copies of its own.
    header = (paths.native_src_dir() / "npusim" / "npusim.h").read_text()
    assert not re.search(r"#define ACL_\w+ \d+", header)
    names_at = header.index("#define NPUSNAP_CONTRACT_CANN_NAMES")
    assert names_at < header.index('#include "npusnap/contract.h"')
    contract = (paths.native_src_dir() / "include" / "npusnap" / "contract.h").read_text()
    cann_names = contract[contract.index("#if defined(NPUSNAP_CONTRACT_CANN_NAMES)") :]
    codes = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define (ACL_\w+) (\d+)", cann_names)}
    assert codes == {name: code for code, (name, _m, _h) in acl.ERRORS.items()}
