"""What `npusnap sim ops` counts as a looked-up operator name in a torch_npu library."""

from __future__ import annotations

from pathlib import Path

import pytest

from npusnap_cli.errors import PreflightError
from npusnap_sim import opscover


def test_only_whole_aclnn_strings_count(tmp_path: Path) -> None:
    lib = tmp_path / "libtorch_npu.so"
    lib.write_bytes(
        b"\x7fELF\x00aclnnAdd\x00aclnnAddGetWorkspaceSize\x00aclnnMm\x00"
        b"call aclnnMatmul failed\x00"  # a message, not a lookup
        b"H\xb8aclnnLogH\x89E"  # an immediate in code, not a string
        b"\x00aclnnOnlyItsWorkspaceGetWorkspaceSize\x00"
    )
    assert opscover.looked_up_names(lib) == {"aclnnAdd", "aclnnMm"}


def test_the_wheel_is_found_from_any_of_its_directories(tmp_path: Path) -> None:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    lib = site / "torch_npu" / "lib" / "libtorch_npu.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    for where in (site, site / "torch_npu", tmp_path / "venv", lib):
        assert opscover.wheel_library(where) == lib
    with pytest.raises(PreflightError, match="no torch_npu wheel at") as err:
        opscover.wheel_library(tmp_path / "elsewhere")
    assert "setup-torch-npu.sh" in (err.value.fix or "")
