"""Snapshots of a real torch_npu training job (npusnap_workloads/torch_npu_block.py: an attention block,
AdamW or SGD with their default foreach settings) on the simulated NPU, with no change to the
script: `npusnap run`, `npusnap dump` at some moment, `npusnap restore`, and every later step line
(loss and a hash of every parameter) equals the uninterrupted run's.

The dumps are shown to land where a torch_npu job is hardest to cut, not only between steps:
the job records its phase in a file (what the dump that killed it caught), the simulated device
records at Lock what it held (NPUSIM_TRACE_LOCK: kernels queued or executing, launches held at
the runtime's gate), and slow kernels (NPUSIM_KERNEL_BLOCK_US) keep work in flight. Each case
asserts the state it was meant to catch, then the exact continuation.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli import paths
from tests.conftest import requires_root
from tests.integration.dumplib import REPO, Job, alive, cli, job_env, unpaced, wait_until

pytestmark = [pytest.mark.integration, requires_root]

JOB = str(REPO / "npusnap_workloads" / "torch_npu_block.py")
# The simulated tree that exports real CANN names only (and, as in every test, npusnap refused by
# the simulator's daemon): what npusnap does for torch_npu needs nothing a real node lacks.
STRICT = {
    "ASCEND_HOME_PATH": str(paths.sim_cann_dir() / "cann-strict"),
    "ASCEND_OPP_PATH": str(paths.sim_cann_dir() / "cann-strict" / "opp"),
    "LD_LIBRARY_PATH": str(paths.sim_cann_dir() / "cann-strict" / "lib64"),
}
BUSY_US = "1000"  # a kernel block's time: an operator takes 8 ms


@dataclass
class Cut:
    """What a dump caught: the job's phase and step, the device's state at Lock and at Backup, and
    (when watched) pictures of the job's threads taken while the dump ran: name -> (syscall number,
    -1 when in none, -2 when running; what its first argument names when that is a descriptor)."""

    phase: str
    step: int
    lock: dict[str, Any]
    backup: dict[str, Any] = field(default_factory=dict)
    threads: list[dict[str, tuple[int, str]]] = field(default_factory=list)


class ThreadWatch:
    """Samples a process's threads (/proc/PID/task/*/comm and syscall) until it ends or stop()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.history: list[dict[str, tuple[int, str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> dict[str, tuple[int, str]]:
        seen: dict[str, tuple[int, str]] = {}
        base = f"/proc/{self.pid}/task"
        for tid in os.listdir(base):
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{tid}/syscall") as f:
                fields = f.read().split()
            nr = int(fields[0]) if fields and fields[0] not in ("running",) else -2
            target = ""
            if nr >= 0 and len(fields) > 1:
                try:
                    target = os.readlink(f"/proc/{self.pid}/fd/{int(fields[1], 16)}")
                except (OSError, ValueError):
                    target = ""
            key = name if tid != str(self.pid) else "main"
            seen.setdefault(key, (nr, target))
        return seen

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.history.append(self._sample())
            except (OSError, ValueError):
                return  # the process ended
            self._stop.wait(0.02)

    def stop(self) -> list[dict[str, tuple[int, str]]]:
        self._stop.set()
        self._thread.join(5)
        return self.history


def _reference(python: str, env: dict[str, str], args: list[str]) -> list[str]:
    fast = dict(env, NPUSIM_KERNEL_BLOCK_US="0")
    argv = unpaced(args)
    if "--stall" in argv:
        i = argv.index("--stall")
        del argv[i : i + 2]
    done = subprocess.run([python, JOB, *argv], env=fast, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("step")]
    assert len(lines) == int(args[args.index("--steps") + 1]), done.stdout[-2000:]
    return lines


def _phase(tmp: Path) -> str:
    try:
        return (tmp / "phase").read_bytes().decode().strip("\0 ")
    except FileNotFoundError:
        return ""


def _cut(tmp: Path, pid: int) -> Cut:
    name, _, step = _phase(tmp).partition(" ")
    step = step.split()[0] if step else "-1"
    trace = [json.loads(ln) for ln in (tmp / "lock.trace").read_text().splitlines() if ln.strip()]
    locks = [r for r in trace if r["pid"] == pid and r["at"] == "lock"]
    backups = [r for r in trace if r["pid"] == pid and r["at"] == "backup"]
    assert locks, f"no Lock of {pid} traced: {trace}"
    return Cut(name, int(step.strip()), locks[-1], backups[-1] if backups else {})


def _dump_restore(
    python: str,
    sim_env: dict[str, str],
    runtime_dir: Path,
    tmp: Path,
    args: list[str],
    *,
    after: int = 0,
    stalled: str = "",
    ready: str = "",
    watch: bool = False,
    busy: bool = False,
    leave_running: bool = False,
    **extra: str,
) -> Cut:
    """Run the job under npusnap, dump it once `after` step lines are out (or as soon as the job
    says it stalled in phase `stalled`), restore the image, and check every step line against an
    uninterrupted run's. Returns what the dump caught."""
    env = job_env(sim_env, runtime_dir, NPUSIM_KERNEL_BLOCK_US=BUSY_US if busy else "0", **extra)
    env["NPUSIM_TRACE_LOCK"] = str(tmp / "lock.trace")
    ref = _reference(python, env, args)
    job = Job(tmp, env, [python, JOB, *args, "--phase", str(tmp / "phase")])
    try:
        if stalled:
            wait_until(lambda: _phase(tmp) == f"{stalled} 2 stalled", 180, f"the job to stall in {stalled}")
        elif ready:
            wait_until(lambda: _phase(tmp).startswith(ready), 180, f"the job to reach {ready!r}")
        else:
            job.wait_lines(after, timeout=180)
        flags = ["--leave-running"] if leave_running else []
        watcher = ThreadWatch(job.pid) if watch else None
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp / "img"), *flags, timeout=300)
        threads = watcher.stop() if watcher else []
        assert rc == 0, (out or {}).get("error") or err
        cut = _cut(tmp, job.pid)
        cut.threads = threads
        if leave_running:
            assert job.reap(300) == 0, job.text()[-3000:]
            assert job.lines() == ref, "the original, left running, continued differently"
            first = len(job.lines())
        else:
            job.reap(60)
            first = 0
        rc, out, err = cli(env, "restore", str(tmp / "img"), timeout=300)
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        job.restored_pid = out["result"]["root_pid"]
        wait_until(lambda: not alive(job.restored_pid), 300, "the restored job to finish")
        lines = job.lines()[first:]
        if leave_running:
            # the restored copy repeats the steps after the cut, exactly
            assert lines and lines == ref[len(ref) - len(lines) :], job.text()[-3000:]
        else:
            assert lines == ref, job.text()[-3000:]
        return cut
    finally:
        job.cleanup()


def _steps(n: int, *more: str) -> list[str]:
    return ["--steps", str(n), *more]


@pytest.mark.parametrize(
    "name,extra,args",
    [
        ("default", {}, _steps(30, "--interval", "0.05")),
        (
            "expandable",
            {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"},
            _steps(30, "--interval", "0.05"),
        ),
        (
            "expandable-empty-cache",
            {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"},
            _steps(30, "--interval", "0.05", "--empty-cache"),
        ),
        ("task-queue-0", {"TASK_QUEUE_ENABLE": "0"}, _steps(30, "--interval", "0.05")),
        ("task-queue-2", {"TASK_QUEUE_ENABLE": "2"}, _steps(30, "--interval", "0.05")),
        ("sgd", {}, _steps(30, "--interval", "0.05", "--optimizer", "sgd")),
        ("dataloader-workers", {}, _steps(30, "--interval", "0.05", "--workers", "2")),
        ("strict-tree-no-daemon", STRICT, _steps(30, "--interval", "0.05")),
    ],
)
def test_a_torch_npu_job_continues_exactly(
    name: str,
    extra: dict[str, str],
    args: list[str],
    torch_npu_python: str,
    sim_env: dict[str, str],
    runtime_dir: Path,
    tmp_path: Path,
) -> None:
    _dump_restore(torch_npu_python, sim_env, runtime_dir, tmp_path, args, after=5, **extra)


@pytest.mark.parametrize("expandable", [False, True], ids=["default", "expandable"])
def test_leave_running_original_and_image_both_continue_exactly(
    expandable: bool, torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    extra = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"} if expandable else {}
    _dump_restore(
        torch_npu_python,
        sim_env,
        runtime_dir,
        tmp_path,
        _steps(30, "--interval", "0.05"),
        after=5,
        leave_running=True,
        **extra,
    )


def _hard(
    python: str, sim_env: dict[str, str], runtime_dir: Path, tmp: Path, args: list[str], stalled: str = ""
) -> Cut:
    return _dump_restore(python, sim_env, runtime_dir, tmp, args, after=2, stalled=stalled, busy=True)


def _in_flight(cut: Cut) -> bool:
    lk = cut.lock
    return bool(lk["running"] or lk["kernels_queued"] or lk["copies_queued"] or lk["gated"])


@pytest.mark.parametrize("phase", ["h2d", "backward", "optimizer"])
def test_dump_inside_a_phase_with_work_in_flight(
    phase: str, torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The job sleeps inside the phase in step 2 while slow kernels run: the dump lands there
    (an async H2D copy from pinned memory queued; mid-backward; between the two halves of the
    foreach optimizer step) with the device still executing what was queued before."""
    cut = _hard(torch_npu_python, sim_env, runtime_dir, tmp_path, _steps(4, "--stall", f"{phase}:10"), phase)
    assert cut.phase == phase, cut
    assert _in_flight(cut), f"nothing queued or executing at Lock: {cut}"
    if phase == "h2d":
        assert cut.lock["copies_queued"] or cut.lock["running"], cut


READ = {"x86_64": 0, "aarch64": 63}.get(platform.machine(), -100)


def test_dump_with_the_task_queue_ring_full(
    torch_npu_python: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """600,000 tiny launches a step: the dump lands in the burst. The Lock holds acl_thread's next
    launch at the runtime's gate (never failed, so the queue never turns to its error state);
    the Python thread then fills torch_npu's 4096-slot ring and blocks reading the queue's eventfd,
    which is how the dump finds it (seen in /proc while the dump runs). Filling 4096 slots takes
    the Python thread a moment; the simulator's Backup holds the job 0.5 s, so that the ring is
    full while the dump holds it however quick the rest of the dump is."""
    cut = _dump_restore(
        torch_npu_python,
        sim_env,
        runtime_dir,
        tmp_path,
        _steps(2, "--burst", "600000"),
        ready="burst 0 ",
        watch=True,
        NPUSIM_BACKUP_HANG_MS="500",
    )
    assert cut.phase == "burst", cut
    assert cut.backup.get("gated", 0) >= 1, f"no launch was held at the gate: {cut}"
    # The ring is full throughout the burst (acl_thread launches slower than Python enqueues), so
    # the Python thread is seen blocked reading the queue's eventfd while the dump runs.
    blocked = [t for t in cut.threads if t.get("main", (0, ""))[0] == READ and "eventfd" in t["main"][1]]
    assert blocked, f"never seen: the Python thread blocked on the full ring during the dump: {cut}"
