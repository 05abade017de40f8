"""The agent's device record, read from a process whose agent cannot answer.

A stopped process (SIGSTOP, a job-control stop) runs no code, its agent's included: asking it
whether it holds device state would wait until someone resumes it, and resuming it to ask would
be seen by the program (its parent's waitpid(WCONTINUED) reports it). The agent keeps the answer
where the kernel shows it without the process running: an exported variable of the agent
library (the contract's ``agent_record``) that counts the device-opening calls the process made
(set device, contexts, allocations, address reservations) since it began or was forked. npusnap
reads it through /proc/PID/mem, as a debugger reads a stopped process, at the library's load
address (/proc/PID/maps) plus the symbol's value (the library's own dynamic symbol table).

The record is the process's own memory, so it is as trustworthy as the agent's spoken answer:
it decides only about the process's own device state. Only a preloaded agent sees the process's
device calls; the record says whether it was. npusnap acts on one answer only: "this
process never opened a device" (its record counts none, or is still its parent's: a copy that
opened nothing since), and only when /proc agrees (no device file open, no device memory
mapped: host/devmaps.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from npusnap_cli import contract, elf
from npusnap_cli.host import devmaps, procfs

PT_LOAD = elf.PT_LOAD


@dataclass(frozen=True)
class AgentRecord:
    # The process the record describes: another pid means a copy (fork, clone) that made no
    # device-opening call since it was made (each such call claims the record first).
    pid: int
    opened: int  # device-opening calls since then (never decremented)
    # The agent was preloaded, so the process's device calls pass its wrappers: without that
    # (attached, or started from Python without LD_PRELOAD) ``opened`` counts nothing.
    tracking: bool = True


def agent_mapping(pid: int) -> Optional[tuple[int, int, str]]:
    """(start, end, path) of the agent library's mapping at file offset 0 in ``pid``."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or int(parts[2], 16) != 0:
                    continue
                path = parts[5].strip()
                if path.endswith("/" + contract.AGENT_LIBRARY):
                    lo, _, hi = parts[0].partition("-")
                    return int(lo, 16), int(hi, 16), path
    except (OSError, ValueError):
        return None
    return None


def _symbol_offset(pid: int, start: int, end: int, path: str) -> Optional[int]:
    """The record's offset from the mapping's start: its symbol's value less the first PT_LOAD's
    page-aligned address. Read from the mapped file itself (map_files), which is the library the
    process loaded even if the path now names another file or lies in another mount namespace."""
    for candidate in (f"/proc/{pid}/map_files/{start:x}-{end:x}", f"/proc/{pid}/root{path}"):
        try:
            with elf.open_elf(candidate) as lib:
                sym = lib.symbol(contract.AGENT_RECORD_SYMBOL)
                loads = [s.vaddr for s in lib.segments() if s.type == PT_LOAD]
        except (OSError, elf.ElfError):
            continue
        if sym is None or sym.size < contract.AGENT_RECORD_SIZE or not loads:
            return None
        return sym.value - (min(loads) & ~(os.sysconf("SC_PAGE_SIZE") - 1))
    return None


def read(pid: int) -> Optional[AgentRecord]:
    """The agent's record in ``pid``; None when no agent library is mapped, it has no record (an
    older agent), its constructor has not filled it in yet (no process is pid 0, in any
    namespace), or its memory cannot be read (privileges: the same as CRIU's)."""
    found = agent_mapping(pid)
    if found is None:
        return None
    start, end, path = found
    offset = _symbol_offset(pid, start, end, path)
    if offset is None:
        return None
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.pread(fd, contract.AGENT_RECORD_SIZE, start + offset)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != contract.AGENT_RECORD_SIZE:
        return None
    magic, rec_pid, opened, tracking, _ = contract.AGENT_RECORD.unpack(raw)
    if magic.rstrip(b"\0") != contract.AGENT_RECORD_MAGIC or rec_pid == 0:
        return None
    return AgentRecord(pid=rec_pid, opened=opened, tracking=bool(tracking))


def never_opened_a_device(pid: int) -> bool:
    """Whether ``pid`` holds no device state by every sign a node offers: its agent's record
    (describing this very process) counts no device-opening call, and /proc shows no device file
    open and no device memory mapped. Anything unreadable answers False."""
    rec = read(pid)
    inner = procfs.ns_pids(pid)  # getpid() in the process: its pid in its own pid namespace
    if rec is None or not inner or not rec.tracking:
        return False
    # Another pid's record: a copy (fork, clone) that made no device-opening call since, and so
    # owns no device, whatever its parent had opened (native/agent/devmem.c).
    if rec.pid == inner[-1] and rec.opened != 0:
        return False
    dm = devmaps.device_memory(pid)
    return dm is not None and not dm.present and devmaps.device_files(pid) == []
