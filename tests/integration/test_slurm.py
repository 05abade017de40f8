"""A two-task Slurm job snapshotted by job id, restored as a step of the same allocation.

The fixture starts a private single-node Slurm (munged on its own socket, slurmctld and slurmd on
free ports, state in a temporary directory) and stops it afterwards. Needs slurm-wlm and munge
(scripts/setup.sh installs them) and root; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.dumplib import PY, continues_reference, wait_until
from tests.integration.test_jobs import NPUSNAP, RANKS, free_port, job_reference, jobs_env

# serial: the host has one Slurm.
pytestmark = [pytest.mark.integration, pytest.mark.serial]

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sbatch", "srun", "scancel", "sinfo")


def _skip_reason() -> str:
    if os.geteuid() != 0:
        return "the Slurm daemons need root"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    return (
        f"not installed: {', '.join(missing)} (scripts/setup.sh installs slurm-wlm and munge)"
        if missing
        else ""
    )


def _pid(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    d = Path(tempfile.mkdtemp(prefix="npslurm-"))  # short: the munge socket path
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=npusnaptest",
                f"SlurmctldHost={host}",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "AuthType=auth/munge",
                f"AuthInfo=socket={d}/munge.sock",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={d}/state",
                f"SlurmdSpoolDir={d}/spool",
                f"SlurmctldPidFile={d}/slurmctld.pid",
                f"SlurmdPidFile={d}/slurmd.pid",
                f"SlurmctldLogFile={d}/slurmctld.log",
                f"SlurmdLogFile={d}/slurmd.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                f"NodeName={host} CPUs={os.cpu_count() or 2} State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=FORCE:4",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pidfiles = [d / "slurmd.pid", d / "slurmctld.pid", d / "munge" / "pid"]
    try:
        subprocess.run(
            ["munged", f"--socket={d}/munge.sock", f"--log-file={d}/munge/log", f"--pid-file={d}/munge/pid",
             f"--seed-file={d}/munge/seed", "--force"],
            check=True, timeout=30, capture_output=True,
        )  # fmt: skip
        subprocess.run(["slurmctld", "-i"], env=env, check=True, timeout=60, capture_output=True)
        subprocess.run(["slurmd"], env=env, check=True, timeout=60, capture_output=True)

        def idle() -> bool:
            p = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
            )
            return p.stdout.strip() == "idle"

        wait_until(idle, 120, "the Slurm node to be idle")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30)
        for f in pidfiles:
            pid = _pid(f)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                end = time.monotonic() + 20
                while time.monotonic() < end and os.path.exists(f"/proc/{pid}"):
                    time.sleep(0.1)
        shutil.rmtree(d, ignore_errors=True)


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith("[rank")]


def _listpids(env: dict[str, str], job: str) -> list[list[str]]:
    p = subprocess.run(["scontrol", "listpids", job], env=env, capture_output=True, text=True, timeout=30)
    return [ln.split() for ln in p.stdout.splitlines()[1:] if ln.split()]


def test_two_task_slurm_job_snapshotted_by_job_id(
    slurm: dict[str, str], sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = {**jobs_env(sim_env, runtime_dir), "SLURM_CONF": slurm["SLURM_CONF"]}
    ref = job_reference(env, seed=21)
    # The allocation: a batch script that only holds it; the computation is a step of it.
    p = subprocess.run(
        ["sbatch", "--parsable", "-n2", "-o", "/dev/null", "--wrap", "sleep 600"],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    job = p.stdout.strip().split(";")[0]
    outs = [tmp_path / "r0.out", tmp_path / "r1.out"]
    step = None
    restore = None
    try:
        wait_until(
            lambda: any(r[2:3] == ["batch"] for r in _listpids(env, job)), 60, "the allocation to start"
        )
        master = f"127.0.0.1:{free_port()}"
        task = (
            f"exec {NPUSNAP} run -- {PY} {RANKS} --rank $SLURM_PROCID --world 2 --master {master} "
            f"--device $SLURM_PROCID --steps 40 --interval 0.1 --seed 21 "
            f"</dev/null >>{tmp_path}/r$SLURM_PROCID.out 2>&1"
        )
        step = subprocess.Popen(
            ["srun", f"--jobid={job}", "--overlap", "-n2", "--input=none", "sh", "-c", task],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(lambda: all(o.exists() and len(_lines(o)) >= 3 for o in outs), 60, "both tasks to step")

        img = tmp_path / "img"
        argv = [NPUSNAP, "dump", "--slurm-job", job, str(img), "--tcp-established", "--json"]
        d = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
        assert d.returncode == 0, d.stdout + d.stderr
        import json

        dumped = json.loads(d.stdout)["result"]["job"]["ranks"]
        task_pids = [int(r["pid"]) for r in dumped]
        assert len(task_pids) == 2
        step.wait(60)  # the step ends with its (killed) tasks; the allocation stays
        before = [len(_lines(o)) for o in outs]

        # Restore as a step of the same allocation: Slurm tracks the restored tasks again.
        restore = subprocess.Popen(
            ["srun", f"--jobid={job}", "--overlap", "-n1", "--input=none",
             NPUSNAP, "restore", str(img), "--wait"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

        def tracked() -> bool:
            listed = {int(r[0]) for r in _listpids(env, job) if r[0].isdigit() and r[2] != "batch"}
            return set(task_pids) <= listed

        wait_until(tracked, 60, "Slurm to list the restored tasks under the restore step")
        o, e = restore.communicate(timeout=120)
        assert restore.returncode == 0, o + e
        for i, out in enumerate(outs):
            lines = _lines(out)
            assert lines[: before[i]] == ref[i][: before[i]]
            cont = lines[before[i] :]
            assert cont and continues_reference(cont, ref[i]) and cont[0] == ref[i][before[i]], cont[:3]
    finally:
        for proc in (step, restore):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
