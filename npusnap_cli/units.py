"""Quantities written for people: the one spelling of a byte count in messages and tables.

In the foundation floor (standard library only): core modules put sizes into their error
messages, and the command line renders the same sizes in tables.
"""

from __future__ import annotations

from typing import Optional


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
