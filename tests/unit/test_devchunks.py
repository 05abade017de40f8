"""The device-memory chunk layout (npusnap_cli/image/devchunks.py): how a stream is cut, what an
index accepts, and how chunks are shared by hard links between the images of one user."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from npusnap_cli import contract
from npusnap_cli.errors import ImageError
from npusnap_cli.image import devchunks, digest

MiB = 1 << 20


def stream(*sizes: int) -> bytes:
    """An agent's stream of allocations of these sizes (at made-up addresses), each byte its
    allocation's index."""
    hdr = contract.DEVMEM_FILE_HEADER.pack(contract.DEVMEM_FILE_MAGIC, len(sizes), sum(sizes))
    recs = b"".join(
        contract.DEVMEM_FILE_RECORD.pack(0x1000_0000 * (i + 1), n, 0, 0) for i, n in enumerate(sizes)
    )
    return hdr + recs + b"".join(bytes([i]) * n for i, n in enumerate(sizes))


def test_each_allocation_is_cut_from_its_own_start() -> None:
    data = stream(MiB + 5, 3, 2 * MiB)
    meta = contract.DEVMEM_FILE_HEADER.size + 3 * contract.DEVMEM_FILE_RECORD.size
    pieces = devchunks.cut(memoryview(data))
    assert pieces == [
        (0, meta),
        (meta, MiB),
        (meta + MiB, 5),
        (meta + MiB + 5, 3),
        (meta + MiB + 8, MiB),
        (meta + 2 * MiB + 8, MiB),
    ]
    assert devchunks.records(memoryview(data)) == [
        (0x1000_0000, MiB + 5, 0),
        (0x2000_0000, 3, 0),
        (0x3000_0000, 2 * MiB, 0),
    ]


@pytest.mark.parametrize("damage", ["short", "magic", "length"])
def test_a_stream_that_does_not_add_up_is_refused(damage: str) -> None:
    data = bytearray(stream(10, 20))
    if damage == "short":
        data = data[:10]
    elif damage == "magic":
        data[0] ^= 1
    else:
        data += b"x"
    with pytest.raises(ImageError):
        devchunks.cut(memoryview(bytes(data)))


def test_an_index_reads_back_and_refuses_what_it_did_not_write() -> None:
    index = devchunks.Index((("a" * 64, 10), ("b" * 64, MiB)))
    assert devchunks.Index.from_bytes(index.to_bytes(), "x") == index
    good = json.loads(index.to_bytes())
    for bad in (
        {**good, "format": "other"},
        {**good, "version": 99},
        {**good, "bytes": 1},
        {**good, "pieces": [["../../etc/passwd", 1]]},
        {**good, "pieces": [["a" * 64, -1]]},
        {**good, "algo": "md5"},
    ):
        with pytest.raises(ImageError):
            devchunks.Index.from_bytes(json.dumps(bad).encode(), "x")


def test_the_index_is_read_only_when_its_digest_matches(tmp_path: Path) -> None:
    data = devchunks.Index((("c" * 64, 4),)).to_bytes()
    rel = devchunks.index_rel(7)
    (tmp_path / "device").mkdir()
    (tmp_path / rel).write_bytes(data)
    h = digest.new()
    h.update(data)
    assert devchunks.read_index(tmp_path, rel, h.hexdigest(), "blake3").size == 4
    with pytest.raises(ImageError, match="checksum"):
        devchunks.read_index(tmp_path, rel, "0" * 64, "blake3")


def _image_with_chunk(root: Path, name: str, value: str, data: bytes, mode: int = 0o400) -> Path:
    image = root / name
    (image / "device" / "chunks").mkdir(parents=True, mode=0o700)
    for d in (image, image / "device", image / "device" / "chunks"):
        d.chmod(0o700)
    (image / "npusnap.json").write_text("{}")
    chunk = image / "device" / "chunks" / value
    chunk.write_bytes(data)
    chunk.chmod(mode)
    return image


def test_a_chunk_is_linked_only_from_a_read_only_file_of_this_user(tmp_path: Path) -> None:
    data = b"z" * 100
    value = "d" * 64
    root = tmp_path / "images"
    root.mkdir(mode=0o700)
    _image_with_chunk(root, "old", value, data)
    _image_with_chunk(root, "writable", "e" * 64, data, mode=0o600)
    work = tmp_path / "work"
    work.mkdir()
    dfd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sharing = devchunks.Sharing(root / "new")
        assert sharing.link(value, 100, dfd)
        assert os.stat(work / value).st_ino == os.stat(root / "old" / "device" / "chunks" / value).st_ino
        assert not sharing.link(value[:-1] + "0", 100, dfd)  # none there
        assert not sharing.link("e" * 64, 100, dfd)  # writable: could change under the image
        assert not devchunks.Sharing(root / "new").link(value, 99, os.open(tmp_path, os.O_RDONLY))  # size
    finally:
        os.close(dfd)


def test_incremental_bits_name_pieces_in_stream_order() -> None:
    base = devchunks.BaseSave(Path("/x"), "1", {})
    inc = devchunks.Incremental(base, bytes([0b00000101, 0b1]))
    assert [inc.left_out(k) for k in range(10)] == [
        True,
        False,
        True,
        False,
        False,
        False,
        False,
        False,
        True,
        False,
    ]
    assert not inc.left_out(100)
