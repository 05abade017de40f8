"""Issue 14 end to end with real CRIU: planted names next to DIR, signed images that travel, edited
manifests, and the lock token that the dump hands to restore through the image."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.image import layout
from npusnap_cli.image.manifest import SELF_HASH_KEY, _self_hash
from tests.conftest import requires_root
from tests.integration.dumplib import PY, TRAIN, TRAIN_ARGS, Job, alive, cli, job_env, reference, wait_until

pytestmark = [pytest.mark.integration, requires_root]

DEAD_PID = 999_999_999


def _keys(tmp_path: Path) -> tuple[Path, Path]:
    priv, pub = tmp_path / "key.pem", tmp_path / "key.pub.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(priv)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(priv), "-pubout", "-out", str(pub)], check=True)
    return priv, pub


def test_signed_dump_with_planted_names_restores_and_edits_are_refused(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "40", *TRAIN_ARGS, "--device", "0", "--seed", "21"]
    ref = reference(env, args)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # a /tmp-like parent
    victim = tmp_path / "theirs"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (shared / f".img{layout.TMP_MARKER}{DEAD_PID}-a").symlink_to(victim)
    os.mkfifo(shared / f".img{layout.TMP_MARKER}{DEAD_PID}-b")
    priv, pub = _keys(tmp_path)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = shared / "img"
    try:
        job.wait_lines(6)
        rc, _, err = cli(
            env, "dump", str(job.pid), str(img), "--sign", str(priv), timeout=120, json_mode=False
        )
        assert rc == 0, err
        err = " ".join(err.split())  # the console wraps long lines
        job.reap()
        # Item 1: the planted names were refused and reported, the parent kept its mode.
        assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
        assert (victim / "keep").exists()
        assert "left" in err and "symbolic link" in err and "FIFO" in err
        # Item 2: every file of the image is 0600, the manifest carries the dump's lock token.
        for f in layout.criu_dir(img).iterdir():
            assert stat.S_IMODE(f.lstat().st_mode) == 0o600, f
        manifest = json.loads(layout.manifest_path(img).read_text())
        assert len(manifest["processes"][0]["lock_token"]) == 32

        rc, out, _ = cli(env, "verify", str(img), "--require-signature", str(pub))
        assert rc == 0, out

        # An edit that keeps the manifest self-consistent is still caught by the signature.
        edited = tmp_path / "edited"
        subprocess.run(["cp", "-a", str(img), str(edited)], check=True)
        d = json.loads(layout.manifest_path(edited).read_text())
        d.pop(SELF_HASH_KEY)
        d["processes"][0]["cmdline"] = ["evil"]
        d[SELF_HASH_KEY] = _self_hash(d)
        layout.manifest_path(edited).write_text(json.dumps(d))
        rc, out, _ = cli(env, "restore", str(edited), "--require-signature", str(pub))
        assert rc == ExitCode.IMAGE and out is not None and "signature" in out["error"]["message"]
        # A symlink inside refuses it too, before anything else.
        (layout.logs_dir(edited)).mkdir(exist_ok=True)
        (layout.logs_dir(edited) / "x").symlink_to("/etc")
        rc, out, _ = cli(env, "restore", str(edited))
        assert rc == ExitCode.IMAGE and out is not None and "symbolic link" in out["error"]["message"]
        assert not alive(job.pid)

        # The signed image restores; restore presents the dump's token to the restored agent.
        rc, out, err = cli(env, "restore", str(img), "--require-signature", str(pub))
        assert rc == 0, (out or {}).get("error")
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert job.lines() == ref
    finally:
        job.cleanup()


def test_force_dump_over_an_image_swaps_it_atomically(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "60", *TRAIN_ARGS, "--device", "1", "--seed", "22"]
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, _ = cli(env, "dump", str(job.pid), str(img), "--leave-running", timeout=120)
        assert rc == 0, (out or {}).get("error")
        first = layout.manifest_path(img).stat().st_ino
        rc, out, _ = cli(env, "dump", str(job.pid), str(img), "--leave-running", "--force", timeout=120)
        assert rc == 0, (out or {}).get("error")
        assert layout.manifest_path(img).stat().st_ino != first  # the new image is in place
        assert layout.temp_siblings(img) == []  # the old one was removed, nothing left next to it
        rc, out, _ = cli(env, "verify", str(img))
        assert rc == 0 and out is not None and out["result"]["leftovers"] == []
        assert job.reap(60) == 0  # the job ran on, unlocked, to its end
    finally:
        job.cleanup()
