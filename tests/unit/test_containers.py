"""npusnap_cli.image.containers: reading and verifying checkpoints written through the CRIU plugin, in
each form (images directory, container directory, archive), and every kind of damage."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode, ImageError
from npusnap_cli.image import containers

FILES = {"inventory.img": b"inv", "pages-1.img": b"\x00" * 70000, "pstree.img": b"tree"}


def make_images(d: Path, *, files: dict[str, bytes] = FILES) -> dict[str, object]:
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "dump.log").write_text("npusnap-plugin: ... (logs are not covered)\n")
    state: dict[str, object] = {
        "format": 1,
        "kind": "npusnap-criu-plugin",
        "plugin": "npusnap_plugin",
        "created": "2026-11-30T20:00:00Z",
        "hostname": "node1",
        "criu_pid": 42,
        "lease_s": 60.0,
        "processes": [
            {"pid": 1234, "ns_pid": 1, "agent_socket": "/run/npusnap/1.sock", "lock_token": "a" * 32}
        ],
        "files": [
            {"path": n, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()
        ],
    }
    (d / containers.STATE_FILE).write_text(json.dumps(state))
    return state


def test_images_directory_verifies_and_summarises(tmp_path: Path) -> None:
    make_images(tmp_path / "ckpt")
    ckpt = containers.find(tmp_path / "ckpt")
    assert ckpt is not None and ckpt.form == "directory" and ckpt.prefix == ""
    res = containers.verify(ckpt)
    assert res.to_dict()["ok"] and res.files_checked == 3 and res.bytes_checked == 70007
    summary = ckpt.summary()
    assert summary["processes"] == [{"pid": 1234, "ns_pid": 1, "agent_socket": "/run/npusnap/1.sock"}]
    assert "lock_token" not in json.dumps(summary)


def test_container_directory_is_found_through_checkpoint_subdir(tmp_path: Path) -> None:
    make_images(tmp_path / "userdata" / "checkpoint")
    ckpt = containers.find(tmp_path / "userdata")
    assert ckpt is not None and ckpt.prefix == "checkpoint/"
    assert containers.verify(ckpt).files_checked == 3


def test_not_a_plugin_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    assert containers.find(tmp_path / "plain") is None
    assert containers.find(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        (lambda d: (d / "pstree.img").write_bytes(b"TREE"), "pstree.img: sha256 differs"),
        (lambda d: (d / "pages-1.img").write_bytes(b"short"), "pages-1.img: size 5 != 70000"),
        (lambda d: (d / "inventory.img").unlink(), "inventory.img: missing"),
    ],
    ids=["modified", "truncated", "missing"],
)
def test_damage_is_named(tmp_path: Path, damage: object, expect: str) -> None:
    make_images(tmp_path / "ckpt")
    damage(tmp_path / "ckpt")  # type: ignore[operator]
    ckpt = containers.find(tmp_path / "ckpt")
    assert ckpt is not None
    with pytest.raises(ImageError) as info:
        containers.verify(ckpt)
    assert info.value.exit_code == ExitCode.IMAGE
    assert expect in str(info.value)


def test_sizes_only_skips_the_sums(tmp_path: Path) -> None:
    make_images(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "pstree.img").write_bytes(b"TREE")  # same size, other bytes
    ckpt = containers.find(tmp_path / "ckpt")
    assert ckpt is not None
    assert containers.verify(ckpt, checksums=False).checksums is False


def test_bad_state_file(tmp_path: Path) -> None:
    make_images(tmp_path / "ckpt")
    (tmp_path / "ckpt" / containers.STATE_FILE).write_text("{not json")
    with pytest.raises(ImageError, match="not valid JSON"):
        containers.find(tmp_path / "ckpt")
    (tmp_path / "ckpt" / containers.STATE_FILE).write_text(json.dumps({"kind": "other", "format": 1}))
    with pytest.raises(ImageError, match="unknown kind/format"):
        containers.find(tmp_path / "ckpt")


def _archive(tmp_path: Path, suffix: str) -> Path:
    root = tmp_path / "export"
    make_images(root / "checkpoint")
    (root / "config.dump").write_text("{}")
    (root / "spec.dump").write_text("{}")
    plain = tmp_path / "ckpt.tar"
    with tarfile.open(plain, "w") as tar:
        tar.add(root, arcname=".")
    if suffix == ".tar":
        return plain
    if suffix == ".tar.gz":
        out = tmp_path / "ckpt.tar.gz"
        with tarfile.open(out, "w:gz") as tar:
            tar.add(root, arcname=".")
        return out
    out = tmp_path / "ckpt.tar.zst"
    subprocess.run(["zstd", "-q", "-f", str(plain), "-o", str(out)], check=True, timeout=60)
    return out


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tar.zst"])
def test_export_archive(tmp_path: Path, suffix: str) -> None:
    if suffix == ".tar.zst" and shutil.which("zstd") is None:
        pytest.skip("zstd is not installed (scripts/setup-containers.sh installs it)")
    archive = _archive(tmp_path, suffix)
    ckpt = containers.find(archive)
    assert ckpt is not None and ckpt.form == "archive" and ckpt.prefix == "checkpoint/"
    res = containers.verify(ckpt)
    assert res.files_checked == 3
    assert {"config.dump", "spec.dump"} <= set(ckpt.extra_files)


def test_archive_missing_an_image_file(tmp_path: Path) -> None:
    root = tmp_path / "export"
    make_images(root / "checkpoint")
    (root / "checkpoint" / "pages-1.img").unlink()
    archive = tmp_path / "ckpt.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    ckpt = containers.find(archive)
    assert ckpt is not None
    with pytest.raises(ImageError, match=r"pages-1\.img: missing"):
        containers.verify(ckpt)
