"""Snapshots of real torch_npu jobs on several devices: a DDP job over hccl
(npusnap_workloads/torch_npu_ddp.py), two ranks on two simulated devices, every torch_npu
setting at its default (task queue, the HCCL watchdog with its tear-down, the caching
allocator), started under plain `npusnap run` (`--no-io-uring` for torchrun), dumped and
restored with plain `npusnap dump PID DIR` / `npusnap restore DIR` -- twice in one run, so that
a restored job is dumped again -- and
every step line of every rank (loss, a hash of all parameters) must equal the uninterrupted
run's. npusnap makes the HCCL communicators anew behind the job's handles
(native/agent/hccl.c, npusnap_cli/device/hcclrebuild.py); the job is not told.

And a torch_npu inference server restored as replicas on other devices (`--replicas`,
`--device-map`), each answering as the original (npusnap_workloads/torch_npu_serve.py).

Launchers: torch.multiprocessing (one tree: the launcher and two ranks, rank 0 hosting the
rendezvous store) and torchrun (its elastic agent hosting the store). Trees: the simulator's
default CANN tree, and its strict tree with npusnap kept away from the simulator's daemon.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.integration.dumplib import NPUSNAP, REPO, Job, alive, cli, job_env, kill, unpaced, wait_until
from tests.integration.test_torch_npu_snapshot import STRICT

pytestmark = [pytest.mark.integration, requires_root]

JOB = str(REPO / "npusnap_workloads" / "torch_npu_ddp.py")
# Two processes share the output file: a line may be cut by the other's, so lines are found by
# pattern, not by newline.
LINE = re.compile(r"rank (\d+) step (\d+) loss (\S+) params ([0-9a-f]{16})")
# Enough steps that the second dump, once 40 lines are out, lands well before the end on a busy
# machine (a dump of a job already tearing down finds no device handles to save).
STEPS = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def steps_of(text: str) -> dict[int, list[tuple[int, str, str]]]:
    """rank -> its (step, loss, params hash) in the order printed."""
    out: dict[int, list[tuple[int, str, str]]] = {}
    for m in LINE.finditer(text):
        out.setdefault(int(m[1]), []).append((int(m[2]), m[3], m[4]))
    return out


def argv_for(python: str, launcher: str, args: list[str]) -> list[str]:
    if launcher == "torchrun":
        torchrun = str(Path(python).parent / "torchrun")
        return [torchrun, "--standalone", "--nproc-per-node", "2", JOB, "--launcher", "none", *args]
    return [python, JOB, *args]


_references: dict[tuple[str, ...], dict[int, list[tuple[int, str, str]]]] = {}


def reference(python: str, env: dict[str, str], args: list[str]) -> dict[int, list[tuple[int, str, str]]]:
    """Every rank's step lines of an uninterrupted run (torch.multiprocessing, unpaced), once per
    set of arguments: the launcher and the CANN tree change nothing a step computes, so a job
    under torchrun or on the strict tree must match the same lines."""
    key = tuple(unpaced(args))
    if key not in _references:
        ref = subprocess.run([python, JOB, *key], env=env, capture_output=True, text=True, timeout=300)
        assert ref.returncode == 0, ref.stderr[-3000:]
        _references[key] = steps_of(ref.stdout)
    return _references[key]


def count(job: Job) -> int:
    return sum(len(v) for v in steps_of(job.text()).values())


@pytest.mark.parametrize("tree", ["default", "strict"])
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_ddp_job_dumped_twice_continues_exactly(
    launcher: str,
    tree: str,
    torch_npu_python: str,
    sim_env: dict[str, str],
    runtime_dir: Path,
    tmp_path: Path,
) -> None:
    extra = STRICT if tree == "strict" else {}
    env = job_env(sim_env, runtime_dir, NPUSIM_KERNEL_BLOCK_US="0", **extra)
    args = ["--steps", str(STEPS), "--interval", "0.1"]
    want = reference(torch_npu_python, job_env(sim_env, runtime_dir, NPUSIM_KERNEL_BLOCK_US="0"), args)
    assert sorted(want) == [0, 1] and all(len(v) == STEPS for v in want.values()), want
    # torchrun's own store ignores USE_LIBUV (which `npusnap run` sets): it needs --no-io-uring.
    flags = ("--no-io-uring",) if launcher == "torchrun" else ()
    job = Job(tmp_path, env, argv_for(torch_npu_python, launcher, args), run_flags=flags)
    try:
        for i, after in enumerate((8, 40)):
            wait_until(lambda after=after: count(job) >= after, 180, f"{after} step lines")
            img = tmp_path / f"img{i}"
            rc, out, err = cli(env, "dump", str(job.pid), str(img), timeout=300)
            assert rc == 0, (out or {}).get("error") or err
            if i == 0:
                job.reap(60)
            else:
                wait_until(lambda: not alive(job.pid), 60, "the restored job to be gone")
            rc, out, err = cli(env, "restore", str(img), timeout=300)
            assert rc == 0, (out or {}).get("error") or err
            assert out is not None
            job.restored_pid = out["result"]["root_pid"]
            # What restore said is what status says: both ranks' communicator made anew (live).
            rc, st, err = cli(env, "status", str(job.restored_pid))
            assert rc == 0 and st is not None, err
            comms = [c for p in st["result"]["processes"] for c in (p.get("status") or {}).get("hccl") or []]
            assert sorted(c["rank"] for c in comms) == [0, 1], comms
            assert {c["state"] for c in comms} == {"live"} and len({c["key"] for c in comms}) == 1, comms
        wait_until(lambda: not alive(job.restored_pid), 300, "the restored job to finish")
        got = steps_of(job.text())
        assert got == want, job.text()[-4000:]
        assert "Traceback" not in job.text(), job.text()[-4000:]
    finally:
        job.cleanup()


def test_a_dump_while_one_rank_holds_up_an_all_reduce(
    torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 sleeps inside its backward, before its gradient all-reduce, while rank 1's is
    launched and waits for it on rank 1's device: the dump starts then, lands on a collective
    boundary (it waits until rank 0's all-reduce is launched too, retrying its lock), and the
    job, restored longer after the dump than its process group's timeout (the watchdog's work
    timeout), continues exactly."""
    env = job_env(sim_env, runtime_dir, NPUSIM_KERNEL_BLOCK_US="0")
    # The stall, and the dump's wait for the collective boundary, stay within the process group's
    # timeout (else the watchdog rightly ends the job).
    args = ["--steps", "12", "--interval", "0.05", "--pg-timeout", "15"]
    want = reference(torch_npu_python, env, args)
    phases = tmp_path / "phases"
    phases.mkdir()
    job = Job(tmp_path, env, [torch_npu_python, JOB, *args, "--stall", "3", "--phase", str(phases)])
    try:
        wait_until(
            lambda: (phases / "rank-0").exists() and "stalled" in (phases / "rank-0").read_text(),
            180,
            "rank 0 to stall in its backward",
        )
        assert not (phases / "rank-1").read_text().startswith("idle"), "rank 1 must be mid-step"
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        job.reap(60)
        time.sleep(17)  # longer than --pg-timeout
        rc, out, err = cli(env, "restore", str(tmp_path / "img"), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 300, "the restored job to finish")
        assert steps_of(job.text()) == want, job.text()[-4000:]
    finally:
        job.cleanup()


def test_leave_running_both_the_original_and_the_image_continue_exactly(
    torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """--leave-running: the original DDP job is unlocked without a Restore (its communicators
    stay) and finishes as if nothing happened; the image, restored afterwards, repeats the steps
    after the cut with new communicators, exactly."""
    env = job_env(sim_env, runtime_dir, NPUSIM_KERNEL_BLOCK_US="0")
    args = ["--steps", "30", "--interval", "0.1"]
    want = reference(torch_npu_python, env, args)
    job = Job(tmp_path, env, [torch_npu_python, JOB, *args])
    try:
        wait_until(lambda: count(job) >= 10, 180, "10 step lines")
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running", timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        assert job.reap(300) == 0, job.text()[-3000:]
        assert steps_of(job.text()) == want, "the original, left running, continued differently"
        first = len(job.text())
        rc, out, err = cli(env, "restore", str(tmp_path / "img"), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 300, "the restored job to finish")
        again = steps_of(job.text()[first:])
        assert sorted(again) == [0, 1], job.text()[first:][-3000:]
        for rank, lines in again.items():
            assert lines and lines == want[rank][len(want[rank]) - len(lines) :], (rank, lines[:3])
    finally:
        job.cleanup()


SERVE = str(REPO / "npusnap_workloads" / "torch_npu_serve.py")


def http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return str(r.read().decode())


def answers_by_copy(port: int, want: int, timeout_s: float = 120) -> dict[int, str]:
    """Host pid -> its answer to `/infer?n=7`, until `want` copies answered (the kernel spreads
    connections over the copies that share the port)."""
    seen: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only {sorted(seen)} answered"
        try:
            pid = int(http_get(port, "/hello").split()[1])
            if pid not in seen:
                answer = http_get(port, "/infer?n=7")
                if int(answer.split()[1]) == pid:
                    seen[pid] = answer.split(" ", 2)[2].strip()
        except OSError:
            time.sleep(0.05)
    return seen


def test_inference_replicas_answer_as_the_original(
    torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A torch_npu inference server (a GPT-style model built in the process, greedy generation over
    HTTP, npusnap_workloads/torch_npu_serve.py) dumped once warm, restored as two replicas on
    the two devices (`--replicas 2 --device-map 0=0 --device-map 0=1`): both serve, and each
    answers exactly what the original answered."""
    env = job_env(sim_env, runtime_dir, NPUSIM_KERNEL_BLOCK_US="0")
    port = free_port()
    p = subprocess.run(
        [
            *(NPUSNAP, "run", "--pid-ns", "--detach", "--output", str(tmp_path / "server.out")),
            *("--", torch_npu_python, SERVE, "--port", str(port)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    pid = int(p.stdout.strip())
    roots: list[int] = []
    try:
        original = answers_by_copy(port, 1)
        assert list(original) == [pid], original
        # The answer's connection may still be closing in the server: CRIU refuses a socket in
        # flight and npusnap rolls the dump back; the next try finds it closed.
        for _ in range(3):
            time.sleep(0.3)
            rc, out, err = cli(env, "dump", str(pid), str(tmp_path / "img"), timeout=300)
            if rc == 0:
                break
        assert rc == 0, (out or {}).get("error") or err
        rc, out, err = cli(
            env,
            "restore",
            str(tmp_path / "img"),
            "--replicas",
            "2",
            "--device-map",
            "0=0",
            "--device-map",
            "0=1",
            timeout=300,
        )
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        roots = [int(r["root_pid"]) for r in out["result"]["replicas"]]
        copies = answers_by_copy(port, 2)
        assert sorted(copies) == sorted(roots), (copies, roots)
        assert set(copies.values()) == set(original.values()), (copies, original)
    finally:
        for r in [*roots, pid]:
            kill(r)
