"""Real jobs on a node with other jobs running: a PyTorch DataLoader with worker processes, an
inference server with a keep-alive client.

* A DataLoader (2 workers, spawn or fork) feeding train.py's device loop, dumped mid-epoch with
  --leave-running, the original killed, the image restored: the output equals an uninterrupted
  run's. Its copies beside the running original are refused before anything is touched: its
  workers' multiprocessing listeners (/tmp/pymp-*) would be bound over the original's, which
  then failed ("Connection reset by peer").
* The inference server (weights on the device) with a client holding one TCP connection:
  dumped with --tcp-established --leave-running; 4 replicas restore beside it (their copies
  of the client's connection closed: the original keeps it) and answer correctly, while the
  client goes on with the original, unbroken.
* Meanwhile two unrelated NPU jobs on other devices and a CPU hog run on: npusnap touches none.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_workloads.infer import write_weights
from tests.integration import torchlib
from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    REPO,
    TRAIN,
    TRAIN_ARGS,
    alive,
    cli,
    job_env,
    kill,
    private_sim,
    wait_until,
)
from tests.integration.test_pidns import nspid, start_ns_job

pytestmark = pytest.mark.integration

LOADER = str(REPO / "npusnap_workloads" / "torch_loader.py")
INFER = str(REPO / "npusnap_workloads" / "infer.py")
LOADER_ARGS = ["--epochs", "2", "--workers", "2", "--records", "96", "--batch", "4"]
needs_torch = pytest.mark.skipif(torchlib.skip_reason() is not None, reason=str(torchlib.skip_reason()))


@pytest.fixture(scope="module")
def sim_env() -> Iterator[dict[str, str]]:
    """A simulated NPU of 8 devices for this module (the session's has 2): the original on
    device 0, four copies on 1-4, the neighbours on 5 and 6."""
    with private_sim(devices=8, capacity_bytes=256 << 20) as env:
        yield env


def loader_lines(out: Path) -> list[str]:
    return [ln for ln in out.read_text(errors="replace").splitlines() if ln.startswith("epoch ")]


@pytest.fixture(scope="module")
def loader_reference(sim_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """An uninterrupted run (fork workers, no interval: the output depends on neither)."""
    d = tmp_path_factory.mktemp("loaderref")
    p = subprocess.run(
        [str(torchlib.TORCH_BIN / "python"), "-W", "ignore", LOADER, *LOADER_ARGS, "--context", "fork"],
        env=sim_env,
        cwd=d,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = p.stdout.splitlines()
    assert len(got) == 48, got[-3:]
    return got


@pytest.fixture
def neighbours(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> Iterator[list[int]]:
    """Other jobs on the node: train.py on device 5 (under `npusnap run`: an agent of its own) and
    on device 6 (no agent), and a CPU hog."""
    procs = []
    for dev in (5, 6):
        launch = [NPUSNAP, "run", "--"] if dev == 5 else []
        with open(tmp_path / f"neighbour{dev}.out", "ab") as f:
            procs.append(
                subprocess.Popen(
                    [*launch, PY, TRAIN, *TRAIN_ARGS, "--steps", "0", "--device", str(dev)],
                    env=job_env(sim_env, runtime_dir),
                    stdout=f,
                    stderr=f,
                    start_new_session=True,
                )
            )
    procs.append(subprocess.Popen([PY, "-c", "while True: pass"], start_new_session=True))
    try:
        for dev in (5, 6):
            out = tmp_path / f"neighbour{dev}.out"
            wait_until(lambda o=out: o.read_text().count("\nstep") >= 2, 30, "the neighbours' steps")
        yield [p.pid for p in procs]
        # Untouched: still running, never stopped, their steps still coming.
        for p in procs:
            assert p.poll() is None, p.args
        for dev in (5, 6):
            out = tmp_path / f"neighbour{dev}.out"
            n = out.read_text().count("\nstep")
            wait_until(lambda o=out, n=n: o.read_text().count("\nstep") > n, 10, "the neighbours going on")
            assert "train:" not in out.read_text(), out.read_text()[-500:]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def start_loader(env: dict[str, str], out: Path, context: str, pid_ns: bool, data: Path) -> int:
    argv = [str(torchlib.TORCH_BIN / "python"), "-W", "ignore", LOADER, *LOADER_ARGS]
    argv += ["--context", context, "--interval", "0.25", "--data", str(data)]
    if pid_ns:
        return start_ns_job(env, out, argv, cwd=out.parent)
    p = subprocess.run(
        [NPUSNAP, "run", "--detach", "--output", str(out), "--", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=out.parent,
    )
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip())


@needs_torch
@pytest.mark.parametrize(("context", "pid_ns"), [("spawn", True), ("fork", False)])
def test_dataloader_dumped_mid_epoch_restores_after_the_original_is_killed(
    sim_env: dict[str, str],
    runtime_dir: Path,
    tmp_path: Path,
    loader_reference: list[str],
    neighbours: list[int],
    context: str,
    pid_ns: bool,
) -> None:
    """Killed with SIGKILL, a --pid-ns job leaves its spawn semaphores in /dev/shm, changed since
    the dump and held by nobody: restore puts the image's copies back instead of refusing."""
    env = job_env(sim_env, runtime_dir)
    out = tmp_path / "job.out"
    pid = start_loader(env, out, context, pid_ns, tmp_path / "records.bin")
    restored = 0
    try:
        wait_until(lambda: len(loader_lines(out)) >= 5, 90, "batches")
        assert len(psutil_children(pid)) >= 2  # the workers
        rc, res, err = cli(env, "dump", str(pid), str(tmp_path / "img"), "--leave-running")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        for p in [*psutil_children(pid), pid]:  # the whole tree: a host-pid restore needs its pids
            kill(p)
        at = len(loader_lines(out))
        assert at < 24, "dumped mid-epoch"
        rc, res, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        restored = int(res["result"]["root_pid"])
        wait_until(lambda: not alive(restored), 120, "the restored job to finish")
        got = loader_lines(out)
        # Every line the original printed, then the restored job's from the dump on: the
        # restored lines are exactly the reference's from where the dump was taken.
        cont = got[at:]
        assert cont and loader_reference[-len(cont) :] == cont, (len(cont), cont[:2])
        assert got[:at] == loader_reference[:at]
    finally:
        kill(restored)
        kill(pid)


def psutil_children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


@needs_torch
def test_dataloader_copies_beside_the_running_original_are_refused_untouched(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, loader_reference: list[str]
) -> None:
    env = job_env(sim_env, runtime_dir)
    out = tmp_path / "job.out"
    pid = start_loader(env, out, "spawn", True, tmp_path / "records.bin")
    img = str(tmp_path / "img")
    try:
        wait_until(lambda: len(loader_lines(out)) >= 3, 90, "batches")
        rc, res, err = cli(env, "dump", str(pid), img, "--leave-running")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        maps = [a for k in range(1, 5) for a in ("--device-map", f"0={k}")]
        rc, res, err = cli(env, "restore", img, "--replicas", "4", *maps)
        assert rc == ExitCode.PREFLIGHT and res is not None, err
        assert "/tmp/pymp-" in res["error"]["message"], res["error"]
        rc, res, err = cli(env, "restore", img, "--device-map", "0=1")
        assert rc == ExitCode.PREFLIGHT and res is not None, err
        e = res["error"]
        if e["message"].startswith("/dev/shm/sem.mp-"):
            # The running original's DataLoader moved its semaphore since the dump: that check
            # comes first and refuses as rightly (seen on a busy machine).
            assert "changed since the dump" in e["message"], e
        else:
            assert e["message"].startswith("pid ") and "/tmp/pymp-" in e["message"], e
            workers = psutil_children(pid)
            assert all(v["pid"] in workers for v in e["details"]["busy_listeners"].values()), e["details"]
        wait_until(lambda: not alive(pid), 120, "the original to finish")
        assert loader_lines(out) == loader_reference
    finally:
        kill(pid)


# --------------------------------------------------------------------------------------------
# The inference server and a keep-alive client
# --------------------------------------------------------------------------------------------


CYCLE = 40  # request numbers 1..CYCLE, again and again: their answers are known


def start_server(env: dict[str, str], tmp_path: Path, port: int) -> tuple[int, Path]:
    write_weights(str(tmp_path / "w.bin"), 4, 64)
    out = tmp_path / "server.out"
    argv = [PY, INFER, "--weights", str(tmp_path / "w.bin"), "--device", "0", "--port", str(port)]
    pid = start_ns_job(env, out, [*argv, "--warmup-batch", "2"], cwd=tmp_path)
    wait_until(lambda: "serving" in out.read_text(), 60, "the server to listen")
    return pid, out


def answers(port: int) -> dict[int, str]:
    """``infer 1`` .. ``infer CYCLE`` on one connection: what every copy must answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        lines = c.makefile("r")
        got = {}
        for n in range(1, CYCLE + 1):
            c.sendall(f"infer {n}\n".encode())
            got[n] = lines.readline().split()[3]
    return got


class KeepAlive(threading.Thread):
    """One TCP connection, a request every 20 ms until stopped; (k, pid, result) per answer, the
    k-th request being ``infer`` of k's place in 1..CYCLE."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.answers: list[tuple[int, int, str]] = []
        self.error: str = ""
        self.stop = threading.Event()

    def run(self) -> None:
        lines = self.sock.makefile("r")
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self.sock.sendall(f"infer {(n - 1) % CYCLE + 1}\n".encode())
                parts = lines.readline().split()
                if len(parts) != 4:
                    raise OSError(f"answer {parts!r}")
            except OSError as exc:
                self.error = f"request {n}: {exc}"
                return
            self.answers.append((n, int(parts[1]), parts[3]))
            time.sleep(0.02)


def one_shot(port: int, n: int) -> tuple[int, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(f"infer {n}\n".encode())
        parts = c.makefile("r").readline().split()
    return int(parts[1]), parts[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_inference_server_with_a_keep_alive_client_gives_four_replicas(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, neighbours: list[int]
) -> None:
    env = job_env(sim_env, runtime_dir)
    port = free_port()
    pid, _out = start_server(env, tmp_path, port)
    roots: list[int] = []
    client = None
    try:
        ref = answers(port)
        client = KeepAlive(port)
        client.start()
        wait_until(lambda: len(client.answers) >= 5, 20, "keep-alive answers")
        img = str(tmp_path / "img")
        rc, res, err = cli(env, "dump", str(pid), img, "--leave-running", "--tcp-established")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        # A neighbour's device is not free: refused before anything is touched (the neighbour
        # with an agent names its device; one without is met by CANN's own check at Restore).
        rc, res, err = cli(env, "restore", img, "--device-map", "0=5", "--tcp-close")
        assert rc == ExitCode.BUSY and res is not None, err
        assert str(neighbours[0]) in res["error"]["message"], res["error"]
        maps = [a for k in range(1, 5) for a in ("--device-map", f"0={k}")]
        rc, res, err = cli(
            env, "restore", img, "--replicas", "4", *maps, "--output", str(tmp_path / "r{n}.out")
        )
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        roots = [int(r["root_pid"]) for r in res["result"]["replicas"]]
        assert len(set(roots)) == 4 and pid not in roots
        for root in roots:
            assert nspid(root)[-1] == 1
        # Every copy answers, correctly; the kernel spreads new connections over all five.
        seen: set[int] = set()
        n = 0
        while not set(roots) <= seen:
            n += 1
            assert n < 400, f"copies that never answered: {set(roots) - seen}"
            m = (n - 1) % CYCLE + 1
            who, result = one_shot(port, m)
            assert result == ref[m], (who, m)
            seen.add(who)
        # The keep-alive client stayed with the original, on its one connection.
        k = len(client.answers)
        wait_until(lambda: len(client.answers) >= k + 5, 20, "keep-alive answers after the restore")
        assert not client.error, client.error
        assert {p for _n, p, _r in client.answers} == {pid}
        assert all(r == ref[(k - 1) % CYCLE + 1] for k, _p, r in client.answers)
        rc, st, _ = cli(env, "sim", "status")
        assert rc == 0 and st is not None
        owners = {d["id"]: {o["pid"] for o in d["owners"]} for d in st["result"]["devices"]}
        assert pid in owners[0] and all(r in owners[k] for k, r in enumerate(roots, 1)), owners
        assert set(neighbours[:2]) <= owners[5] | owners[6], owners
    finally:
        if client is not None:
            client.stop.set()
            client.join(10)
            client.sock.close()
        for r in roots:
            kill(r)
        kill(pid)


def test_keep_alive_connection_follows_the_server_restored_after_a_kill(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Dumped with --tcp-established, the server killed and restored (one copy, the connection
    restored with TCP repair): the client's connection goes on, served by the restored server."""
    env = job_env(sim_env, runtime_dir)
    port = free_port()
    pid, _out = start_server(env, tmp_path, port)
    restored = 0
    client = None
    try:
        ref = answers(port)
        client = KeepAlive(port)
        client.start()
        wait_until(lambda: len(client.answers) >= 5, 20, "keep-alive answers")
        rc, res, err = cli(env, "dump", str(pid), str(tmp_path / "img"), "--tcp-established")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        wait_until(lambda: not alive(pid), 10, "the dumped server to be gone")
        k = len(client.answers)
        rc, res, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        restored = int(res["result"]["root_pid"])
        wait_until(lambda: len(client.answers) >= k + 5, 30, "keep-alive answers after the restore")
        assert not client.error, client.error
        assert {p for _n, p, _r in client.answers[k:]} == {restored}
        assert [n for n, _p, _r in client.answers] == list(range(1, len(client.answers) + 1))
        assert all(r == ref[(k - 1) % CYCLE + 1] for k, _p, r in client.answers)
    finally:
        if client is not None:
            client.stop.set()
            client.join(10)
            client.sock.close()
        kill(restored)
        kill(pid)


@pytest.mark.skipif(
    shutil.which("strace") is None, reason="strace is not installed (setup installs it as root)"
)
def test_the_agent_of_a_pid_ns_job_keeps_no_proc_file_open_while_it_ticks(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The agent's tick (every 100 ms) read /proc/self/stat; a dump that froze it between open and
    close saved /proc/<host pid>/stat, which a --pid-ns job's restore cannot reopen (new host
    pids): "Can't open file proc/N/stat on restore". Its tick now opens no file there."""
    env = job_env(sim_env, runtime_dir)
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, TRAIN, *TRAIN_ARGS, "--steps", "400", "--interval", "0.5"])
    try:
        wait_until(lambda: "step 1 " in out.read_text(), 30, "a step")
        p = subprocess.run(
            ["timeout", "-s", "INT", "1.5", "strace", "-f", "-qq", "-e", "trace=open,openat", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "strace: attach" not in p.stderr, p.stderr[-500:]  # it did trace the job
        assert "/proc/self/stat" not in p.stderr, p.stderr[-1000:]
        rc, _res, err = cli(env, "status", str(pid))  # a request still reads it: restore detection
        assert rc == 0, err
    finally:
        kill(pid)
