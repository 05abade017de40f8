"""Facts the code, docs and tools state in many places, checked where they are stated.

* The agent copies a job's device memory *after* Lock (native/agent/ops.c, devmem_save: the
  driver's copy, which the runtime's lock does not gate); text saying it is copied before Lock
  describes an order that no longer exists.
* npusnap's CRIU plugins live in its own directory (paths.CRIU_PLUGIN_INSTALL_DIR); CRIU's
  shared /usr/lib/criu belongs to the node's CRIU and its vendor's plugins, and setup never
  installs there.
"""

from __future__ import annotations

import re
from pathlib import Path

from npusnap_cli import paths

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("npusnap_cli", "npusnap_sim", "npusnap_workloads")
SOURCES = [REPO / d for d in (*PACKAGES, "docs", "bench", "native", "scripts")] + [REPO / "README.md"]
SUFFIXES = {".py", ".md", ".c", ".h", ".sh"}

STALE_COPY = re.compile(
    r"(cop(y|ies|ied)[^.\n]{0,60}before Lock|\(before Lock\) instead of|to host before Lock)", re.IGNORECASE
)
SHARED_AS_OURS = re.compile(r"install(s|ed)? (in)?to `?/usr/lib/criu`?(?! is)", re.IGNORECASE)


def _texts() -> list[tuple[Path, str]]:
    files: list[Path] = []
    for src in SOURCES:
        files += [src] if src.is_file() else [p for p in src.rglob("*") if p.suffix in SUFFIXES]
    return [(p, p.read_text(errors="replace")) for p in files if ".build" not in p.parts]


def test_nothing_says_device_memory_is_copied_before_lock() -> None:
    found = [f"{p.relative_to(REPO)}: {m.group(0)!r}" for p, t in _texts() for m in STALE_COPY.finditer(t)]
    assert not found, found


def test_nothing_installs_npusnaps_plugins_into_crius_shared_directory() -> None:
    assert paths.CRIU_PLUGIN_INSTALL_DIR == "/usr/lib/npusnap/criu-plugins"
    found = [
        f"{p.relative_to(REPO)}: {m.group(0)!r}" for p, t in _texts() for m in SHARED_AS_OURS.finditer(t)
    ]
    assert not found, found
