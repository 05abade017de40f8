"""The image layout, manifest round trip and validation, atomic publish and verify (no root)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode, ImageError, UsageError
from npusnap_cli.host import hostclean
from npusnap_cli.image import integrity, layout, publishing
from npusnap_cli.image.manifest import (
    ByteCounts,
    FileEntry,
    HostInfo,
    Manifest,
    ProcessEntry,
    Timings,
    Versions,
    load_manifest,
    now_iso,
)


def _manifest(files: tuple[FileEntry, ...] = ()) -> Manifest:
    return Manifest(
        created_at=now_iso(),
        versions=Versions(tool="0.1.0", criu="4.1.1", cann="9.1.0", cann_simulated=True, python="3.11"),
        host=HostInfo.current(),
        root_pid=1234,
        processes=(
            ProcessEntry(pid=1234, ppid=1, cmdline=("python3", "launch.py"), uid=0, agent=True),
            ProcessEntry(
                pid=1235,
                ppid=1234,
                cmdline=("python3", "worker.py"),
                uid=0,
                agent=True,
                npu=True,
                devices=(1,),
                device_bytes=4096,
                agent_socket="/run/npusnap/1235.sock",
            ),
        ),
        timings=Timings(lock_s=0.01, backup_s=0.2, criu_total_s=0.5, frozen_s=0.8, total_s=1.0),
        bytes=ByteCounts(device_bytes=4096, image_bytes=sum(f.size for f in files), criu_pages_bytes=3),
        criu_options={"tcp_established": False},
        files=files,
    )


def _build(tmp_path: Path, name: str = "img") -> tuple[Path, Path]:
    final = tmp_path / name
    tmp = layout.create_temp_image(final)
    (layout.criu_dir(tmp) / "pages-1.img").write_bytes(b"\x01" * 5000)
    (layout.criu_dir(tmp) / "core-1235.img").write_bytes(b"core")
    (layout.logs_dir(tmp) / layout.DUMP_LOG).write_text("log\n")
    return tmp, final


def test_manifest_round_trips_through_json() -> None:
    m = _manifest((FileEntry("criu/a.img", 3, "ab" * 32),))
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert [p.pid for p in again.npu_processes] == [1235]
    assert again.processes[1].devices == (1,)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.pop("versions"), "versions"),
        (lambda d: d.__setitem__("root_pid", "12"), "root_pid"),
        (lambda d: d["processes"][0].__setitem__("agent", 1), "agent"),
        (lambda d: d.__setitem__("schema", 99), "schema 99"),
        (lambda d: d["files"].append({"path": "../etc/passwd", "size": 1, "sha256": "x"}), "outside"),
    ],
)
def test_manifest_validation_names_the_problem(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    d = _manifest().to_dict()
    mutate(d)
    with pytest.raises(ImageError) as exc:
        Manifest.from_dict(d)
    assert needle in exc.value.message
    # Another schema is an intact image of another version (12); the rest are broken images (8).
    want = ExitCode.IMAGE_INCOMPATIBLE if needle == "schema 99" else ExitCode.IMAGE
    assert exc.value.exit_code == want


def test_publish_is_atomic_and_private(tmp_path: Path) -> None:
    tmp, final = _build(tmp_path)
    assert tmp.name.startswith(".img.npusnap-tmp-")
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o700
    files = publishing.file_entries(tmp)
    assert [f.path for f in files] == ["criu/core-1235.img", "criu/pages-1.img"]
    publishing.publish(tmp, final, _manifest(files))
    assert not tmp.exists()
    assert layout.temp_siblings(final) == []
    assert stat.S_IMODE(final.stat().st_mode) == 0o700
    assert stat.S_IMODE(layout.manifest_path(final).stat().st_mode) == 0o600
    result = integrity.verify(final)
    assert result.files_checked == 2
    assert result.bytes_checked == 5004


def test_publish_replaces_empty_dir_but_not_full_one_without_force(tmp_path: Path) -> None:
    tmp, final = _build(tmp_path)
    final.mkdir()
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    assert layout.manifest_path(final).exists()

    tmp2, _ = _build(tmp_path)
    with pytest.raises(UsageError):
        publishing.publish(tmp2, final, _manifest(publishing.file_entries(tmp2)))
    publishing.publish(tmp2, final, _manifest(publishing.file_entries(tmp2)), force=True)
    assert integrity.verify(final).files_checked == 2
    assert not any(layout.OLD_MARKER in p.name for p in tmp_path.iterdir())


def _published(tmp_path: Path) -> Path:
    tmp, final = _build(tmp_path)
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    return final


def test_verify_names_tampered_file(tmp_path: Path) -> None:
    final = _published(tmp_path)
    p = layout.criu_dir(final) / "pages-1.img"
    p.write_bytes(b"\x02" * 5000)  # same size, other bytes
    with pytest.raises(ImageError) as exc:
        integrity.verify(final)
    assert "criu/pages-1.img" in exc.value.message
    assert "does not match its blake3 checksum" in exc.value.message
    # Without checksums only the structure is checked, which is intact.
    assert integrity.verify(final, checksums=False).files_checked == 2


def test_images_with_sha256_digests_are_still_verified(tmp_path: Path) -> None:
    """Images made before BLAKE3 list sha256 digests: read, checked, and tampering named."""
    import hashlib

    tmp, final = _build(tmp_path)
    entries = tuple(
        FileEntry(e.path, e.size, hashlib.sha256((tmp / e.path).read_bytes()).hexdigest(), "sha256")
        for e in publishing.file_entries(tmp)
    )
    publishing.publish(tmp, final, _manifest(entries))
    listed = json.loads(layout.manifest_path(final).read_text())["files"]
    assert all(set(f) == {"path", "size", "sha256"} for f in listed)
    assert integrity.verify(final).files_checked == 2
    (layout.criu_dir(final) / "pages-1.img").write_bytes(b"\x02" * 5000)
    with pytest.raises(ImageError, match=r"pages-1\.img does not match its sha256 checksum"):
        integrity.verify(final)


@pytest.mark.parametrize(
    "entry",
    [
        {"path": "criu/a.img", "size": 1, "sha256": "0" * 64, "blake3": "0" * 64},
        {"path": "criu/a.img", "size": 1},
        {"path": "criu/a.img", "size": 1, "md5": "0" * 32},
        {"path": "criu/a.img", "size": 1, "blake3": 7},
    ],
)
def test_a_file_entry_needs_exactly_one_known_digest(entry: dict[str, object]) -> None:
    with pytest.raises(ImageError):
        FileEntry.from_dict(entry)


def test_verify_names_truncated_missing_and_extra_files(tmp_path: Path) -> None:
    final = _published(tmp_path)
    with open(layout.criu_dir(final) / "pages-1.img", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ImageError) as exc:
        integrity.verify(final, checksums=False)
    assert "criu/pages-1.img has 100 bytes" in exc.value.message

    final2 = _published(tmp_path / "b")
    (layout.criu_dir(final2) / "core-1235.img").unlink()
    (layout.criu_dir(final2) / "evil.img").write_bytes(b"x")
    with pytest.raises(ImageError) as exc:
        integrity.verify(final2)
    problems = exc.value.details["problems"]
    assert any("evil.img" in p for p in problems)
    assert any("core-1235.img is missing" in p for p in problems)


def test_logs_are_not_checksummed(tmp_path: Path) -> None:
    final = _published(tmp_path)
    (layout.logs_dir(final) / layout.RESTORE_LOG).write_text("restore happened\n")
    assert integrity.verify(final).files_checked == 2


def test_load_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="no image"):
        load_manifest(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageError, match="is missing"):
        load_manifest(tmp_path / "empty")
    final = _published(tmp_path / "t")
    text = layout.manifest_path(final).read_text()
    layout.manifest_path(final).write_text(text[: len(text) // 2])
    with pytest.raises(ImageError, match="not valid JSON"):
        load_manifest(final)


def test_check_dump_target(tmp_path: Path) -> None:
    layout.check_dump_target(tmp_path / "new" / "img", force=False)
    (tmp_path / "empty").mkdir()
    layout.check_dump_target(tmp_path / "empty", force=False)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        layout.check_dump_target(full, force=False)
    layout.check_dump_target(full, force=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        layout.check_dump_target(tmp_path / "file", force=True)


def test_save_failure_logs_moves_logs_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    (tmp_path / "t").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    tmp, final = _build(tmp_path)
    dest = hostclean.save_failure_logs(tmp, "dump")
    # Beside the image it was writing, named after it: where an operator looks.
    assert dest == layout.failed_logs_dir(final) == final.parent / f"{final.name}.failed-logs"
    assert dest is not None and (dest / layout.DUMP_LOG).read_text() == "log\n"
    layout.remove_tree(tmp)
    assert not tmp.exists()
    assert os.path.isdir(dest)
    assert not list((tmp_path / "t").iterdir())  # nothing node-wide
    # The next failure of the same image replaces them.
    tmp2 = layout.create_temp_image(final)
    (layout.logs_dir(tmp2) / layout.DUMP_LOG).write_text("second\n")
    assert hostclean.save_failure_logs(tmp2, "dump") == dest
    assert (dest / layout.DUMP_LOG).read_text() == "second\n"


def test_remove_stale_temps_only_of_dead_runs(tmp_path: Path) -> None:
    final = tmp_path / "img"
    mine = layout.create_temp_image(final)
    dead = tmp_path / f".img{layout.TMP_MARKER}999999999-abc"
    dead.mkdir()
    (dead / "x").write_text("x")
    done = {lo.path: lo.action for lo in layout.remove_stale_temps(final)}
    assert done == {dead: "removed", mine: "kept"}
    assert mine.exists() and not dead.exists()


def test_parallel_hashing_matches_the_libraries_and_reports_every_byte(tmp_path: Path) -> None:
    import hashlib

    import blake3

    from npusnap_cli.image import digest

    paths = []
    for i in range(5):
        p = tmp_path / f"pages-{i}.img"
        p.write_bytes(bytes([i]) * (300_000 + i))
        paths.append(p)
    seen: list[int] = []
    algos = ["blake3", "sha256", "blake3", "sha256", "blake3"]
    digests = digest.of_files(list(zip(paths, algos)), seen.append)
    want = {
        "blake3": lambda b: blake3.blake3(b).hexdigest(),
        "sha256": lambda b: hashlib.sha256(b).hexdigest(),
    }
    assert digests == [want[a](p.read_bytes()) for p, a in zip(paths, algos)]
    assert sum(seen) == sum(p.stat().st_size for p in paths)
