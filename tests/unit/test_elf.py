"""elf: the one ELF reader, against this process's own libc and python and against broken files."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest

from npusnap_cli import elf


def _libc() -> tuple[str, int]:
    """The path and load base of the libc this process maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if (
            len(parts) == 6
            and int(parts[2], 16) == 0
            and os.path.basename(parts[5]).startswith(("libc.so", "libc-"))
        ):
            return parts[5].strip(), int(parts[0].split("-")[0], 16)
    pytest.skip("no libc.so mapped in this process (not a glibc system)")


def test_an_export_read_from_the_file_is_where_the_loader_put_it() -> None:
    path, base = _libc()
    with elf.open_elf(path) as lib:
        sym = lib.symbol("getpid")
        assert sym is not None and sym.type == elf.STT_FUNC
        names = {s.name for s in lib.symbols()}
    assert base + sym.value == ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    assert {"getpid", "malloc", "free"} <= names
    assert elf.ElfFile(Path(path).read_bytes()).symbol("getpid") == sym  # bytes and mapping agree


def test_a_dynamically_linked_python_has_an_interpreter() -> None:
    with elf.open_elf(os.path.realpath(sys.executable)) as exe:
        assert exe.has_interpreter()
        assert exe.file_offset(0xFFFF_FFFF_FFFF_0000) is None


@pytest.mark.parametrize("content", [b"", b"#!/bin/sh\n" * 10, b"\x7fELF\x01" + b"\0" * 59])
def test_what_is_not_a_64_bit_elf_file_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "f").write_bytes(content)
    with pytest.raises(elf.ElfError), elf.open_elf(tmp_path / "f"):
        pass


def test_tables_pointing_outside_the_file_are_an_error_not_a_crash() -> None:
    path, _base = _libc()
    head = Path(path).read_bytes()[:4096]  # the header, but not the section table at the end
    with pytest.raises(elf.ElfError):
        list(elf.ElfFile(head).symbols())
