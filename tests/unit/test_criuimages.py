"""criuimages.py: CRIU's image files read into typed records, with one rule for each field's default."""

from __future__ import annotations

import socket
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
    assert [(s.id, s.name, s.path, s.listening_stream) for s in socks] == [
        (1, b"/tmp/x.sock\0", "/tmp/x.sock", True),
        (2, b"/tmp/y.sock", "/tmp/y.sock", False),
    ]
    assert criuimages.regular_files(criu) == {}
    assert criuimages.tcp_connections(criu) == []


def test_every_kind_of_file_typed(tmp_path: Path) -> None:
    v4 = [int.from_bytes(socket.inet_aton(a), "little") for a in ("10.0.0.1", "10.0.0.2")]
    pipe = {"id": 5, "pipe_id": 77, "flags": 0, "fown": fake.FOWN}
    fake.write(
        tmp_path / "files.img",
        "FILES",
        [
            fake.reg(1, "/var/log/a.log", pos=9),
            fake.reg(2, "/data/b", pos=1, size=0),
            fake.isk(3, socket.AF_INET, v4[:1], 4000, v4[1:], 5000),
            fake.isk(4, socket.AF_INET, v4[:1], 4001, [0], 0, state=criuimages.TCP_LISTEN),
            {"type": "PIPE", "id": 5, "pipe": pipe},
            {"type": "REG", "id": 6},  # no reg: an image older than files.img's reg
        ],
    )
    got = criuimages.files(tmp_path)
    assert [f.type for f in got] == ["REG", "REG", "INETSK", "INETSK", "PIPE", "REG"]
    # size: None where CRIU did not record it (has_size), 0 where it recorded 0
    assert got[0].reg == criuimages.RegFile(name="/var/log/a.log", pos=9, size=None, flags=0o2)
    assert got[1].reg is not None and got[1].reg.size == 0
    assert got[2].isk is not None and got[2].isk.src_addr == tuple(v4[:1]) and got[2].isk.dst_port == 5000
    assert got[4].pipe_id == 77 and got[4].reg is None and got[4].usk is None
    assert got[5].reg is None
    assert criuimages.regular_files(tmp_path) == {1: "/var/log/a.log", 2: "/data/b"}
    assert criuimages.tcp_connections(tmp_path) == [
        criuimages.TcpConnection("10.0.0.1", 4000, "10.0.0.2", 5000)
    ]


def test_task_ids_fdinfo_and_mounts_with_protobuf_defaults(tmp_path: Path) -> None:
    assert criuimages.ids(tmp_path, 1) is None
    fake.write(tmp_path / "ids-1.img", "IDS", [fake.ids(1, 3)])
    assert criuimages.ids(tmp_path, 1) == criuimages.TaskIds(files_id=3, mnt_ns_id=0)
    fake.write(tmp_path / "ids-2.img", "IDS", [fake.ids(1, 3, mnt_ns_id=9)])
    assert criuimages.ids(tmp_path, 2) == criuimages.TaskIds(files_id=3, mnt_ns_id=9)
    fake.write(tmp_path / "fdinfo-3.img", "FDINFO", [fake.fdinfo(1, 0, "TTY"), fake.fdinfo(2, 1, "REG")])
    assert criuimages.fdinfo(tmp_path, 3) == [
        criuimages.Fdinfo(fd=0, id=1, type="TTY", flags=0),
        criuimages.Fdinfo(fd=1, id=2, type="REG", flags=0),
    ]
    with pytest.raises(FileNotFoundError):
        criuimages.fdinfo(tmp_path, 4)
    fake.write(tmp_path / "mountpoints-9.img", "MNTS", [fake.mount(1, "/"), fake.mount(2, "/d", ext_key="k")])
    got = criuimages.mounts(tmp_path, 9)
    assert [(m.mnt_id, m.mountpoint, m.ext_key, m.ext_mount) for m in got] == [
        (1, "/", "", False),
        (2, "/d", "k", False),
    ]


def test_core_is_the_task_state(tmp_path: Path) -> None:
    assert criuimages.core(tmp_path, 1) is None
    fake.write(tmp_path / "core-1.img", "CORE", [fake.core(criuimages.TASK_DEAD, exit_code=3)])
    assert criuimages.core(tmp_path, 1) == criuimages.TaskCore(
        state=criuimages.TASK_DEAD, exit_code=3, stop_signo=0
    )


def test_damage_wrong_kind_and_missing_fields_are_undecodable(tmp_path: Path) -> None:
    fake.write(tmp_path / "pstree.img", "PSTREE", [{"pid": 5, "ppid": 0, "pgid": 5, "sid": 5}])
    whole = (tmp_path / "pstree.img").read_bytes()
    (tmp_path / "files.img").write_bytes(whole)  # a pstree where files.img should be
    with pytest.raises(criuimages.Undecodable, match="not a FILES image"):
        criuimages.files(tmp_path)
    (tmp_path / "pstree.img").write_bytes(whole[:-1])
    with pytest.raises(criuimages.Undecodable, match="truncated"):
        criuimages.pstree(tmp_path)
    # an entry without the ppid, pgid and sid CRIU's .proto requires: refused as CRIU refuses it
    (tmp_path / "pstree.img").write_bytes(whole[:8] + b"\x02\x00\x00\x00\x08\x05")
    with pytest.raises(criuimages.Undecodable, match="ppid"):
        criuimages.pstree(tmp_path)
    (tmp_path / "pstree.img").write_bytes(whole[:8])
    assert criuimages.pstree(tmp_path) == []


def test_renaming_unix_sockets_keeps_every_other_entry(tmp_path: Path) -> None:
    criu = tmp_path / "criu"
    fake.unix_image(criu, [("/run/a.sock=00", 1, 10), ("/run/b.sock", 1, 10)])
    criuimages.rename_unix_sockets(
        criu, tmp_path / "files.img", lambda n: b"/run/c.sock\0" if b"a" in n else None
    )
    assert [s.name for s in criuimages.unix_sockets(tmp_path)] == [b"/run/c.sock\0", b"/run/b.sock"]
    before, after = (criuimages._read(d / "files.img", "FILES") for d in (criu, tmp_path))
    assert after.head == before.head and after.entries[1][0] == before.entries[1][0]  # byte for byte
    original = (criu / "files.img").read_bytes()
    criuimages.rename_unix_sockets(criu, tmp_path / "same.img", lambda n: None)
    assert (tmp_path / "same.img").read_bytes() == original


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


def test_stats_of_a_dump(tmp_path: Path) -> None:
    dump = {
        "freezing_time": 1, "frozen_time": 2, "memdump_time": 3, "memwrite_time": 4, "pages_scanned": 5,
        "pages_skipped_parent": 6, "pages_written": 7, "pages_lazy": 0,
    }  # fmt: skip
    fake.write(tmp_path / "stats-dump", "STATS", [{"dump": dump}])
    assert criuimages.stats(tmp_path / "stats-dump") == dump  # what the image records, no more
