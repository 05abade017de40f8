"""The agent changes nothing a program can observe (tests/data/quiet_probe.c).

Each case runs the same C program without npusnap and under `npusnap run` and wants the same
bytes on stdout and stderr and the same exit: a process whose last program thread ends with the
bare exit system call ends (no agent thread keeps it alive), signals reach the thread they would
reach without npusnap (no thread of the agent or of the simulated runtime takes them), the lowest
descriptors and fixed numbers stay the program's, and the agent's messages -- a CRIU restore
included -- go to its log file, not to the job's stderr.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from npusnap_cli import contract, paths
from tests.conftest import requires_root
from tests.integration.dumplib import NPUSNAP, alive, cli, job_env, kill, wait_until

pytestmark = [pytest.mark.integration, requires_root]
SOURCE = Path(__file__).resolve().parents[1] / "data" / "quiet_probe.c"
# A case that hangs fails here, not at pytest's global timeout.
CASE_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory, sim_env: dict[str, str]) -> str:
    out = tmp_path_factory.mktemp("quiet") / "quiet_probe"
    lib64 = paths.sim_cann_home() / "lib64"
    subprocess.run(
        ["cc", "-O1", "-Wall", "-Werror", "-o", str(out), str(SOURCE), f"-L{lib64}", "-lacl_rt"],
        check=True,
        timeout=120,
    )
    return str(out)


def run_both(env: dict[str, str], argv: list[str]) -> tuple[subprocess.CompletedProcess[bytes], ...]:
    plain = subprocess.run(argv, env=env, capture_output=True, timeout=CASE_TIMEOUT_S)
    try:
        under = subprocess.run(
            [NPUSNAP, "run", "--", *argv], env=env, capture_output=True, timeout=CASE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{argv[1:]} under npusnap run did not end within {CASE_TIMEOUT_S}s: {exc.stdout!r}")
    return plain, under


@pytest.mark.parametrize(
    ("mode", "code"),
    [
        ("bare-exit", 7),
        ("fork-bare-exit", 0),
        ("seccomp-strict", 0),
        ("seccomp-kill", 0),
        ("pthread-exit", 0),
        ("signalfd", 0),
        ("fds", 0),
        ("environ", 0),
    ],
)
def test_same_output_and_exit_as_without_npusnap(
    probe: str, sim_env: dict[str, str], runtime_dir: Path, mode: str, code: int
) -> None:
    env = job_env(sim_env, runtime_dir)
    plain, under = run_both(env, [probe, mode])
    assert plain.returncode == code, (plain.stdout, plain.stderr)
    assert (under.returncode, under.stdout, under.stderr) == (plain.returncode, plain.stdout, plain.stderr)


def fd_numbers(pid: int) -> list[int]:
    return sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))


def fd_flags(pid: int, fd: int) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no flags in /proc/{pid}/fdinfo/{fd}")


def start(env: dict[str, str], argv: list[str], out: Path, err: Path, agent: bool) -> subprocess.Popen[bytes]:
    """Detached as the dump tests start jobs: own session, stdin /dev/null, output appended to files
    (CRIU restores a file opened O_APPEND whatever its size by then)."""
    cmd = [NPUSNAP, "run", "--", *argv] if agent else argv
    with open(out, "ab") as o, open(err, "ab") as e:
        return subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=o, stderr=e, start_new_session=True
        )


def job_fds(env: dict[str, str], argv: list[str], tmp: Path, agent: bool) -> list[int]:
    """The descriptor numbers of a running job, once it is ready (and, under npusnap, once its
    agent has served a client)."""
    out, err = tmp / f"out-{agent}", tmp / f"err-{agent}"
    proc = start(env, argv, out, err, agent)
    try:
        wait_until(lambda: b"ready" in out.read_bytes(), 20, "the job to be ready")
        if agent:
            sock = env["NPUSNAP_RUNTIME_DIR"] + f"/{proc.pid}.sock"
            wait_until(lambda: os.path.exists(sock), 10, "the agent socket")
            rc, _, stderr = cli(env, "status", str(proc.pid))
            assert rc == 0, stderr
        return fd_numbers(proc.pid)
    finally:
        kill(proc.pid)
        proc.wait(10)


def test_agent_descriptors_leave_the_low_numbers_free(
    probe: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    argv = [probe, "talk", "2", "10", str(tmp_path / "go")]
    plain = job_fds(env, argv, tmp_path, agent=False)
    under = job_fds(env, argv, tmp_path, agent=True)
    ours = [fd for fd in under if fd not in plain]
    assert ours, (plain, under)  # the agent's listening socket at least
    low = 64  # far below the agent's floor (32 under the soft RLIMIT_NOFILE, at most 1024)
    assert [fd for fd in under if fd < low] == [fd for fd in plain if fd < low]
    assert all(fd >= low for fd in ours), (plain, under)


def test_agent_listening_socket_is_close_on_exec(
    probe: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    out, err = tmp_path / "out", tmp_path / "err"
    proc = start(env, [probe, "talk", "2", "10", str(tmp_path / "go")], out, err, True)
    try:
        wait_until(lambda: (runtime_dir / f"{proc.pid}.sock").exists(), 20, "the agent socket")
        high = [fd for fd in fd_numbers(proc.pid) if fd >= 64]
        assert high, fd_numbers(proc.pid)
        for fd in high:
            assert fd_flags(proc.pid, fd) & os.O_CLOEXEC, f"fd {fd} is not close-on-exec"
    finally:
        kill(proc.pid)
        proc.wait(10)


def device_views(pid: int) -> list[str]:
    """The process's host mappings of (simulated) device memory: address range and name."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and "npusim-dev" in fields[5]:
            out.append(f"{fields[0]} {fields[5]}")
    return out


def test_output_byte_identical_across_dump_and_restore(
    probe: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The job's stdout and stderr, dumped and restored under npusnap, are the bytes of an
    uninterrupted run without it; the agent's lines about the restore are in its log."""
    env = job_env(sim_env, runtime_dir)
    steps = ["talk", "30", "20"]
    ref_out, ref_err = tmp_path / "ref.out", tmp_path / "ref.err"
    ref = start(env, [probe, *steps], ref_out, ref_err, False)
    assert ref.wait(60) == 0, ref_err.read_text()

    out, err, go = tmp_path / "job.out", tmp_path / "job.err", tmp_path / "go"
    img = tmp_path / "img"
    job = start(env, [probe, *steps, str(go)], out, err, True)
    restored = 0
    try:
        wait_until(lambda: b"out 0" in out.read_bytes(), 20, "the first step")
        wait_until(lambda: (runtime_dir / f"{job.pid}.sock").exists(), 10, "the agent socket")
        rc, status, stderr = cli(env, "status", str(job.pid))
        assert rc == 0, stderr
        assert status is not None
        log = runtime_dir / contract.AGENT_LOG_NAME.format(pid=job.pid)
        assert status["result"]["processes"][0]["hello"]["log"] == str(log)

        views = device_views(job.pid)
        assert views, Path(f"/proc/{job.pid}/maps").read_text()

        rc, result, stderr = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0, (result or {}).get("error") or stderr
        job.wait(30)
        rc, result, stderr = cli(env, "restore", str(img))
        assert rc == 0, (result or {}).get("error") or stderr
        restored = job.pid
        assert alive(restored)
        # The process's mappings of device memory are back where they were, under their names.
        assert device_views(restored) == views
        go.touch()
        wait_until(lambda: b"done" in out.read_bytes(), 30, "the restored job to finish")
        wait_until(lambda: not alive(restored), 10, "the restored job to exit")
    finally:
        go.touch()
        if restored:
            kill(restored)
        kill(job.pid)
        if job.poll() is None:
            job.kill()
    assert out.read_bytes() == ref_out.read_bytes()
    assert err.read_bytes() == ref_err.read_bytes()
    assert "process was restored by CRIU" in log.read_text()


def test_agent_messages_on_stderr_only_when_asked(
    probe: str, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """An agent that cannot start says why in its log -- and on stderr too with NPUSNAP_AGENT_STDERR=1."""
    bad = tmp_path / "npusnap"
    bad.mkdir(mode=0o755)
    os.chmod(bad, 0o755)  # not 0700: every agent refuses it
    env = job_env(sim_env, bad)
    env["LD_PRELOAD"] = str(paths.build_dir() / "agent" / "libnpusnap_agent.so")
    env["NPUSNAP_AGENT"] = "1"
    log = tmp_path / "agent.log"
    env[contract.AGENT_LOG_ENV] = str(log)
    quiet = subprocess.run([probe, "fds"], env=env, capture_output=True, timeout=CASE_TIMEOUT_S)
    assert quiet.returncode == 0 and quiet.stderr == b"", quiet.stderr
    assert "could not start the agent" in log.read_text()
    env[contract.AGENT_STDERR_ENV] = "1"
    loud = subprocess.run([probe, "fds"], env=env, capture_output=True, timeout=CASE_TIMEOUT_S)
    assert loud.returncode == 0
    assert b"npusnap-agent: [" in loud.stderr and b"could not start the agent" in loud.stderr
    assert quiet.stdout == loud.stdout


def test_python_face_logs_into_the_agent_log(runtime_dir: Path, tmp_path: Path) -> None:
    """The Python face's messages follow the native core's: the log file, not the app's stderr."""
    log = tmp_path / "agent.log"
    env = dict(os.environ, **{contract.AGENT_LOG_ENV: str(log)})
    env.pop(contract.AGENT_STDERR_ENV, None)
    code = "import npusnap_cli.agent as a; a.log('hello from the face')"
    p = subprocess.run(
        [str(Path(NPUSNAP).parent / "python"), "-c", code], env=env, capture_output=True, timeout=60
    )
    assert p.returncode == 0 and p.stderr == b"" and p.stdout == b"", p.stderr
    assert "hello from the face" in log.read_text()
