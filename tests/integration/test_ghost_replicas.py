"""Copies of a job that holds a small deleted file open (CRIU saves it as a ghost file), restored
at the same time: `--replicas 3` beside the running original, and a separate `npusnap restore`
of the same image started with them. CRIU recreates the file under one name per image
(`PATH.cr.ID.ghost`), so their CRIU restores take turns (host/ghostlock.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.host import ghostlock
from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    REPO,
    TRAIN_ARGS,
    alive,
    cli,
    continues_reference,
    job_env,
    kill,
    private_sim,
    reference,
    wait_until,
)
from tests.integration.test_pidns import lines, start_ns_job

pytestmark = pytest.mark.integration

# train.py's device loop; every step first reads the deleted file back through the fd it kept.
GHOST_JOB = """
import os, sys
sys.path.insert(0, {workloads!r})
import train
data = b"kept only by its fd\\n" * 200  # 4 KiB: under CRIU's ghost limit
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, data)
os.unlink(sys.argv[1])
step = train.Trainer.step
def checked(self, n):
    same = os.pread(fd, len(data) + 1, 0) == data
    deleted = os.readlink(f"/proc/self/fd/{{fd}}").endswith(" (deleted)")
    print(f"ghost {{n}} {{'ok' if same and deleted else 'BAD'}}", flush=True)
    return step(self, n)
train.Trainer.step = checked
raise SystemExit(train.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def sim_env() -> Iterator[dict[str, str]]:
    """A simulated NPU of 5 devices: the original on 0, the replicas on 1-3, the separate
    restore on 4."""
    with private_sim(devices=5, capacity_bytes=64 << 20) as env:
        yield env


def ghost_lines(out: Path) -> list[str]:
    return [ln for ln in out.read_text(errors="replace").splitlines() if ln.startswith("ghost ")]


def test_replicas_of_a_job_holding_a_deleted_file(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "80", "--device", "0"]
    ref = reference(env, args)
    job = tmp_path / "ghostjob.py"
    job.write_text(GHOST_JOB.format(workloads=str(REPO / "npusnap_workloads")))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, str(job), str(data_dir / "x"), *args])
    roots: list[int] = []
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        img = tmp_path / "img"
        rc, res, err = cli(env, "dump", str(pid), str(img), "--leave-running")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        assert list((img / "criu").glob("ghost-file-*.img")), "CRIU saved no ghost file"
        assert os.listdir(data_dir) == [], "the dump left a file beside the deleted one"
        at = len(lines(out))
        # The test holds the image's ghost locks while the replicas and a separate restore start,
        # so that all four reach CRIU together once it lets go: without the locks their CRIUs
        # would overlap (each keeps PATH.cr.ID.ghost for a few ms only, so a plain start collides
        # only sometimes).
        logdirs = [img / "logs" / f"replica-{i}" for i in range(3)] + [tmp_path / "single-logs"]
        single_argv = ["--device-map", "0=4", "--output", str(tmp_path / "single.out")]
        replicas = ["--replicas", "3", "--device-map", "0=1", "--device-map", "0=2", "--device-map", "0=3"]
        replicas += ["--output", str(tmp_path / "replica-{n}.out")]
        procs = []
        with ghostlock.held(ghostlock.ghost_paths(img / "criu"), lambda _m: None):
            for argv in ([*single_argv, "--logs", str(logdirs[3])], replicas):
                procs.append(
                    subprocess.Popen(
                        [NPUSNAP, "restore", str(img), *argv, "--json"],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            wait_until(lambda: all(d.is_dir() for d in logdirs), 60, "the four restores' preflight")
            time.sleep(1.0)  # from the preflight to the CRIU step
            assert not [d for d in logdirs if (d / "restore.log").exists()], "a CRIU ran past the lock"
        (s_out, s_err), (r_out, r_err) = (p.communicate(timeout=120) for p in procs)
        res = json.loads(r_out) if r_out.strip() else None
        assert procs[1].returncode == 0 and res is not None, (res or {}).get("error") or r_err
        sres = json.loads(s_out)
        assert procs[0].returncode == 0 and sres["ok"], sres.get("error") or s_err
        roots = [int(r["root_pid"]) for r in res["result"]["replicas"]] + [int(sres["result"]["root_pid"])]
        # (The original may have finished by now on a busy machine: its output is checked below.)
        assert len(set(roots)) == 4 and pid not in roots
        waits = [w for r in res["result"]["replicas"] for w in r["warnings"]] + sres["warnings"]
        waits = [w for w in waits if "waiting for the CRIU restore" in w]
        assert waits, "no restore waited for another's CRIU"
        for p in [pid, *roots]:
            wait_until(lambda p=p: not alive(p), 60, f"pid {p} to finish")
        assert continues_reference(lines(out)[at:], ref), "the original went on unharmed"
        for name in ["replica-0.out", "replica-1.out", "replica-2.out", "single.out"]:
            own = lines(tmp_path / name)
            assert own and continues_reference(own, ref), (name, own[:3])
            # every step after the restore read the file (the first may have read it before the dump)
            steps = [ln.split()[1] for ln in own]
            ghosts = ghost_lines(tmp_path / name)
            assert [g.split()[1] for g in ghosts] in (steps, steps[1:]), (name, ghosts, steps)
            assert all(g.endswith(" ok") for g in ghosts), (name, ghosts)
        assert os.listdir(data_dir) == [], "a CRIU ghost file was left behind"
        # One left behind (a CRIU killed mid-restore) is named before CRIU would trip on it.
        (leftover,) = ghostlock.ghost_paths(img / "criu")
        Path(leftover).write_bytes(b"")
        rc, res, err = cli(env, "restore", str(img), "--device-map", "0=1")
        assert rc == ExitCode.PREFLIGHT and res is not None, err
        assert leftover in res["error"]["message"] and f"rm {leftover}" in res["error"]["fix"], res["error"]
    finally:
        for r in roots:
            kill(r)
        kill(pid)
