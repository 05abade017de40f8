"""Agent pieces that need no NPU: the hook registry, the socket directory and stale-socket checks."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from npusnap_cli.agent import hooks as hooks_mod
from npusnap_cli.host.procfs import start_time

REPO = Path(__file__).resolve().parents[2]


def test_hook_registry_runs_in_order_and_reports_the_failing_hook() -> None:
    reg = hooks_mod.HookRegistry()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")

    def broken() -> None:
        raise ValueError("no weights")

    reg.register("pre_lock", first)
    reg.register("pre_lock", broken, name="broken-hook")
    assert reg.names()["pre_lock"] == [
        f"{__name__}.test_hook_registry_runs_in_order_and_reports_the_failing_hook.<locals>.first",
        "broken-hook",
    ]
    with pytest.raises(hooks_mod.HookFailed) as info:
        reg.run("pre_lock")
    assert ran == ["first"]
    assert (info.value.stage, info.value.hook, info.value.error) == (
        "pre_lock",
        "broken-hook",
        "ValueError: no weights",
    )
    assert reg.unregister("pre_lock", broken) is True
    assert reg.run("pre_lock") == [reg.names()["pre_lock"][0]]
    with pytest.raises(ValueError):
        reg.register("pre_backup", first)


def _start_in_child(runtime_dir: Path, umask: int = 0o022) -> tuple[int, str]:
    """Start the native agent in a forked child with ``runtime_dir``; (exit code, its stderr).

    A child, because the agent binds once per process and the test runner must stay clean."""
    script = (
        "import os, sys\n"
        f"os.umask({umask})\n"
        "import npusnap_cli.agent as agent\n"
        "path = agent.start()\n"
        "print(path)\n"
        "agent.stop()\n"
        "sys.exit(0 if path else 3)\n"
    )
    # Its reasons go to the agent log; asked on stderr as well, where this test reads them.
    env = {**os.environ, "NPUSNAP_RUNTIME_DIR": str(runtime_dir), "NPUSNAP_AGENT_STDERR": "1"}
    env.pop("NPUSNAP_AGENT", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30, cwd=REPO
    )
    return done.returncode, done.stdout + done.stderr


def test_private_dir_is_created_0700_and_checked(tmp_path: Path) -> None:
    d = tmp_path / "npusnap"
    code, out = _start_in_child(d, umask=0o177)  # would leave 0600 without the explicit chmod
    assert code == 0, out
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    code, out = _start_in_child(loose)
    assert code == 3 and "not 700" in out, out
    link = tmp_path / "link"
    link.symlink_to(d)
    code, out = _start_in_child(link)
    assert code == 3 and "symlink" in out, out


def test_bind_replaces_a_stale_socket_but_never_a_file(tmp_path: Path) -> None:
    d = tmp_path / "npusnap"
    d.mkdir(mode=0o700)
    # The agent names its socket after its own pid, so the child plants the stale socket itself.
    script = (
        "import os, socket, stat, sys\n"
        "d = sys.argv[1]\n"
        "path = os.path.join(d, f'{os.getpid()}.sock')\n"
        "stale = socket.socket(socket.AF_UNIX); stale.bind(path); stale.close()\n"
        "import npusnap_cli.agent as agent\n"
        "assert agent.start() == path, 'stale socket not replaced'\n"
        "assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600\n"
        "agent.stop()\n"
        "assert not os.path.exists(path), 'stop() left the socket'\n"
        "open(path, 'w').write('not a socket')\n"
        "assert agent.start() is None\n"
        "assert open(path).read() == 'not a socket'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "NPUSNAP_RUNTIME_DIR": str(d)}
    for var in ("NPUSNAP_AGENT", "NPUSNAP_AGENT_LOG", "NPUSNAP_AGENT_STDERR"):
        env.pop(var, None)
    done = subprocess.run(
        [sys.executable, "-c", script, str(d)], env=env, capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    # The reason is in the agent's log beside its socket, and not on the application's stderr.
    log = "".join(p.read_text() for p in d.glob("*.log"))
    assert "exists and is not a socket; not removing it" in log
    assert "npusnap-agent" not in done.stderr


def test_start_time_is_read_from_proc() -> None:
    assert isinstance(start_time(), int)
    assert start_time(str(os.getpid())) == start_time()


def test_run_leaves_only_a_foreign_session(monkeypatch: pytest.MonkeyPatch) -> None:
    from npusnap_cli.agent import launch

    calls: list[str] = []
    monkeypatch.setattr(os, "setsid", lambda: calls.append("setsid"))
    monkeypatch.setattr(os, "getsid", lambda pid: 4242)
    assert launch.leave_foreign_session() is None and calls == []  # a session we can see: kept

    monkeypatch.setattr(os, "getsid", lambda pid: 0)
    note = launch.leave_foreign_session()
    assert calls == ["setsid"] and note is not None and "new session" in note

    def refuse() -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setsid", refuse)
    note = launch.leave_foreign_session()
    assert note is not None and "cannot be dumped" in note and "setsid" in note


def test_socket_is_removed_when_the_process_exits(tmp_path: Path) -> None:
    d = tmp_path / "npusnap"
    d.mkdir(mode=0o700)
    script = "import npusnap_cli.agent as agent, sys\nprint(agent.start())\nsys.exit(0)\n"
    env = {**os.environ, "NPUSNAP_RUNTIME_DIR": str(d)}
    env.pop("NPUSNAP_AGENT", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.parent == d and not path.exists(), "an exited process left its agent socket behind"


def test_static_executables_are_recognised(tmp_path: Path) -> None:
    from npusnap_cli.agent import launch

    assert launch.statically_linked(sys.executable) is False
    script = tmp_path / "s.sh"
    script.write_text("#!/bin/sh\n")
    assert launch.statically_linked(str(script)) is False
    src = tmp_path / "m.c"
    src.write_text("int main(void) { return 0; }\n")
    static = tmp_path / "static"
    done = subprocess.run(["cc", "-static", "-o", str(static), str(src)], capture_output=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"no static libc to link a test program: {done.stderr[-200:]!r}")
    assert launch.statically_linked(str(static)) is True
