"""Image management without root or CRIU: list, rotation, `latest`, export/import archives."""

from __future__ import annotations

import dataclasses
import json
import os
import tarfile
from pathlib import Path

import pytest
import zstandard

from npusnap_cli.cli import main
from npusnap_cli.errors import ExitCode, ImageError, UsageError
from npusnap_cli.image import archive, imagestore, integrity, layout, publishing
from tests.unit.test_image import _build, _manifest


def _image(parent: Path, name: str, created_at: str) -> Path:
    tmp, final = _build(parent, name)
    m = dataclasses.replace(_manifest(publishing.file_entries(tmp)), created_at=created_at)
    publishing.publish(tmp, final, m)
    return final


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Four images, oldest first, each noted as this user's own as `npusnap dump` notes them."""
    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path / "state"))
    parent = tmp_path / "snaps"
    parent.mkdir()
    for i in range(4):
        assert imagestore.record_own(_image(parent, f"snap-{i}", f"2026-11-30T10:0{i}:00+00:00"))
    return parent


def test_list_is_newest_first_and_marks_corrupt_images(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (layout.criu_dir(store / "snap-3") / "core-1235.img").write_bytes(b"CORE")  # same size, other bytes
    (store / "notes.txt").write_text("not an image")
    (store / "empty-dir").mkdir()
    assert main(["--json", "list", "--checksums", str(store)]) == 0
    images = json.loads(capsys.readouterr().out)["result"]["images"]
    assert [Path(i["path"]).name for i in images] == ["snap-3", "snap-2", "snap-1", "snap-0"]
    assert [i["valid"] for i in images] == [False, True, True, True]
    assert "blake3 checksum" in images[0]["problem"] and images[1]["pids"] == [1234, 1235]
    # By default (and with --quick, kept as an alias) nothing is hashed: the edit keeps the size, so it
    # passes, and says so ("checked": sizes); --valid --paths for scripts.
    for argv in (["--json", "list", str(store)], ["--json", "list", "--quick", str(store)]):
        assert main(argv) == 0
        listed = json.loads(capsys.readouterr().out)["result"]["images"]
        assert all(i["valid"] and i["checked"] != "checksums" for i in listed)
    assert main(["list", "-c", "--valid", "--paths", str(store)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == str(store / "snap-2")
    # Human output: the table on stdout, paths whole even in 80 columns.
    os.environ["COLUMNS"] = "80"
    try:
        assert main(["list", "--checksums", str(store)]) == 0
    finally:
        del os.environ["COLUMNS"]
    table = capsys.readouterr().out
    assert "NO:" in table and "…" not in table


def test_list_of_a_missing_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--json", "list", str(tmp_path / "nope")]) == ExitCode.USAGE
    assert json.loads(capsys.readouterr().out)["error"]["kind"] == "usage"


def test_rotation_removes_only_the_oldest_complete_images(store: Path) -> None:
    (store / "notes.txt").write_text("keep me")
    not_image = store / "data"
    not_image.mkdir()
    (not_image / "npusnap.json").write_text("{ not json")  # looks like one, is not: never touched
    work_area = store / ".snap-9.npusnap-tmp-1-x"
    work_area.mkdir()
    layout.manifest_path(work_area).write_text(layout.manifest_path(store / "snap-0").read_text())
    removed = imagestore.rotate(store, 2, keep=store / "snap-0")
    # snap-0 is the one just written (kept whatever its time says); of the rest the newest one stays.
    assert sorted(Path(p).name for p in removed) == ["snap-1", "snap-2"]
    assert sorted(p.name for p in store.iterdir()) == sorted(
        ["snap-0", "snap-3", "notes.txt", "data", ".snap-9.npusnap-tmp-1-x"]
    )
    with pytest.raises(UsageError):
        imagestore.rotate(store, 0)


def test_rotation_never_removes_what_it_cannot_prove_is_its_own(store: Path, tmp_path: Path) -> None:
    """Forged images dated in the future beside ours (another user's, in a shared directory) do
    not make ours look old, and are never removed; neither is an image we did not record, nor
    one of ours swapped for another directory of the same name."""
    for i in range(3):
        _image(store, f"forged-{i}", "2099-01-01T00:00:00+00:00")
    unrecorded = _image(store, "copied-in", "2026-11-30T10:05:00+00:00")
    (store / "snap-1").rename(tmp_path / "away")
    _image(store, "snap-1", "2026-11-30T10:01:00+00:00")  # same name, not the recorded directory
    removed = imagestore.rotate(store, 2)
    assert sorted(Path(p).name for p in removed) == ["snap-0"]
    left = sorted(p.name for p in store.iterdir())
    assert left == sorted(["snap-1", "snap-2", "snap-3", "forged-0", "forged-1", "forged-2", unrecorded.name])
    # The record follows what is left: the removed and the swapped images are no longer in it.
    records = (tmp_path / "state" / imagestore.OWN_IMAGES).read_text().splitlines()
    assert sorted(Path(json.loads(r)["path"]).name for r in records) == ["snap-2", "snap-3"]


def test_rotation_removes_nothing_when_the_record_is_not_private(store: Path, tmp_path: Path) -> None:
    os.chmod(tmp_path / "state", 0o777)  # anyone could have added lines naming any directory
    assert imagestore.rotate(store, 1) == []
    assert len([p for p in store.iterdir() if p.name.startswith("snap-")]) == 4


def test_latest_is_a_symlink_replaced_atomically_and_rotation_spares_it(store: Path) -> None:
    link = imagestore.update_latest(store / "snap-0")
    assert os.readlink(link) == "snap-0"  # relative: the directory can move
    assert imagestore.rotate(store, 1) == [str(store / "snap-2"), str(store / "snap-1")]
    assert (store / "snap-0").is_dir() and (store / "snap-3").is_dir()
    imagestore.update_latest(store / "snap-3")
    assert os.readlink(store / "latest") == "snap-3"
    assert not [p for p in store.iterdir() if "tmp" in p.name]
    (store / "latest").unlink()
    (store / "latest").mkdir()
    with pytest.raises(UsageError):
        imagestore.update_latest(store / "snap-3")


def test_export_import_round_trip(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = store / "snap-1"
    dest = tmp_path / "snap-1.tar.zst"
    assert main(["export", str(src), str(dest)]) == 0
    assert capsys.readouterr().out.strip() == str(dest)  # the archive's path is the data
    assert archive.is_archive(dest) and (dest.stat().st_mode & 0o777) == 0o600
    with (
        open(dest, "rb") as fh,
        zstandard.ZstdDecompressor().stream_reader(fh) as zr,
        tarfile.open(fileobj=zr, mode="r|") as tar,
    ):
        names = [m.name for m in tar]
    assert names[0] == "snap-1/npusnap.json" and not any("logs" in n for n in names)

    # inspect and verify read the archive in place.
    assert main(["--json", "inspect", str(dest)]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["root_pid"] == 1234
    assert main(["--json", "verify", str(dest)]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["files_checked"] == 2

    out = tmp_path / "imported" / "img"
    out.parent.mkdir()
    assert main(["import", str(dest), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert integrity.verify(out).files_checked == 2
    assert layout.manifest_path(out).read_bytes() == layout.manifest_path(src).read_bytes()
    assert (out.stat().st_mode & 0o777) == 0o700
    assert main(["import", str(dest), str(out)]) == ExitCode.USAGE  # never overwrites
    capsys.readouterr()


def test_a_corrupt_image_is_never_exported(store: Path, tmp_path: Path) -> None:
    (layout.criu_dir(store / "snap-1") / "core-1235.img").write_bytes(b"CORE")
    dest = tmp_path / "x.tar.zst"
    with pytest.raises(ImageError, match="blake3 checksum"):
        archive.export(store / "snap-1", dest)
    assert not dest.exists() and not list(tmp_path.glob(".x.tar.zst*"))


def _tar_zst(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    import io

    with (
        open(path, "wb") as fh,
        zstandard.ZstdCompressor().stream_writer(fh) as zw,
        tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
    ):
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


def test_import_refuses_unsafe_or_tampered_archives(store: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.tar.zst"
    archive.export(store / "snap-1", good)
    manifest = layout.manifest_path(store / "snap-1").read_bytes()

    evil = tmp_path / "evil.tar.zst"
    link = tarfile.TarInfo("snap-1/criu/pages-1.img")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    _tar_zst(evil, [(tarfile.TarInfo("snap-1/npusnap.json"), manifest), (link, b"")])
    with pytest.raises(ImageError, match="not a regular file"):
        archive.import_archive(evil, tmp_path / "e1")

    escape = tmp_path / "escape.tar.zst"
    _tar_zst(escape, [(tarfile.TarInfo("snap-1/npusnap.json"), manifest), (tarfile.TarInfo("../x"), b"x")])
    with pytest.raises(ImageError, match="unsafe path"):
        archive.import_archive(escape, tmp_path / "e2")

    tampered = tmp_path / "tampered.tar.zst"
    _tar_zst(
        tampered,
        [
            (tarfile.TarInfo("snap-1/npusnap.json"), manifest),
            (tarfile.TarInfo("snap-1/criu/core-1235.img"), b"CORE"),
            (tarfile.TarInfo("snap-1/criu/pages-1.img"), b"\x01" * 5000),
        ],
    )
    with pytest.raises(ImageError, match="blake3 checksum"):
        archive.verify(tampered)
    with pytest.raises(ImageError, match="blake3 checksum"):
        archive.import_archive(tampered, tmp_path / "e3")
    # Nothing half-imported is left behind, under the final name or a temporary one.
    left = {p.name for p in tmp_path.iterdir()} - {
        "snaps",
        "state",
        "good.tar.zst",
        "evil.tar.zst",
        "escape.tar.zst",
    }
    assert left == {"tampered.tar.zst"}

    truncated = tmp_path / "truncated.tar.zst"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ImageError):
        archive.verify(truncated)


def test_a_reader_that_stops_reading_is_not_a_failure(store: Path) -> None:
    """`npusnap list --paths DIR | head -n 1` under `set -o pipefail`: the reader leaves early."""
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "npusnap"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{exe} list --paths {store} | true; echo rc=$?"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "rc=0", proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


def test_export_without_compression_is_a_plain_tar_every_command_reads(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = store / "snap-1"
    assert main(["export", str(src), "--compress", "none"]) == 0
    dest = Path(capsys.readouterr().out.strip())
    assert dest == store / "snap-1.tar"  # the default name says what it is
    with tarfile.open(dest, mode="r:") as tar:  # no compressor needed to read it
        assert tar.getnames()[0] == "snap-1/npusnap.json"
    assert main(["--json", "verify", str(dest)]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["files_checked"] == 2
    out = tmp_path / "imported"
    assert main(["import", str(dest), str(out)]) == 0
    capsys.readouterr()
    assert integrity.verify(out).files_checked == 2
    # A level is zstd's: refused with none, taken with zstd.
    assert (
        main(["export", str(src), str(tmp_path / "x.tar"), "--compress", "none", "--level", "9"])
        == ExitCode.USAGE
    )
    assert main(["export", str(src), str(tmp_path / "x.tar"), "--compress", "gzip"]) == ExitCode.USAGE
    assert main(["export", str(src), str(tmp_path / "y.tar.zst"), "--level", "19"]) == 0
    assert archive.is_archive(tmp_path / "y.tar.zst")
    # Another tool's tar (not an image's) is not taken for an npusnap archive.
    other = tmp_path / "other.tar"
    with tarfile.open(other, mode="w") as tar:
        tar.add(str(src / "npusnap.json"), arcname="config.dump")
    assert not archive.is_archive(other)
