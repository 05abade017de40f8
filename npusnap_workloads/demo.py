"""The demo: a training workload on the simulated NPU is dumped, restored and checked.

The workload is ``torch_npu_block.py`` (``torch_npu``: an attention block trained by the real
torch_npu wheel, in the venv scripts/setup-torch-npu.sh builds at ``.build/torch-npu``),
``npu_train.py`` (``compute``: an MLP trained by aclnn operators and streams on the device, tensors
in an expandable-segment allocator) or ``train.py`` (``memory``: parameters in device memory,
updated through host copies). ``auto`` takes torch_npu where its venv is there and says why not
otherwise (the reason setup-torch-npu.sh left), then runs ``compute``.

It drives the product exactly as an operator would — the real ``npusnap run``, ``npusnap dump``
and ``npusnap restore`` commands, each as a subprocess with ``--json`` — and then proves
continuity: the restored workload's complete output must equal an uninterrupted reference run
of the same deterministic workload, line for line.

Core module: reports progress through a callback and returns a ``DemoResult``; it never prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import errors, paths
from npusnap_cli.errors import ContinuityError, NpusnapError, PreflightError, TargetError
from npusnap_cli.host import procfs
from npusnap_sim import manager
from npusnap_workloads import WORKLOADS_DIR

TRAIN = WORKLOADS_DIR / "train.py"
NPU_TRAIN = WORKLOADS_DIR / "npu_train.py"
TORCH_NPU_BLOCK = WORKLOADS_DIR / "torch_npu_block.py"
WORKLOADS = {"torch_npu": TORCH_NPU_BLOCK, "compute": NPU_TRAIN, "memory": TRAIN}
AUTO = "auto"  # torch_npu when its venv is there, else compute

Report = Callable[[str, str], None]  # (phase, message)


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 40
    dump_after: int = 12
    interval_s: float = 0.1
    param_bytes: int = 16 << 20
    device: int = 0
    seed: int = 7
    workdir: Optional[Path] = None
    keep: bool = False
    workload: str = AUTO  # a key of WORKLOADS, or AUTO
    hidden: int = 64  # the compute workload's hidden units


@dataclass
class DemoResult:
    workdir: Optional[str]
    image: Optional[str]
    workload: str = ""  # the key of WORKLOADS that ran
    torch_npu_unavailable: Optional[str] = None  # why AUTO did not run torch_npu
    dump_caught: Optional[str] = None  # torch_npu: the job's phase and step when the dump stopped it
    original_pid: int = 0
    restored_pid: int = 0
    lines_before_dump: int = 0
    lines_total: int = 0
    reference_lines: int = 0
    continuity: bool = False
    first_difference: Optional[dict[str, Any]] = None
    phases_s: dict[str, float] = field(default_factory=dict)
    dump: dict[str, Any] = field(default_factory=dict)
    restore: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def torch_npu_python() -> tuple[Optional[Path], str]:
    """The torch_npu venv's python, or None and why there is none (setup-torch-npu.sh leaves the
    reason of its last failure in ``.build/torch-npu.why``)."""
    venv = paths.build_dir() / "torch-npu"
    python = venv / "bin" / "python"
    if os.access(python, os.X_OK) and (venv / ".npusnap-ok").is_file():
        return python, ""
    why_file = paths.build_dir() / "torch-npu.why"
    try:
        why = " ".join(why_file.read_text().split("\n")[:1]).strip()
    except OSError:
        why = ""
    if not why:
        why = (
            f"{venv} was not built by scripts/setup-torch-npu.sh (`make demo` runs it)"
            if not python.exists()
            else f"{venv} is unfinished (no .npusnap-ok): run scripts/setup-torch-npu.sh again"
        )
    return None, why


def _npusnap() -> list[str]:
    exe = Path(sys.executable).parent / "npusnap"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "npusnap_cli"]


def _workload_args(s: DemoSettings, interval: float, phase: Optional[Path] = None) -> list[str]:
    if s.workload == "torch_npu":
        args = ["--steps", str(s.steps), "--interval", str(interval), "--device", f"npu:{s.device}"]
        return [str(TORCH_NPU_BLOCK), *args, *(["--phase", str(phase)] if phase else [])]
    common = ["--steps", str(s.steps), "--interval", str(interval), "--device", str(s.device)]
    common += ["--seed", str(s.seed)]
    if s.workload == "compute":
        return [str(NPU_TRAIN), *common, "--hidden", str(s.hidden)]
    return [str(TRAIN), *common, "--param-bytes", str(s.param_bytes)]


def _run_json(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run an npusnap command with --json; return its envelope (raise its error if it failed)."""
    proc = subprocess.run(
        [*_npusnap(), *args, "--json"], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    try:
        envelope: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise NpusnapError(
            f"`npusnap {args[0]}` printed no JSON envelope (exit {proc.returncode})",
            why="it crashed before reporting",
            fix=f"run it by hand: npusnap {' '.join(args)}",
            details={"stderr": proc.stderr.strip().splitlines()[-15:]},
        ) from None
    if not envelope.get("ok"):
        raise errors.from_dict(envelope.get("error") or {}, prefix=f"`npusnap {args[0]}` failed: ")
    return envelope


def _read_lines(path: Path) -> list[str]:
    try:
        return [ln for ln in path.read_text().splitlines() if ln.startswith("step ")]
    except OSError:
        return []


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TargetError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def _caught(phase_file: Path) -> Optional[str]:
    """What torch_npu_block.py's phase file said when the dump stopped it ("backward 12")."""
    try:
        text = phase_file.read_bytes().decode(errors="replace").strip("\0 ")
    except OSError:
        return None
    return text or None


def run_demo(settings: DemoSettings, report: Report) -> DemoResult:
    if os.geteuid() != 0:
        raise PreflightError(
            "the demo needs root", why="CRIU dump and restore run as root", fix="sudo make demo"
        )
    python = Path(sys.executable)
    unavailable: Optional[str] = None
    if settings.workload in (AUTO, "torch_npu"):
        found, why = torch_npu_python()
        if found is not None:
            python = found
            settings = dataclasses.replace(settings, workload="torch_npu")
        elif settings.workload == "torch_npu":
            raise PreflightError(
                "--workload torch_npu: no torch_npu venv",
                why=why,
                fix="run ./scripts/setup-torch-npu.sh (or make demo), or choose --workload compute",
            )
        else:
            unavailable = why
            settings = dataclasses.replace(settings, workload="compute")
    work = settings.workdir or Path(tempfile.mkdtemp(prefix="npusnap-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    image = work / "img"
    phase_file = work / "phase"
    result = DemoResult(
        workdir=str(work), image=str(image), workload=settings.workload, torch_npu_unavailable=unavailable
    )
    if unavailable:
        report("workload", f"no torch_npu venv ({unavailable}): running the built-in workload instead")
    elif settings.workload == "torch_npu":
        report("workload", f"torch_npu: an attention block trained by the real torch_npu wheel ({python})")
    t0 = time.monotonic()

    def mark(name: str, since: float) -> float:
        now = time.monotonic()
        result.phases_s[name] = round(now - since, 3)
        return now

    report("sim", "starting the simulated NPU")
    sim = manager.start()
    if sim.get("keep_contents"):
        raise PreflightError(
            "the simulated NPU runs with --keep-contents, which real CANN does not do",
            why="the demo must prove continuity on a device that, like CANN's Restore, gives "
            "allocations back without their contents",
            fix="npusnap sim stop && npusnap sim start, then rerun the demo",
        )
    report("sim", "truthful mode: like CANN, Restore brings back addresses, not device memory contents")
    env = {**os.environ, **manager.env()}
    t = mark("simulator", t0)

    name = WORKLOADS[settings.workload].name
    report("reference", f"uninterrupted reference run of {name} ({settings.steps} steps)")
    ref = subprocess.run(
        [str(python), *_workload_args(settings, 0.0)], env=env, capture_output=True, text=True, timeout=600
    )
    if ref.returncode != 0:
        raise NpusnapError("the reference run failed", details={"stderr": ref.stderr.splitlines()[-10:]})
    reference = [ln for ln in ref.stdout.splitlines() if ln.startswith("step ")]
    result.reference_lines = len(reference)
    t = mark("reference run", t)

    log = work / "train.log"
    script = WORKLOADS[settings.workload]
    report("launch", f"npusnap run -- {python.name} {script.name} (output in {log})")
    with open(log, "w") as out, open(os.devnull) as devnull:
        # Detached (own session, no terminal, output to a file): that is what CRIU can restore.
        proc = subprocess.Popen(
            [
                *_npusnap(),
                "run",
                "--",
                str(python),
                *_workload_args(settings, settings.interval_s, phase_file),
            ],
            stdin=devnull,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    result.original_pid = proc.pid
    restored_pid = 0
    try:
        _wait_for(
            lambda: len(_read_lines(log)) >= settings.dump_after or proc.poll() is not None,
            # torch_npu's import and first steps take seconds on a loaded 2-core machine
            180 if settings.workload == "torch_npu" else 60,
            f"{settings.dump_after} training steps",
        )
        if proc.poll() is not None:
            raise TargetError(
                "the workload exited early", details={"log": log.read_text().splitlines()[-10:]}
            )
        t = mark("train until dump", t)

        report("dump", f"npusnap dump {proc.pid} {image}")
        envelope = _run_json(["dump", str(proc.pid), str(image)], env, timeout=600)
        result.dump = envelope.get("result") or {}
        kept = (result.dump.get("device_memory") or {}).get("processes") or {}
        saved = sum(int(p.get("saved_bytes") or 0) for p in kept.values())
        report("dump", f"npusnap copied {saved} bytes of device memory after Lock")
        proc.wait(timeout=30)  # reap it: its pid must be free for the restore
        # What the job printed until the lock stopped it (it trained on while the dump started).
        result.lines_before_dump = len(_read_lines(log))
        report("dump", f"process {proc.pid} is gone; it printed {result.lines_before_dump} steps first")
        result.dump_caught = _caught(phase_file) if settings.workload == "torch_npu" else None
        if result.dump_caught:
            report("dump", f"the dump stopped the job in: {result.dump_caught} (phase, step)")
        t = mark("dump", t)

        pidfile = work / "restored.pid"
        report("restore", f"npusnap restore {image}")
        envelope = _run_json(["restore", str(image), "--pidfile", str(pidfile)], env, timeout=600)
        result.restore = envelope.get("result") or {}
        restored_pid = int(pidfile.read_text().strip())
        result.restored_pid = restored_pid
        t = mark("restore", t)

        report("continue", f"restored pid {restored_pid} is training again")
        _wait_for(lambda: not procfs.is_alive(restored_pid), 300, "the restored workload to finish")
        t = mark("train to the end", t)
    finally:
        for pid in (proc.pid, restored_pid):
            # Only if the pid still is our workload: an exited pid may already be someone else's.
            if pid and procfs.is_alive(pid) and str(script) in procfs.cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(timeout=10)

    actual = _read_lines(log)
    result.lines_total = len(actual)
    cut = result.lines_before_dump
    if 0 < cut < len(actual):
        report("check", f"last line before the dump:   {actual[cut - 1]}")
        report("check", f"first line after the restore: {actual[cut]}")
        report("check", f"reference run at that step:   {reference[cut] if cut < len(reference) else '-'}")
    result.continuity = actual == reference and result.lines_before_dump < len(reference)
    if actual != reference:
        i = next(
            (i for i, (a, b) in enumerate(zip(actual, reference)) if a != b), min(len(actual), len(reference))
        )
        result.first_difference = {
            "line": i + 1,
            "restored_run": actual[i] if i < len(actual) else None,
            "reference": reference[i] if i < len(reference) else None,
        }
    mark("total", t0)
    if not result.continuity:
        raise ContinuityError(
            "the restored workload did not continue identically to the reference run",
            why="device or host state was not restored faithfully",
            fix=f"inspect {log} and the image (rerun with --keep)",
            details={"first_difference": result.first_difference, "result": result.to_dict()},
        )
    if not settings.keep:
        # A work dir of our own (a temporary one) goes entirely; in one the user gave, only the image.
        shutil.rmtree(work if settings.workdir is None else image, ignore_errors=True)
        result.image = None
        if settings.workdir is None:
            result.workdir = None
    return result
