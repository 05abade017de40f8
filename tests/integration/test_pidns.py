"""Jobs started as init of their own pid namespace (`npusnap run --pid-ns`): agents that do not
collide, dump, and restores that need no host pid free (beside the original, and N at once)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    TRAIN,
    TRAIN_ARGS,
    alive,
    cli,
    continues_reference,
    job_env,
    kill,
    reference,
    wait_until,
)

pytestmark = pytest.mark.integration


def nspid(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no NSpid for {pid}")


def start_ns_job(env: dict[str, str], out: Path, argv: list[str]) -> int:
    p = subprocess.run(
        [NPUSNAP, "run", "--pid-ns", "--detach", "--output", str(out), "--", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip())


def lines(out: Path) -> list[str]:
    return [ln for ln in out.read_text(errors="replace").splitlines() if ln.startswith("step")]


def test_two_namespaced_jobs_have_their_own_agents(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    pids = []
    try:
        for i in range(2):
            pids.append(
                start_ns_job(
                    env,
                    tmp_path / f"job{i}.out",
                    [PY, TRAIN, *TRAIN_ARGS, "--steps", "400", "--device", str(i)],
                )
            )
        for i, pid in enumerate(pids):
            assert nspid(pid) == [pid, 1]
            out_file = tmp_path / f"job{i}.out"
            wait_until(lambda f=out_file: len(lines(f)) >= 2, 30, "steps")
            rc, out, err = cli(env, "status", str(pid))
            assert rc == 0 and out is not None, err
            assert sorted(p.name for p in runtime_dir.iterdir()) == sorted(f"{p}.sock" for p in pids)
    finally:
        for pid in pids:
            kill(pid)


def test_restore_needs_no_host_pid_free(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """A launcher (ns pid 1) with an NPU worker (ns pid 2): dumped with --leave-running; the
    worker is then stopped (its device must be free for CANN's Restore) while the launcher keeps
    its host pid; the image restores beside it, in a namespace of its own, and goes on."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "60"]
    ref = reference(env, args)
    out = tmp_path / "job.out"
    script = f"{PY} {TRAIN} {' '.join(args)}; exec sleep 600"
    launcher = start_ns_job(env, out, ["sh", "-c", script])
    restored = 0
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        worker = int(subprocess.check_output(["pgrep", "-P", str(launcher)], text=True).split()[0])
        assert nspid(worker)[0] == worker and nspid(worker)[1] > 1
        rc, res, err = cli(env, "dump", str(launcher), str(tmp_path / "img"), "--leave-running")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        kill(worker)
        at = len(lines(out))
        rc, res, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        restored = int(res["result"]["root_pid"])
        assert restored != launcher and alive(launcher)
        assert nspid(restored)[-1] == 1
        wait_until(lambda: "step 60" in " ".join(lines(out)), 60, "the restored worker to finish")
        cont = lines(out)[at:]
        assert cont and continues_reference(cont, ref), cont[:3]
        # Both launchers still answer on their own sockets.
        for pid in (launcher, restored):
            rc, _st, err = cli(env, "status", str(pid))
            assert rc == 0, (pid, err)
    finally:
        for pid in (restored, launcher):
            if pid:
                kill(pid)
