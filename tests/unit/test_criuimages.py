"""criuimages.py: CRIU's image files read into typed records, with one rule for each field's default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pycriu
import pytest

from npusnap_cli import criuimages
from tests.unit import criufake as fake


def _write(path: Path, magic: str, entries: list[dict[str, Any]]) -> None:
    with open(path, "wb") as f:
        pycriu.images.dump({"magic": magic, "entries": entries}, f)


def test_remaps_one_rule_for_old_and_new_images(tmp_path: Path) -> None:
    """A ghost is GHOST by remap_type or, in images older than remap_type, by the ghost bit of
    remap_id; anything else without remap_type is a link. Every reader gets the same answer."""
    _write(
        tmp_path / "remap-fpath.img",
        "REMAP_FPATH",
        [
            {"orig_id": 1, "remap_id": 7 | criuimages.REMAP_GHOST},
            {"orig_id": 2, "remap_id": 8},
            {"orig_id": 3, "remap_id": 9, "remap_type": "GHOST"},
            {"orig_id": 4, "remap_id": 10, "remap_type": "LINKED"},
        ],
    )
    got = criuimages.remaps(tmp_path)
    assert [(r.orig_id, r.remap_id, r.kind) for r in got] == [
        (1, 7, "GHOST"),
        (2, 8, "LINKED"),
        (3, 9, "GHOST"),
        (4, 10, "LINKED"),
    ]
    assert criuimages.remaps(tmp_path / "none") == []


def test_pstree_typed_and_damage_named(tmp_path: Path) -> None:
    assert criuimages.pstree(tmp_path) is None
    _write(tmp_path / "pstree.img", "PSTREE", [{"pid": 5, "ppid": 0, "pgid": 5, "sid": 5, "threads": [5, 6]}])
    assert criuimages.pstree(tmp_path) == [criuimages.TreeEntry(pid=5, ppid=0, pgid=5, sid=5, threads=(5, 6))]
    (tmp_path / "pstree.img").write_bytes(b"not an image at all")
    with pytest.raises(criuimages.Undecodable):
        criuimages.pstree(tmp_path)


def test_files_and_sockets(tmp_path: Path) -> None:
    criu = tmp_path / "criu"
    fake.unix_image(criu, [("/tmp/x.sock=00", 1, 10), ("/tmp/y.sock", 1, 1)])  # (name, type, state)
    socks = criuimages.unix_sockets(criu)
    assert [(s.id, s.name, s.listening_stream) for s in socks] == [
        (1, "/tmp/x.sock", True),
        (2, "/tmp/y.sock", False),
    ]
    assert criuimages.regular_files(criu) == {}
    assert criuimages.tcp_connections(criu) == []


def test_stats_absent_or_damaged_is_none(tmp_path: Path) -> None:
    assert criuimages.stats(tmp_path / "stats-dump") is None
    (tmp_path / "stats-dump").write_bytes(b"\0" * 8)
    assert criuimages.stats(tmp_path / "stats-dump") is None


def test_stopped_tasks_by_core_state(tmp_path: Path) -> None:
    tree = [{"pid": p, "ppid": 0 if p == 1 else 1, "pgid": 1, "sid": 1, "threads": [p]} for p in (1, 2, 3, 4)]
    fake.write(tmp_path / "pstree.img", "PSTREE", tree)
    fake.write(tmp_path / "core-1.img", "CORE", [fake.core(1)])
    fake.write(tmp_path / "core-2.img", "CORE", [fake.core(3, stop_signo=19)])
    fake.write(tmp_path / "core-3.img", "CORE", [fake.core(3)])  # an image older than stop_signo
    fake.write(tmp_path / "core-4.img", "CORE", [fake.core(2)])  # a zombie
    assert criuimages.stopped(tmp_path) == {2: 19, 3: 0}
    assert criuimages.stopped(tmp_path / "none") == {}
