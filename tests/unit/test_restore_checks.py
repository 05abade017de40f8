"""Issue 14, item 6: the smaller holes. Restore's pre-checks see a taken thread id and too little
device capacity before CRIU starts; a full disk during CRIU is reported as one; the agents'
runtime directory squatted by another user is reported loudly; restore never creates the
parents of an agent socket directory."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli import criu, paths
from npusnap_cli import replies as agent_replies
from npusnap_cli.criu import failures as criu_failures
from npusnap_cli.errors import BusyError, ExitCode, ImageError, PreflightError
from npusnap_cli.image import layout
from npusnap_cli.pipelines import restore
from tests import replies
from tests.unit.test_image import _manifest

REPO = Path(__file__).resolve().parents[2]


def _pstree(directory: Path, entries: list[dict[str, Any]]) -> None:
    import pycriu

    layout.criu_dir(directory).mkdir(parents=True, exist_ok=True)
    with open(layout.criu_dir(directory) / "pstree.img", "wb") as f:
        pycriu.images.dump({"magic": "PSTREE", "entries": entries}, f)


def test_a_taken_thread_id_is_found_before_criu_starts(tmp_path: Path) -> None:
    started = threading.Event()
    stop = threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    started.wait(5)
    try:
        m = _manifest()
        # The image's processes are free pids; one of their threads has the id of a live thread.
        entries = [
            {"pid": 1234, "ppid": 1, "pgid": 1234, "sid": 1234, "threads": [1234]},
            {"pid": 1235, "ppid": 1234, "pgid": 1234, "sid": 1234, "threads": [1235, tid[0]]},
        ]
        _pstree(tmp_path, entries)
        ids = restore.image_thread_ids(tmp_path, m)
        assert tid[0] in ids
        if any(os.path.exists(f"/proc/{p}") for p in (1234, 1235)):
            pytest.skip("pid 1234 or 1235 is in use on this host")
        with pytest.raises(PreflightError) as exc:
            restore.check_pids_free(m, ids)
        assert str(tid[0]) in exc.value.message and "thread id" in exc.value.message
    finally:
        stop.set()
        t.join()


def test_a_zombie_in_the_way_is_waited_for_and_a_live_process_is_not(tmp_path: Path) -> None:
    """The dump's killed tree lingers as zombies until init reaps it, seconds late on some
    hosts: restore waits for those (bounded), never for a live process."""
    import time

    child = subprocess.Popen(["true"])
    time.sleep(0.3)  # exited, not reaped: a zombie holding its pid
    m = dataclasses.replace(
        _manifest(), processes=(dataclasses.replace(_manifest().processes[0], pid=child.pid),)
    )
    reaper = threading.Timer(1.0, child.wait)
    reaper.start()
    t0 = time.monotonic()
    restore.check_pids_free(m, [child.pid])
    assert 0.8 < time.monotonic() - t0 < restore.ZOMBIE_WAIT_S
    reaper.join()

    live = subprocess.Popen(["sleep", "30"])
    try:
        m = dataclasses.replace(m, processes=(dataclasses.replace(m.processes[0], pid=live.pid),))
        t0 = time.monotonic()
        with pytest.raises(PreflightError) as exc:
            restore.check_pids_free(m, [live.pid])
        assert time.monotonic() - t0 < 1.0
        assert f"{live.pid}: sleep 30" in exc.value.message
    finally:
        live.kill()
        live.wait()


def test_pstree_pids_must_be_the_manifests(tmp_path: Path) -> None:
    _pstree(tmp_path, [{"pid": 777, "ppid": 1, "pgid": 777, "sid": 777, "threads": [777]}])
    with pytest.raises(ImageError, match="not the image's"):
        restore.image_thread_ids(tmp_path, _manifest())


def _fake_agents(
    monkeypatch: pytest.MonkeyPatch, users: list[int], hellos: dict[int, dict[str, Any]]
) -> None:
    """NPU users ``users`` of which those in ``hellos`` have an agent answering that hello."""
    from npusnap_cli import paths
    from npusnap_cli.device import occupancy
    from npusnap_cli.host import devmaps

    monkeypatch.setattr(
        devmaps, "npu_users", lambda exclude=frozenset(): [u for u in users if u not in exclude]
    )
    monkeypatch.setattr(paths, "find_agent_socket", lambda pid: Path("/x") if pid in hellos else None)

    class FakeClient:
        def __init__(self, pid: int, **kw: object) -> None:
            self.pid = pid

        def __enter__(self) -> FakeClient:
            return self

        def __exit__(self, *a: object) -> None:
            return None

        def hello(self) -> agent_replies.HelloReply:
            return replies.hello(hellos[self.pid])

    monkeypatch.setattr(occupancy, "AgentClient", FakeClient)


def test_a_device_held_by_another_agent_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device-free check of every image: /proc finds the NPU users, their agents name their
    devices; one on a device of the image is refused, one without an agent is a note."""
    from npusnap_cli.device import occupancy

    m = _manifest()  # pid 1235 holds device 1
    hellos: dict[int, dict[str, Any]] = {4001: {"acl": {"devices": [1]}}}
    _fake_agents(monkeypatch, [4001, 4002], hellos)
    monkeypatch.setattr(occupancy, "driver_view", lambda pid, simulated: None)
    with pytest.raises(BusyError) as exc:
        restore.check_devices_free(m)
    assert "device 1 by pid 4001" in exc.value.message
    hellos[4001] = {"acl": {"devices": [0]}}
    notes = restore.check_devices_free(m)
    assert len(notes) == 1 and "4002" in notes[0] and "507909" in notes[0]


def test_devices_are_compared_as_the_node_s_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy in a container (its view: devices 1, or 2) says "device 0": it holds devices 1 and 2,
    not 0; a restore needing device 0 is not refused, one needing device 1 is, naming the host pid
    (and the namespace pid beside it)."""
    from npusnap_cli.device import occupancy

    views = {4001: [1], 4002: [2]}
    _fake_agents(monkeypatch, [4001, 4002], {p: {"acl": {"devices": [0]}} for p in views})
    monkeypatch.setattr(occupancy, "driver_view", lambda pid, simulated: views.get(pid))
    monkeypatch.setattr(occupancy, "node_devices", lambda simulated: [0, 1, 2, 3])
    monkeypatch.setattr(occupancy, "ns_pid", lambda pid: 1)
    base = _manifest()
    on0 = dataclasses.replace(base, processes=(dataclasses.replace(base.processes[1], devices=(0,)),))
    assert restore.check_devices_free(on0) == []
    with pytest.raises(BusyError) as exc:
        restore.check_devices_free(on0, ((0, 1),))
    assert "device 1 by pid 4001 (1 in its pid namespace)" in exc.value.message
    assert exc.value.details["busy"] == [{"device": 1, "pid": 4001, "ns_pid": 1}]
    # ASCEND_RT_VISIBLE_DEVICES=2: the image's device 0 is device 2
    vis = dataclasses.replace(on0, processes=(dataclasses.replace(on0.processes[0], visible_devices="2"),))
    with pytest.raises(BusyError) as exc:
        restore.check_devices_free(vis)
    assert "device 2 by pid 4002" in exc.value.message


def test_the_running_original_of_a_pid_ns_image_holds_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The original of a `--pid-ns` image keeps its host pid, which the manifest names: it is not
    the restore's own process, and its device is taken."""
    from npusnap_cli.device import occupancy

    base = _manifest()
    orig = base.processes[1].pid  # the NPU process, on device 1
    m = dataclasses.replace(base, pid_ns={str(base.processes[0].pid): 1, str(orig): 2})
    _fake_agents(monkeypatch, [orig], {orig: {"acl": {"devices": [1]}}})
    monkeypatch.setattr(occupancy, "driver_view", lambda pid, simulated: None)
    with pytest.raises(BusyError) as exc:
        restore.check_devices_free(m)
    assert f"device 1 by pid {orig}" in exc.value.message


def test_a_full_disk_during_criu_is_reported_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Exc(Exception):
        errno = 0

    log = tmp_path / "logs" / "dump.log"
    log.parent.mkdir()
    log.write_text("")  # CRIU could not write a line of it
    monkeypatch.setattr(criu_failures, "_free_bytes", lambda _p: 0)
    err = criu._criu_error("dump", Exc("Error(0): Unknown"), str(log), pid=42)
    assert "no space left" in err.message and "Unknown" not in err.message
    assert err.exit_code == ExitCode.PREFLIGHT and "df -h" in err.fix  # a full disk: 3 everywhere

    log.write_text("(00.1) Error (criu/image.c:1): Can't write: No space left on device\n")
    monkeypatch.setattr(criu_failures, "_free_bytes", lambda _p: 10 << 30)
    err = criu._criu_error("dump", Exc("Error(0): Unknown"), str(log), pid=42)
    assert "no space left" in err.message


def test_a_squatted_runtime_dir_is_reported(tmp_path: Path) -> None:
    squat = tmp_path / "npusnap"
    squat.mkdir(mode=0o700)
    assert paths.runtime_dir_problem(squat) is None
    os.chmod(squat, 0o777)
    assert "mode 777" in (paths.runtime_dir_problem(squat) or "")
    link = tmp_path / "link"
    link.symlink_to(squat)
    assert "not a real directory" in (paths.runtime_dir_problem(link) or "")
    if os.geteuid() == 0:
        os.chmod(squat, 0o700)
        os.chown(squat, 65534, 65534)
        assert "another user created it first" in (paths.runtime_dir_problem(squat) or "")
    env = dict(os.environ, NPUSNAP_RUNTIME_DIR=str(link))
    done = subprocess.run(
        [sys.executable, "-m", "npusnap_cli", "run", "--", "true"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == ExitCode.PREFLIGHT, done.stderr
    assert "runtime directory" in done.stderr


def test_restore_creates_no_parents_for_a_socket_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / "a" / "b" / "npusnap"
    monkeypatch.setenv("NPUSNAP_RUNTIME_DIR", str(deep))
    m = _manifest()
    procs = list(m.processes)
    procs[1] = dataclasses.replace(procs[1], agent_socket=str(deep / "1235.sock"))
    m = dataclasses.replace(m, processes=tuple(procs))
    from npusnap_cli.image import imagetrust

    imagetrust.check_manifest(m)  # a runtime dir of this host: allowed
    with pytest.raises(PreflightError, match="cannot create"):
        restore.prepare_sockets(m)
    assert not (tmp_path / "a").exists()
    (tmp_path / "a" / "b").mkdir(parents=True)
    restore.prepare_sockets(m)
    assert deep.is_dir() and oct(deep.stat().st_mode & 0o777) == "0o700"


def test_a_non_root_jobs_socket_dir_is_created_as_its_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restoring another user's job as root: its agents' directory (/tmp/npusnap-UID) is theirs,
    not root's 0700 (which would shut that user's agents and npusnap out)."""
    if os.geteuid() != 0:
        pytest.skip("only root restores another user's job")
    d = tmp_path / "npusnap"
    monkeypatch.setenv("NPUSNAP_RUNTIME_DIR", str(d))
    m = _manifest()
    procs = [dataclasses.replace(p, uid=65534) for p in m.processes]
    procs[1] = dataclasses.replace(procs[1], agent_socket=str(d / "1235.sock"))
    m = dataclasses.replace(m, processes=tuple(procs))
    restore.prepare_sockets(m)
    assert d.stat().st_uid == 65534 and oct(d.stat().st_mode & 0o777) == "0o700"
