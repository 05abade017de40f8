"""A dump never reports success for an image its own restore would refuse.

Real CRIU and real processes: a job with a zombie child (CRIU dumps it, so the manifest lists it),
a job holding a lock on a file in a directory its restore may not write (left in place),
a verification that fails after CRIU (rolled back: the job runs on, no image), and snapshot
loops over restored copies (restore -> dump -> restore) of plain and `--pid-ns` jobs and of
replicas: each image verifies and restores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.host import pidns, procfs
from tests.integration.dumplib import (
    PY,
    REPO,
    TRAIN,
    TRAIN_ARGS,
    Job,
    agent_state,
    alive,
    cli,
    continues_reference,
    job_env,
    kill,
    reference,
    wait_until,
)
from tests.integration.test_pidns import lines, nspid, start_ns_job

pytestmark = pytest.mark.integration

WORKLOADS = str(REPO / "npusnap_workloads")

# train.py with a child that exits at once and that it never waits for: a zombie for the whole
# run (zdtm's zombie00 in a job).
ZOMBIE_JOB = """
import os, sys
sys.path.insert(0, {workloads!r})
import train
child = os.fork()
if child == 0:
    os._exit(7)
print(f"zombie {{child}}", flush=True)
raise SystemExit(train.main(sys.argv[1:]))
"""

# train.py holding an flock on a file in a directory only root may write, on disk (zdtm's
# file_locks00 in a job): restore would have to write that file back as root where the job's
# user could not have made it.
LOCK_JOB = """
import fcntl, os, sys
sys.path.insert(0, {workloads!r})
import train
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, b"locked by the job\\n")
fcntl.flock(fd, fcntl.LOCK_EX)
raise SystemExit(train.main(sys.argv[2:]))
"""


def _ok(rc: int, out: object, err: str) -> str:
    return f"rc={rc} {json.dumps((out or {}).get('error') if isinstance(out, dict) else out)} {err[-600:]}"


def _dump_verified(env: dict[str, str], pid: int, image: Path, *extra: str) -> dict[str, object]:
    """`dump`, then `verify` of what it published: both must succeed."""
    rc, out, err = cli(env, "dump", str(pid), str(image), *extra)
    assert rc == 0 and out is not None, _ok(rc, out, err)
    rc, ver, err = cli(env, "verify", str(image))
    assert rc == 0, _ok(rc, ver, err)
    return out


def test_a_zombie_child_is_in_the_image_and_comes_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """CRIU dumps an unreaped child: the manifest lists it (marked a zombie), verify and restore
    accept the image, the job continues and its child is a zombie again."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "80", "--seed", "5"]
    ref = reference(env, args)
    script = ZOMBIE_JOB.format(workloads=WORKLOADS)
    job = Job(tmp_path, env, [PY, "-c", script, *args])
    job.marker = "train"
    try:
        job.wait_lines(3)
        zombie = int(next(ln.split()[1] for ln in job.text().splitlines() if ln.startswith("zombie ")))
        assert procfs.state(zombie) == "Z"
        out = _dump_verified(env, job.pid, tmp_path / "img")
        result = out["result"]
        assert isinstance(result, dict)
        assert zombie in result["pids"], result["pids"]
        manifest = json.loads((tmp_path / "img" / "npusnap.json").read_text())
        entry = next(p for p in manifest["processes"] if p["pid"] == zombie)
        assert entry.get("zombie") is True and not entry["agent"] and not entry["npu"], entry
        job.reap()
        at = len(job.lines())
        rc, res, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and res is not None, _ok(rc, res, err)
        job.restored_pid = int(res["result"]["root_pid"])
        assert job.restored_pid == job.pid
        assert procfs.state(zombie) == "Z", "CRIU restores the child as the zombie it was"
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored run to finish")
        cont = job.lines()[at:]
        assert cont and continues_reference(cont, ref), job.text()[-800:]
    finally:
        job.cleanup()


def _locks_of(pid: int, path: Path) -> list[str]:
    """The /proc/locks lines of ``pid`` on the file at ``path``."""
    st = path.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return [ln for ln in Path("/proc/locks").read_text().splitlines() if f" {pid} {dev} " in ln]


def test_a_lock_file_in_a_root_only_directory_is_left_in_place_and_its_lock_comes_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """`--file-locks` of a job holding a lock on a file in a root-only directory on disk (zdtm's
    file_locks00): restore may not write such a file as root, and need not: it is still there as
    the image has it. The dump succeeds and its image verifies, the restore leaves the file alone,
    the restored job holds its lock again and computes on. With the file gone (or changed), the
    restore refuses the image before anything is restored, naming the file and its copy in the
    image; put back, the image restores."""
    env = job_env(sim_env, runtime_dir)
    # Not under /tmp (nor a checkout there): every directory up to a sticky shared one counts as
    # one the image could make for the job (a private lock directory in /tmp is carried:
    # test_host_side.py). /var/lib is root's, and no directory above it is sticky.
    private = Path(tempfile.mkdtemp(prefix="npusnap-locktest-", dir="/var/lib"))
    lock = private / "job.lock"
    args = [*TRAIN_ARGS, "--steps", "0", "--seed", "6"]
    script = LOCK_JOB.format(workloads=WORKLOADS)
    job = Job(tmp_path, env, [PY, "-c", script, str(lock), *args])
    job.marker = "train"
    image = tmp_path / "img"
    try:
        job.wait_lines(3)
        assert _locks_of(job.pid, lock)
        _dump_verified(env, job.pid, image, "--file-locks")
        manifest = json.loads((image / "npusnap.json").read_text())
        assert [f["path"] for f in manifest["host_files"]] == [str(lock)], manifest["host_files"]
        job.reap()
        before = lock.stat()

        saved = lock.read_bytes()
        lock.unlink()
        rc, out, err = cli(env, "restore", str(image))
        assert rc == ExitCode.IMAGE and out is not None, _ok(rc, out, err)
        message = out["error"]["message"]
        assert str(lock) in message and "hostfiles" in message, message
        assert not lock.exists() and not alive(job.pid)

        lock.write_bytes(saved)
        lock.chmod(before.st_mode & 0o7777)
        before = lock.stat()
        at = len(job.lines())
        rc, out, err = cli(env, "restore", str(image))
        assert rc == 0 and out is not None, _ok(rc, out, err)
        job.restored_pid = int(out["result"]["root_pid"])
        after = lock.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "restore wrote it"
        assert _locks_of(job.restored_pid, lock), "the restored job holds its lock again"
        job.wait_lines(at + 3)
    finally:
        job.cleanup()
        shutil.rmtree(private, ignore_errors=True)


# train.py that forks a child at every step, which exits at once, and reaps the one before: the
# tree changes between the dump's first look and CRIU's freeze, and there is a zombie at the
# freeze. (While the job is locked its steps wait for the device: no fork then.)
FORKING_JOB = """
import os, sys
sys.path.insert(0, {workloads!r})
import train
step = train.Trainer.step
last = [0]
def forking(self, n):
    child = os.fork()
    if child == 0:
        os._exit(0)
    if last[0]:
        os.waitpid(last[0], 0)
    last[0] = child
    return step(self, n)
train.Trainer.step = forking
raise SystemExit(train.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("leave_running", [False, True], ids=["default", "leave-running"])
def test_a_tree_that_changes_before_the_freeze_is_described_as_dumped(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, leave_running: bool
) -> None:
    """Children come and go at every step: whatever CRIU froze is what the manifest lists, and
    the image verifies and restores (after the original is gone), finishing the run."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--interval", "0.01", "--steps", "300", "--seed", "8"]
    ref = reference(env, args)
    script = FORKING_JOB.format(workloads=WORKLOADS)
    job = Job(tmp_path, env, [PY, "-c", script, *args])
    job.marker = "train"
    try:
        job.wait_lines(10)
        extra = ["--leave-running"] if leave_running else []
        out = _dump_verified(env, job.pid, tmp_path / "img", *extra)
        result = out["result"]
        assert isinstance(result, dict) and len(result["pids"]) >= 2, result["pids"]
        if leave_running:
            wait_until(lambda: not alive(job.pid), 60, "the original to finish")
            assert job.lines() == ref
        job.reap()
        at = len(job.lines())
        rc, res, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and res is not None, _ok(rc, res, err)
        job.restored_pid = int(res["result"]["root_pid"])
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored run to finish")
        cont = job.lines()[at:]
        assert cont and continues_reference(cont, ref), job.text()[-800:]
    finally:
        job.cleanup()


FAILING_VERIFY = """
import sys
from npusnap_cli import cli
from npusnap_cli.errors import ImageError
from npusnap_cli.image import integrity

def refuse(image, **kw):
    raise ImageError(f"image {{image}} failed verification: planted by the test")

integrity.verify = refuse  # what the dump's publish step calls (pipelines/dump/manifest.py)
raise SystemExit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("leave_running", [False, True], ids=["default", "leave-running"])
def test_a_dump_whose_image_fails_verification_rolls_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, leave_running: bool
) -> None:
    """The verification after CRIU fails (planted): exit 8, nothing published, and the job —
    stopped by CRIU until the image is verified in a default dump — runs on, unlocked."""
    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, *TRAIN_ARGS, "--steps", "0"])
    image = tmp_path / "img"
    try:
        job.wait_lines(3)
        argv = ["dump", str(job.pid), str(image), "--json", *(["--leave-running"] if leave_running else [])]
        p = subprocess.run(
            [PY, "-c", FAILING_VERIFY, *argv], env=env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == ExitCode.IMAGE, p.stdout + p.stderr[-800:]
        error = json.loads(p.stdout)["error"]
        assert "failed its own verification" in error["message"], error
        assert "runs on" in error["fix"], error
        assert not image.exists()
        assert not [x for x in tmp_path.iterdir() if x.name.startswith(".img")], list(tmp_path.iterdir())
        assert (tmp_path / "img.failed-logs" / "dump.log").is_file(), "CRIU's log is kept for the report"
        assert alive(job.pid) and procfs.state(job.pid) != "T"
        wait_until(lambda: agent_state(job.pid) == "RUNNING", 10, "the agent to be unlocked")
        at = len(job.lines())
        job.wait_lines(at + 3)
        # And the next dump of the same job is an ordinary one.
        _dump_verified(env, job.pid, image, "--leave-running")
    finally:
        job.cleanup()


def test_snapshot_loop_over_restored_plain_job(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """dump -> restore -> dump --leave-running -> dump -> restore (onto another device) -> ... of
    a job in the host's pid namespace: every image verifies, and the last restore finishes the
    run as if never stopped."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "400", "--seed", "12"]
    ref = reference(env, args)
    job = Job(tmp_path, env, [PY, TRAIN, *args])
    try:
        job.wait_lines(3)
        _dump_verified(env, job.pid, tmp_path / "img1")
        job.reap()
        pid = job.pid
        for n in (2, 3):
            # The second copy runs in a container of the simulated NPU (another mount namespace).
            moved = ["--device-map", "0=1"] if n == 3 else []
            rc, res, err = cli(env, "restore", str(tmp_path / f"img{n - 1}"), *moved)
            assert rc == 0 and res is not None, _ok(rc, res, err)
            pid = job.restored_pid = int(res["result"]["root_pid"])
            assert pidns.in_device_view(pid) == bool(moved)
            at = len(job.lines())
            job.wait_lines(at + 2)
            _dump_verified(env, pid, tmp_path / f"img{n}a", "--leave-running")
            assert agent_state(pid) == "RUNNING"
            _dump_verified(env, pid, tmp_path / f"img{n}")
            wait_until(lambda p=pid: not alive(p), 10, "the dumped copy to be gone")
        rc, res, err = cli(env, "restore", str(tmp_path / "img3"))
        assert rc == 0 and res is not None, _ok(rc, res, err)
        job.restored_pid = int(res["result"]["root_pid"])
        at = len(job.lines())
        wait_until(lambda: not alive(job.restored_pid), 60, "the last copy to finish")
        cont = job.lines()[at:]
        assert cont and continues_reference(cont, ref), job.text()[-800:]
    finally:
        job.cleanup()


def _kill_copies(seed: str) -> None:
    """Every process of this test's job left running, the copies included (a replica restore that
    failed halfway leaves the others running, and they would hold their devices for the next
    tests): found by the seed no other test uses."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if TRAIN in argv and "--seed" in argv and argv[argv.index("--seed") + 1 :][:1] == [seed]:
            kill(proc.pid)


def _restore(env: dict[str, str], image: Path, *extra: str) -> int:
    rc, res, err = cli(env, "restore", str(image), *extra)
    assert rc == 0 and res is not None, _ok(rc, res, err)
    return int(res["result"]["root_pid"])


def test_snapshot_loop_over_restored_pid_ns_job(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """`run --pid-ns`, then a loop of restore -> `dump --leave-running` of the copy -> restore of
    that image while the copy before it ends: each copy's agent listens under a name of its own
    (not its new host pid), each image records it, verifies and restores; the last copy finishes
    the run from where the last image was taken."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "400", "--seed", "13"]
    ref = reference(env, args)
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, TRAIN, *args])
    live = [pid]
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        _dump_verified(env, pid, tmp_path / "img0", "--leave-running")
        for n in (1, 2, 3):
            kill(live[-1])  # the copy's device must be free for CANN's Restore
            copy = _restore(env, tmp_path / f"img{n - 1}")
            live.append(copy)
            assert nspid(copy)[-1] == 1 and copy != pid
            at = len(lines(out))
            wait_until(lambda a=at: len(lines(out)) >= a + 2, 30, "the copy to compute")
            image = tmp_path / f"img{n}"
            _dump_verified(env, copy, image, "--leave-running")
            manifest = json.loads((image / "npusnap.json").read_text())
            root = next(p for p in manifest["processes"] if p["pid"] == copy)
            assert root["agent_socket"] and not root["agent_socket"].endswith(f"/{copy}.sock"), root
            assert agent_state(copy) == "RUNNING"
        kill(live[-1])
        at = len(lines(out))
        last = _restore(env, tmp_path / "img3")
        live.append(last)
        wait_until(lambda: not alive(last), 60, "the last copy to finish")
        cont = lines(out)[at:]
        assert cont and continues_reference(cont, ref), cont[:3]
    finally:
        for p in reversed(live):
            kill(p)
        _kill_copies("13")


def test_snapshot_of_a_replica_restores(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """`restore --replicas 2`, then `dump --leave-running` of each replica: each image verifies;
    one replica's image restores (the replicas stopped: their devices free) and a dump of that
    copy (the original killed) restores again and finishes the run."""
    env = job_env(sim_env, runtime_dir)
    args = [*TRAIN_ARGS, "--steps", "400", "--seed", "14"]
    ref = reference(env, args)
    out = tmp_path / "job.out"
    pid = start_ns_job(env, out, [PY, TRAIN, *args])
    live = [pid]
    try:
        wait_until(lambda: len(lines(out)) >= 3, 30, "steps")
        _dump_verified(env, pid, tmp_path / "img")
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
            "--output",
            str(tmp_path / "replica-{n}.out"),
        )
        assert rc == 0 and res is not None, _ok(rc, res, err)
        roots = [int(r["root_pid"]) for r in res["result"]["replicas"]]
        live += roots
        for i, root in enumerate(roots):
            own = tmp_path / f"replica-{i}.out"
            wait_until(lambda f=own: len(lines(f)) >= 2, 30, f"replica {i} to compute")
            _dump_verified(env, root, tmp_path / f"rep{i}", "--leave-running")
            assert agent_state(root) == "RUNNING"
        for root in roots:
            kill(root)
        copy = _restore(env, tmp_path / "rep1", "--output", str(tmp_path / "copy.out"))
        live.append(copy)
        wait_until(lambda: len(lines(tmp_path / "copy.out")) >= 2, 30, "the copy to compute")
        _dump_verified(env, copy, tmp_path / "again")
        wait_until(lambda: not alive(copy), 10, "the dumped copy to be gone")
        last = _restore(env, tmp_path / "again", "--output", str(tmp_path / "last.out"))
        live.append(last)
        wait_until(lambda: not alive(last), 60, "the last copy to finish")
        cont = lines(tmp_path / "last.out")
        assert cont and continues_reference(cont, ref), cont[:3]
    finally:
        for p in reversed(live):
            kill(p)
        _kill_copies("14")
