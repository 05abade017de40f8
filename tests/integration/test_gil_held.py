"""A job that holds the GIL while it waits for the device (the issue's deadlock).

The native agent needs no GIL: `npusnap run` jobs whose extension calls the runtime without
releasing the GIL (tests/data/gil_job.py, ctypes.PyDLL in a tight loop) can be dumped with
--leave-running, dumped and restored, and frozen with a lease that fires after the CLI is
SIGKILLed. Every CLI call has a deadline; a hang fails the test instead of the suite.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.integration.dumplib import NPUSNAP, PY, Job, agent_state, alive, cli, job_env, wait_until

pytestmark = [pytest.mark.integration, requires_root, pytest.mark.timeout(240)]
GIL_JOB = str(Path(__file__).resolve().parents[1] / "data" / "gil_job.py")
MASK = (1 << 64) - 1


def values(job: Job) -> list[tuple[int, int]]:
    out = []
    for line in job.lines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step" and parts[2] == "value":
            out.append((int(parts[1]), int(parts[3])))
    return out


def assert_consistent(job: Job) -> None:
    """Every printed value is the one the sequence gives for its step."""
    printed = dict(values(job))
    assert printed, job.text()[-500:]
    value = 0
    for step in range(max(printed) + 1):
        value = (value * 6364136223846793005 + step + 1442695040888963407) & MASK
        if step in printed:
            assert printed[step] == value, f"step {step}: {printed[step]} != {value}"


def state(pid: int) -> str:
    """The agent's state, or "BUSY" while another command (the freeze) is connected."""
    from npusnap_cli.device.agent_client import AgentOpError

    try:
        return str(agent_state(pid))
    except AgentOpError as exc:
        if exc.error.name == "BUSY":
            return "BUSY"
        raise


def start(
    tmp_path: Path, sim_env: dict[str, str], runtime_dir: Path, device: str, steps: int = 0, **extra: str
) -> Job:
    env = job_env(sim_env, runtime_dir, **extra)
    job = Job(tmp_path, env, [PY, GIL_JOB, "--steps", str(steps), "--device", device])
    wait_until(lambda: "ready" in job.text(), 20, "the job to start")
    wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
    job.wait_lines(3)
    return job


def progress(job: Job, more: int = 3, timeout: float = 20) -> None:
    n = len(job.lines())
    job.wait_lines(n + more, timeout)


def test_dump_leave_running(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    env = job_env(sim_env, runtime_dir)
    job = start(tmp_path, sim_env, runtime_dir, "0")
    try:
        t0 = time.monotonic()
        rc, _, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running", timeout=60)
        assert rc == 0, err
        assert time.monotonic() - t0 < 30
        assert agent_state(job.pid) == "RUNNING"
        progress(job)
        assert_consistent(job)
    finally:
        job.cleanup()


def test_dump_and_restore(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    env = job_env(sim_env, runtime_dir)
    job = start(tmp_path, sim_env, runtime_dir, "1")
    img = tmp_path / "img"
    try:
        rc, out, err = cli(env, "dump", str(job.pid), str(img), timeout=60)
        assert rc == 0, err
        job.reap()
        dumped = values(job)[-1][0]
        rc, out, err = cli(env, "restore", str(img), timeout=60)
        assert rc == 0, err
        job.restored_pid = out["result"]["root_pid"] if out else 0
        wait_until(lambda: values(job)[-1][0] > dumped + 200, 30, "the restored job to go on")
        steps = [s for s, _ in values(job)]
        assert steps == list(range(0, steps[-1] + 1, 50)), "steps lost or repeated across the restore"
        assert_consistent(job)
    finally:
        job.cleanup()


def test_freeze_then_cli_killed_lease_thaws(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """freeze is SIGKILLed while the job is locked (its Backup made slow by the simulator): the
    lease, a timed wait on the native agent thread, thaws the job although it holds the GIL."""
    faults = tmp_path / "faults"
    faults.write_text("NPUSIM_BACKUP_HANG_MS=3000\n")
    env = job_env(sim_env, runtime_dir, NPUSIM_FAULT_FILE=str(faults))
    job = Job(tmp_path, env, [PY, GIL_JOB, "--steps", "0", "--device", "0"])
    try:
        wait_until(lambda: "ready" in job.text(), 20, "the job to start")
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        job.wait_lines(3)
        freeze = subprocess.Popen(
            [NPUSNAP, "freeze", str(job.pid), "--lease", "3"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Locked: the job's output stops (no agent connection here: freeze must get the agent).
        last, still_since = len(job.lines()), time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() - still_since < 0.5:
            assert time.monotonic() < deadline and freeze.poll() is None, "the freeze never locked the job"
            time.sleep(0.05)
            if len(job.lines()) != last:
                last, still_since = len(job.lines()), time.monotonic()
        freeze.send_signal(signal.SIGKILL)  # mid-Backup
        freeze.wait(10)
        # status answers although the job holds the GIL while it waits for the device
        rc, _, err = cli(env, "status", str(job.pid), timeout=30)
        assert rc == 0, err
        wait_until(lambda: state(job.pid) == "RUNNING", 30, "the lease to thaw the job")
        from npusnap_cli.device.agent_client import AgentClient

        with AgentClient(job.pid) as c:
            events = c.status().events
        assert any("lease of 3s expired" in e for e in events), events
        progress(job)
        assert alive(job.pid)
        assert_consistent(job)
    finally:
        job.cleanup()


def test_a_hook_that_cannot_get_the_gil_fails_in_time_and_rolls_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A pre_lock hook needs the GIL, which the job holds in a long C call: the hook deadline
    (1 s) bounds the wait, the lock is refused (HOOK_TIMEOUT) and nothing stays locked."""
    script = tmp_path / "hooked.py"
    script.write_text(
        "import ctypes, time, sys\n"
        "acl = ctypes.CDLL('libacl_rt.so')\n"
        "assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(1) == 0\n"
        "import npusnap_cli.agent as agent\n"
        f"mark = {str(tmp_path / 'late')!r}\n"
        "agent.register_hook('pre_lock', lambda: open(mark, 'w').close(), name='mark')\n"
        "agent.start(hook_timeout_s=1.0)\n"
        "spin = ctypes.PyDLL(None).usleep\n"  # a C call that holds the GIL
        "print('ready', flush=True)\n"
        "while True:\n"
        "    spin(3_000_000)\n"
    )
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, str(script)])
    try:
        wait_until(lambda: "ready" in job.text(), 20, "the job to start")
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        time.sleep(0.5)  # now inside usleep with the GIL held
        from npusnap_cli.device.agent_client import AgentClient, AgentOpError

        with AgentClient(job.pid) as c:
            t0 = time.monotonic()
            with pytest.raises(AgentOpError) as info:
                c.lock(lease_s=30)
            assert time.monotonic() - t0 < 4
            assert info.value.error.name == "HOOK_TIMEOUT"
            assert c.status().state == "RUNNING"
        # The hook gets the GIL when the C call returns, sees it was cancelled and does nothing.
        time.sleep(4)
        assert not (tmp_path / "late").exists(), "a cancelled hook ran late"
        assert alive(job.pid)
    finally:
        job.cleanup()


def test_a_copy_past_the_runtimes_entry_at_lock_is_in_the_image(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Every call of the job sleeps 2 ms right after the runtime's entry check (a thread preempted
    there), so a Lock mostly comes while a copy is past it: the runtime lets such a call run to
    its end, and a host-to-device copy that wrote after the agent's copy would leave the image
    one step behind the host. Dumped and restored three times, every value follows the sequence."""
    env = job_env(sim_env, runtime_dir)
    job = start(tmp_path, sim_env, runtime_dir, "1", NPUSIM_ENTRY_DELAY_US="2000")
    try:
        for cycle in range(3):
            img = tmp_path / f"img{cycle}"
            rc, out, err = cli(env, "dump", str(job.restored_pid or job.pid), str(img), timeout=60)
            assert rc == 0, (out or {}).get("error") or err
            if cycle == 0:
                job.reap()
            dumped = values(job)[-1][0]
            rc, out, err = cli(env, "restore", str(img), timeout=60)
            assert rc == 0, err
            job.restored_pid = out["result"]["root_pid"] if out else 0
            wait_until(lambda d=dumped: values(job)[-1][0] > d + 100, 30, "the restored job to go on")
        assert_consistent(job)
    finally:
        job.cleanup()
