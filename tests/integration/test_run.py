"""`npusnap run`: the env-gated bootstrap starts an agent in target interpreters 3.9 and 3.13."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from npusnap_cli import paths
from npusnap_cli.agent import launch
from npusnap_cli.device.agent_client import AgentClient
from tests.conftest import requires_root
from tests.integration.agentlib import (
    PY,
    REPO,
    Sim,
    Workload,
    python_versions,
    wait_socket,
    workload_env,
    write_workload,
)

pytestmark = pytest.mark.integration
PYTHONS = python_versions()


@pytest.mark.parametrize("minor", ["3.9", "3.13"])
def test_run_starts_an_agent_in_another_python(
    sim: Sim, runtime_dir: Path, tmp_path: Path, minor: str
) -> None:
    if minor not in PYTHONS:
        pytest.skip(f"no pyenv Python {minor} on this host (~/.pyenv/versions/{minor}.*)")
    usersite = tmp_path / "usersite"
    usersite.mkdir()
    mark = tmp_path / "user-sitecustomize-ran"
    (usersite / "sitecustomize.py").write_text(f"open({str(mark)!r}, 'w').write('yes')\n")
    env = workload_env(sim, runtime_dir, PYTHONPATH=str(usersite))
    argv = [PY, "-m", "npusnap_cli", "run", "--json", "--", PYTHONS[minor], str(write_workload(tmp_path))]
    w = Workload(argv, env, tmp_path)
    try:
        ready = w.wait_for("ready").split()
        assert int(ready[1]) == w.pid  # exec kept the pid that `run` reported
        assert ready[2:] == minor.split(".")
        envelope, _ = json.JSONDecoder().raw_decode(w.out_path.read_text())
        assert envelope["command"] == "run" and envelope["ok"] is True
        assert envelope["result"]["pid"] == w.pid
        wait_socket(runtime_dir, w.pid)
        with AgentClient(w.pid) as c:
            hello = c.hello()
            assert hello.python.version.startswith(minor + ".")
            assert hello.python.executable == PYTHONS[minor]
            assert hello.acl.loaded is True
            assert c.lock(lease_s=30).state == "LOCKED"
            assert c.unlock().state == "RUNNING"
        assert mark.read_text() == "yes", "the user's own sitecustomize must still run"
        w.wait_steps(3)
        w.assert_correct()
        assert "npusnap-agent" not in w.stderr(), "the agent wrote into the job's stderr"
        assert w.agent_log() == "", "the agent logged a problem"
    finally:
        w.kill()


def test_bootstrap_is_inert_without_the_switch(tmp_path: Path) -> None:
    usersite = tmp_path / "usersite"
    usersite.mkdir()
    (usersite / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPUSNAP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(launch.BOOTSTRAP_DIR), str(usersite)])
    code = (
        "import os, sys; print(int('npusnap_cli' in sys.modules), os.environ.get('USER_SITE_RAN'), "
        f"int(any(p == {str(launch.BOOTSTRAP_DIR)!r} for p in sys.path)))"
    )
    done = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "0"]


def test_run_reports_a_missing_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [PY, "-m", "npusnap_cli", "run", "--json", "--", "no-such-program-xyz"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert done.returncode == 4
    envelope = json.loads(done.stdout)
    assert envelope["error"]["message"] == "command not found: no-such-program-xyz"


# Prints the program's view of its session: "sid pid".
SESSION_PROBE = "import os; print(os.getsid(0), os.getpid())"


def _in_a_foreign_session(script: str) -> list[str]:
    """A command line running ``script`` in a session whose leader is outside its pid namespace."""
    if os.getsid(0) == 0:
        return ["sh", "-c", script]  # already there (a CI runner's session, say)
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed (util-linux) and this session is not foreign")
    ns = ["unshare", "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run([*ns, "true"], capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip(
            f"cannot create a pid namespace here ({probe.stderr.strip()}) and this session is not foreign"
        )
    return [*ns, "sh", "-c", script]


@requires_root
@pytest.mark.parametrize("keep", [False, True])
def test_run_leaves_a_session_whose_leader_is_outside_the_namespace(keep: bool, runtime_dir: Path) -> None:
    """Where the program's session leader is invisible (getsid 0: under `docker exec`, a CI runner,
    or here a new pid namespace from unshare(1)), CRIU could not dump it: `run` gives it its own
    session, unless --keep-session. (The job's log goes to runtime_dir, which the environment
    names, not to the node's /run/npusnap.)"""
    npusnap = [PY, "-m", "npusnap_cli", "run", *(["--keep-session"] if keep else []), "--"]
    script = f"cd {shlex.quote(str(REPO))} && exec {shlex.join([*npusnap, PY, '-c', SESSION_PROBE])}"
    proc = subprocess.run(
        _in_a_foreign_session(script), capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    sid, pid = (int(x) for x in proc.stdout.split())
    if keep:
        assert sid == 0, "--keep-session must leave the session alone"
        assert "new session" not in proc.stderr
    else:
        assert sid == pid, f"expected a session of its own, got sid {sid} for pid {pid}"
        # Not a terminal: the program's stderr stays its own, the note goes to the job's log.
        assert "new session" not in proc.stderr
        log = paths.agent_log_path(pid)
        assert "new session of its own" in log.read_text(), log
