"""Find the tasks of a Slurm job on this node (``scontrol listpids``), for a coordinated dump.

``scontrol listpids JOBID`` prints, for every process Slurm tracks on this node,
``PID JOBID STEPID LOCALID GLOBALID``; a task's own process has numeric ids, its children and
slurmstepd's helpers have ``-``. The batch script (step ``batch``) and the ``extern`` step are
not tasks of the job's computation. The rank of a task is its global task id.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from npusnap_cli.errors import PreflightError, TargetError

SCONTROL_TIMEOUT_S = 30.0
NOT_TASK_STEPS = ("batch", "extern")


@dataclass(frozen=True)
class SlurmTask:
    pid: int
    job: str
    step: str
    local_id: int
    global_id: int


def parse_listpids(text: str) -> list[SlurmTask]:
    tasks = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        pid, job, step, local, glob = fields[:5]
        if step in NOT_TASK_STEPS or not local.isdigit() or not glob.isdigit():
            continue
        tasks.append(SlurmTask(int(pid), job, step, int(local), int(glob)))
    return sorted(tasks, key=lambda t: (t.step, t.global_id))


def job_tasks(jobid: str) -> list[SlurmTask]:
    """The job's tasks on this node, in (step, global task id) order."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise PreflightError(
            "scontrol is not installed: cannot ask Slurm for the job's tasks",
            fix="run npusnap on a Slurm node (slurm-client), or name the pids: npusnap dump PID PID DIR",
        )
    try:
        p = subprocess.run(
            [scontrol, "listpids", str(jobid)], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise PreflightError(
            f"scontrol listpids {jobid} did not answer within {SCONTROL_TIMEOUT_S:.0f}s",
            fix="check slurmd on this node (`scontrol ping`, `systemctl status slurmd`)",
        ) from None
    if p.returncode != 0:
        raise TargetError(
            f"Slurm does not list job {jobid} on this node: {(p.stderr or p.stdout).strip()}",
            why="the job does not exist, has ended, or has no step on this node",
            fix="check `squeue -j JOBID` and run npusnap on a node of the job",
        )
    tasks = parse_listpids(p.stdout)
    if not tasks:
        raise TargetError(
            f"job {jobid} has no task on this node (only its batch script or helpers)",
            why="npusnap snapshots the tasks of the job's steps (srun), one rank per task",
            fix="start the computation with srun inside the job, or name the pids: npusnap dump PID PID DIR",
            details={"listpids": p.stdout.splitlines()},
        )
    return tasks
