"""Jobs started as init of their own pid namespace (`npusnap run --pid-ns`): agents that do not
collide, dump, and restores that need no host pid free (beside the original, and N at once)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from npusnap_cli.errors import ExitCode
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


def start_ns_job(env: dict[str, str], out: Path, argv: list[str], cwd: Optional[Path] = None) -> int:
    p = subprocess.run(
        [NPUSNAP, "run", "--pid-ns", "--detach", "--output", str(out), "--", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
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


def _count_after(out: Path, ref: list[str], at: int) -> dict[str, int]:
    got = lines(out)
    return {line: got.count(line) for line in ref[at:]}


def test_copy_beside_the_original_on_another_device(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The original keeps running on device 0; its image restores beside it onto device 1
    (--device-map 0=1): the copy runs in a container of the simulated NPU (a mount namespace whose
    device nodes are device 1's only), so its device 0 is device 1 and its memory is there; both
    finish the run, each step once per copy, with the results of an uninterrupted run."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "80", "--device", "0"]
    ref = reference(env, args)
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, TRAIN, *args])
    restored = 0
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        rc, res, err = cli(env, "dump", str(pid), str(tmp_path / "img"), "--leave-running")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        at = len(lines(out))
        rc, res, err = cli(env, "restore", str(tmp_path / "img"), "--device-map", "0=1")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        restored = int(res["result"]["root_pid"])
        assert restored != pid and alive(pid)
        rc, st, _ = cli(env, "sim", "status")
        assert rc == 0 and st is not None
        owners = {d["id"]: {o["pid"] for o in d["owners"]} for d in st["result"]["devices"]}
        assert pid in owners[0] and restored in owners[1] and restored not in owners[0], owners
        devs = {d["id"]: d for d in st["result"]["devices"]}
        views = {o["pid"]: o["visible_devices"] for o in st["result"]["owners"]}
        assert views[pid] == [0, 1] and views[restored] == [1], views
        assert devs[1]["used"] > 0 and devs[1]["allocations"] > 0, devs[1]
        assert os.path.exists(f"{st['result']['device_nodes']}/davinci0")  # the host's view is untouched
        assert os.listdir(f"/proc/{restored}/root{st['result']['device_nodes']}") == ["davinci1"]
        for p in (pid, restored):
            wait_until(lambda p=p: not alive(p), 60, f"pid {p} to finish")
        counts = _count_after(out, ref, at + 2)
        assert set(counts.values()) == {2}, counts
    finally:
        for p in (restored, pid):
            if p:
                kill(p)


def test_a_job_with_visible_devices_keeps_them_across_a_restore(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """ASCEND_RT_VISIBLE_DEVICES=1: the job's device 0 is device 1. npusnap saves its memory
    (tracked under the driver's id 1, its contexts under 0), and the restored job keeps its
    variable and its device: it finishes with the results of an uninterrupted run."""
    env = job_env(sim_env, runtime_dir, ASCEND_RT_VISIBLE_DEVICES="1")
    args = [*TRAIN_ARGS, "--steps", "40", "--device", "0"]
    ref = reference(env, args)
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, TRAIN, *args])
    restored = 0
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        rc, st, _ = cli(env, "sim", "status")
        assert rc == 0 and st is not None
        assert {o["pid"]: o["visible_devices"] for o in st["result"]["owners"]}[pid] == [0, 1]
        assert [o["pid"] for o in st["result"]["devices"][1]["owners"]] == [pid]
        rc, res, err = cli(env, "dump", str(pid), str(tmp_path / "img"))
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        at = len(lines(out))
        # Its list stays in its memory: another device is refused before anything is restored.
        rc, res, err = cli(env, "restore", str(tmp_path / "img"), "--device-map", "0=2")
        assert rc == 3 and res is not None, err
        assert "ASCEND_RT_VISIBLE_DEVICES=1" in res["error"]["message"], res["error"]
        rc, res, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        restored = int(res["result"]["root_pid"])
        rc, st, _ = cli(env, "sim", "status")
        assert st is not None and [o["pid"] for o in st["result"]["devices"][1]["owners"]] == [restored]
        wait_until(lambda: not alive(restored), 60, "the restored job to finish")
        cont = lines(out)[at:]
        assert cont and continues_reference(cont, ref), cont[:3]
    finally:
        for p in (restored, pid):
            if p:
                kill(p)


def test_one_image_restored_twice_at_once(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """`restore --replicas 2`: two copies of one image at once, each in its own pid namespace on
    a device of its own, each with its own pidfile and output file; both finish the run from the
    dump's step."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "60"]
    ref = reference(env, args)
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, TRAIN, *args])
    roots: list[int] = []
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        rc, res, err = cli(env, "dump", str(pid), str(tmp_path / "img"))
        assert rc == 0 and res is not None, ((res or {}).get("error") or {}).get("details") or err
        at = len(lines(out))
        pf = tmp_path / "replica-{n}.pid"
        rc, res, err = cli(
            env,
            "restore",
            str(tmp_path / "img"),
            "--replicas",
            "2",
            "--device-map",
            "0=0",
            "--device-map",
            "0=1",
            "--pidfile",
            str(pf),
            "--output",
            str(tmp_path / "replica-{n}.out"),
        )
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        roots = [int(r["root_pid"]) for r in res["result"]["replicas"]]
        assert len(set(roots)) == 2
        for i, root in enumerate(roots):
            assert (tmp_path / f"replica-{i}.pid").read_text().strip() == str(root)
            assert nspid(root)[-1] == 1
        # Replica 1 answers on an agent socket of its own.
        rc, _st, err = cli(env, "status", str(roots[1]))
        assert rc == 0, err
        # ps lists both copies, each as a replica of the dumped job.
        rc, listing, err = cli(env, "ps")
        assert rc == 0 and listing is not None, err
        copies = {e["pid"]: e for e in listing["result"]["processes"] if e["pid"] in roots}
        assert sorted(copies) == sorted(roots), listing["result"]["processes"]
        assert all(e["replica_of"] == pid and e["agent_error"] is None for e in copies.values()), copies
        for root in roots:
            wait_until(lambda r=root: not alive(r), 60, f"replica {root} to finish")
        assert len(lines(out)) == at, "the copies write to their own --output files"
        for i in range(2):
            own = lines(tmp_path / f"replica-{i}.out")
            assert own and continues_reference(own, ref), own[:3]
        # (the agents' logs, <pid>.log, stay for the operator to read)
        left = [p.name for p in runtime_dir.iterdir() if not p.name.endswith(".log")]
        assert left == [], "a replica left its socket behind"
    finally:
        for r in roots:
            kill(r)
        kill(pid)


def test_run_pid_ns_in_the_foreground_waits_and_passes_the_status(tmp_path: Path) -> None:
    """Without --detach npusnap stays the parent: the program is pid 1 inside, leads its own
    session, and npusnap exits with its status (and hands it SIGTERM)."""
    p = subprocess.run(
        [NPUSNAP, "run", "--pid-ns", "--", "sh", "-c", 'echo "$$ $(cut -d" " -f6 /proc/self/stat)"; exit 3'],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 3, p.stderr
    pid_inside, _session = p.stdout.split()
    assert pid_inside == "1"
    sleeper = subprocess.Popen(
        [
            NPUSNAP,
            "run",
            "--pid-ns",
            "--",
            PY,
            "-c",
            "import signal,time; signal.signal(signal.SIGTERM, lambda *a: exit(7)); time.sleep(60)",
        ],
    )
    try:
        time.sleep(1.0)
        sleeper.terminate()
        assert sleeper.wait(20) == 7
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


def test_a_job_of_pid_ns_ranks_dumps_and_restores(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Two ranks (ranks.py: an all-reduce over TCP every step), each init of a pid namespace of
    its own and in a working directory of its own (see the next test): one job image (their
    connection in it), restored as a job into new namespaces with new host pids; both ranks
    finish with exactly the lines of an uninterrupted run."""
    from tests.integration.test_jobs import RANKS, free_port, job_reference, jobs_env, rank_args

    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=23)
    master = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / f"r{r}.out" for r in (0, 1)]
    pids: list[int] = []
    roots: list[int] = []

    def rank_lines(out: Path) -> list[str]:
        return [ln for ln in out.read_text(errors="replace").splitlines() if ln.startswith("[rank")]

    try:
        for r in (0, 1):
            (tmp_path / f"cwd{r}").mkdir()
            argv = [PY, RANKS, *rank_args(r, master, 23)]
            pids.append(start_ns_job(env, outs[r], argv, cwd=tmp_path / f"cwd{r}"))
        for pid, out in zip(pids, outs):
            assert nspid(pid) == [pid, 1]
            wait_until(lambda o=out: len(rank_lines(o)) >= 3, 60, "steps")
        img = str(tmp_path / "img")
        rc, res, err = cli(env, "dump", str(pids[0]), str(pids[1]), img, "--tcp-established")
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        for pid in pids:
            wait_until(lambda p=pid: not alive(p), 10, f"pid {pid} to be gone")
        # Options of single images are refused for a job image, not ignored.
        rc, res, err = cli(env, "restore", img, "--device-map", "0=1")
        assert rc == ExitCode.USAGE and res is not None, err
        assert "not supported for job images" in res["error"]["message"], res["error"]
        rc, res, err = cli(env, "restore", img)
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        roots = [int(r["root_pid"]) for r in res["result"]["ranks"]]
        assert set(roots).isdisjoint(pids), (roots, pids)  # new namespaces, new host pids
        for root in roots:
            assert nspid(root)[-1] == 1, nspid(root)
            # The restored rank answers on its agent socket (a name of its own, found by inode).
            rc, _st, err = cli(env, "status", str(root))
            assert rc == 0, err
        for root in roots:
            wait_until(lambda p=root: not alive(p), 90, f"restored rank {root} to finish")
        for r in (0, 1):
            assert rank_lines(outs[r]) == ref[r], (r, outs[r].read_text()[-800:])
    finally:
        for p in (*roots, *pids):
            kill(p)


def test_pid_ns_ranks_sharing_a_working_directory_are_refused_before_the_lock(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """CRIU's parasite mounts such a process's /proc at proc.crtools in its working directory, and
    a job's ranks are dumped at once: two ranks in one directory would fail mid-dump (EEXIST)."""
    env = {**os.environ, "NPUSNAP_RUNTIME_DIR": str(runtime_dir)}
    pids = [start_ns_job(env, tmp_path / f"s{i}.out", ["sleep", "60"], cwd=tmp_path) for i in (0, 1)]
    try:
        rc, res, err = cli(env, "dump", str(pids[0]), str(pids[1]), str(tmp_path / "img"))
        assert rc == ExitCode.PREFLIGHT and res is not None, err
        e = res["error"]
        assert f"both run in {tmp_path}" in e["message"] and "working directory of its own" in e["fix"], e
        assert sorted(e["details"]["pids"]) == sorted(pids)
        assert all(alive(p) for p in pids) and not (tmp_path / "img").exists()
    finally:
        for p in pids:
            kill(p)


def test_a_job_of_pid_ns_ranks_restores_beside_its_running_launchers(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Each rank a launcher (ns pid 1) with an NPU worker (ns pid 2), dumped as a job with
    --leave-running; the workers are then stopped (CANN's Restore needs their devices free)
    while the launchers keep their host pids: the job image restores beside them, each rank in a
    namespace of its own, and both ranks finish from the snapshot's step."""
    from tests.integration.test_jobs import RANKS, free_port, job_reference, jobs_env, rank_args

    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=29)
    master = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / f"r{r}.out" for r in (0, 1)]
    launchers: list[int] = []
    roots: list[int] = []

    def rank_lines(out: Path) -> list[str]:
        return [ln for ln in out.read_text(errors="replace").splitlines() if ln.startswith("[rank")]

    try:
        for r in (0, 1):
            (tmp_path / f"cwd{r}").mkdir()
            script = f"{PY} {RANKS} {' '.join(rank_args(r, master, 29))}; exec sleep 600"
            launchers.append(start_ns_job(env, outs[r], ["sh", "-c", script], cwd=tmp_path / f"cwd{r}"))
        for out in outs:
            wait_until(lambda o=out: len(rank_lines(o)) >= 3, 60, "steps")
        img = str(tmp_path / "img")
        rc, res, err = cli(
            env, "dump", str(launchers[0]), str(launchers[1]), img, "--tcp-established", "--leave-running"
        )
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        workers = [
            int(subprocess.check_output(["pgrep", "-P", str(p)], text=True).split()[0]) for p in launchers
        ]
        for w in workers:
            kill(w)
        at = [len(rank_lines(o)) for o in outs]
        rc, res, err = cli(env, "restore", img)
        assert rc == 0 and res is not None, (res or {}).get("error") or err
        roots = [int(r["root_pid"]) for r in res["result"]["ranks"]]
        assert set(roots).isdisjoint(launchers) and all(alive(p) for p in launchers)
        for r in (0, 1):
            wait_until(lambda r=r: ref[r][-1] in rank_lines(outs[r])[at[r] :], 90, f"rank {r} to finish")
            cont = rank_lines(outs[r])[at[r] :]
            assert cont and continues_reference(cont, ref[r]), (r, cont[:3])
    finally:
        for p in (*roots, *launchers):
            kill(p)
