"""criudetail.py: what `inspect` shows of CRIU's images, from images encoded as CRIU writes them."""

from __future__ import annotations

import socket
from pathlib import Path

from npusnap_cli.image import criudetail
from tests.unit import criufake as fake

V4 = [int.from_bytes(socket.inet_aton("10.0.0.1"), "little")]
V4_PEER = [int.from_bytes(socket.inet_aton("10.0.0.2"), "little")]
V6_BYTES = socket.inet_pton(socket.AF_INET6, "fd00::1")
V6 = [int.from_bytes(V6_BYTES[i : i + 4], "little") for i in range(0, 16, 4)]


def _image(criu: Path) -> None:
    fake.write(
        criu / "pstree.img",
        "PSTREE",
        [
            {"pid": 10, "ppid": 0, "pgid": 10, "sid": 10, "threads": [10, 11]},
            {"pid": 12, "ppid": 10, "pgid": 10, "sid": 10, "threads": [12]},
        ],
    )
    fake.write(criu / "ids-10.img", "IDS", [fake.ids(1, 1, mnt_ns_id=5)])
    fake.write(criu / "ids-12.img", "IDS", [fake.ids(2, 2)])
    tty = {"id": 100, "tty_info_id": 3, "flags": 0, "fown": fake.FOWN}
    pipe = {"id": 107, "pipe_id": 4242, "flags": 0, "fown": fake.FOWN}
    nl = {
        "id": 108, "ino": 5, "protocol": 0, "state": 0, "flags": 0, "portid": 0, "dst_portid": 0,
        "dst_group": 0, "fown": fake.FOWN, "opts": fake.SK_OPTS,
    }  # fmt: skip
    efd = {"id": 109, "flags": 0, "fown": fake.FOWN, "counter": 0}
    fake.write(
        criu / "files.img",
        "FILES",
        [
            {"type": "TTY", "id": 100, "tty": tty},
            fake.reg(101, "/var/log/job.log", pos=77),
            fake.reg(102, "/data/x.bin", pos=4096, size=8192),
            fake.usk(103, "/run/x.sock=00", ino=500),
            fake.usk(104, "", state=1, ino=501, peer=500),
            fake.usk(110, "=00abstract", type=2, state=7, ino=502),
            fake.isk(105, 2, V4, 4000, V4_PEER, 5000),
            fake.isk(106, 10, V6, 6000, [0, 0, 0, 0], 0, state=10),
            {"type": "PIPE", "id": 107, "pipe": pipe},
            {"type": "NETLINKSK", "id": 108, "nlsk": nl},
            {"type": "EVENTFD", "id": 109, "efd": efd},
        ],
    )
    fake.write(
        criu / "fdinfo-1.img",
        "FDINFO",
        [
            fake.fdinfo(100, 0, "TTY"),
            fake.fdinfo(101, 1, "REG"),
            fake.fdinfo(102, 3, "REG"),
            fake.fdinfo(103, 4, "UNIXSK"),
            fake.fdinfo(104, 5, "UNIXSK"),
            fake.fdinfo(110, 6, "UNIXSK"),
            fake.fdinfo(105, 7, "INETSK"),
            fake.fdinfo(106, 8, "INETSK"),
            fake.fdinfo(108, 9, "NETLINKSK"),
            fake.fdinfo(109, 10, "EVENTFD"),
            fake.fdinfo(999, 11, "REG"),
        ],
    )
    fake.write(criu / "fdinfo-2.img", "FDINFO", [fake.fdinfo(107, 0, "PIPE")])
    fake.write(
        criu / "mountpoints-5.img",
        "MNTS",
        [fake.mount(1, "/"), fake.mount(2, "/data", source="/dev/sdb", ext_key="data", fstype=3)],
    )


def test_describe_reads_every_kind_it_shows(tmp_path: Path) -> None:
    criu, stats = tmp_path / "criu", tmp_path / "logs"
    _image(criu)
    dump = {
        "freezing_time": 10, "frozen_time": 20, "memdump_time": 30, "memwrite_time": 40, "pages_scanned": 5,
        "pages_skipped_parent": 0, "pages_written": 3, "pages_lazy": 0, "page_pipes": 1,
    }  # fmt: skip
    fake.write(stats / "stats-dump", "STATS", [{"dump": dump}])
    got = criudetail.describe(criu, stats)
    assert got["processes"] == [
        {"pid": 10, "ppid": 0, "threads": [10, 11], "fds": 11},
        {"pid": 12, "ppid": 10, "threads": [12], "fds": 1},
    ]
    assert got["files"] == [
        {"pid": 10, "fd": 0, "type": "tty", "name": "tty index ?"},
        {"pid": 10, "fd": 1, "type": "file", "name": "/var/log/job.log", "pos": 77, "size": None},
        {"pid": 10, "fd": 3, "type": "file", "name": "/data/x.bin", "pos": 4096, "size": 8192},
        {"pid": 10, "fd": 10, "type": "eventfd", "name": "-"},
        {"pid": 10, "fd": 11, "type": "reg", "name": "-"},  # an fd whose file is not in files.img
        {"pid": 12, "fd": 0, "type": "pipe", "name": "pipe:[4242]"},
    ]
    unix = {"type": "socket", "family": "unix"}
    assert got["sockets"] == [
        {"pid": 10, "fd": 4, **unix, "socket_type": "stream", "name": "/run/x.sock", "state": "listening",
         "peer_inode": None},
        {"pid": 10, "fd": 5, **unix, "socket_type": "stream", "name": "(unnamed)", "state": "connected",
         "peer_inode": 500, "peer": "/run/x.sock"},
        {"pid": 10, "fd": 6, **unix, "socket_type": "dgram", "name": "(unnamed)", "state": "unconnected",
         "peer_inode": None},
        {"pid": 10, "fd": 7, "type": "socket", "family": "inet", "socket_type": "stream",
         "name": "10.0.0.1:4000 -> 10.0.0.2:5000", "state": "ESTABLISHED"},
        {"pid": 10, "fd": 8, "type": "socket", "family": "inet6", "socket_type": "stream",
         "name": "[fd00::1]:6000", "state": "LISTEN"},
        {"pid": 10, "fd": 9, "type": "socket", "family": "netlink", "socket_type": "-", "name": "-",
         "state": "-"},
    ]  # fmt: skip
    assert got["mounts"] == [
        {"mount_ns": 5, "mountpoint": "/", "fstype": 1, "source": "none", "root": "/", "external": False},
        {
            "mount_ns": 5,
            "mountpoint": "/data",
            "fstype": 3,
            "source": "/dev/sdb",
            "root": "/",
            "external": True,
        },
    ]
    page = criudetail.PAGE
    assert got["stats"] == {
        **dump, "bytes_scanned": 5 * page, "bytes_written": 3 * page, "bytes_skipped_parent": 0,
        "bytes_lazy": 0,
    }  # fmt: skip


def test_describe_shows_what_is_missing_or_damaged_as_nothing(tmp_path: Path) -> None:
    empty: dict[str, object] = {"processes": [], "files": [], "sockets": [], "mounts": [], "stats": None}
    assert criudetail.describe(tmp_path / "none") == empty
    (tmp_path / "pstree.img").write_bytes(b"not an image")
    assert criudetail.describe(tmp_path, tmp_path) == empty
    fake.write(tmp_path / "pstree.img", "PSTREE", [{"pid": 7, "ppid": 0, "pgid": 7, "sid": 7}])
    (tmp_path / "files.img").write_bytes(b"\0" * 12)
    assert criudetail.describe(tmp_path)["processes"] == [{"pid": 7, "ppid": 0, "threads": [], "fds": 0}]
