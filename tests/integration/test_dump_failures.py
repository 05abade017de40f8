"""Every way a dump can fail ends with the job running, unlocked and computing correctly, no image
left behind, and the exit code of the failed stage. Bad input changes nothing at all.

Device faults come from the simulator's switches (NPUSIM_FAULT_FILE, re-read on every snapshot
call); a slow Backup (NPUSIM_BACKUP_HANG_MS) opens a window to kill or interrupt things mid-dump.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import ExitCode
from npusnap_cli.image import layout
from tests.conftest import plugin_dir_with, requires_root
from tests.integration.dumplib import (
    LAUNCHER,
    NPUSNAP,
    PY,
    TRAIN,
    TRAIN_ARGS,
    Job,
    agent_state,
    alive,
    assert_no_image,
    cli,
    crashing_criu,
    job_env,
    kill,
    reference,
    wait_until,
)

pytestmark = [pytest.mark.integration, requires_root]
ARGS = ["--steps", "60", *TRAIN_ARGS, "--device", "0", "--seed", "7"]


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *, ro: bool = False) -> Iterator[Path]:
    path.mkdir()
    opts = f"size={size},mode=0755" + (",ro" if ro else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def finishes_correctly(job: Job, ref: list[str]) -> None:
    """The job runs on, unlocked, to the end, printing exactly the uninterrupted run's lines (on a
    busy machine it may have got there already: then its exit status and lines say it ran on)."""
    if alive(job.pid):
        assert agent_state(job.pid) == "RUNNING"
    assert job.reap(120) == 0  # 32 MiB bigint steps take seconds each on a loaded 2-core machine
    assert job.lines() == ref


def free_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid  # reaped: no process has it now (pids are not reused this quickly)


def test_bad_input_is_refused_and_changes_nothing(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    # Long enough to outlive six refused dumps on a loaded machine.
    args = ["--steps", "200", *ARGS[2:]]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    plain = subprocess.Popen(["sleep", "60"], start_new_session=True)
    no_agent_dir = tmp_path / "noagent"
    no_agent_dir.mkdir()
    no_agent = Job(no_agent_dir, env, [PY, TRAIN, "--steps", "0", *TRAIN_ARGS, "--device", "1"], agent=False)
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        no_agent.wait_lines(1)

        rc, out, _ = cli(env, "dump", str(free_pid()), str(img))
        assert rc == ExitCode.TARGET and out is not None and "no process" in out["error"]["message"]

        rc, out, _ = cli(env, "dump", str(plain.pid), str(img))
        assert rc == ExitCode.TARGET and out is not None and "no NPU process" in out["error"]["message"]
        assert plain.poll() is None

        rc, out, _ = cli(env, "dump", str(no_agent.pid), str(img), "--no-attach")
        assert rc == ExitCode.TARGET and out is not None
        assert "without an agent" in out["error"]["message"]
        assert f"npusnap attach {no_agent.pid}" in out["error"]["fix"]

        full = tmp_path / "full"
        full.mkdir()
        (full / "keep.txt").write_text("precious")
        rc, out, _ = cli(env, "dump", str(job.pid), str(full))
        assert rc == ExitCode.USAGE and out is not None and "not empty" in out["error"]["message"]
        assert (full / "keep.txt").read_text() == "precious"

        with tmpfs(tmp_path / "ro", "1m", ro=True) as ro:
            rc, out, _ = cli(env, "dump", str(job.pid), str(ro / "img"))
            assert rc == ExitCode.USAGE and out is not None and "read-only" in out["error"]["message"]

        with tmpfs(tmp_path / "tiny", "4m") as tiny:
            rc, out, _ = cli(env, "dump", str(job.pid), str(tiny / "img"))
            assert rc == ExitCode.PREFLIGHT and out is not None, ((out or {}).get("error"), job.text()[-400:])
            assert "not enough free space" in out["error"]["message"]
            assert_no_image(tiny / "img")

        assert_no_image(img)
        finishes_correctly(job, ref)
    finally:
        plain.kill()
        plain.wait()
        no_agent.cleanup()
        job.cleanup()


def test_shared_session_is_refused_before_the_lock(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A job that shares its launcher's session: preflight says --shell-job before anything is
    locked (CRIU would refuse after the freeze); with --shell-job dump and restore work."""
    env = job_env(sim_env, runtime_dir)
    ref = reference(env, ARGS)
    # `npusnap run` makes the launcher sh (a session leader) start the workload with an agent.
    launcher = Job(tmp_path, env, ["sh", "-c", '"$@" & wait', "sh", PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        launcher.wait_lines(3)
        (child,) = [c.pid for c in psutil.Process(launcher.pid).children() if TRAIN in " ".join(c.cmdline())]
        rc, out, _ = cli(env, "dump", str(child), str(img))
        assert rc == ExitCode.PREFLIGHT, out
        assert out is not None and "not a session leader" in out["error"]["message"]
        assert "--shell-job" in out["error"]["fix"]
        assert_no_image(img)
        # Refused before the lock: the job ran on and the agent holds no lease.
        with AgentClient(child) as c:
            status = c.status()
        assert status.state == "RUNNING" and not status.lease.active, status
        # With --shell-job the dump works; the image remembers it, and restore needs nothing more.
        rc, out, _ = cli(env, "dump", "--shell-job", str(child), str(img))
        assert rc == ExitCode.OK, out
        assert launcher.reap(30) == 0  # the launcher's only child was dumped and is gone
        rc, out, _ = cli(env, "restore", str(img))
        assert rc == ExitCode.OK, out
        launcher.restored_pid = child
        assert out is not None and out["result"]["root_pid"] == child
        wait_until(lambda: not alive(child), 30, "the restored run to finish")
        assert launcher.lines() == ref
    finally:
        launcher.cleanup()


# The training job behind a connection to a peer outside its tree: a unix socket path, or a
# TCP port on 127.0.0.1.
PEER_WRAPPER = """
import runpy, socket, sys
peer = sys.argv[1]
if peer.startswith("/"):
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(peer)
else:
    conn = socket.create_connection(("127.0.0.1", int(peer)))
train = sys.argv[2]
sys.argv = [train] + sys.argv[3:]
runpy.run_path(train, run_name="__main__")
"""


@contextlib.contextmanager
def job_with_outside_peer(tmp_path: Path, env: dict[str, str], listener: socket.socket) -> Iterator[Job]:
    """The job of ARGS connected to ``listener`` (listening; closed afterwards), once the
    connection is accepted and three steps are out."""
    addr = listener.getsockname()
    peer = addr if isinstance(addr, str) else str(addr[1])
    wrapper = tmp_path / "peer_train.py"
    wrapper.write_text(PEER_WRAPPER)
    job = Job(tmp_path, env, [PY, str(wrapper), peer, TRAIN, *ARGS])
    conn = None
    try:
        conn, _ = listener.accept()
        job.wait_lines(3)
        yield job
    finally:
        if conn is not None:
            conn.close()
        listener.close()
        job.cleanup()


def test_criu_refusal_rolls_back(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """A connection to a unix socket outside the tree: CRIU refuses it (without --ext-unix-sk)
    after the lock; the dump rolls back, keeps CRIU's log and the job finishes correctly."""
    env = job_env(sim_env, runtime_dir)
    ref = reference(env, ARGS)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "outside.sock"))
    listener.listen(1)
    img = tmp_path / "img"
    with job_with_outside_peer(tmp_path, env, listener) as job:
        rc, out, _ = cli(env, "dump", str(job.pid), str(img))
        assert rc == ExitCode.CRIU
        assert out is not None
        err = out["error"]
        # CRIU suggests --ext-unix-sk, which cannot save a stream connection: the fix says so
        assert "with or without --ext-unix-sk" in err["fix"] and "outside.sock" in err["fix"], err
        assert err["details"]["rolled_back"] == [job.pid]
        # The log survives the removed partial image, and the error points at it.
        assert Path(err["details"]["criu_log"]).is_file()
        assert any("Error" in line for line in err["details"]["criu_log_excerpt"])
        assert_no_image(img)
        finishes_correctly(job, ref)


def test_a_tcp_connection_to_outside_is_refused_before_the_lock(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """An established TCP connection whose peer is outside the tree: CRIU would refuse it after
    the lock (it needs --tcp-established); preflight refuses it first, naming it and the fix,
    and nothing is locked or written. (Connections with both ends in the tree are dumped with
    --tcp-established by themselves: test_torch_npu_ddp.py.)"""
    env = job_env(sim_env, runtime_dir)
    ref = reference(env, ARGS)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    img = tmp_path / "img"
    with job_with_outside_peer(tmp_path, env, listener) as job:
        rc, out, _ = cli(env, "dump", str(job.pid), str(img))
        assert rc == ExitCode.PREFLIGHT
        assert out is not None
        err = out["error"]
        assert "TCP connection" in err["message"] and f":{port}" in err["message"], err
        assert "outside the tree" in err["message"], err
        assert "--tcp-established" in err["fix"]
        assert [c["pid"] for c in err["details"]["connections"]] == [job.pid], err["details"]
        assert_no_image(img)
        assert agent_state(job.pid) == "RUNNING"
        finishes_correctly(job, ref)


def _start_dump(env: dict[str, str], pid: int, img: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [NPUSNAP, "dump", str(pid), str(img), "--json", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@dataclass
class FaultyJob:
    """The training job, its simulator's fault switches (NPUSIM_FAULT_FILE), the uninterrupted run's
    lines, and where its image goes."""

    faults: Path
    env: dict[str, str]
    ref: list[str]
    job: Job
    img: Path

    def set_faults(self, text: str) -> None:
        self.faults.write_text(text)


@contextlib.contextmanager
def faulty_job(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, faults: str = ""
) -> Iterator[FaultyJob]:
    """The job of ARGS, three steps in, its fault file holding ``faults``; cleaned up after."""
    path = tmp_path / "faults"
    path.write_text(faults)
    env = job_env(sim_env, runtime_dir, NPUSIM_FAULT_FILE=str(path))
    ref = reference(job_env(sim_env, runtime_dir), ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    try:
        job.wait_lines(3)
        yield FaultyJob(path, env, ref, job, tmp_path / "img")
    finally:
        job.cleanup()


def _wait_locked(img: Path, dump: subprocess.Popen[str]) -> None:
    """The work area appears right before the lock: from then on the dump is in its critical part."""
    wait_until(lambda: bool(layout.temp_siblings(img)) or dump.poll() is not None, 20, "the dump to start")
    assert dump.poll() is None, dump.communicate()


def test_disk_full_during_criu_rolls_back(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    with faulty_job(sim_env, runtime_dir, tmp_path, "NPUSIM_BACKUP_HANG_MS=1500\n") as fj:
        with tmpfs(tmp_path / "small", "96m") as small:
            img = small / "img"
            dump = _start_dump(fj.env, fj.job.pid, img)
            _wait_locked(img, dump)
            # Someone else fills the disk while the device is being backed up.
            free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
            fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
            os.posix_fallocate(fd, 0, free - (256 << 10))
            os.close(fd)
            stdout, _ = dump.communicate(timeout=60)
            assert dump.returncode == ExitCode.PREFLIGHT, stdout  # a full disk: 3 in every command
            assert_no_image(img)
        finishes_correctly(fj.job, fj.ref)


@pytest.mark.parametrize(
    ("fault", "call"),
    [("NPUSIM_FAULT_LOCK_TIMEOUT", "Lock"), ("NPUSIM_FAULT_BACKUP", "Backup")],
)
def test_device_call_failure_rolls_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, fault: str, call: str
) -> None:
    with faulty_job(sim_env, runtime_dir, tmp_path) as fj:
        # The runtime's own wait for a thread that never parks is 60 s; 2 s fail the same way.
        fj.set_faults(f"{fault}=1\nNPUSIM_LOCK_WAIT_MS=2000\n")
        rc, out, _ = cli(fj.env, "dump", str(fj.job.pid), str(fj.img))
        fj.set_faults("")
        assert rc == ExitCode.DEVICE, out
        assert out is not None and "rolled back" in out["error"]["message"]
        assert out["error"]["details"]["agent_error"]["code"] in (507905, 507908)
        assert_no_image(fj.img)
        finishes_correctly(fj.job, fj.ref)


def test_unlock_failure_after_leave_running_is_state_unknown_then_thaw_recovers(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    with faulty_job(sim_env, runtime_dir, tmp_path) as fj:
        fj.set_faults("NPUSIM_FAULT_UNLOCK=1\n")
        rc, out, _ = cli(fj.env, "dump", str(fj.job.pid), str(fj.img), "--leave-running")
        assert rc == ExitCode.STATE_UNKNOWN, out
        assert out is not None
        err = out["error"]
        assert f"npusnap thaw {fj.job.pid}" in err["fix"]
        assert f"npusnap status {fj.job.pid}" in err["fix"]
        assert_no_image(fj.img)
        # says it like it is, and what status says a moment later: stuck in that state
        state = agent_state(fj.job.pid)
        assert state in ("LOCKED", "BACKED_UP")
        assert f"pid {fj.job.pid} is {state}" in err["message"], err["message"]
        assert err["details"]["states"] == {str(fj.job.pid): state}
        fj.set_faults("")
        rc, _, errtext = cli(fj.env, "thaw", str(fj.job.pid))
        assert rc == 0, errtext
        finishes_correctly(fj.job, fj.ref)


def test_sigint_mid_dump_rolls_back(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    with faulty_job(sim_env, runtime_dir, tmp_path, "NPUSIM_BACKUP_HANG_MS=1000\n") as fj:
        dump = _start_dump(fj.env, fj.job.pid, fj.img)
        _wait_locked(fj.img, dump)
        dump.send_signal(signal.SIGINT)
        stdout, _ = dump.communicate(timeout=60)
        assert dump.returncode == ExitCode.INTERRUPTED, stdout
        assert_no_image(fj.img)
        finishes_correctly(fj.job, fj.ref)


def test_cli_sigkilled_mid_dump_lease_rolls_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    with faulty_job(sim_env, runtime_dir, tmp_path, "NPUSIM_BACKUP_HANG_MS=1000\n") as fj:
        dump = _start_dump(fj.env, fj.job.pid, fj.img, "--lease", "2")
        _wait_locked(fj.img, dump)
        dump.kill()
        dump.communicate()
        # Nobody renews the lease: the agent rolls its process back by itself.
        wait_until(lambda: agent_state(fj.job.pid) == "RUNNING", 20, "the lease to roll the job back")
        assert not fj.img.exists()
        # The killed CLI's stop guard removes its work area once the job runs again (or the next
        # dump does, whichever comes first).
        fj.set_faults("")
        rc, out, errtext = cli(fj.env, "dump", str(fj.job.pid), str(fj.img), "--leave-running")
        assert rc == 0, (out or {}).get("error") or errtext
        wait_until(lambda: not layout.temp_siblings(fj.img), 20, "the dead dump's work area to go")
        finishes_correctly(fj.job, fj.ref)


def _tracer(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def test_cli_sigkilled_while_criu_holds_the_job(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Killed after the lock, with CRIU seizing the tree (which it leaves *stopped*): the stop
    guard resumes the job once CRIU lets go, and the lease then rolls the device back."""
    env = job_env(sim_env, runtime_dir)
    args = [
        "--steps",
        "24",  # 32 MiB steps take a quarter second each: the job outlives the dump
        "--interval",
        "0.05",
        "--param-bytes",
        str(32 << 20),
        "--device",
        "0",
        "--seed",
        "7",
    ]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        dump = _start_dump(env, job.pid, img, "--lease", "2")
        deadline = time.monotonic() + 30
        while _tracer(job.pid) == 0 and dump.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)  # CRIU holds the job for a fraction of a second: poll tightly
        assert dump.poll() is None, "the dump finished before it could be killed"
        dump.kill()
        dump.communicate()
        wait_until(lambda: agent_state(job.pid) == "RUNNING", 30, "the job to be resumed and rolled back")
        assert not img.exists()
        finishes_correctly(job, ref)
    finally:
        job.cleanup()


def test_worker_killed_mid_dump_rolls_back_the_other(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    faults = tmp_path / "faults"
    faults.write_text("NPUSIM_BACKUP_HANG_MS=1500\n")
    env = job_env(sim_env, runtime_dir, NPUSIM_FAULT_FILE=str(faults))
    # Rank 0 must still be running after the dump's 1.5 s Backup, its rollback and the checks
    # below, on a busy machine too: 150 steps are 7.5 s of its life.
    steps = ["--steps", "150", *TRAIN_ARGS]
    ref0 = [
        f"[rank 0] {ln}"
        for ln in reference(job_env(sim_env, runtime_dir), [*steps, "--device", "0", "--seed", "0"])
    ]
    job = Job(tmp_path, env, [PY, LAUNCHER, *steps, "--devices", "0,1"])
    img = tmp_path / "img"
    try:
        wait_until(lambda: sum(ln.startswith("[rank 1]") for ln in job.lines()) >= 3, 20, "rank 1")
        wait_until(lambda: sum(ln.startswith("[rank 0]") for ln in job.lines()) >= 3, 20, "rank 0")
        workers = sorted(c.pid for c in psutil.Process(job.pid).children())
        assert len(workers) == 2
        dump = _start_dump(env, job.pid, img)
        _wait_locked(img, dump)
        kill(workers[1])
        stdout, _ = dump.communicate(timeout=60)
        assert dump.returncode in (ExitCode.AGENT, ExitCode.TARGET), stdout
        assert str(workers[1]) in stdout
        assert_no_image(img)
        assert alive(workers[0]) and agent_state(workers[0]) == "RUNNING"
        wait_until(lambda: not alive(workers[0]), 30, "rank 0 to finish")
        assert [ln for ln in job.lines() if ln.startswith("[rank 0]")] == ref0
    finally:
        job.cleanup()


def test_criu_crash_rolls_back(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    env = job_env(sim_env, runtime_dir, NPUSNAP_CRIU=str(crashing_criu(tmp_path / "criu")))
    ref = reference(env, ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, _ = cli(env, "dump", str(job.pid), str(img))
        assert rc == ExitCode.CRIU, out
        assert out is not None and out["error"]["kind"] == "criu"
        assert out["error"]["details"]["rolled_back"] == [job.pid]
        assert_no_image(img)
        finishes_correctly(job, ref)
    finally:
        job.cleanup()


# A device plugin that takes the simulated NPU's connection but writes none of its image files:
# CRIU's dump goes through, and only the dump-log/image scan (as Huawei's GRUS does it) notices.
SILENT_SIM_PLUGIN = r"""
#include <errno.h>
#include <criu-plugin.h>
static int init(int stage) { (void)stage; return 0; }
static void fini(int stage, int ret) { (void)stage; (void)ret; }
static int dump_unix_sk(int fd, int id) { (void)fd; (void)id; return 0; }
CR_PLUGIN_REGISTER("npusim_plugin", init, fini)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__DUMP_UNIX_SK, dump_unix_sk)
"""


def test_dump_refuses_a_simulated_npu_without_its_criu_plugin(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The simulated runtime keeps its device connection across Backup; with no npusim_plugin.so
    where CRIU loads plugins, dump's preflight refuses before anything is locked."""
    empty = plugin_dir_with(tmp_path)
    env = job_env(sim_env, runtime_dir, CRIU_LIBS_DIR=str(empty))
    ref = reference(env, ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, _ = cli(env, "dump", str(job.pid), str(img))
        assert rc == ExitCode.PREFLIGHT
        assert out is not None
        err = out["error"]
        assert "CRIU has no plugin for its device connection" in err["message"]
        assert "npusim_plugin.so" in err["why"] and str(empty) in err["why"]
        assert "setup.sh" in err["fix"]
        assert agent_state(job.pid) == "RUNNING"
        assert_no_image(img)
        finishes_correctly(job, ref)
    finally:
        job.cleanup()


def test_a_device_plugin_that_leaves_no_image_fails_the_dump_and_rolls_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    from npusnap_cli.host import criuplugin

    header = next(
        (Path(t.format(version="4.2.1")) for t in criuplugin.HEADER_CANDIDATES
         if Path(t.format(version="4.2.1")).is_file()),
        None,
    )  # fmt: skip
    if header is None:
        pytest.skip("no criu-plugin.h of CRIU 4.2.1 (scripts/setup.sh builds CRIU in /var/cache/npusnap)")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    src = tmp_path / "silent.c"
    src.write_text(SILENT_SIM_PLUGIN)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-idirafter", str(header.parent), "-o", str(plugins / "npusim_plugin.so"),
         str(src)],
        check=True, timeout=60,
    )  # fmt: skip
    env = job_env(sim_env, runtime_dir, CRIU_LIBS_DIR=str(plugins))
    ref = reference(env, ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, _ = cli(env, "dump", str(job.pid), str(img))
        assert rc == ExitCode.CRIU, out
        assert out is not None
        err = out["error"]
        assert "did not dump the device handles cleanly" in err["message"]
        assert "npusim-dev-*.img" in err["message"]
        assert err["details"]["rolled_back"] == [job.pid]
        assert_no_image(img)
        finishes_correctly(job, ref)
    finally:
        job.cleanup()


def test_a_thaw_force_during_the_dump_fails_it_loudly(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """`thaw --force` while the dump holds the lock, before CRIU froze the job (CRIU held back by
    a wrapper): the dump must not publish an image of a job that ran unlocked. It fails with 7,
    names the thaw, leaves no image, and the job runs on."""
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, "--steps", "4000", *TRAIN_ARGS, "--device", "1"])
    img = tmp_path / "img"
    token = tmp_path / "hold-once"
    token.write_text("")
    wrapper = tmp_path / "criu-wrapper"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = swrk ] && mv "{token}" "{token}.held" 2>/dev/null; then\n'
        f'  while [ ! -e "{token}.go" ]; do sleep 0.05; done\n'
        "fi\n"
        'exec /usr/local/sbin/criu "$@"\n'
    )
    wrapper.chmod(0o755)
    try:
        job.wait_lines(3)
        dump = subprocess.Popen(
            [NPUSNAP, "dump", str(job.pid), str(img), "--json"],
            env={**env, "NPUSNAP_CRIU": str(wrapper)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(lambda: Path(f"{token}.held").exists(), 60, "the dump's CRIU to be held")
            assert agent_state(job.pid) in ("LOCKED", "BACKED_UP")
            rc, _, err = cli(env, "thaw", "--force", str(job.pid))
            assert rc == 0, err
            assert agent_state(job.pid) == "RUNNING"
        finally:
            Path(f"{token}.go").write_text("")
        stdout, stderr = dump.communicate(timeout=180)
        assert dump.returncode == ExitCode.DEVICE, (stdout, stderr)
        error = json.loads(stdout)["error"]
        assert "thaw --force" in error["message"] and error["details"]["taken_by_thaw"] == [job.pid], error
        assert_no_image(img)
        assert alive(job.pid) and agent_state(job.pid) == "RUNNING"
        n = len(job.lines())
        wait_until(lambda: len(job.lines()) > n, 30, "the job to compute on")
        assert not list(runtime_dir.glob("*.lock-taken")), "the thaw's note was left behind"
    finally:
        job.cleanup()
