"""`npusnap restore --lazy`: CRIU's lazy pages, real CRIU, real processes, the simulated NPU.

The job keeps its state in simulated device memory; a lazily restored run must print exactly the
lines of an uninterrupted run. The failure modes use the test hook NPUSNAP_TEST_LAZY_PAUSE (the
lazy-pages daemon is stopped before it serves anything and continued N s after the job was
released), so that pages are surely still owed when the test acts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from npusnap_cli.errors import ExitCode
from npusnap_cli.host import procfs
from npusnap_cli.host.lazypages import TEST_HOOK_ENV
from tests.conftest import requires_root
from tests.integration.dumplib import (
    NPUSNAP,
    PY,
    TRAIN,
    TRAIN_ARGS,
    Job,
    alive,
    cli,
    job_env,
    reference,
    wait_until,
)

pytestmark = [pytest.mark.integration, requires_root]

ARGS = ["--steps", "40", *TRAIN_ARGS, "--device", "0", "--seed", "5"]


def _dumped(env: dict[str, str], tmp_path: Path) -> tuple[Job, Path, list[str]]:
    ref = reference(env, ARGS)
    job = Job(tmp_path, env, [PY, TRAIN, *ARGS])
    img = tmp_path / "img"
    job.wait_lines(6)
    rc, out, err = cli(env, "dump", str(job.pid), str(img))
    assert rc == 0, (out or {}).get("error") or err
    job.reap()
    return job, img, ref


def _daemon_of(img: Path, stopped: bool = False) -> Optional[int]:
    """The pid of the `criu lazy-pages` serving ``img`` (``stopped``: only once the hook stopped it)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        state = procfs.state(int(name))
        if b"lazy-pages" in argv and str(img / "criu").encode() in argv and (state == "T" or not stopped):
            return int(name)
    return None


def _wait_daemon(img: Path, proc: subprocess.Popen[str], stopped: bool = False) -> int:
    found: list[int] = []

    def there() -> bool:
        assert proc.poll() is None, proc.communicate()
        found.append(_daemon_of(img, stopped) or 0)
        return found[-1] > 0

    wait_until(there, 60, "the lazy-pages daemon")
    return found[-1]


class _Throttle:
    """Holds a process, and the children it starts from then on, to ``quota_us`` per 100 ms of one
    CPU (a cpu cgroup, v2 or v1), so that their work surely takes long."""

    def __init__(self, pid: int, quota_us: int = 1000, name: str = "") -> None:
        v2 = Path("/sys/fs/cgroup")
        controllers = v2 / "cgroup.controllers"
        if controllers.exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            self.dir = v2 / f"npusnap-test-lazy-{os.getpid()}{name}"
            self.dir.mkdir()
            self._quota, self._fmt, self._off = "cpu.max", "{} 100000", "max 100000"
            procs = "cgroup.procs"
        elif (v2 / "cpu" / "cpu.cfs_quota_us").exists():
            self.dir = v2 / "cpu" / f"npusnap-test-lazy-{os.getpid()}{name}"
            self.dir.mkdir()
            self._quota, self._fmt, self._off = "cpu.cfs_quota_us", "{}", "-1"
            procs = "tasks"
        else:
            pytest.skip("no cpu cgroup controller to slow the lazy-pages daemon down with")
        self.set(quota_us)
        (self.dir / procs).write_text(str(pid))

    def set(self, quota_us: int) -> None:
        (self.dir / self._quota).write_text(self._fmt.format(quota_us))

    def lift(self) -> None:
        (self.dir / self._quota).write_text(self._off)

    def remove(self) -> None:
        # Empty once the restore's processes exited: npusnap, its lazy-pages daemon (which ends
        # with the restore) and the restored job (CRIU restores it into its parent's cgroup).
        wait_until(lambda: not self.dir.exists() or _rmdir(self.dir), 20, f"removing {self.dir}")


def _daemon_lines(lazy: dict[str, Any]) -> str:
    """What the lazy-pages daemon said about each process's pages (its log), for a failed assert."""
    try:
        text = Path(lazy["daemon_log"]).read_text(errors="replace")
    except (OSError, TypeError, KeyError) as exc:
        return f"(no daemon log: {exc})"
    keep = ("pages", "PID", "uffd", "Error", "exit", "fork")
    return "\n".join(ln for ln in text.splitlines() if any(k in ln for k in keep))[-4000:]


def _rmdir(d: Path) -> bool:
    try:
        d.rmdir()
    except OSError:
        return False
    return True


def test_lazy_restore_continues_bit_identically(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job, img, ref = _dumped(env, tmp_path)
    try:
        rc, out, err = cli(env, "restore", str(img), "--lazy")
        assert rc == 0, (out or {}).get("error") or err
        assert out is not None
        res = out["result"]
        job.restored_pid = res["root_pid"]
        assert res["npu_pids"] == [job.pid] and res["device_memory"] == "npusnap"
        lazy = res["lazy"]
        # Every page of the image came through the daemon, which ended cleanly by itself.
        assert lazy["daemon_status"] == 0 and lazy["killed"] is None
        # (0 when the daemon had copied everything before npusnap looked: a small job)
        assert lazy["uffds_held"] in (0, 1)
        assert lazy["pages_total"] and lazy["pages_copied"] == lazy["pages_total"], _daemon_lines(lazy)
        assert lazy["pages_verified"] == "while the job ran"
        assert res["timings"]["lazy_complete_s"] >= res["timings"]["total_s"] > 0
        assert not alive(lazy["daemon_pid"])
        # Nothing left in the image that verify would refuse (CRIU's daemon leaves its socket).
        rc, _, err = cli(env, "verify", str(img))
        assert rc == 0, err
        wait_until(lambda: not alive(job.restored_pid), 30, "the restored run to finish")
        assert job.lines() == ref
    finally:
        job.cleanup()


def test_image_removed_while_paging_in_is_harmless(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job, img, ref = _dumped(env, tmp_path)
    logs = tmp_path / "logs"  # outside the image, which is removed below
    proc = subprocess.Popen(
        [NPUSNAP, "restore", str(img), "--lazy", "--logs", str(logs), "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    throttles: list[_Throttle] = []
    try:
        # The whole restore at 5 % of a CPU from the start, so that its lazy-pages daemon (a
        # child) cannot serve a small job's every page before the test finds it (faster, on a
        # loaded machine, the daemon can be found with its work done); then the daemon alone at
        # 1 %, so that nearly every page is still owed when the image goes, while CRIU's restore
        # goes on at 5 % and connects the job to it (the whole restore at 1 % makes that
        # connection take tens of seconds).
        throttles.append(_Throttle(proc.pid, 5_000))
        daemon = _wait_daemon(img, proc)
        throttles.append(_Throttle(daemon, 1000, name="-daemon"))
        log = logs / "lazy-pages.log"
        wait_until(lambda: log.exists() and "Opened local page read" in log.read_text(), 60, "the page read")
        # The daemon got the job's userfaultfd and opened the page files: remove the image now.
        assert alive(daemon), "the lazy-pages daemon was done before the image could be removed"
        shutil.rmtree(img)
        time.sleep(0.5)
        for t in throttles:
            t.lift()
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stdout + stderr
        lazy = json.loads(stdout)["result"]["lazy"]
        assert lazy["pages_total"] and lazy["pages_copied"] == lazy["pages_total"], _daemon_lines(lazy)
        job.restored_pid = job.pid
        wait_until(lambda: not alive(job.pid), 30, "the restored run to finish")
        assert job.lines() == ref
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        job.cleanup()
        for t in reversed(throttles):
            t.remove()


def test_daemon_killed_midway_kills_the_job_and_fails(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job, img, ref = _dumped(env, tmp_path)
    proc = subprocess.Popen(
        [NPUSNAP, "restore", str(img), "--lazy", "--json"],
        env={**env, TEST_HOOK_ENV: "hang"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        daemon = _wait_daemon(img, proc, stopped=True)
        wait_until(lambda: alive(job.pid), 10, "the restored job")
        time.sleep(0.5)  # the job runs into a missing page and waits there
        os.kill(daemon, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
        envelope = json.loads(stdout)
        assert proc.returncode == ExitCode.CRIU, stdout + stderr
        assert envelope["ok"] is False
        error = envelope["error"]
        assert "lazy-pages daemon" in error["message"] and "killed by signal 9" in error["message"]
        assert error["details"]["killed_pids"] == [job.pid]
        # npusnap held the job's userfaultfd: a fault on a missing page waited, never read zeros.
        assert error["details"]["lazy"]["uffds_held"] == 1
        wait_until(lambda: not alive(job.pid), 10, "the restored job to be gone")
        # It never printed a step computed on missing memory: whatever it printed continues the run.
        lines = job.lines()
        assert lines == ref[: len(lines)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        job.cleanup()


def test_hung_daemon_is_killed_at_the_deadline(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job, img, _ref = _dumped(env, tmp_path)
    try:
        hang = {**env, TEST_HOOK_ENV: "hang"}
        rc, out, err = cli(hang, "restore", str(img), "--lazy", "--lazy-timeout", "3")
        assert rc == ExitCode.CRIU, err
        assert out is not None and out["ok"] is False
        assert "did not finish within 3 s" in out["error"]["message"]
        wait_until(lambda: not alive(job.pid), 10, "the restored job to be gone")
        assert _daemon_of(img) is None
    finally:
        job.cleanup()


def test_changed_page_file_is_caught_while_running_and_kills_the_job(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    job, img, _ref = _dumped(env, tmp_path)
    try:
        # One byte of the page file changes after the dump (size and everything else unchanged).
        pages = sorted((img / "criu").glob("pages-*.img"))[0]
        with open(pages, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        rc, out, err = cli(env, "restore", str(img), "--lazy")
        assert rc == ExitCode.IMAGE, err
        assert out is not None and out["ok"] is False
        error = out["error"]
        assert f"{pages.relative_to(img)} does not match its blake3 checksum" in error["message"]
        assert "paged in lazily" in error["message"] and "killed" in error["message"]
        assert error["details"]["lazy"]["killed"] == "checksum"
        wait_until(lambda: not alive(job.pid), 10, "the restored job to be gone")
        assert _daemon_of(img) is None
    finally:
        job.cleanup()
