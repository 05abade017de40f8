"""The one reader of ELF files: headers, sections, symbols, relocations, read and never loaded.

npusnap looks into shared libraries and executables without dlopen()ing them: the exports of a CANN
library (loading one would run its constructors and pull in the driver), ``dlopen`` in a target's
libc, a CRIU plugin's ``CR_PLUGIN_DESC``, whether an executable has an interpreter. 64-bit ELF
only, either byte order (elf(5)); the file is mapped, so only the pages read are touched.

Standard library only, Python 3.9 syntax: ``acl`` (which targets import) uses it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple, Union

# elf(5) constants used here.
PT_LOAD = 1
PT_INTERP = 3
SHT_SYMTAB = 2
SHT_RELA = 4
SHT_DYNSYM = 11
STT_OBJECT = 1
STT_FUNC = 2
R_X86_64_RELATIVE = 8
R_AARCH64_RELATIVE = 1027
EM_X86_64 = 62
EM_AARCH64 = 183

_HEADER_SIZE = 64  # Elf64_Ehdr

Buffer = Union[bytes, bytearray, mmap.mmap]


class ElfError(ValueError):
    """Not a 64-bit ELF file, or one whose tables point outside it."""


@dataclass(frozen=True)
class Section:
    type: int
    addr: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class Segment:
    type: int
    offset: int
    vaddr: int
    filesz: int


@dataclass(frozen=True)
class Symbol:
    """A defined, named symbol (imports and anonymous entries are never returned)."""

    name: str
    value: int
    size: int
    type: int  # STT_*


class ElfFile:
    """A 64-bit ELF image in memory (bytes, or a mapping from :func:`open_elf`)."""

    def __init__(self, data: Buffer) -> None:
        if len(data) < _HEADER_SIZE or data[:4] != b"\x7fELF" or data[4] != 2:  # ELFCLASS64
            raise ElfError("not a 64-bit ELF file")
        self.data = data
        self.byte_order = "<" if data[5] == 1 else ">"  # ELFDATA2LSB
        self._phoff, self._shoff = self._unpack("QQ", 0x20)
        self._phentsize, self._phnum, self._shentsize, self._shnum = self._unpack("HHHH", 0x36)
        self._sections: Optional[List[Section]] = None

    def _unpack(self, fmt: str, offset: int) -> Tuple[int, ...]:
        try:
            return struct.unpack_from(self.byte_order + fmt, self.data, offset)
        except struct.error as exc:
            raise ElfError(f"truncated ELF file (at offset {offset}): {exc}") from None

    @property
    def machine(self) -> int:
        """e_machine: the architecture the file was built for (EM_X86_64, EM_AARCH64...)."""
        return self._unpack("H", 18)[0]

    def u32(self, offset: int) -> int:
        """A 32-bit unsigned value at a file offset, in the file's byte order."""
        return self._unpack("I", offset)[0]

    def segments(self) -> List[Segment]:
        """The program headers."""
        out = []
        for i in range(self._phnum):
            p_type, _flags, offset, vaddr, _paddr, filesz, _memsz, _align = self._unpack(
                "IIQQQQQQ", self._phoff + i * self._phentsize
            )
            out.append(Segment(p_type, offset, vaddr, filesz))
        return out

    def sections(self) -> List[Section]:
        """The section headers."""
        if self._sections is None:
            out = []
            for i in range(self._shnum):
                _name, sh_type, _flags, addr, offset, size, link, _info, _align, entsize = self._unpack(
                    "IIQQQQIIQQ", self._shoff + i * self._shentsize
                )
                out.append(Section(sh_type, addr, offset, size, link, entsize))
            self._sections = out
        return self._sections

    def has_interpreter(self) -> bool:
        """True when the program headers name an interpreter (PT_INTERP): ld.so runs for it."""
        return any(s.type == PT_INTERP for s in self.segments())

    def _string(self, offset: int, encoding: str) -> str:
        nul = self.data.find(b"\x00", offset)
        if nul < 0:
            raise ElfError(f"unterminated string at offset {offset}")
        return self.data[offset:nul].decode(encoding, "replace")

    def symbols(self, tables: Tuple[int, ...] = (SHT_DYNSYM,)) -> Iterator[Symbol]:
        """The defined, named symbols of the symbol tables of the given section types."""
        secs = self.sections()
        for sec in secs:
            if sec.type not in tables or not sec.entsize:
                continue
            if sec.link >= len(secs):
                raise ElfError(f"symbol table links to section {sec.link} of {len(secs)}")
            strtab = secs[sec.link].offset
            for k in range(sec.size // sec.entsize):
                st_name, st_info, _other, st_shndx, value, size = self._unpack(
                    "IBBHQQ", sec.offset + k * sec.entsize
                )
                if st_shndx == 0 or st_name == 0:  # undefined (imported) or anonymous
                    continue
                yield Symbol(self._string(strtab + st_name, "ascii"), value, size, st_info & 0xF)

    def symbol(self, name: str, tables: Tuple[int, ...] = (SHT_DYNSYM,)) -> Optional[Symbol]:
        """The first defined symbol called ``name``, or None."""
        return next((s for s in self.symbols(tables) if s.name == name), None)

    def file_offset(self, vaddr: int) -> Optional[int]:
        """Where the byte loaded at ``vaddr`` lies in the file (None: not in a loaded segment)."""
        for seg in self.segments():
            if seg.type == PT_LOAD and seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                return vaddr - seg.vaddr + seg.offset
        return None

    def relative_target(self, where: int) -> Optional[int]:
        """The addend of an R_*_RELATIVE relocation at ``where`` (a pointer filled at load time)."""
        for sec in self.sections():
            if sec.type != SHT_RELA or not sec.entsize:
                continue
            for k in range(sec.size // sec.entsize):
                r_offset, r_info, r_addend = self._unpack("QQq", sec.offset + k * sec.entsize)
                if r_offset == where and (r_info & 0xFFFFFFFF) in (R_X86_64_RELATIVE, R_AARCH64_RELATIVE):
                    return r_addend
        return None

    def c_string(self, vaddr: int) -> Optional[str]:
        """The NUL-terminated UTF-8 string loaded at ``vaddr`` (None: not in the file)."""
        off = self.file_offset(vaddr)
        if off is None:
            return None
        try:
            return self._string(off, "utf-8")
        except ElfError:
            return None


@contextlib.contextmanager
def open_elf(path: Union[str, os.PathLike[str]]) -> Iterator[ElfFile]:
    """Map ``path`` read-only and read it as ELF. OSError when it cannot be opened, ElfError when
    it is not a 64-bit ELF file (also for an empty one, which cannot be mapped)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < _HEADER_SIZE:
            raise ElfError("not a 64-bit ELF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            yield ElfFile(data)
