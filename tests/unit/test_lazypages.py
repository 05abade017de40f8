"""restore --lazy's checks: the uffd feature check against a fake criu, and the page-file split."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from npusnap_cli import criu
from npusnap_cli.errors import ExitCode, ImageError, PreflightError
from npusnap_cli.host.lazypages import LazyReport, check_lazy, open_files, split_page_files, verify_open_files
from npusnap_cli.image.manifest import FileEntry, Manifest


def _fake_criu(tmp_path: Path, answer: str, rc: int) -> criu.CriuBinary:
    """A criu that answers `check --feature uffd-noncoop` as told (and records its arguments)."""
    script = tmp_path / "criu"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\necho "{answer}"\nexit {rc}\n')
    script.chmod(0o755)
    return criu.CriuBinary(str(script), "4.2.1")


def test_uffd_check_passes_when_criu_says_supported(tmp_path: Path) -> None:
    ok, words = criu.lazy_pages_supported(_fake_criu(tmp_path, "uffd-noncoop is supported", 0))
    assert ok and words == "uffd-noncoop is supported"
    assert (tmp_path / "args").read_text().split() == ["check", "--feature", "uffd-noncoop"]


def _manifest(files: list[tuple[str, bytes]], tmp_path: Path) -> tuple[Path, Manifest]:
    """An image directory holding ``files`` and a Manifest naming them (only ``files`` is used)."""
    image = tmp_path / "img"
    entries = []
    for rel, data in files:
        (image / rel).parent.mkdir(parents=True, exist_ok=True)
        (image / rel).write_bytes(data)
        # sha256: the digests of images made before blake3, still checked
        entries.append(
            FileEntry(path=rel, size=len(data), digest=hashlib.sha256(data).hexdigest(), algo="sha256")
        )

    return image, cast(Manifest, SimpleNamespace(files=entries))


def test_refused_before_anything_when_uffd_is_missing(tmp_path: Path) -> None:
    image, manifest = _manifest([("criu/pages-1.img", b"x" * 4096)], tmp_path)
    fake = _fake_criu(tmp_path, "Error (criu/cr-check.c:1234): uffd-noncoop is not supported", 1)
    with pytest.raises(PreflightError) as exc:
        check_lazy(image, manifest, fake)
    err = exc.value
    assert err.exit_code == ExitCode.PREFLIGHT
    assert "cannot restore lazily" in err.message and "uffd-noncoop is not supported" in err.message
    assert "without --lazy" in err.fix


def test_page_files_split_from_the_rest(tmp_path: Path) -> None:
    _image, manifest = _manifest(
        [
            ("criu/pages-1.img", b"p"),
            ("criu/pagemap-7.img", b"m"),
            ("criu/core-7.img", b"c"),
            ("hostfiles/x", b"h"),
        ],
        tmp_path,
    )
    pages, rest = split_page_files(manifest)
    assert [f.path for f in pages] == ["criu/pages-1.img"]
    assert [f.path for f in rest] == ["criu/pagemap-7.img", "criu/core-7.img", "hostfiles/x"]


def test_page_files_are_verified_from_fds_opened_before(tmp_path: Path) -> None:
    image, manifest = _manifest([("criu/pages-1.img", os.urandom(1 << 20))], tmp_path)
    opened = open_files(image, list(manifest.files))
    (image / "criu/pages-1.img").unlink()  # removed after opening: still verified
    verify_open_files(image, opened)
    # A changed file is caught.
    (image / "criu/pages-1.img").write_bytes(b"y" * (1 << 20))
    opened = open_files(image, list(manifest.files))
    with pytest.raises(ImageError) as exc:
        verify_open_files(image, opened)
    assert exc.value.exit_code == ExitCode.IMAGE and "pages-1.img does not match" in exc.value.message


def test_npusnap_check_warns_when_lazy_restore_is_impossible(tmp_path: Path) -> None:
    from npusnap_cli.host import preflight

    item = preflight.lazy_pages_item(_fake_criu(tmp_path, "uffd-noncoop is not supported", 1))
    assert item.name == "criu-lazy-pages" and item.status == preflight.WARNING
    assert "not possible" in item.detail and "plain restore is unaffected" in item.fix
    item = preflight.lazy_pages_item(_fake_criu(tmp_path, "uffd-noncoop is supported", 0))
    assert item.status == preflight.OK and item.data == {"supported": True}


def test_the_lazy_report_keeps_its_json_form() -> None:
    report = LazyReport(
        daemon_pid=12,
        daemon_log="/x/lazy-pages.log",
        daemon_status=None,
        uffds_held=2,
        pages_copied=None,
        pages_total=None,
        pages_verified="while the job ran",
        complete_s=0.25,
        killed=None,
    )
    assert list(report.to_json()) == [
        "daemon_pid",
        "daemon_log",
        "daemon_status",
        "uffds_held",
        "pages_copied",
        "pages_total",
        "pages_verified",
        "complete_s",
        "killed",
    ]
    assert report.to_json()["uffds_held"] == 2 and report.to_json()["complete_s"] == 0.25
