"""Device occupancy as the node has it: copies in containers of the simulated NPU hold the
devices their containers hold (not the ids their programs use), and the running original of a
`--pid-ns` image holds its device; `restore --dry-run`, restore and `status` agree on it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import ExitCode
from npusnap_cli.host import procfs
from npusnap_cli.image import layout
from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    TRAIN,
    TRAIN_ARGS,
    agent_state,
    alive,
    cli,
    job_env,
    kill,
    private_sim,
    wait_until,
)
from tests.integration.test_pidns import lines, nspid, start_ns_job

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sim_env() -> Iterator[dict[str, str]]:
    """Four devices: the original on 0, copies on 1 and 2."""
    with private_sim(devices=4, capacity_bytes=64 << 20) as env:
        yield env


def _error(res: Any, err: str) -> Any:
    return (res or {}).get("error") or err


def _busy(res: Any) -> Any:
    """The refusal's error: the envelope's, or the devices check's of a dry run."""
    assert res is not None
    if res.get("error"):
        return res["error"]
    (check,) = [c for c in res["result"]["checks"] if c["name"] == "devices"]
    return check["error"]


def test_copies_in_containers_and_a_running_original_hold_their_own_devices(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    out = tmp_path / "job.out"
    img = str(tmp_path / "img")
    pid = start_ns_job(env, out, [PY, TRAIN, *TRAIN_ARGS, "--steps", "4000", "--device", "0"])
    roots: list[int] = []
    restored = 0
    try:
        wait_until(lambda: len(lines(out)) >= 3, 60, "steps")
        rc, res, err = cli(env, "dump", str(pid), img, "--leave-running")
        assert rc == 0, _error(res, err)

        # The original runs on device 0 under its host pid, which the image names: its device
        # is taken, for the dry run and the restore alike, and nothing is restored.
        for extra in (["--dry-run"], []):
            rc, res, err = cli(env, "restore", img, *extra)
            assert rc == ExitCode.BUSY, (extra, rc, _error(res, err))
            busy = _busy(res)
            assert busy["details"]["busy"] == [{"device": 0, "pid": pid, "ns_pid": 1}], busy
            assert f"stop pid {pid}" in busy["fix"]

        # Two copies beside it, in containers holding devices 1 and 2: each says "device 0".
        rc, res, err = cli(
            env, "restore", img, "--replicas", "2", "--device-map", "0=1", "--device-map", "0=2"
        )
        assert rc == 0 and res is not None, _error(res, err)
        roots = [int(r["root_pid"]) for r in res["result"]["replicas"]]
        for i, root in enumerate(roots):
            rc, st, err = cli(env, "status", str(root))
            assert rc == 0 and st is not None, err
            entry = st["result"]["processes"][0]
            assert (entry["pid"], entry["ns_pid"]) == (root, nspid(root)[-1]) == (root, 1)
            assert entry["devices"] == [i + 1] and entry["program_devices"] == [0], entry

        # A third copy onto device 1 is refused, naming the copy there by its host pid.
        rc, res, err = cli(env, "restore", img, "--device-map", "0=1", "--dry-run")
        assert rc == ExitCode.BUSY, _error(res, err)
        assert [b["pid"] for b in _busy(res)["details"]["busy"]] == [roots[0]]

        # Once the original is gone, device 0 is free, although both copies call theirs 0.
        kill(pid)
        rc, res, err = cli(env, "restore", img, "--dry-run")
        assert rc == 0, _error(res, err)
        rc, res, err = cli(env, "restore", img)
        assert rc == 0 and res is not None, _error(res, err)
        restored = int(res["result"]["root_pid"])
        rc, st, err = cli(env, "status", str(restored))
        assert rc == 0 and st is not None, err
        assert st["result"]["processes"][0]["devices"] == [0]
        rc, sim, err = cli(env, "sim", "status")
        assert rc == 0 and sim is not None, err
        owners = {d["id"]: {o["pid"] for o in d["owners"] if o["alive"]} for d in sim["result"]["devices"]}
        assert owners[0] == {restored} and owners[1] == {roots[0]} and owners[2] == {roots[1]}, owners
        assert all(alive(p) for p in (*roots, restored))
    finally:
        for p in (restored, *roots, pid):
            if p:
                kill(p)


def _owners(env: dict[str, str]) -> dict[int, set[int]]:
    rc, sim, err = cli(env, "sim", "status")
    assert rc == 0 and sim is not None, err
    return {d["id"]: {o["pid"] for o in d["owners"] if o["alive"]} for d in sim["result"]["devices"]}


def test_a_device_map_onto_no_device_is_refused_before_anything(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A device map onto a device the node lacks is refused by the dry run and the restore before
    anything is touched (exit 2)."""
    env = job_env(sim_env, runtime_dir)
    out = tmp_path / "job.out"
    img = str(tmp_path / "img")
    pid = start_ns_job(env, out, [PY, TRAIN, *TRAIN_ARGS, "--steps", "4000", "--device", "0"])
    blocker = 0
    try:
        wait_until(lambda: len(lines(out)) >= 3, 60, "steps")
        rc, res, err = cli(env, "dump", str(pid), img, "--leave-running")
        assert rc == 0, _error(res, err)
        before = _owners(env)
        sockets = sorted(p.name for p in runtime_dir.iterdir())

        for argv in (
            ["--device-map", "0=9", "--dry-run"],
            ["--device-map", "0=9"],
        ):
            rc, res, err = cli(env, "restore", img, *argv)
            assert rc == ExitCode.USAGE, (argv, rc, _error(res, err))
            got = _busy(res) if "--dry-run" in argv else res["error"]  # type: ignore[index]
            assert "does not have" in got["message"] and got["details"]["missing_devices"] == [9], got
            assert _owners(env) == before and sorted(p.name for p in runtime_dir.iterdir()) == sockets

        assert alive(pid)
    finally:
        for p in (blocker, pid):
            if p:
                kill(p)


def test_replicas_run_all_or_none(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """--replicas with one target device busy (or missing) is refused before any copy starts; a
    copy that fails after another was restored makes the other one stop again, and the envelope
    on stdout says so."""
    env = job_env(sim_env, runtime_dir)
    out = tmp_path / "job.out"
    img = str(tmp_path / "img")
    pid = start_ns_job(env, out, [PY, TRAIN, *TRAIN_ARGS, "--steps", "4000", "--device", "0"])
    blocker = 0
    try:
        wait_until(lambda: len(lines(out)) >= 3, 60, "steps")
        rc, res, err = cli(env, "dump", str(pid), img, "--leave-running")
        assert rc == 0, _error(res, err)
        before = _owners(env)
        rc, res, err = cli(
            env, "restore", img, "--replicas", "2", "--device-map", "0=1", "--device-map", "0=9"
        )
        assert rc == ExitCode.USAGE and res is not None, _error(res, err)
        assert _owners(env) == before

        blocker = start_ns_job(
            env, tmp_path / "b.out", [PY, TRAIN, *TRAIN_ARGS, "--steps", "4000", "--device", "2"]
        )
        wait_until(lambda: blocker in _owners(env)[2], 60, "the blocker on device 2")
        before = _owners(env)
        rc, res, err = cli(
            env, "restore", img, "--replicas", "2", "--device-map", "0=1", "--device-map", "0=2"
        )
        assert rc == ExitCode.BUSY and res is not None, _error(res, err)
        assert res["error"]["message"].startswith("replica 1: device(s) of the image are occupied")
        assert res["error"]["details"]["busy"][0]["pid"] == blocker
        assert _owners(env) == before

        # Replica 1's pidfile cannot be written (a directory is there): its restore fails while
        # replica 0's restores; replica 0 is stopped again and nothing runs.
        (tmp_path / "replica-1.pid").mkdir()
        rc, res, err = cli(
            env,
            "restore",
            img,
            "--replicas",
            "2",
            "--device-map",
            "0=1",
            "--device-map",
            "0=3",
            "--pidfile",
            str(tmp_path / "replica-{n}.pid"),
        )
        assert rc == ExitCode.USAGE and res is not None, _error(res, err)
        reps = res["error"]["details"]["replicas"]
        assert res["error"]["details"]["running"] == [] and "no replica runs" in res["error"]["why"]
        assert not reps[1]["ok"] and not reps[1]["stopped"]
        assert reps[0]["stopped"] and not reps[0]["ok"], reps[0]
        stopped = int(reps[0]["result"]["stopped_pid"])
        assert not alive(stopped) and not (tmp_path / "replica-0.pid").exists()
        assert f"stopped again (pids {stopped})" in res["error"]["why"]
        wait_until(lambda: _owners(env) == before, 20, "the devices as before")
        assert alive(pid) and alive(blocker)
    finally:
        for p in (blocker, pid):
            if p:
                kill(p)


def test_a_stuck_copy_is_named_by_its_host_pid(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A copy of a `--pid-ns` job is pid 1 in its namespace. When its lease's rollback fails (its
    device-memory file was moved away while its restore was stopped), the agent's message names
    the host pid to thaw, and that thaw brings the copy back once the file is there again."""
    env = job_env(sim_env, runtime_dir)
    out = tmp_path / "job.out"
    img = tmp_path / "img"
    pid = start_ns_job(env, out, [PY, TRAIN, *TRAIN_ARGS, "--steps", "4000", "--device", "3"])
    copy = 0
    try:
        wait_until(lambda: len(lines(out)) >= 3, 60, "steps")
        rc, res, err = cli(env, "dump", str(pid), str(img), "--lease", "3")
        assert rc == 0, _error(res, err)
        restore = subprocess.Popen(
            [NPUSNAP, "restore", str(img), "--json"],
            env={**env, "NPUSNAP_TEST_STOP_AT": "restore:device-restore"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        moved = tmp_path / "device-moved"
        try:
            wait_until(lambda: procfs.state(restore.pid) == "T", 120, "the restore to stop")
            (img / layout.DEVICE_SUBDIR).rename(moved)
            copies = [int(p) for p in subprocess.check_output(["pgrep", "-f", TRAIN], text=True).split()]
            (copy,) = [p for p in copies if p != pid and nspid(p)[-1] == 1]

            def events() -> str:
                with AgentClient(copy) as c:
                    return " ".join(c.status().events)

            wait_until(lambda: "lease rollback FAILED" in events(), 60, "the lease's rollback")
            assert f"run `npusnap thaw {copy}`" in events() and "thaw 1`" not in events(), events()
        finally:
            restore.kill()
            restore.wait(30)
        moved.rename(img / layout.DEVICE_SUBDIR)
        rc, res, err = cli(env, "thaw", "--force", str(copy))
        assert rc == 0, _error(res, err)
        assert agent_state(copy) == "RUNNING"
    finally:
        for p in (copy, pid):
            if p:
                kill(p)
