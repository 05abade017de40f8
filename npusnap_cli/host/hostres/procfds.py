"""What /proc says of the processes' descriptors, for every kind of host resource here."""

from __future__ import annotations

import os


def _fd_links(pid: int) -> dict[int, str]:
    out: dict[int, str] = {}
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(f"{base}/{name}")
        except (OSError, ValueError):
            continue
    return out


def _all_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"
