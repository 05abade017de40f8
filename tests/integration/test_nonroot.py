"""Every command run by an unprivileged user on root's job or image says that root is missing.

Root runs a real job and dumps it with real CRIU; a real unprivileged user (``nobody``, or one
made with useradd) then runs npusnap's own package with a system interpreter of the same Python
version, as an operator without sudo would. Each command must exit 3 (the host cannot do this)
with a message that names root, never 1 (a bug), 0 ("no agent") or 4 ("no NPU process").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from npusnap_cli.errors import ExitCode
from tests.conftest import requires_root
from tests.integration.dumplib import PY, REPO, TRAIN, TRAIN_ARGS, Job, cli, job_env
from tests.integration.test_local_attacks import _attacker

pytestmark = [pytest.mark.integration, requires_root]


def _user_python() -> Optional[str]:
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory the user can reach (pytest's tmp_path sits under a root-only one)."""
    d = Path(tempfile.mkdtemp(prefix="npusnap-user-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_user(home: Path, sim_env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    python = _user_python()
    if python is None:
        pytest.skip("no interpreter of npusnap's Python version that an unprivileged user may run")
    uid, gid = _attacker()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "XDG_RUNTIME_DIR": str(home),
        "PYTHONPATH": f"{REPO}:{sysconfig.get_paths()['purelib']}",
        "ASCEND_HOME_PATH": sim_env.get("ASCEND_HOME_PATH", ""),
        "LD_LIBRARY_PATH": sim_env.get("LD_LIBRARY_PATH", ""),
    }
    p = subprocess.run(
        [python, "-m", "npusnap_cli", "--json", *args],
        env=env,
        user=uid,
        group=gid,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=home,
    )
    envelope = json.loads(p.stdout) if p.stdout.strip() else {}
    return p.returncode, envelope, p.stderr


def test_commands_on_roots_job_and_image_say_that_root_is_needed(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, open_dir: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, "--steps", "100000", *TRAIN_ARGS])
    try:
        job.wait_lines(3)
        image = open_dir / "img"
        rc, out, err = cli(env, "dump", str(job.pid), str(image), "--leave-running")
        assert rc == 0, (rc, out, err)
        home = open_dir / "home"
        home.mkdir()
        os.chown(home, *_attacker())
        elsewhere = home / "img"
        for args in (
            ["dump", str(job.pid), str(elsewhere)],
            ["verify", str(image)],
            ["inspect", str(image)],
            ["export", str(image), str(home / "img.tar.zst")],
            ["restore", str(image)],
            ["restore", "--dry-run", str(image)],
            ["status", str(job.pid)],
            ["freeze", str(job.pid)],
            ["thaw", str(job.pid)],
        ):
            rc, out, err = _as_user(home, sim_env, *args)
            error = out.get("error") or {}
            shown = f"{args}: rc={rc} {error} {err[-400:]}"
            assert rc == ExitCode.PREFLIGHT, shown
            assert error.get("kind") == "preflight", shown
            assert "needs root" in error.get("message", ""), shown
        assert not elsewhere.exists()
        # Nothing was touched: the job runs on, unlocked, and root still sees it as before.
        rc, out, err = cli(env, "status", str(job.pid))
        assert rc == 0 and out is not None, (rc, out, err)
        assert [p["status"]["state"] for p in out["result"]["processes"]] == ["RUNNING"], out
        before = len(job.lines())
        job.wait_lines(before + 2)
    finally:
        job.cleanup()
