"""Real jobs on the host side: sockets, spawn pools, pipes, /dev/shm, changed files, bare shells.

Each test runs ``hostjob.py`` (train.py's device loop plus one host resource used every step)
under `npusnap run`, dumps and restores it with the CLI, and compares its lines with an
uninterrupted run of the same command. Every job runs 4 s or more: on a busy machine a dump can
take more than a second to reach the job, and a job that ended first is not what a test asks.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Optional

import pytest

from npusnap_cli.errors import ExitCode
from tests.integration.dumplib import (
    PY,
    REPO,
    Job,
    alive,
    cli,
    continues_reference,
    job_env,
    wait_until,
)

pytestmark = pytest.mark.integration

HOSTJOB = str(REPO / "npusnap_workloads" / "hostjob.py")
_refs: dict[tuple[str, ...], list[str]] = {}


def host_reference(env: dict[str, str], args: list[str]) -> list[str]:
    """Lines of an uninterrupted run (no interval: the lines do not depend on it)."""
    key = tuple(args)
    if key not in _refs:
        fast = list(args)
        fast[fast.index("--interval") + 1] = "0"
        out = subprocess.run([PY, HOSTJOB, *fast], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        _refs[key] = out.stdout.splitlines()
    return list(_refs[key])


def restored_run_matches(job: Job, ref: list[str], before: int, timeout: float = 60) -> None:
    wait_until(lambda: not alive(job.restored_pid), timeout, "the restored run to finish")
    lines = job.lines()
    assert lines[:before] == ref[:before]
    continuation = lines[before:]
    assert continuation and continues_reference(continuation, ref), (continuation[:3], job.text()[-800:])
    assert continuation[0] == ref[before], "a step was lost or repeated"


def dump_and_restore(
    env: dict[str, str],
    job: Job,
    img: Path,
    dump_args: tuple[str, ...] = (),
    restore_args: tuple[str, ...] = (),
) -> int:
    rc, out, err = cli(env, "dump", str(job.pid), str(img), *dump_args)
    assert rc == 0, (out or {}).get("error") or err
    job.reap()
    before = len(job.lines())
    rc, out, err = cli(env, "restore", str(img), *restore_args)
    assert rc == 0 and out is not None, (out or {}).get("error") or err
    job.restored_pid = int(out["result"]["root_pid"])
    return before


def test_check_reports_whether_criu_dumps_inet_sockets(sim_env: dict[str, str]) -> None:
    _rc, out, _ = cli(sim_env, "check")
    assert out is not None
    items = {i["name"]: i for i in out["result"]["checks"]}
    item = items["criu-sockets"]
    assert item["status"] == "ok", item  # setup installs CRIU 4.2.1
    assert "TCP/UDP" in item["detail"]


def test_tcp_udp_and_spawn_pool_round_trip(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A listening TCP socket, a UDP socket, a unix socket pair and a spawn Pool + Lock
    (link-remap by default)."""
    env = job_env(sim_env, runtime_dir)
    args = ["--with", "tcp-listen", "--with", "udp", "--with", "unix-pair", "--with", "spawn-pool"]
    args += ["--steps", "40", "--interval", "0.1", "--seed", "3"]
    ref = host_reference(env, args)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    try:
        job.wait_lines(3, timeout=60)
        before = dump_and_restore(env, job, tmp_path / "img")
        restored_run_matches(job, ref, before)
    finally:
        job.cleanup()


def link_remaps() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("link_remap.*")}


def test_forkserver_pool_round_trip(sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path) -> None:
    """The pool's deleted semaphores travel in the image (CRIU's link-remap files), not on the
    host: a file in the way of one is refused clearly, and nothing is left in /dev/shm."""
    env = job_env(sim_env, runtime_dir)
    args = ["--with", "forkserver-pool", "--steps", "40", "--interval", "0.1", "--seed", "2"]
    ref = host_reference(env, args)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    img = tmp_path / "img"
    existing = link_remaps()
    in_the_way: Optional[Path] = None
    try:
        job.wait_lines(3, timeout=60)
        rc, out, err = cli(env, "dump", str(job.pid), str(img))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.reap()
        assert link_remaps() == existing, "the dump left CRIU's link-remap files on the host"
        manifest = json.loads((img / "npusnap.json").read_text())
        remaps = [f["path"] for f in manifest["host_files"] if f.get("remap")]
        assert remaps and all(Path(p).name.startswith("link_remap.") for p in remaps), manifest["host_files"]
        before = len(job.lines())

        in_the_way = Path(remaps[0])
        in_the_way.write_text("another dump's\n")
        rc, out, _ = cli(env, "restore", str(img))
        assert rc == ExitCode.PREFLIGHT and out is not None, out
        assert f"{in_the_way} is in the way" in out["error"]["message"]
        assert f"rm {in_the_way}" in out["error"]["fix"]
        in_the_way.unlink()

        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.restored_pid = int(out["result"]["root_pid"])
        assert link_remaps() == existing
        restored_run_matches(job, ref, before)
    finally:
        if in_the_way is not None:
            in_the_way.unlink(missing_ok=True)
        job.cleanup()


def test_spawn_pool_leave_running_image_restores_after_the_original_ends(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """CRIU deletes its link-remap files when a --leave-running dump ends: the image keeps its
    own copies, so it restores after the original is gone. A leftover link_remap.N of another
    dump in the way of CRIU's dump is named, and the job keeps running."""
    env = job_env(sim_env, runtime_dir)
    args = ["--with", "spawn-pool", "--steps", "100", "--interval", "0.05", "--seed", "6"]
    ref = host_reference(env, args)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    existing = link_remaps()
    # CRIU numbers them from each dump's file ids: these cover every id a job this size gets
    leftovers = [Path(f"/dev/shm/link_remap.{i}") for i in range(1, 400) if f"link_remap.{i}" not in existing]
    try:
        job.wait_lines(3, timeout=60)
        for f in leftovers:
            f.write_text("")
        rc, out, _ = cli(env, "dump", str(job.pid), str(tmp_path / "refused"), "--leave-running")
        assert rc == ExitCode.CRIU and out is not None, out
        assert "link_remap.N file left in /dev/shm by an earlier dump" in out["error"]["message"]
        assert alive(job.pid)
        for f in leftovers:
            f.unlink()
        assert link_remaps() == existing

        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert job.reap(60) == 0
        assert job.lines() == ref
        assert link_remaps() == existing
        at = len(job.lines())
        rc, out, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.restored_pid = int(out["result"]["root_pid"])
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored run to finish")
        continuation = job.lines()[at:]
        assert continuation and continues_reference(continuation, ref)
        assert link_remaps() == existing
    finally:
        for f in leftovers:
            f.unlink(missing_ok=True)
        job.cleanup()


def test_sockets_survive_leave_running_and_a_later_restore(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = ["--with", "tcp-listen", "--with", "udp", "--steps", "80", "--interval", "0.05", "--seed", "4"]
    ref = host_reference(env, args)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert job.reap(60) == 0
        assert job.lines() == ref
        at = len(job.lines())
        rc, out, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and out is not None, err
        job.restored_pid = int(out["result"]["root_pid"])
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored run to finish")
        continuation = job.lines()[at:]
        assert continuation and continues_reference(continuation, ref)
    finally:
        job.cleanup()


def test_stdout_piped_outside_is_refused_then_handed_a_new_file(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """`job | tee log`: refused in preflight; with --external-pipes, restore --pipe-to FILE."""
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "40", "--interval", "0.1", "--seed", "5"]
    ref = host_reference(env, args)
    log = tmp_path / "piped.out"
    proc = subprocess.Popen(
        [str(Path(PY).parent / "npusnap"), "run", "--", PY, HOSTJOB, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def tee() -> None:  # the reader outside the tree, as `| tee` is
        assert proc.stdout is not None
        with open(log, "ab") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()

    reader = threading.Thread(target=tee, daemon=True)
    reader.start()

    def lines() -> list[str]:
        return [ln for ln in log.read_text().splitlines() if ln.startswith("step")] if log.exists() else []

    img = tmp_path / "img"
    restored = 0
    try:
        wait_until(lambda: len(lines()) >= 3, 30, "the piped job to print")
        rc, out, _ = cli(env, "dump", str(proc.pid), str(img))
        assert rc == ExitCode.PREFLIGHT and out is not None, (rc, (out or {}).get("error"))
        assert "pipe to a process outside" in out["error"]["message"]
        assert "--external-pipes" in out["error"]["fix"]
        assert not img.exists() and alive(proc.pid)

        rc, out, err = cli(env, "dump", str(proc.pid), str(img), "--external-pipes")
        assert rc == 0, (out or {}).get("error") or err
        proc.wait(10)
        reader.join(10)
        before = len(lines())

        rc, out, _ = cli(env, "restore", str(img))
        assert rc == ExitCode.PREFLIGHT and out is not None
        assert "--pipe-to" in out["error"]["fix"]

        rc, out, err = cli(env, "restore", str(img), "--pipe-to", str(log))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        restored = int(out["result"]["root_pid"])
        wait_until(lambda: not alive(restored), 60, "the restored run to finish")
        got = lines()
        assert got[:before] == ref[:before]
        assert got[before:] == ref[before:], got[before : before + 3]
    finally:
        for pid in (restored, proc.pid):
            if pid and alive(pid) and HOSTJOB in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, 9)
        if proc.poll() is None:
            proc.kill()


STRAY_WRITER = """
import os, sys, time
sys.path.insert(0, {wl!r})
from train import Trainer, load_acl
t = Trainer(load_acl(), 0, 4096, 1)
for n in range(1, 400):
    print(t.step(n), flush=True)
    os.write(5, b"x")  # a pipe to a process outside the tree
    time.sleep(0.05)
"""


def test_restore_fails_when_the_job_dies_right_after_resuming(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Restore never says "running" of a job that is dead: a pipe on fd 5 lost its reader."""
    env = job_env(sim_env, runtime_dir)
    script = tmp_path / "stray.py"
    script.write_text(STRAY_WRITER.format(wl=str(REPO / "npusnap_workloads")))
    r, w = os.pipe()
    drain = threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(r, 4096), b"")], daemon=True)
    drain.start()
    # dup2 runs before subprocess closes the fds it was not told to keep: keep 5 too.
    job = Job(tmp_path, env, [PY, str(script)], pass_fds=(w, 5), preexec_fn=lambda: os.dup2(w, 5))
    os.close(w)
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"))
        assert rc == 0, (out or {}).get("error") or err
        job.reap()
        os.close(r)  # the reader is gone, as a `tee` that exited
        # A watch longer than the default: on a busy machine the job's first step after the
        # restore (a device call through the simulator's daemon, starved too) can take longer
        # than 0.5 s, and the death this test is about would come after the watch.
        rc, out, _ = cli(env, "restore", str(tmp_path / "img"), "--settle", "5")
        assert rc == ExitCode.TARGET and out is not None, out
        assert "died right after resuming" in out["error"]["message"]
        # Python ignores SIGPIPE: the write raises BrokenPipeError and the job exits 1.
        assert "exit status 1" in out["error"]["message"]
        assert "BrokenPipeError" in job.text()
    finally:
        job.cleanup()


def test_dev_shm_segment_is_saved_and_put_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """/dev/shm: saved while frozen; a changed segment is refused; a missing one is put back."""
    env = job_env(sim_env, runtime_dir)
    name = f"npusnap-test-{os.getpid()}"
    seg = Path("/dev/shm") / name
    seg.unlink(missing_ok=True)
    # Steps enough that the job outlives the dump's start on a busy machine (30 ended first there).
    args = ["--with", f"shm:{name}", "--steps", "120", "--interval", "0.05", "--seed", "6"]
    ref = host_reference(env, args)
    seg.unlink(missing_ok=True)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    img = tmp_path / "img"
    try:
        job.wait_lines(4)
        rc, out, err = cli(env, "dump", str(job.pid), str(img), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert job.reap(60) == 0  # the original went on and changed the segment
        at = len(job.lines())
        assert seg.exists()

        rc, out, _ = cli(env, "restore", str(img))
        assert rc == ExitCode.PREFLIGHT and out is not None
        assert str(seg) in out["error"]["message"] and "changed since the dump" in out["error"]["message"]

        seg.unlink()  # as when the job cleaned up after itself
        rc, out, err = cli(env, "verify", str(img))
        assert rc == 0, err
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.restored_pid = int(out["result"]["root_pid"])
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored run to finish")
        continuation = job.lines()[at:]
        assert continuation and continues_reference(continuation, ref), continuation[:3]
    finally:
        job.cleanup()
        seg.unlink(missing_ok=True)


def test_log_changed_since_a_leave_running_dump_is_named(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "80", "--interval", "0.05"]
    job = Job(tmp_path, env, [PY, HOSTJOB, *args], truncate=True)  # `>`: CRIU checks its size
    out_file = job.out
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert job.reap(60) == 0
        rc, out, _ = cli(env, "restore", str(tmp_path / "img"))
        assert rc == ExitCode.CRIU and out is not None
        err_ = out["error"]
        assert str(out_file) in err_["message"] and "changed since the dump" in err_["message"]
        assert "truncate -s" in err_["fix"] and ">>" in err_["fix"]
        assert err_["details"]["changed_file"] == str(out_file)
    finally:
        job.cleanup()


def test_restore_from_a_shell_without_the_cann_environment(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    env = job_env(sim_env, runtime_dir)
    args = ["--steps", "80", "--interval", "0.05", "--seed", "8"]
    ref = host_reference(env, args)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    try:
        job.wait_lines(3)
        bare = {k: v for k, v in env.items() if k not in ("ASCEND_HOME_PATH", "LD_LIBRARY_PATH")}
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"))
        assert rc == 0, err
        job.reap()
        before = len(job.lines())
        rc, out, err = cli(bare, "restore", str(tmp_path / "img"))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.restored_pid = int(out["result"]["root_pid"])
        restored_run_matches(job, ref, before)
    finally:
        job.cleanup()


ECHO_SERVER = """
import socket, sys, threading
def serve(c):
    with c:
        for line in c.makefile("rb"):
            c.sendall(b"echo " + line)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


class Netns:
    """Network namespaces of this test only, joined by veth pairs (addresses in them only)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.names: list[str] = []

    def ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def add(self, name: str) -> str:
        full = f"{name}{self.tag}"
        self.ip("netns", "add", full)
        self.names.append(full)
        self.ip("-n", full, "link", "set", "lo", "up")
        return full

    def link(self, a: str, a_addr: str, b: str, b_addr: str, n: int) -> None:
        va, vb = f"va{n}{self.tag}"[:15], f"vb{n}{self.tag}"[:15]
        self.ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((a, va, a_addr), (b, vb, b_addr)):
            self.ip("link", "set", dev, "netns", ns)
            self.ip("-n", ns, "addr", "add", addr, "dev", dev)
            self.ip("-n", ns, "link", "set", dev, "up")

    def delete(self, name: str) -> None:
        self.ip("netns", "del", name)
        self.names.remove(name)

    def close(self) -> None:
        for name in list(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _netns_skip_reason() -> str:
    import shutil

    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (setup installs iproute2; util-linux has nsenter)"
    return ""


@pytest.mark.skipif(bool(_netns_skip_reason()), reason=_netns_skip_reason() or "-")
def test_established_tcp_survives_migration_to_a_fresh_namespace(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A connection to a peer in another namespace, dumped with --tcp-established, restored into
    a new namespace with the same address: no message lost or duplicated."""
    env = job_env(sim_env, runtime_dir)
    tag = str(os.getpid() % 100000)
    nets = Netns(tag)
    server = None
    job = None
    # The same steps without the peer, each line completed with the echo it must carry.
    ref = [
        f"{line.split(' | ')[0]} | peer echo msg {i}"
        for i, line in enumerate(
            host_reference(env, ["--steps", "40", "--interval", "0.1", "--seed", "9"]), start=1
        )
    ]
    try:
        job_ns, peer_ns = nets.add("npjob"), nets.add("nppeer")
        nets.link(job_ns, "10.231.0.1/24", peer_ns, "10.231.0.2/24", 1)
        srv = tmp_path / "echo.py"
        srv.write_text(ECHO_SERVER)
        server = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{peer_ns}", PY, str(srv), "10.231.0.2", "7000"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        args = ["--with", "tcp-peer:10.231.0.2:7000", "--steps", "40", "--interval", "0.1", "--seed", "9"]
        job = Job(tmp_path, env, ["nsenter", f"--net=/run/netns/{job_ns}", PY, HOSTJOB, *args])
        job.marker = HOSTJOB
        job.wait_lines(3, timeout=30)

        in_job_ns = ["nsenter", f"--net=/run/netns/{job_ns}"]
        img = tmp_path / "img"
        p = subprocess.run(
            [
                *in_job_ns,
                str(Path(PY).parent / "npusnap"),
                "dump",
                str(job.pid),
                str(img),
                "--tcp-established",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        job.reap()
        before = len(job.lines())

        # Migration: the job's namespace is gone; a fresh one gets the same address.
        nets.delete(job_ns)
        new_ns = nets.add("npnew")
        nets.link(new_ns, "10.231.0.1/24", peer_ns, "10.231.0.2/24", 2)
        p = subprocess.run(
            [
                "nsenter",
                f"--net=/run/netns/{new_ns}",
                str(Path(PY).parent / "npusnap"),
                "restore",
                str(img),
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        import json

        job.restored_pid = int(json.loads(p.stdout)["result"]["root_pid"])
        restored_run_matches(job, ref, before)
    finally:
        if job is not None:
            job.cleanup()
        if server is not None:
            server.kill()
            server.wait(10)
        nets.close()


def _bound_dirs(pid: int) -> list[str]:
    from npusnap_cli.host import hostres

    return sorted(
        {os.path.dirname(p) for p in hostres.bound_unix_paths(pid)}
        | {os.path.dirname(p) for p in hostres._fifos(pid)}
    )


def test_socket_and_fifo_directories_are_recreated_after_the_original_exits(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A multiprocessing listener under /tmp/pymp-*/ and a FIFO in a private directory: Python
    removes both directories when the original exits after a --leave-running dump; restore
    recreates them (owner, mode) before CRIU binds and opens there, and the job goes on. A
    directory in the way with another owner is refused before anything starts."""
    env = job_env(sim_env, runtime_dir)
    args = ["--with", "mp-listener", "--with", "fifo", "--steps", "80", "--interval", "0.05", "--seed", "8"]
    ref = host_reference(env, args)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    dirs: list[str] = []
    try:
        job.wait_lines(3, timeout=60)
        dirs = [d for d in _bound_dirs(job.pid) if "/pymp-" in d or "/npusnap-fifo-" in d]
        assert any("/pymp-" in d for d in dirs) and any("npusnap-fifo-" in d for d in dirs), dirs
        modes = {d: os.stat(d).st_mode & 0o7777 for d in dirs}
        rc, out, err = cli(env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running")
        assert rc == 0, (out or {}).get("error") or err
        assert job.reap(60) == 0
        assert job.lines() == ref
        for d in dirs:  # what Python's exit handlers left: gone as on another node
            subprocess.run(["rm", "-rf", d], check=True)
        rc, out, _ = cli(env, "inspect", str(tmp_path / "img"))
        assert rc == 0 and out is not None
        needed = {n["path"]: n for n in out["result"]["host_nodes"]}
        assert set(dirs) <= set(needed), (dirs, needed)
        assert any(n["kind"] == "fifo" for n in needed.values())

        # Someone else's directory in the way: refused, nothing created or started.
        squat = dirs[0]
        os.mkdir(squat)
        os.chown(squat, 65534, 65534)
        rc, out, _ = cli(env, "restore", str(tmp_path / "img"))
        assert rc == ExitCode.PREFLIGHT and out is not None, out
        assert "belongs to uid 65534" in out["error"]["message"]
        os.rmdir(squat)
        assert not any(os.path.exists(d) for d in dirs), [d for d in dirs if os.path.exists(d)]

        at = len(job.lines())
        rc, out, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.restored_pid = int(out["result"]["root_pid"])
        for d in dirs:
            if os.path.exists(d):  # the restored job may have finished and removed them already
                assert os.stat(d).st_mode & 0o7777 == modes[d]
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored run to finish")
        continuation = job.lines()[at:]
        assert continuation and continues_reference(continuation, ref), job.text()[-800:]
    finally:
        job.cleanup()
        for d in dirs:
            subprocess.run(["rm", "-rf", d], check=False)


def test_lock_file_removed_by_the_original_is_put_back(
    sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A flock'ed lock file in a private directory on disk (not tmpfs), removed with its
    directory when the original exits after a --leave-running --file-locks dump: the image
    carries it, restore puts it (and its directory) back, and CRIU re-takes the lock."""
    env = job_env(sim_env, runtime_dir)
    args = ["--with", "lockfile", "--steps", "80", "--interval", "0.05", "--seed", "9"]
    ref = host_reference(env, args)
    job = Job(tmp_path, env, [PY, HOSTJOB, *args])
    lock_dir = ""
    try:
        job.wait_lines(3, timeout=60)
        from npusnap_cli.host import hostres

        locked = hostres.find_locked_files([job.pid])
        assert len(locked) == 1 and "/npusnap-lock-" in locked[0], locked
        lock_dir = os.path.dirname(locked[0])
        rc, out, err = cli(
            env, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running", "--file-locks"
        )
        assert rc == 0, (out or {}).get("error") or err
        assert job.reap(60) == 0
        assert job.lines() == ref
        assert not os.path.exists(lock_dir), "the original should have removed it at exit"
        at = len(job.lines())
        rc, out, err = cli(env, "restore", str(tmp_path / "img"))
        assert rc == 0 and out is not None, (out or {}).get("error") or err
        job.restored_pid = int(out["result"]["root_pid"])
        wait_until(lambda: not alive(job.restored_pid), 60, "the restored run to finish")
        continuation = job.lines()[at:]
        assert continuation and continues_reference(continuation, ref), job.text()[-800:]
    finally:
        job.cleanup()
        if lock_dir:
            subprocess.run(["rm", "-rf", lock_dir], check=False)
