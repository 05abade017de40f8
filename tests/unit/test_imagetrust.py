"""Issue 14, items 1, 2 and 5: stale-temp cleanup that cannot be aimed elsewhere, images trusted only
when they should be, and publishing that no crash leaves half done. Each test is one attack of the
issue's fault matrix (no root needed except where a test chowns, which it skips otherwise)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from npusnap_cli.errors import ImageError
from npusnap_cli.host import hostclean
from npusnap_cli.image import imagetrust, integrity, layout, publishing
from npusnap_cli.image.manifest import SELF_HASH_KEY, _self_hash, load_manifest
from tests.unit.test_image import _build, _manifest

DEAD_PID = 999_999_999  # above any pid_max: never alive


def _publish(tmp_path: Path, name: str = "img", sign: Path | None = None, **changes: object) -> Path:
    tmp, final = _build(tmp_path, name)
    m = _manifest(publishing.file_entries(tmp))
    if changes:
        from dataclasses import replace

        m = replace(m, **changes)  # type: ignore[arg-type]
    publishing.publish(tmp, final, m, sign_key=sign)
    return final


@pytest.fixture
def alarm() -> object:
    """Fail instead of hanging: a FIFO opened without O_NONBLOCK would block forever."""

    def boom(*_: object) -> None:
        raise TimeoutError("blocked: something opened a FIFO")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(10)
    yield None
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------------------------
# 1. stale-temp cleanup
# --------------------------------------------------------------------------------------------


def test_planted_symlink_is_refused_and_the_parent_keeps_its_mode(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o1777)  # like /tmp
    victim = tmp_path / "theirs"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    planted = parent / f".img{layout.TMP_MARKER}{DEAD_PID}-x"
    planted.symlink_to(victim)
    done = layout.remove_stale_temps(parent / "img")
    assert [(d.path, d.action) for d in done] == [(planted, "refused")]
    assert "symbolic link" in done[0].message and "removed" not in done[0].message
    assert stat.S_IMODE(parent.stat().st_mode) == 0o1777
    assert (victim / "keep").read_text() == "precious"
    assert planted.is_symlink()


def test_planted_fifo_is_refused_without_blocking(tmp_path: Path, alarm: object) -> None:
    fifo = tmp_path / f".img{layout.TMP_MARKER}{DEAD_PID}-x"
    os.mkfifo(fifo)
    old = tmp_path / f".img{layout.OLD_MARKER}{DEAD_PID}"
    os.mkfifo(old)
    done = layout.remove_stale_temps(tmp_path / "img")
    assert {d.path: d.action for d in done} == {fifo: "refused", old: "refused"}
    assert all("FIFO" in d.message for d in done)
    # remove_tree of a partial image named like one never blocks on it either
    layout.remove_tree(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_symlink_inside_a_stale_temp_is_removed_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    stale = tmp_path / f".img{layout.TMP_MARKER}{DEAD_PID}-x"
    (stale / "criu").mkdir(parents=True)
    (stale / "criu" / "link").symlink_to(victim)
    done = layout.remove_stale_temps(tmp_path / "img")
    assert [d.action for d in done] == ["removed"]
    assert not os.path.lexists(stale) and (victim / "keep").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_another_users_directory_is_not_touched(tmp_path: Path) -> None:
    theirs = tmp_path / f".img{layout.TMP_MARKER}{DEAD_PID}-x"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    done = layout.remove_stale_temps(tmp_path / "img")
    assert [d.action for d in done] == ["refused"] and "uid 65534" in done[0].message
    assert theirs.is_dir()


def test_failure_logs_go_to_a_fresh_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    shared = tmp_path / "shared"
    shared.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (shared / "npusnap-logs").symlink_to(elsewhere)  # a predictable name, planted
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    tmp, final = _build(tmp_path)
    # The name beside the image, planted too: never followed, the logs go to /tmp instead.
    layout.failed_logs_dir(final).symlink_to(elsewhere)
    dest = hostclean.save_failure_logs(tmp, "dump")
    assert dest is not None and dest.parent == shared and not dest.is_symlink()
    assert stat.S_IMODE(dest.stat().st_mode) == 0o700
    assert list(elsewhere.iterdir()) == []


# --------------------------------------------------------------------------------------------
# 2. images trusted only when they should be
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["page file", "criu dir", "manifest", "extra link to /etc", "fifo"])
def test_symlinks_and_special_files_are_refused(tmp_path: Path, what: str, alarm: object) -> None:
    final = _publish(tmp_path)
    crit = layout.criu_dir(final)
    if what == "page file":
        target = tmp_path / "pages"
        target.write_bytes((crit / "pages-1.img").read_bytes())
        (crit / "pages-1.img").unlink()
        (crit / "pages-1.img").symlink_to(target)
        name = "pages-1.img"
    elif what == "criu dir":
        os.rename(crit, tmp_path / "real-criu")
        crit.symlink_to(tmp_path / "real-criu")
        name = "criu"
    elif what == "manifest":
        m = layout.manifest_path(final)
        os.rename(m, tmp_path / "m.json")
        m.symlink_to(tmp_path / "m.json")
        name = "npusnap.json"
    elif what == "fifo":
        os.mkfifo(layout.logs_dir(final) / "restore.log")
        name = "restore.log"
    else:
        (layout.logs_dir(final) / "etc").symlink_to("/etc")
        name = "etc"
    with pytest.raises(ImageError) as exc:
        integrity.verify(final)
    assert name in exc.value.message and "refus" in exc.value.message


def test_symlinked_image_dir_is_refused(tmp_path: Path) -> None:
    final = _publish(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(final)
    with pytest.raises(ImageError, match="symbolic link"):
        integrity.verify(link)


def test_group_or_world_writable_image_is_refused_with_the_fix(tmp_path: Path) -> None:
    final = _publish(tmp_path)
    os.chmod(layout.criu_dir(final) / "pages-1.img", 0o666)
    with pytest.raises(ImageError) as exc:
        integrity.verify(final)
    assert "writable by others" in exc.value.message
    assert "chmod -R go-w" in exc.value.fix and "chown -R" in exc.value.fix


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_image_owned_by_another_user_is_refused_by_root(tmp_path: Path) -> None:
    final = _publish(tmp_path)
    os.chown(final, 65534, 65534)
    with pytest.raises(ImageError, match="owned by uid 65534"):
        integrity.verify(final)


def test_criu_files_are_sealed_0600(tmp_path: Path) -> None:
    tmp, _ = _build(tmp_path)
    f = layout.criu_dir(tmp) / "core-1235.img"
    os.chmod(f, 0o644)
    publishing.file_entries(tmp)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600


def _rewrite(final: Path, mutate) -> None:  # type: ignore[no-untyped-def]
    """Edit the manifest as a careful attacker would: the self-hash is recomputed."""
    d = json.loads(layout.manifest_path(final).read_text())
    d.pop(SELF_HASH_KEY)
    mutate(d)
    d[SELF_HASH_KEY] = _self_hash(d)
    layout.manifest_path(final).write_text(json.dumps(d))


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (
            lambda d: d["files"].append({"path": "logs/dump.log", "size": 4, "sha256": "0" * 64}),
            "under criu/",
        ),
        (lambda d: d["processes"][1].__setitem__("agent_socket", "/etc/evil/1235.sock"), "agent_socket"),
        (
            lambda d: d["processes"][1].__setitem__("agent_socket", "/run/npusnap/../etc/1235.sock"),
            "agent_socket",
        ),
        (lambda d: d["processes"][1].__setitem__("npu", False), "npu is false"),
        (lambda d: d["processes"][1].__setitem__("pid", -5), "out of range"),
        (lambda d: d["processes"][0].__setitem__("cmdline", [1, 2]), "cmdline"),
        (lambda d: d.__setitem__("surprise", 1), "surprise"),
        (lambda d: d["criu_options"].__setitem__("action_script", "/tmp/x.sh"), "action_script"),
        (lambda d: d["processes"][1].__setitem__("lock_token", "../../x"), "lock_token"),
        (lambda d: d.__setitem__("root_pid", 4242), "root_pid"),
    ],
)
def test_manifest_fields_are_checked_against_the_schema(tmp_path: Path, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    final = _publish(tmp_path)
    _rewrite(final, mutate)
    with pytest.raises(ImageError) as exc:
        integrity.verify(final, checksums=False)
    assert needle in exc.value.message


def test_deep_json_is_an_image_error_not_a_recursion_error(tmp_path: Path) -> None:
    final = _publish(tmp_path)
    layout.manifest_path(final).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ImageError, match="nested deeper"):
        integrity.verify(final)
    with pytest.raises(ImageError, match="nested deeper"):
        load_manifest(final)


def test_an_edit_of_a_non_hash_field_is_reported(tmp_path: Path) -> None:
    final = _publish(tmp_path)
    path = layout.manifest_path(final)
    path.write_text(path.read_text().replace('"leave_running": false', '"leave_running": true'))
    with pytest.raises(ImageError, match="edited after the dump"):
        integrity.verify(final)


def _keys(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    priv = tmp_path / "key.pem"
    pub = tmp_path / "key.pub.pem"
    priv.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv, pub


def test_signature_accepts_the_signed_image_and_refuses_edits_and_unsigned(tmp_path: Path) -> None:
    priv, pub = _keys(tmp_path)
    signed = _publish(tmp_path, "signed", sign=priv)
    assert stat.S_IMODE((signed / imagetrust.SIGNATURE_NAME).stat().st_mode) == 0o600
    assert integrity.verify(signed, require_signature=pub).files_checked == 2
    _rewrite(signed, lambda d: d.__setitem__("leave_running", True))  # self-hash recomputed
    with pytest.raises(ImageError, match="signature"):
        integrity.verify(signed, require_signature=pub)
    unsigned = _publish(tmp_path, "unsigned")
    with pytest.raises(ImageError, match="not signed"):
        integrity.verify(unsigned, require_signature=pub)
    (tmp_path / "o").mkdir()
    _, other_pub = _keys(tmp_path / "o")
    again = _publish(tmp_path, "again", sign=priv)
    with pytest.raises(ImageError, match="signature"):
        integrity.verify(again, require_signature=other_pub)


def test_openssl_made_keys_work(tmp_path: Path) -> None:
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary on this host")
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(priv)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(priv), "-pubout", "-out", str(pub)], check=True)
    final = _publish(tmp_path, sign=priv)
    assert integrity.verify(final, require_signature=pub).checksums


# --------------------------------------------------------------------------------------------
# 5. crash windows in publish
# --------------------------------------------------------------------------------------------

_CRASHER = r"""
import sys
from pathlib import Path
from npusnap_cli.image import publishing
from tests.unit.test_image import _build, _manifest
tmp_path, force, exchange = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
if not exchange:
    publishing.rename_exchange = lambda a, b: False  # where publish() looks it up
tmp, final = _build(tmp_path)
publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)), force=force)
"""


def _crash_publish(tmp_path: Path, at: str, *, force: bool, exchange: bool = True) -> int:
    env = dict(os.environ, NPUSNAP_TEST_CRASH_AT=at)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHER, str(tmp_path), "1" if force else "0", "1" if exchange else "0"],
        env=env,
        cwd=root,
        timeout=60,
    )
    return proc.returncode


def test_kill_before_the_rename_leaves_no_image_and_is_cleaned(tmp_path: Path) -> None:
    assert _crash_publish(tmp_path, "publish:before-rename", force=False) == -signal.SIGKILL
    final = tmp_path / "img"
    assert not final.exists()
    (left,) = layout.temp_siblings(final)
    assert layout.manifest_path(left).exists()  # complete, but never published
    with pytest.raises(ImageError, match="work directory of a dump that did not finish"):
        integrity.verify(left)
    with pytest.raises(ImageError, match="leftovers of an interrupted dump"):
        integrity.verify(final)
    assert [d.action for d in layout.remove_stale_temps(final)] == ["removed"]
    assert layout.temp_siblings(final) == []


def test_kill_after_the_exchange_keeps_the_new_image(tmp_path: Path) -> None:
    old = _publish(tmp_path)
    old_inode = layout.manifest_path(old).stat().st_ino
    assert _crash_publish(tmp_path, "publish:after-exchange", force=True) == -signal.SIGKILL
    assert integrity.verify(old).files_checked == 2
    assert layout.manifest_path(old).stat().st_ino != old_inode  # the new one
    assert [d.action for d in layout.remove_stale_temps(old)] == ["removed"]


def test_kill_between_the_two_renames_is_recovered(tmp_path: Path) -> None:
    old = _publish(tmp_path)
    old_inode = layout.manifest_path(old).stat().st_ino
    assert _crash_publish(tmp_path, "publish:between-renames", force=True, exchange=False) == -signal.SIGKILL
    assert not old.exists()
    with pytest.raises(ImageError, match="leftovers"):
        integrity.verify(old)
    actions = sorted(d.action for d in layout.remove_stale_temps(old))
    assert actions == ["recovered", "removed"]  # the old image back as DIR, the new work dir gone
    assert layout.manifest_path(old).stat().st_ino == old_inode  # the old image is back
    assert integrity.verify(old).files_checked == 2
    assert layout.temp_siblings(old) == []


def test_force_publish_uses_the_exchange_where_the_kernel_has_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    if not publishing.rename_exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this kernel/filesystem")
    assert (b / "x").read_text() == "a" and not (a / "x").exists()


def test_dump_target_named_like_a_work_directory_is_refused(tmp_path: Path) -> None:
    from npusnap_cli.errors import UsageError

    with pytest.raises(UsageError, match="work directory"):
        layout.check_dump_target(tmp_path / f".x{layout.TMP_MARKER}1-a", force=False)


def test_cleanup_works_through_a_symlinked_parent(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)  # e.g. /var/run -> /run: the user's own path
    stale = real / f".img{layout.TMP_MARKER}{DEAD_PID}-x"
    stale.mkdir()
    done = layout.remove_stale_temps(tmp_path / "via" / "img")
    assert [d.action for d in done] == ["removed"] and not stale.exists()


def test_verify_reports_leftovers_next_to_a_good_image(tmp_path: Path) -> None:
    final = _publish(tmp_path)
    left = tmp_path / f".img{layout.TMP_MARKER}{DEAD_PID}-x"
    left.mkdir()
    result = integrity.verify(final)
    assert result.leftovers == (str(left),) and result.to_dict()["leftovers"] == [str(left)]
