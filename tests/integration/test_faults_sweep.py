"""Kill and stop points across dump and restore: the job is never lost, never left stopped or
locked without a word, and the exit code is the documented one (docs/exit-codes.md).

A representative sweep, not every point: npusnap stopped for longer than the lease after the
lock, CRIU slow to start (a wrapper that sleeps before `criu swrk`), npusnap SIGKILLed while
CRIU starts, SIGTERM while a restore's device step waits, npusnap SIGKILLed while a restore's
tree is stopped for its checksums, a concurrent dump's and restore's losers. Each point uses the
training job of test_dump_failures (its uninterrupted run is the reference) and ends by checking
that the job, or its restored copy, computes correctly to the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from npusnap_cli.device.agent_client import PASSING_CLIENT_WAIT_S
from npusnap_cli.errors import ExitCode
from npusnap_cli.host import procfs
from npusnap_cli.image import layout, publishing
from npusnap_cli.image.manifest import SELF_HASH_KEY, _self_hash
from tests.conftest import requires_root
from tests.integration.agentlib import REPO, Sim, Workload, wait_socket, workload_env, write_workload
from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    TRAIN,
    Job,
    agent_state,
    alive,
    assert_no_image,
    cli,
    continues_reference,
    job_env,
    reference,
    wait_until,
)
from tests.integration.test_dump_failures import (
    ARGS,
    _start_dump,
    _wait_locked,
    faulty_job,
    finishes_correctly,
)

pytestmark = [pytest.mark.integration, requires_root]

SLOW_CRIU = """#!/bin/sh
# The real CRIU, but its RPC worker starts {delay} s late (a loaded host, a slow CRIU build).
if [ "$1" = swrk ]; then sleep {delay}; fi
exec {real} "$@"
"""


def _slow_criu(tmp_path: Path, delay: float) -> str:
    from npusnap_cli.criu import find_criu

    path = tmp_path / "criu"
    path.write_text(SLOW_CRIU.format(delay=delay, real=find_criu().path))
    path.chmod(0o755)
    return str(path)


def _restored_finishes(env: dict[str, str], job: Job, img: Path, ref: list[str], before: int) -> None:
    rc, out, err = cli(env, "restore", str(img))
    assert rc == 0 and out is not None, (out or {}).get("error") or err
    job.restored_pid = int(out["result"]["root_pid"])
    wait_until(lambda: not alive(job.restored_pid), 90, "the restored run to finish")
    continuation = job.lines()[before:]
    assert continuation and continues_reference(continuation, ref), continuation[:3]


def test_criu_slower_than_the_lease_still_dumps_a_locked_job(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """CRIU takes longer to start than the lease: the dump renews it while it waits, so the job is
    still locked when CRIU freezes it, and the image restores."""
    env = job_env(sim_env, runtime_dir, NPUSNAP_CRIU=_slow_criu(tmp_path, 3))
    ref = reference(job_env(sim_env, runtime_dir), ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--lease", "2")
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        _restored_finishes(job_env(sim_env, runtime_dir), job, img, ref, len(job.lines()))
    finally:
        job.cleanup()


def test_npusnap_stopped_longer_than_the_lease_fails_and_the_job_runs_on(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """npusnap is stopped, after the lock and while CRIU starts, for longer than the lease: the
    agent rolls the job back. The dump, resumed, must neither publish an image nor kill the job
    (exit 7, and it says so), even though CRIU then dumps the tree."""
    env = job_env(sim_env, runtime_dir, NPUSNAP_CRIU=_slow_criu(tmp_path, 1))
    ref = reference(job_env(sim_env, runtime_dir), ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        dump = _start_dump(env, job.pid, img, "--lease", "2")
        wait_until(lambda: _swrk_started(dump.pid), 30, "CRIU to be started")
        os.kill(dump.pid, signal.SIGSTOP)
        try:
            # The 2 s lease runs out with nobody renewing it (not asked meanwhile: a connection
            # of ours would be one more client in CRIU's way).
            time.sleep(3.5)
        finally:
            os.kill(dump.pid, signal.SIGCONT)
        stdout, _ = dump.communicate(timeout=60)
        assert dump.returncode == ExitCode.DEVICE, stdout
        assert "lost its lock" in stdout, stdout
        assert_no_image(img)
        finishes_correctly(job, ref)
    finally:
        job.cleanup()


def test_npusnap_killed_while_criu_starts_leaves_the_job_running_and_no_work_area(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir, NPUSNAP_CRIU=_slow_criu(tmp_path, 2))
    ref = reference(job_env(sim_env, runtime_dir), ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        dump = _start_dump(env, job.pid, img, "--lease", "2")
        wait_until(lambda: _swrk_started(dump.pid), 30, "CRIU to be started")
        dump.kill()
        dump.communicate()
        wait_until(lambda: agent_state(job.pid) == "RUNNING", 20, "the lease to roll the job back")
        assert not img.exists()
        finishes_correctly(job, ref)
        wait_until(lambda: not layout.temp_siblings(img), 20, "the dead dump's work area to go")
    finally:
        job.cleanup()


def _swrk_started(parent: int) -> bool:
    import psutil

    try:
        return any("swrk" in " ".join(c.cmdline()) for c in psutil.Process(parent).children(recursive=True))
    except psutil.Error:
        return False


def test_a_dump_waits_for_a_client_only_passing_by(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """An agent serves one client at a time. `npusnap ps`, `status` or another user's restore
    asking which devices are in use talk to it for a moment: a dump then waits for them instead
    of failing, for a while; a client that stays longer gets the dump refused as busy, with the
    job untouched."""
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "200", *ARGS[2:]]  # outlives two dumps and a refusal's wait
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    try:
        job.wait_lines(3)
        passing = socket.socket(socket.AF_UNIX)
        passing.connect(str(runtime_dir / f"{job.pid}.sock"))  # the agent takes clients in order
        closer = threading.Timer(0.8, passing.close)
        closer.start()
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running")
        closer.join()
        assert rc == 0, (out or {}).get("error") or err

        staying = socket.socket(socket.AF_UNIX)
        staying.connect(str(runtime_dir / f"{job.pid}.sock"))
        try:
            started = time.monotonic()
            rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img2"), "--leave-running")
            waited = time.monotonic() - started
        finally:
            staying.close()
        assert rc == ExitCode.BUSY and out is not None, (rc, out and out["error"], err)
        assert "another client" in out["error"]["message"], out["error"]
        assert waited >= PASSING_CLIENT_WAIT_S
        assert_no_image(tmp_path / "img2")
        finishes_correctly(job, ref)
    finally:
        job.cleanup()


def test_a_concurrent_dump_is_busy_and_the_first_succeeds(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A second dump of a job while the first holds its agent: exit 11, and the first is unharmed."""
    with faulty_job(sim_env, runtime_dir, tmp_path, "NPUSIM_BACKUP_HANG_MS=1500\n") as fj:
        first = _start_dump(fj.env, fj.job.pid, fj.img, "--leave-running")
        _wait_locked(fj.img, first)
        rc, out, err = cli(fj.env, "dump", str(fj.job.pid), str(tmp_path / "img2"), "--leave-running")
        assert rc == ExitCode.BUSY, (rc, out, err)
        stdout, _ = first.communicate(timeout=60)
        assert first.returncode == 0, stdout
        finishes_correctly(fj.job, fj.ref)


def test_restore_killed_while_criu_starts_leaves_nothing_behind(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """npusnap restore SIGKILLed while CRIU starts: no restored copy, stopped or not, and no CRIU
    left running; the image is intact and a new restore brings the job back."""
    env = job_env(sim_env, runtime_dir)
    ref = reference(env, ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        before = len(job.lines())
        slow = job_env(sim_env, runtime_dir, NPUSNAP_CRIU=_slow_criu(tmp_path, 1.5))
        restore = subprocess.Popen(
            [NPUSNAP, "restore", str(img), "--json"], env=slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        wait_until(lambda: _swrk_started(restore.pid), 30, "CRIU to be started")
        import psutil

        # (not the stop guard's watcher: it waits for a restored tree that never comes)
        criu = [
            c
            for c in psutil.Process(restore.pid).children(recursive=True)
            if "stopguard" not in " ".join(c.cmdline())
        ]
        restore.kill()
        restore.communicate()
        wait_until(
            lambda: not any(c.is_running() and c.status() != "zombie" for c in criu), 20, "CRIU to end"
        )
        assert not alive(job.pid) and not _stopped(job.pid)
        _restored_finishes(env, job, img, ref, before)
    finally:
        job.cleanup()


def _tracer(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def _stopped(pid: int) -> bool:
    return procfs.state(pid) in ("T", "t")


@pytest.mark.parametrize("stopped", [False, True], ids=["agent-busy", "agent-stopped"])
def test_sigterm_during_the_device_restore_ends_with_the_recovery_commands(
    sim: Sim, runtime_dir: Path, tmp_path: Path, workloads: list[Workload], stopped: bool
) -> None:
    """The restored agent is busy in a slow post_restore hook (and, in one case, its process is
    stopped by someone else) when restore gets SIGTERM: restore does not wait out the agent's
    900 s; it returns at once, says the tree stays locked and prints the commands that recover it;
    following them, the job runs on correctly."""
    started = tmp_path / "hook-started"
    hook = tmp_path / "slowhook.py"
    hook.write_text(
        "import os, time\n"
        "import npusnap_cli.agent as agent\n"
        "def slow():\n"
        f"    open({str(started)!r}, 'w').close()\n"
        "    time.sleep(3)\n"
        "agent.register_hook('post_restore', slow, name='slow')\n"
        "agent.start(hook_timeout_s=30)\n"
    )
    env = workload_env(sim, runtime_dir, PYTHONPATH=f"{tmp_path}:{REPO}", WL_START_AGENT="1")
    script = write_workload(tmp_path)
    script.write_text("import slowhook\n" + script.read_text())
    w = Workload([PY, str(script)], env, tmp_path)
    workloads.append(w)
    w.wait_for("ready")
    wait_socket(runtime_dir, w.pid)
    w.wait_steps(2)
    img = tmp_path / "img"
    rc, out, err = cli(env, "dump", str(w.pid), str(img), "--device-memory", "app")
    assert rc == 0, (out or {}).get("error") or err
    w.proc.wait(10)
    restore = subprocess.Popen(
        [NPUSNAP, "restore", str(img), "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: started.exists() or restore.poll() is not None, 60, "the restored agent's hook")
    assert restore.poll() is None, restore.communicate()
    if stopped:
        os.kill(w.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    restore.send_signal(signal.SIGTERM)
    stdout, stderr = restore.communicate(timeout=30)
    assert time.monotonic() - t0 < 10, "restore waited on after SIGTERM"
    assert restore.returncode == ExitCode.INTERRUPTED, (stdout, stderr)
    error = json.loads(stdout)["error"]
    assert "stay locked" in error["message"], error
    commands = error["details"]["recovery_commands"]
    assert f"kill -CONT {w.pid}" in commands and f"npusnap thaw --force {w.pid}" in commands, commands
    os.kill(w.pid, signal.SIGCONT)
    time.sleep(3.5)  # the hook ends; the agent finishes the restore it was asked for
    rc, _, err = cli(env, "thaw", "--force", str(w.pid))
    assert rc == 0, err
    assert agent_state(w.pid) == "RUNNING"
    w.wait_steps(3)
    # --device-memory app: the device memory is this workload's to reload, and it does not; its
    # steps go on from where the dump took them, none lost or repeated.
    numbers = [n for n, _ in w.steps()]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers


MANY_ALLOCS = """
import ctypes, os
lib = ctypes.CDLL("libacl_rt.so")
assert lib.aclInit(None) == 0 and lib.aclrtSetDevice(int(os.environ["WL_DEVICE"])) == 0
lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
p = ctypes.c_void_p()
for _ in range(1000):
    assert lib.aclrtMalloc(ctypes.byref(p), 4096, 0) == 0
print("allocated", flush=True)
os._exit(0)  # gone without freeing: the daemon keeps (and poisons) every allocation
"""


def test_the_simulator_daemon_stays_idle_after_a_job_with_many_allocations(
    sim: Sim, runtime_dir: Path, tmp_path: Path
) -> None:
    """A thousand small allocations of a job that exits: the daemon poisons what it keeps without
    holding a core, answers status at once, and is idle again within a second."""
    import psutil

    from npusnap_sim import wire

    sock = sim.env["NPUSIM_SOCKET"]
    daemon = next(p for p in psutil.process_iter(["cmdline"]) if sock in " ".join(p.info["cmdline"] or []))
    script = tmp_path / "many.py"
    script.write_text(MANY_ALLOCS)
    env = workload_env(sim, runtime_dir)
    out = subprocess.run([PY, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "allocated" in out.stdout, out.stderr
    t0 = time.monotonic()
    assert wire.query_status(sock, timeout=2.0) is not None
    assert time.monotonic() - t0 < 2.0
    time.sleep(1.0)
    before = sum(daemon.cpu_times()[:2])
    time.sleep(2.0)
    busy = sum(daemon.cpu_times()[:2]) - before
    assert busy < 0.2, f"the daemon used {busy:.2f} s of CPU in 2 s while idle"


@pytest.mark.parametrize("plugins", [("npusim_plugin.so",), ("npusim_plugin.so", "npusnap_plugin.so")])
def test_another_client_of_the_agent_during_criu_is_busy_not_ext_unix_sk(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, plugins: tuple[str, ...]
) -> None:
    """A second command connected to the job's agent while CRIU dumps (CRIU sees a socket to
    outside the tree; npusnap's CRIU plugin, where present, finds the agent busy): exit 11, not
    CRIU's advice to add --ext-unix-sk; the job is rolled back and runs on."""
    import socket
    import threading

    from tests.conftest import plugin_dir_with

    libs = str(plugin_dir_with(tmp_path, *plugins))
    env = job_env(sim_env, runtime_dir, NPUSNAP_CRIU=_slow_criu(tmp_path, 1), CRIU_LIBS_DIR=libs)
    ref = reference(job_env(sim_env, runtime_dir), ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        dump = _start_dump(env, job.pid, img)
        wait_until(lambda: _swrk_started(dump.pid), 30, "CRIU to be started")
        other = socket.socket(socket.AF_UNIX)
        other.connect(str(runtime_dir / f"{job.pid}.sock"))
        threading.Timer(4.5, other.close).start()  # the other command ends a while later
        stdout, _ = dump.communicate(timeout=90)
        assert dump.returncode == ExitCode.BUSY, stdout
        assert "--ext-unix-sk would not help" in stdout, stdout
        assert_no_image(img)
        finishes_correctly(job, ref)
    finally:
        job.cleanup()


def test_two_restores_of_one_image_one_wins_the_other_is_busy(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    ref = reference(env, ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        before = len(job.lines())
        argv = [NPUSNAP, "-v", "restore", str(img), "--json"]
        both = [
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        outputs = [p.communicate(timeout=90) for p in both]
        results = [(p.returncode, o) for p, (o, _e) in zip(both, outputs)]
        codes = sorted(rc for rc, _ in results)
        # On failure: each restore's error and the end of its log (a traceback, for exit 1).
        said = [
            (rc, json.loads(o or "{}").get("error"), e[-3000:]) for (rc, o), (_o, e) in zip(results, outputs)
        ]
        assert codes == [0, ExitCode.BUSY], said
        won = next(json.loads(o) for rc, o in results if rc == 0)
        job.restored_pid = int(won["result"]["root_pid"])
        wait_until(lambda: not alive(job.restored_pid), 90, "the restored run to finish")
        continuation = job.lines()[before:]
        assert continuation and continues_reference(continuation, ref), continuation[:3]
    finally:
        job.cleanup()


def test_a_restored_tree_whose_lock_is_not_the_dumps_is_state_unknown_with_commands(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The manifest's lock token does not match the restored agent's (an edited manifest, or a
    dump that lost its lock to another owner): not "nothing was changed" (11) but 9, with the
    commands that recover the restored, locked tree; they work."""
    env = job_env(sim_env, runtime_dir)
    ref = reference(env, ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        before = len(job.lines())
        d = json.loads(layout.manifest_path(img).read_text())
        d.pop(SELF_HASH_KEY)
        for p in d["processes"]:
            if p.get("lock_token"):
                p["lock_token"] = "0" * 32
        d[SELF_HASH_KEY] = _self_hash(d)
        layout.manifest_path(img).write_text(json.dumps(d))
        rc, out, err = cli(env, "restore", str(img))
        assert rc == ExitCode.STATE_UNKNOWN and out is not None, (rc, out, err)
        commands = out["error"]["details"]["recovery_commands"]
        assert f"npusnap thaw --force {job.pid}" in commands, commands
        assert "nothing was changed" not in out["error"]["message"]
        rc, _, err = cli(env, "thaw", "--force", str(job.pid))
        assert rc == 0, err
        job.restored_pid = job.pid
        wait_until(lambda: not alive(job.pid), 90, "the restored run to finish")
        continuation = job.lines()[before:]
        assert continuation and continues_reference(continuation, ref), continuation[:3]
    finally:
        job.cleanup()


def test_a_full_disk_in_export_and_import_is_exit_3_and_leaves_nothing(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    from tests.integration.test_dump_failures import tmpfs
    from tests.unit.test_image import _build, _manifest

    tmp, final = _build(tmp_path, "big")
    (layout.criu_dir(tmp) / "pages-2.img").write_bytes(os.urandom(3 << 20))  # does not compress
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    with tmpfs(tmp_path / "small", "1m") as small:
        rc, out, err = cli(sim_env, "export", str(final), str(small / "a.tar.zst"))
        assert rc == ExitCode.PREFLIGHT and out is not None, (rc, err)
        assert "no space left" in out["error"]["message"] and "free space" in out["error"]["fix"]
        assert list(small.iterdir()) == []
        arch = tmp_path / "a.tar.zst"
        rc, out, err = cli(sim_env, "export", str(final), str(arch))
        assert rc == 0, err
        rc, out, err = cli(sim_env, "import", str(arch), str(small / "img"))
        assert rc == ExitCode.PREFLIGHT and out is not None, (rc, err)
        assert "no space left" in out["error"]["message"], out["error"]
        assert list(small.iterdir()) == []


def test_a_job_killed_during_the_dump_is_never_reported_running(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    with faulty_job(sim_env, runtime_dir, tmp_path, "NPUSIM_BACKUP_HANG_MS=1500\n") as fj:
        dump = _start_dump(fj.env, fj.job.pid, fj.img)
        _wait_locked(fj.img, dump)
        time.sleep(0.3)
        os.kill(fj.job.pid, signal.SIGKILL)
        stdout, _ = dump.communicate(timeout=60)
        assert dump.returncode in (ExitCode.TARGET, ExitCode.AGENT), stdout
        error = json.loads(stdout)["error"]
        assert "is running" not in error["message"] and "exited during the dump" in error["message"], error
        assert error["details"]["exited"] == [fj.job.pid] and error["details"]["rolled_back"] == []
        assert_no_image(fj.img)
