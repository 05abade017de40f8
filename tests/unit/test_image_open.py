"""image.open on every kind of image, each made by the code (or the test helper) that writes that
kind, and on paths that are no image; and the commands' dispatch on it (no root, no CRIU)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from npusnap_cli import __version__, image
from npusnap_cli.cli import main
from npusnap_cli.errors import ExitCode, ImageError, UsageError
from npusnap_cli.image import archive, digest, imagestore, integrity, job, layout, publishing
from npusnap_cli.image.manifest import load_manifest, now_iso
from npusnap_cli.k8s import jobcheckpoint as jc
from tests.unit.test_containers import _archive, make_images
from tests.unit.test_image import _build, _manifest


def _published(parent: Path, name: str = "img") -> Path:
    tmp, final = _build(parent, name)
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    return final


def _job_image(parent: Path) -> Path:
    """A job image of two ranks, its manifest written as jobsnap's commit writes it."""
    directory = parent / "job"
    directory.mkdir()
    ranks = []
    for rank in range(2):
        rank_image = _published(directory, job.rank_dir_name(rank))
        ranks.append(
            job.RankEntry(
                rank=rank,
                dir=job.rank_dir_name(rank),
                pid=1234,
                npu_pids=tuple(p.pid for p in load_manifest(rank_image).npu_processes),
                manifest_sha256=digest.of_file(layout.manifest_path(rank_image), "sha256"),
            )
        )
    manifest = job.JobManifest(
        created_at=now_iso(), ranks=tuple(ranks), leave_running=False, tool=__version__
    )
    (directory / job.JOB_MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    return directory


def test_an_image_directory(tmp_path: Path) -> None:
    final = _published(tmp_path)
    ref = image.open(final)
    assert isinstance(ref, image.DirectoryImage) and ref.kind is image.Kind.DIRECTORY
    assert ref.path == final and ref.pointer is None
    assert ref.manifest.root_pid == 1234
    ref.refuse_restore()
    checked = ref.verify()
    assert checked.on_stdout and checked.record["files_checked"] == len(ref.manifest.files)
    assert checked.summary.startswith(f"{final}: valid: ")


def test_a_latest_pointer_is_followed_once(tmp_path: Path) -> None:
    store = tmp_path / "snaps"
    store.mkdir()
    final = _published(store, "snap-0")
    latest = Path(imagestore.update_latest(final))
    ref = image.open(latest)
    assert isinstance(ref, image.DirectoryImage) and ref.kind is image.Kind.DIRECTORY
    assert ref.path == final and ref.given == latest and ref.pointer == latest
    # The real path is what every later step uses: repointing `latest` changes nothing for it.
    other = _published(store, "snap-1")
    imagestore.update_latest(other)
    assert integrity.verify(ref.path).manifest == ref.manifest


def test_a_job_image_and_a_pointer_to_one(tmp_path: Path) -> None:
    directory = _job_image(tmp_path)
    ref = image.open(directory)
    assert isinstance(ref, image.JobImage) and ref.kind is image.Kind.JOB
    assert [r.dir for r in ref.job.ranks] == ["rank-0", "rank-1"]
    ref.refuse_restore()
    _job, result = job.verify_job(ref.path)
    assert [r.files_checked for r in result.ranks] == [2, 2]
    assert ref.verify().record == result.to_dict()
    os.symlink(directory.name, tmp_path / "latest")
    via = image.open(tmp_path / "latest")
    assert isinstance(via, image.JobImage) and via.path == directory and via.job == ref.job


def test_an_export_archive(tmp_path: Path) -> None:
    final = _published(tmp_path)
    dest = tmp_path / archive.default_name(final)
    archive.export(final, dest)
    ref = image.open(dest)
    assert isinstance(ref, image.ArchiveImage) and ref.path == dest
    assert ref.manifest == load_manifest(final)
    # An archive carries no signature: a signature asked for is refused, never skipped.
    with pytest.raises(UsageError, match="does not sign"):
        ref.verify(require_signature=tmp_path / "key.pem")
    with pytest.raises(ImageError, match="image archive") as info:
        ref.refuse_restore()
    assert f"npusnap restore --import {dest}" in info.value.fix
    assert info.value.exit_code == ExitCode.IMAGE


def test_container_checkpoints_directory_and_archive(tmp_path: Path) -> None:
    make_images(tmp_path / "ckpt")
    ref = image.open(tmp_path / "ckpt")
    assert isinstance(ref, image.ContainerImage) and ref.kind is image.Kind.CONTAINER
    assert ref.container.form == "directory"
    with pytest.raises(ImageError, match="container checkpoint"):
        ref.refuse_restore()
    tar = _archive(tmp_path / "t", ".tar")
    ref = image.open(tar)
    assert isinstance(ref, image.ContainerImage) and ref.container.form == "archive"


def test_a_zstd_container_archive_is_not_taken_for_an_npusnap_archive(tmp_path: Path) -> None:
    if shutil.which("zstd") is None:
        pytest.skip("zstd is not installed (scripts/setup-containers.sh installs it)")
    zst = _archive(tmp_path, ".tar.zst")
    assert archive.is_archive(zst)  # the same magic number as `npusnap export` writes
    ref = image.open(zst)
    assert isinstance(ref, image.ContainerImage) and ref.container.prefix == "checkpoint/"


class _OneContainer:
    """The container runtime's side of `npusnap k8s checkpoint`: an export archive of a
    checkpoint written through the plugin, for one container that names no coordinator."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch

    def checkpoint(self, member: jc.Member, location: Path, timeout_s: float) -> Path:
        made = _archive(self.scratch, ".tar")
        shutil.move(made, location)
        return location

    def running(self, member: jc.Member) -> bool:
        return True


def test_a_kubernetes_job_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "scratch").mkdir()
    member = jc.parse_member(0, "default/a/trainer")
    jc.checkpoint_job([member], tmp_path / "job", _OneContainer(tmp_path / "scratch"), None)
    ref = image.open(tmp_path / "job")
    assert isinstance(ref, image.K8sJobImage) and ref.kind is image.Kind.K8S_JOB
    assert ref.path == tmp_path / "job"
    with pytest.raises(ImageError, match="Kubernetes job checkpoint") as info:
        ref.refuse_restore()
    assert info.value.fix == f"npusnap k8s restore {tmp_path / 'job'}"
    assert main(["inspect", str(tmp_path / "job"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["result"]
    assert [m["container"] for m in res["members"]] == ["trainer"]
    assert main(["verify", str(tmp_path / "job"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["members"] == 1


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p / "missing", "no image at"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "npusnap.json is missing"),
        (lambda p: (p / "file").write_text("x") and p / "file", "is not a directory"),
        (lambda p: (p / "z.bin").write_bytes(archive.ZSTD_MAGIC + b"junk") and p / "z.bin", "corrupt"),
        # An engine's archive name, and junk in it: an error, not a traceback from tarfile.
        (
            lambda p: (p / "c.tar.zst").write_bytes(archive.ZSTD_MAGIC + b"junk") and p / "c.tar.zst",
            "not a readable tar archive|zstd tool is missing",
        ),
    ],
)
def test_a_path_that_is_no_image_is_an_image_error(tmp_path: Path, make, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ImageError, match=needle) as info:
        image.open(make(tmp_path))
    assert info.value.exit_code == ExitCode.IMAGE


def test_restore_refuses_an_archive_before_anything_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = _published(tmp_path)
    dest = tmp_path / archive.default_name(final)
    archive.export(final, dest)
    assert main(["restore", str(dest), "--json"]) == ExitCode.IMAGE
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["kind"] == "image" and "--import" in err["fix"]


def test_inspect_and_verify_dispatch_on_the_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = _job_image(tmp_path)
    assert main(["inspect", str(directory), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["result"]
    assert [r["dir"] for r in res["ranks"]] == ["rank-0", "rank-1"]
    assert main(["verify", str(directory), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["result"]
    assert [r["files_checked"] for r in res["ranks"]] == [2, 2]
    make_images(tmp_path / "ckpt")
    assert main(["verify", str(tmp_path / "ckpt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["files_checked"] == 3
