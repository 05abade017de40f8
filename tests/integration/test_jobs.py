"""Coordinated snapshots of a two-rank job (npusnap dump PID PID DIR; pipelines/jobsnap/).

Each rank runs ``ranks.py``: its own simulated device (rank i on device i) and an all-reduce over
TCP every step, so that every rank's output depends on the other's state. Every test compares
each rank's lines with an uninterrupted run of the same job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from npusnap_cli.errors import ExitCode
from tests.conftest import plugin_dir_with
from tests.integration.dumplib import (
    PY,
    REPO,
    Job,
    agent_state,
    alive,
    assert_no_image,
    cli,
    continues_reference,
    job_env,
    wait_until,
)
from tests.integration.test_host_side import Netns, _netns_skip_reason

pytestmark = pytest.mark.integration

RANKS = str(REPO / "npusnap_workloads" / "ranks.py")
NPUSNAP = str(Path(PY).parent / "npusnap")


def jobs_env(sim_env: dict[str, str], runtime_dir: Path) -> dict[str, str]:
    """The test job's environment. CRIU loads every plugin of the directory npusnap names
    (CRIU_LIBS_DIR, else /usr/lib/npusnap/criu-plugins when setup installed there); these tests
    exercise npusnap's own pipeline, so CRIU gets only the simulated device's plugin (what
    Huawei's is on hardware: the device handle needs it) and a plugin installed on the host
    (another version's, say) cannot change what is tested. (With this tree's npusnap_plugin.so
    beside it they pass as well.)"""
    plugins = plugin_dir_with(runtime_dir.parent, "npusim_plugin.so")
    return job_env(sim_env, runtime_dir, CRIU_LIBS_DIR=str(plugins))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_args(rank: int, master: str, seed: int, steps: int = 40, interval: str = "0.1") -> list[str]:
    return [
        "--rank", str(rank), "--world", "2", "--master", master, "--device", str(rank),
        "--steps", str(steps), "--interval", interval, "--seed", str(seed),
    ]  # fmt: skip


def job_reference(env: dict[str, str], seed: int, steps: int = 40) -> list[list[str]]:
    """Every rank's lines of an uninterrupted run (no interval, no agent)."""
    master = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [PY, RANKS, *rank_args(r, master, seed, steps, "0")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_o, e) in zip(procs, outs):
        assert p.returncode == 0, e
    return [o.splitlines() for o, _e in outs]


def start_ranks(
    tmp: Path,
    env: dict[str, str],
    seed: int,
    extra: tuple[list[str], list[str]] = ([], []),
    prefix: list[str] = (),
) -> list[Job]:
    master = f"127.0.0.1:{free_port()}"
    jobs = []
    for r in (0, 1):
        d = tmp / f"r{r}"
        d.mkdir()
        job = Job(d, env, [*prefix, PY, RANKS, *rank_args(r, master, seed), *extra[r]])
        job.marker = RANKS
        jobs.append(job)
    for job in jobs:
        job.wait_lines(3, timeout=60)
    return jobs


def finish_matches(job: Job, ref: list[str], before: int) -> None:
    wait_until(lambda: not alive(job.restored_pid), 90, "the restored rank to finish")
    lines = job.lines()
    assert lines[:before] == ref[:before]
    cont = lines[before:]
    assert cont and continues_reference(cont, ref), (cont[:3], job.text()[-800:])
    assert cont[0] == ref[before], "a step was lost or repeated"


def dump_restore_job(env: dict[str, str], jobs: list[Job], img: Path, *dump_args: str) -> list[int]:
    rc, out, err = cli(env, "dump", str(jobs[0].pid), str(jobs[1].pid), str(img), *dump_args, timeout=240)
    assert rc == 0, (out or {}).get("error") or err
    assert out is not None and [r["rank"] for r in out["result"]["job"]["ranks"]] == [0, 1]
    before = []
    for job in jobs:
        job.reap()
        before.append(len(job.lines()))
    # A job image: one manifest naming two ordinary rank images, verified as a whole.
    manifest = json.loads((img / "npusnap-job.json").read_text())
    assert manifest["schema"] == "npusnap-job/1"
    assert [r["dir"] for r in manifest["ranks"]] == ["rank-0", "rank-1"]
    assert (img / "rank-0" / "npusnap.json").is_file() and (img / "rank-1" / "npusnap.json").is_file()
    rc, out, err = cli(env, "verify", str(img))
    assert rc == 0, err
    rc, out, err = cli(env, "inspect", str(img))
    assert rc == 0 and out is not None and len(out["result"]["ranks"]) == 2, err
    # Each rank's files, sockets and CRIU statistics, read from its CRIU images.
    for rank in out["result"]["ranks"]:
        assert rank["criu"]["files"] and rank["criu"]["stats"]["pages_written"] > 0, rank["criu"]
    return before


def restore_job(env: dict[str, str], jobs: list[Job], img: Path, *args: str, prefix: list[str] = ()) -> None:
    argv = [*prefix, NPUSNAP, "restore", str(img), *args, "--json"]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    ranks = json.loads(p.stdout)["result"]["ranks"]
    for job, r in zip(jobs, ranks):
        job.restored_pid = int(r["root_pid"])


def cleanup(jobs: list[Job]) -> None:
    for job in jobs:
        job.cleanup()


def test_two_rank_job_with_tcp_established(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """The ranks' connection itself is in the image (both ends dumped at once)."""
    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=11)
    jobs = start_ranks(tmp_path, env, seed=11)
    try:
        before = dump_restore_job(env, jobs, tmp_path / "img", "--tcp-established")
        restore_job(env, jobs, tmp_path / "img")
        for job, r in zip(jobs, ref):
            finish_matches(job, r, before[jobs.index(job)])
    finally:
        cleanup(jobs)


def test_two_rank_job_rebuilding_its_communicator(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """As HCCL needs: pre_lock closes the connections at a common step, post_unlock rebuilds them."""
    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=12)
    jobs = start_ranks(tmp_path, env, seed=12, extra=(["--rebuild-comm"], ["--rebuild-comm"]))
    try:
        before = dump_restore_job(env, jobs, tmp_path / "img")
        restore_job(env, jobs, tmp_path / "img")
        for i, job in enumerate(jobs):
            finish_matches(job, ref[i], before[i])
    finally:
        cleanup(jobs)


def assert_rolled_back(env: dict[str, str], jobs: list[Job], img: Path, ref: list[list[str]]) -> None:
    assert_no_image(img)
    for job in jobs:
        assert alive(job.pid)
        assert agent_state(job.pid) == "RUNNING"
    for i, job in enumerate(jobs):
        assert job.reap(120) == 0, job.text()[-800:]
        assert job.lines() == ref[i]


def test_fault_in_one_rank_during_backup_rolls_back_every_rank(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=13)
    jobs = start_ranks(
        tmp_path, env, seed=13, extra=(["--rebuild-comm"], ["--rebuild-comm", "--fail-hook", "post_backup"])
    )
    img = tmp_path / "img"
    try:
        rc, out, err = cli(env, "dump", str(jobs[0].pid), str(jobs[1].pid), str(img))
        assert rc == ExitCode.AGENT, (out or {}).get("error") or err
        assert out is not None
        error = out["error"]
        assert "rank 1" in error["message"] and "rolled back" in error["message"], error
        assert error["details"]["failed_rank"] == 1
        assert_rolled_back(env, jobs, img, ref)
    finally:
        cleanup(jobs)


@pytest.mark.parametrize("mode", ["rebuild-comm", "tcp-established"])
def test_fault_in_one_rank_during_criu_rolls_back_every_rank(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, mode: str
) -> None:
    """A CRIU that fails for the first rank to start it (the other one's dump succeeds). With
    --tcp-established, the rank that was dumped gets its connections back (out of CRIU's repair
    mode, network lock removed)."""
    token = tmp_path / "fail-once"
    token.write_text("")
    wrapper = tmp_path / "criu-wrapper"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = swrk ] && mv "{token}" "{token}.used" 2>/dev/null; then\n'
        '  echo "criu-wrapper: injected failure" >&2; exit 1\nfi\n'
        'exec /usr/local/sbin/criu "$@"\n'
    )
    wrapper.chmod(0o755)
    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=14)
    extra = ["--rebuild-comm"] if mode == "rebuild-comm" else []
    dump_args = ["--tcp-established"] if mode == "tcp-established" else []
    jobs = start_ranks(tmp_path, env, seed=14, extra=(extra, extra))
    img = tmp_path / "img"
    try:
        rc, out, err = cli(
            {**env, "NPUSNAP_CRIU": str(wrapper)},
            "dump",
            str(jobs[0].pid),
            str(jobs[1].pid),
            str(img),
            *dump_args,
        )
        assert rc == ExitCode.CRIU, (out or {}).get("error") or err
        assert (tmp_path / "fail-once.used").exists()
        assert out is not None and "rolled back" in out["error"]["message"], out["error"]
        assert_rolled_back(env, jobs, img, ref)
    finally:
        cleanup(jobs)


@pytest.mark.skipif(bool(_netns_skip_reason()), reason=_netns_skip_reason() or "-")
@pytest.mark.parametrize("mode", ["tcp-established", "rebuild-comm"])
def test_ranks_on_two_simulated_nodes_restored_into_fresh_namespaces(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, mode: str
) -> None:
    """Each rank in its own network namespace ("node"), joined by a veth pair; the connection is
    dumped with --tcp-established, or closed and rebuilt by the job's hooks; both namespaces are
    then deleted and created anew (same names and addresses) and the job restored into them."""
    env = jobs_env(sim_env, runtime_dir)
    tag = str(os.getpid() % 100000)
    nets = Netns(tag)
    ref_master = "10.232.0.1:7300"
    # The reference: the same job, uninterrupted, on loopback (the lines do not depend on addresses).
    ref = job_reference(env, seed=15)
    jobs: list[Job] = []
    try:
        n0, n1 = nets.add("npn0"), nets.add("npn1")
        nets.link(n0, "10.232.0.1/24", n1, "10.232.0.2/24", 1)
        for r, ns in ((0, n0), (1, n1)):
            d = tmp_path / f"r{r}"
            d.mkdir()
            extra = ["--rebuild-comm"] if mode == "rebuild-comm" else []
            argv = ["nsenter", f"--net=/run/netns/{ns}", PY, RANKS, *rank_args(r, ref_master, 15), *extra]
            job = Job(d, env, argv)
            job.marker = RANKS
            jobs.append(job)
        for job in jobs:
            job.wait_lines(3, timeout=60)
        img = tmp_path / "img"
        before = dump_restore_job(
            env, jobs, img, *(["--tcp-established"] if mode == "tcp-established" else [])
        )
        inspect = json.loads((img / "npusnap-job.json").read_text())
        assert [r["netns_path"] for r in inspect["ranks"]] == [f"/run/netns/{n0}", f"/run/netns/{n1}"]
        # Fresh "nodes": same names and addresses, new namespaces.
        nets.delete(n0)
        nets.delete(n1)
        n0, n1 = nets.add("npn0"), nets.add("npn1")
        nets.link(n0, "10.232.0.1/24", n1, "10.232.0.2/24", 2)
        restore_job(env, jobs, img)
        for i, job in enumerate(jobs):
            finish_matches(job, ref[i], before[i])
    finally:
        cleanup(jobs)
        nets.close()


def test_leave_running_job_keeps_every_rank_and_restores_later(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """--leave-running: every rank is unlocked only after every rank was dumped; both finish as
    if nothing happened; the image then restores the job from the snapshot's step."""
    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=16, steps=60)
    master = f"127.0.0.1:{free_port()}"
    jobs = []
    for r in (0, 1):
        d = tmp_path / f"r{r}"
        d.mkdir()
        job = Job(d, env, [PY, RANKS, *rank_args(r, master, 16, steps=60)])
        job.marker = RANKS
        jobs.append(job)
    img = tmp_path / "img"
    try:
        for job in jobs:
            job.wait_lines(3, timeout=60)
        rc, out, err = cli(
            env, "dump", str(jobs[0].pid), str(jobs[1].pid), str(img), "--leave-running", "--tcp-established"
        )
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None and out["result"]["job"]["leave_running"] is True
        for i, job in enumerate(jobs):
            assert job.reap(120) == 0, job.text()[-800:]
            assert job.lines() == ref[i]
        at = [len(job.lines()) for job in jobs]
        restore_job(env, jobs, img)
        for i, job in enumerate(jobs):
            wait_until(lambda j=job: not alive(j.restored_pid), 90, "the restored rank to finish")
            cont = job.lines()[at[i] :]
            assert cont and continues_reference(cont, ref[i]), cont[:3]
            assert len(cont) < len(ref[i]), "the restored rank started over instead of continuing"
    finally:
        cleanup(jobs)


def test_a_failed_restore_of_one_rank_leaves_nothing_running(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """CRIU fails to restore the first rank it starts: the other rank, already restored (and
    locked), is killed; nothing runs; the image is intact. So with a SIGTERM while a rank's CRIU
    runs: every rank is killed once it is restored (exit 130). A last restore brings the job
    back."""
    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=17)
    jobs = start_ranks(tmp_path, env, seed=17, extra=(["--rebuild-comm"], ["--rebuild-comm"]))
    img = tmp_path / "img"
    try:
        before = dump_restore_job(env, jobs, img)
        token = tmp_path / "fail-once"
        token.write_text("")
        wrapper = tmp_path / "criu-wrapper"
        wrapper.write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = swrk ] && mv "{token}" "{token}.used" 2>/dev/null; then\n'
            '  echo "criu-wrapper: injected failure" >&2; exit 1\nfi\n'
            'exec /usr/local/sbin/criu "$@"\n'
        )
        wrapper.chmod(0o755)
        rc, out, err = cli({**env, "NPUSNAP_CRIU": str(wrapper)}, "restore", str(img))
        assert rc == ExitCode.CRIU, (out or {}).get("error") or err
        assert out is not None
        error = out["error"]
        assert "nothing runs" in error["message"] or "no rank was restored" in error["message"], error
        for job in jobs:
            assert not alive(job.pid), f"pid {job.pid} of the image is running after a failed restore"
        rc, out, err = cli(env, "verify", str(img))
        assert rc == 0, err

        # SIGTERM while one rank's CRIU is held (the other is restored, at the barrier).
        token.write_text("")
        wrapper.write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = swrk ] && mv "{token}" "{token}.held" 2>/dev/null; then sleep 2; fi\n'
            'exec /usr/local/sbin/criu "$@"\n'
        )
        restore = subprocess.Popen(
            [NPUSNAP, "restore", str(img), "--json"],
            env={**env, "NPUSNAP_CRIU": str(wrapper)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: Path(f"{token}.held").exists(), 60, "a rank's CRIU to be held")
        restore.send_signal(signal.SIGTERM)
        stdout, stderr = restore.communicate(timeout=120)
        assert restore.returncode == ExitCode.INTERRUPTED, (stdout, stderr)
        error = json.loads(stdout)["error"]
        assert "SIGTERM" in error["message"] and "nothing runs" in error["message"], error
        assert len(error["details"]["killed_root_pids"]) == 2, error
        for job in jobs:
            assert not alive(job.pid), f"pid {job.pid} of the image is running after an interrupted restore"

        restore_job(env, jobs, img)
        for i, job in enumerate(jobs):
            finish_matches(job, ref[i], before[i])
    finally:
        cleanup(jobs)


def test_sigterm_during_a_job_dump_rolls_back_every_rank(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM while rank 1 is still in its post_backup hook (rank 0 waits at the barrier)."""
    import signal
    import time

    env = jobs_env(sim_env, runtime_dir)
    ref = job_reference(env, seed=18)
    jobs = start_ranks(
        tmp_path, env, seed=18, extra=(["--rebuild-comm"], ["--rebuild-comm", "--slow-hook", "post_backup:3"])
    )
    img = tmp_path / "img"
    try:
        # Human mode: the phases go to stderr as they start.
        argv = [NPUSNAP, "dump", str(jobs[0].pid), str(jobs[1].pid), str(img)]
        dump = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err_lines: list[str] = []
        assert dump.stderr is not None
        reader = threading.Thread(
            target=lambda: err_lines.extend(iter(dump.stderr.readline, "")), daemon=True
        )
        reader.start()
        wait_until(lambda: any("rank 1: lock+backup" in ln for ln in err_lines), 60, "the lock+backup phase")
        time.sleep(1.0)  # rank 1 sleeps 3 s in its post_backup hook; rank 0 waits at the barrier
        dump.send_signal(signal.SIGTERM)
        assert dump.stdout is not None
        out = dump.stdout.read()
        dump.wait(120)
        reader.join(10)
        err = "".join(err_lines)
        assert dump.returncode == ExitCode.INTERRUPTED, out + err
        assert "interrupted by SIGTERM" in err and "every rank was rolled back" in err, err
        assert_rolled_back(env, jobs, img, ref)
    finally:
        cleanup(jobs)


def _node_cmd(ns: str, *args: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{ns}", NPUSNAP, *args, "--json"]


def _run_nodes(env: dict[str, str], cmds: list[list[str]]) -> list[tuple[int, dict[str, Any]]]:
    """Run one npusnap per node at once; (exit code, JSON envelope) of each."""
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert out.strip(), err
        results.append((p.returncode, json.loads(out)))
    return results


@pytest.mark.skipif(bool(_netns_skip_reason()), reason=_netns_skip_reason() or "-")
def test_one_npusnap_per_node_coordinated_over_the_network(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Two "nodes" (network namespaces), one npusnap on each, each dumping its own rank into its
    own directory; the barriers go over TCP to node 0's coordinator. First a fault in node 1's
    rank (both nodes roll back, neither writes anything), then a dump and a restore of both
    nodes into fresh namespaces, also coordinated."""
    env = jobs_env(sim_env, runtime_dir)
    tag = str(os.getpid() % 100000)
    nets = Netns(tag)
    ref = job_reference(env, seed=19, steps=120)  # long enough for two dumps under load
    jobs: list[Job] = []
    try:
        n0, n1 = nets.add("npm0"), nets.add("npm1")
        nets.link(n0, "10.233.0.1/24", n1, "10.233.0.2/24", 1)
        for r, ns in ((0, n0), (1, n1)):
            d = tmp_path / f"r{r}"
            d.mkdir()
            extra = [] if r == 0 else ["--fail-hook", "post_backup:once"]
            argv = [
                "nsenter",
                f"--net=/run/netns/{ns}",
                PY,
                RANKS,
                *rank_args(r, "10.233.0.1:7400", 19, steps=120),
                *extra,
            ]
            job = Job(d, env, argv)
            job.marker = RANKS
            jobs.append(job)
        for job in jobs:
            job.wait_lines(3, timeout=60)
        coord = ["--coordinator", "10.233.0.1:7411", "--nodes", "2"]
        imgs = [tmp_path / "node0", tmp_path / "node1"]

        # A fault in node 1's rank: both nodes roll back and write nothing.
        res = _run_nodes(
            env,
            [
                _node_cmd(
                    n0, "dump", str(jobs[0].pid), str(imgs[0]), "--tcp-established", *coord, "--node", "0"
                ),
                _node_cmd(
                    n1, "dump", str(jobs[1].pid), str(imgs[1]), "--tcp-established", *coord, "--node", "1"
                ),
            ],
        )
        assert res[1][0] == ExitCode.AGENT, res[1][1]["error"]
        assert res[0][0] == ExitCode.AGENT, res[0][1]["error"]  # node 1's failure, as node 0 saw it
        assert "node 1" in res[0][1]["error"]["message"], res[0][1]["error"]
        for job, img in zip(jobs, imgs):
            assert_no_image(img)
            assert alive(job.pid) and agent_state(job.pid) == "RUNNING"

        # Now it works: each node writes its part; then the job migrates to fresh namespaces.
        res = _run_nodes(
            env,
            [
                _node_cmd(
                    n0, "dump", str(jobs[0].pid), str(imgs[0]), "--tcp-established", *coord, "--node", "0"
                ),
                _node_cmd(
                    n1, "dump", str(jobs[1].pid), str(imgs[1]), "--tcp-established", *coord, "--node", "1"
                ),
            ],
        )
        assert [rc for rc, _ in res] == [0, 0], [e["error"] for _, e in res]
        before = []
        for i, job in enumerate(jobs):
            job.reap()
            before.append(len(job.lines()))
            part = json.loads((imgs[i] / "npusnap-job.json").read_text())
            assert (part["node"], part["nodes"]) == (i, 2)
        nets.delete(n0)
        nets.delete(n1)
        n0, n1 = nets.add("npm0"), nets.add("npm1")
        nets.link(n0, "10.233.0.1/24", n1, "10.233.0.2/24", 2)
        res = _run_nodes(
            env,
            [
                _node_cmd(n0, "restore", str(imgs[0]), *coord, "--node", "0"),
                _node_cmd(n1, "restore", str(imgs[1]), *coord, "--node", "1"),
            ],
        )
        assert [rc for rc, _ in res] == [0, 0], [e["error"] for _, e in res]
        for i, (job, (_rc, envelope)) in enumerate(zip(jobs, res)):
            job.restored_pid = int(envelope["result"]["ranks"][0]["root_pid"])
            finish_matches(job, ref[i], before[i])
    finally:
        for job in jobs:
            job.cleanup()
        nets.close()


def test_a_job_restore_killed_after_one_rank_leaves_it_to_its_lease(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL of a job restore once CRIU restored one rank (the other's CRIU is held): nobody
    unlocks that rank but its agent's lease, whose rollback reloads the device memory from the
    published job image (the dump wrote it in a work directory that is gone): the rank runs again,
    as `status` says, and nothing is left for `thaw`."""
    env = jobs_env(sim_env, runtime_dir)
    jobs = start_ranks(tmp_path, env, seed=19, extra=(["--rebuild-comm"], ["--rebuild-comm"]))
    img = tmp_path / "img"
    try:
        dump_restore_job(env, jobs, img, "--lease", "3")
        token = tmp_path / "hold-once"
        token.write_text("")
        wrapper = tmp_path / "criu-wrapper"
        wrapper.write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = swrk ] && mv "{token}" "{token}.held" 2>/dev/null; then sleep 5; exit 1; fi\n'
            'exec /usr/local/sbin/criu "$@"\n'
        )
        wrapper.chmod(0o755)
        restore = subprocess.Popen(
            [NPUSNAP, "restore", str(img), "--json"],
            env={**env, "NPUSNAP_CRIU": str(wrapper)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: Path(f"{token}.held").exists(), 60, "a rank's CRIU to be held")
            wait_until(lambda: any(alive(j.pid) for j in jobs), 60, "the other rank restored")
            (rank,) = [j.pid for j in jobs if alive(j.pid)]
            wait_until(lambda: agent_state(rank) in ("LOCKED", "BACKED_UP"), 30, "the rank's agent")
        finally:
            restore.kill()
            restore.wait(30)
        wait_until(lambda: agent_state(rank) == "RUNNING", 60, "the lease to bring the rank back")
        rc, out, err = cli(env, "status", str(rank))
        assert rc == 0 and out is not None, err
        (entry,) = [e for e in out["result"]["processes"] if e["pid"] == rank]
        assert entry["status"]["state"] == "RUNNING" and not entry["status"].get("owner"), entry["status"]
        events = " ".join(entry["status"].get("events") or [])
        assert "lease rollback done" in events and "FAILED" not in events, events
    finally:
        cleanup(jobs)
