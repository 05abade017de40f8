"""streamhash: digests computed while a writer appends equal the digests of the finished files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import blake3
import pytest

from npusnap_cli.image import layout, publishing
from npusnap_cli.image.streamhash import FileHasher, StreamHasher, WritebackFollower, reserve


def test_digests_follow_a_writer_and_match_the_files(tmp_path: Path) -> None:
    root = tmp_path / "criu"
    root.mkdir()
    hasher = StreamHasher(root, interval_s=0.001).start()

    def writer() -> None:
        for name, chunks in (("pages-1.img", 40), ("core-1.img", 1), ("sub/x.img", 3)):
            path = root / name
            path.parent.mkdir(exist_ok=True)
            with open(path, "ab") as f:
                for i in range(chunks):
                    f.write(os.urandom(256 * 1024 + i))
                    f.flush()
                    time.sleep(0.001)

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    got = hasher.finish()
    for rel in ("pages-1.img", "core-1.img", "sub/x.img"):
        data = (root / rel).read_bytes()
        assert got[rel] == (len(data), blake3.blake3(data).hexdigest())


def test_a_truncated_file_is_not_vouched_for_and_file_entries_rehashes_it(tmp_path: Path) -> None:
    img = tmp_path / "img"
    layout.criu_dir(img).mkdir(parents=True)
    f = layout.criu_dir(img) / "pages-1.img"
    f.write_bytes(b"a" * 100000)
    hasher = StreamHasher(layout.criu_dir(img), interval_s=0.001).start()
    time.sleep(0.05)
    f.write_bytes(b"b" * 10)  # shrank: the follower's digest no longer describes it
    got = hasher.finish()
    assert "pages-1.img" not in got
    entries = publishing.file_entries(img, known={f"criu/{k}": v for k, v in got.items()})
    assert (entries[0].algo, entries[0].digest) == ("blake3", blake3.blake3(b"b" * 10).hexdigest())


def test_file_entries_trusts_only_known_digests_whose_size_matches(tmp_path: Path) -> None:
    img = tmp_path / "img"
    layout.criu_dir(img).mkdir(parents=True)
    (layout.criu_dir(img) / "a.img").write_bytes(b"hello")
    wrong = {"criu/a.img": (4, "0" * 64)}  # stale size: recomputed
    (entry,) = publishing.file_entries(img, known=wrong)
    assert entry.digest == blake3.blake3(b"hello").hexdigest()


def test_files_written_in_any_order_are_hashed_once_written(tmp_path: Path) -> None:
    """The agents write device-memory files a chunk at a time at its place, on several threads:
    the writeback follower only starts the disk on them, the file hasher hashes them whole and its
    digests are the files' own."""
    root = tmp_path / "device"
    root.mkdir()
    follower = WritebackFollower(root, interval_s=0.001).start()
    chunks = [os.urandom(1 << 20) for _ in range(8)]
    fd = os.open(root / "devmem-1.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    reserve(fd, 8 << 20)
    assert os.fstat(fd).st_size == 0  # reserved, not grown
    for i in (7, 0, 3, 5, 1, 6, 2, 4):  # out of order
        os.pwrite(fd, chunks[i], i << 20)
        time.sleep(0.002)
    os.close(fd)
    follower.stop()
    got = FileHasher(root).start().finish()
    assert got == {"devmem-1.bin": (8 << 20, blake3.blake3(b"".join(chunks)).hexdigest())}


def test_a_boost_midway_hashes_on_every_core_and_the_digests_stay_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once CRIU is done the file hasher hashes on every core: the file it is in (still early in
    it) again from the start, the next ones from their start; the digests are the files' own."""
    from npusnap_cli.image import digest, streamhash

    root = tmp_path / "device"
    root.mkdir()
    data = {f"devmem-{i}.bin": os.urandom((8 << 20) + i) for i in (1, 2)}
    for name, content in data.items():
        (root / name).write_bytes(content)
    monkeypatch.setattr(streamhash, "_ROUND", 1 << 20)
    made: list[int] = []
    real_new, real_update = digest.new, digest.update_mapped
    monkeypatch.setattr(
        digest, "new", lambda algo=digest.DEFAULT, threads=1: made.append(threads) or real_new(algo, threads)
    )
    hasher = FileHasher(root)

    def update(*args: object) -> None:
        real_update(*args)  # type: ignore[arg-type]
        hasher.boost()  # after the first MiB of the first file

    monkeypatch.setattr(digest, "update_mapped", update)
    got = hasher.start().finish()
    assert got == {n: (len(c), blake3.blake3(c).hexdigest()) for n, c in data.items()}
    cores = digest.usable_cores()
    assert made == ([1, cores, cores] if cores > 1 else [1, 1])


def test_reserve_says_when_the_disk_is_full(tmp_path: Path) -> None:
    import errno
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        fd = os.open(small / "f", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError) as info:
                reserve(fd, 8 << 20)
            assert info.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
