"""What an operator gets besides the image: a node-wide view (`ps`), a record of each operation
(syslog + history), logs kept where they are looked for, a dry-run restore, warnings in --json,
and -v anywhere on the line. One job serves every step, to keep the suite short."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.agentlib import PY, REPO, Sim, kill_pid, wait_socket, workload_env, write_workload

pytestmark = pytest.mark.integration
NPUSNAP = [PY, "-m", "npusnap_cli"]


def npusnap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NPUSNAP, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=90)


def envelope(proc: subprocess.CompletedProcess[str]) -> dict:
    env = json.loads(proc.stdout)
    assert isinstance(env["warnings"], list)  # every envelope has them
    return env


def test_ps_records_logs_and_dry_run(sim: Sim, runtime_dir: Path, tmp_path: Path) -> None:
    log_sock = tmp_path / "syslog.sock"
    syslog = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    syslog.bind(str(log_sock))
    syslog.settimeout(10)
    env = workload_env(
        sim, runtime_dir, NPUSNAP_STATE_DIR=str(tmp_path / "state"), NPUSNAP_SYSLOG_SOCKET=str(log_sock)
    )
    out = tmp_path / "job.log"
    # The launcher holds a pipe it does not close: `run --detach` must not hand it to the job
    # (CRIU would dump it as a pipe whose other end is outside the tree).
    r, w = os.pipe()
    proc = subprocess.run(
        [*NPUSNAP, "run", "--detach", "--output", str(out), "--", PY, str(write_workload(tmp_path))],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60, pass_fds=(w,),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout)
    try:
        inherited = os.readlink(f"/proc/self/fd/{w}")
        wait_socket(runtime_dir, pid)
        job_fds = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # closed meanwhile: the job is starting
                job_fds.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        assert inherited not in job_fds
        deadline = time.monotonic() + 20
        while "step 3 " not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)

        # ps: the node-wide view lists the job, running, unlocked, no snapshot yet.
        listed = {p["pid"]: p for p in envelope(npusnap(env, "ps", "--json"))["result"]["processes"]}
        assert listed[pid]["state"] == "RUNNING" and listed[pid]["owner"] is None
        assert listed[pid]["last_snapshot"] is None

        # A good dump, -v after the command: CRIU's log stays in the image; one syslog line.
        img = tmp_path / "snaps" / "one"
        archive = tmp_path / "one.tar.zst"
        dumped = npusnap(env, "dump", "-R", "-e", str(archive), str(pid), str(img), "-v", "--json")
        assert dumped.returncode == 0, dumped.stdout + dumped.stderr
        assert (img / "logs" / "dump.log").stat().st_size > 0
        assert envelope(dumped)["result"]["export"]["archive"] == str(archive) and archive.is_file()

        # inspect shows what CRIU saved: files, sockets (the agent's own, listening), statistics.
        for what in (img, archive):
            criu = envelope(npusnap(env, "inspect", str(what), "--json"))["result"]["criu"]
            assert {(f["fd"], f["name"]) for f in criu["files"]} >= {(1, str(out)), (2, str(out))}
            assert any(
                k["name"] == str(runtime_dir / f"{pid}.sock") and k["state"] == "listening"
                for k in criu["sockets"]
            ), criu["sockets"]
            if what == img:
                assert criu["stats"]["pages_written"] > 0 and criu["stats"]["bytes_written"] > 0
            else:
                assert criu["stats"] is None  # an archive has no logs/
        line = syslog.recv(4096).decode()
        assert "npusnap[" in line and f"dump pid {pid} image {img}" in line and ": ok in " in line
        history = [json.loads(x) for x in (tmp_path / "state" / "history.jsonl").read_text().splitlines()]
        assert history[-1]["op"] == "dump" and history[-1]["image"] == str(img)

        # ps now names that snapshot (matched by pid and start time).
        listed = {p["pid"]: p for p in envelope(npusnap(env, "ps", "--json"))["result"]["processes"]}
        assert listed[pid]["last_snapshot"]["image"] == str(img)
        table = npusnap({**env, "COLUMNS": "1000"}, "ps")
        row = [ln for ln in table.stdout.splitlines() if f" {pid} " in ln]
        assert len(row) == 1 and str(img) in row[0] and "RUNNING" in row[0], table.stdout

        # A dry run with the original still running: the pids are busy (exit 11), the image is
        # fine, nothing is touched (no restore log); --no-verify's warning is in warnings[].
        dry = npusnap(env, "restore", "--dry-run", "--no-verify", str(img), "--json")
        result = envelope(dry)
        assert dry.returncode == 11, dry.stdout
        status = {c["name"]: c["status"] for c in result["result"]["checks"]}
        assert status["structure"] == "ok" and status["checksums"] == "skipped"
        assert status["pids"] == "problem" and status["versions"] == "ok"
        assert any("--no-verify" in w for w in result["warnings"])
        assert not (img / "logs" / "restore.log").exists()

        # A corrupt copy: exit 8 (corrupt) before 11 (busy), for the dry run and the restore.
        bad = tmp_path / "snaps" / "bad"
        subprocess.run(["cp", "-a", str(img), str(bad)], check=True)
        page = sorted((bad / "criu").glob("pages-*.img"))[0]
        with open(page, "r+b") as f:
            f.seek(10)
            f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
        assert npusnap(env, "restore", "--dry-run", str(bad), "--json").returncode == 8
        assert npusnap(env, "restore", str(bad), "--json").returncode == 8
        failed = json.loads((tmp_path / "state" / "history.jsonl").read_text().splitlines()[-1])
        assert failed["op"] == "restore" and failed["exit_code"] == 8

        # A failed dump (a file in the way of CRIU's freeze is not needed: a lock held by a
        # freeze refuses it) leaves a record; a freeze is shown as its holder, never as dead.
        assert npusnap(env, "freeze", str(pid), "--lease", "60").returncode == 0
        refused = npusnap(env, "dump", str(pid), str(tmp_path / "snaps" / "two"), "--json")
        assert refused.returncode == 11, refused.stdout
        listed = {p["pid"]: p for p in envelope(npusnap(env, "ps", "--json"))["result"]["processes"]}
        assert listed[pid]["state"] == "BACKED_UP"
        assert listed[pid]["owner"]["command"] == "freeze" and listed[pid]["owner"]["alive"] is None
        assert npusnap(env, "thaw", str(pid)).returncode == 0
        ops = [json.loads(x)["op"] for x in (tmp_path / "state" / "history.jsonl").read_text().splitlines()]
        assert ops[-4:] == ["restore", "freeze", "dump", "thaw"]

        # A lock whose holder died (a dump killed mid-way): stale, shown as such, never as held
        # by a live command; the warning's command returns the process.
        locker = (
            "from npusnap_cli.device.agent_client import AgentClient\n"
            f"with AgentClient({pid}, timeout=10) as c:\n"
            "    c.lock(lease_s=120, command='dump')\n"
        )
        subprocess.run([PY, "-c", locker], env=env, cwd=REPO, check=True, timeout=30)
        seen = envelope(npusnap(env, "ps", "--json"))
        owner = {p["pid"]: p for p in seen["result"]["processes"]}[pid]["owner"]
        assert owner["command"] == "dump" and owner["alive"] is False
        assert any(f"npusnap thaw --force {pid}" in w for w in seen["warnings"])
        status = npusnap({**env, "COLUMNS": "1000"}, "status", str(pid))
        assert "EXITED" in status.stdout and f"thaw --force {pid}" in status.stderr
        # thaw and freeze refuse that lock with the same next step as status, never "wait for
        # that command to finish": it has exited.
        for refused_cmd in (["thaw", str(pid)], ["freeze", str(pid)]):
            refused = npusnap(env, *refused_cmd, "--json")
            error = envelope(refused)["error"]
            assert refused.returncode == 11, error
            assert error["fix"].startswith(f"`npusnap thaw --force {pid}` returns the process now"), error
        assert npusnap(env, "thaw", "--force", str(pid)).returncode == 0
        assert (
            envelope(npusnap(env, "status", str(pid), "--json"))["result"]["processes"][0]["status"]["owner"]
            is None
        )
    finally:
        os.close(r)
        os.close(w)
        syslog.close()
        kill_pid(pid)


def test_failed_dump_keeps_its_logs_beside_the_image(sim: Sim, runtime_dir: Path, tmp_path: Path) -> None:
    """CRIU refuses a job connected to a unix socket outside the tree (no --ext-unix-sk): its
    log is kept as IMG.failed-logs, beside where the image would have been, and the error
    names it."""
    env = workload_env(sim, runtime_dir, NPUSNAP_STATE_DIR=str(tmp_path / "state"))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "outside.sock"))
    listener.listen(1)
    wrapper = tmp_path / "tcp_job.py"
    wrapper.write_text(
        "import runpy, socket, sys\n"
        "conn = socket.socket(socket.AF_UNIX)\n"
        "conn.connect(sys.argv[1])\n"
        "sys.argv = sys.argv[2:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    job_out = tmp_path / "job.log"
    proc = npusnap(
        env, "run", "--detach", "--output", str(job_out), "--",
        PY, str(wrapper), str(tmp_path / "outside.sock"), str(write_workload(tmp_path)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout)
    conn = None
    try:
        conn, _ = listener.accept()
        wait_socket(runtime_dir, pid)
        img = tmp_path / "img"
        failed = npusnap(env, "dump", str(pid), str(img), "--json")
        assert failed.returncode == 6, failed.stdout
        err = envelope(failed)["error"]
        logs = tmp_path / "img.failed-logs"
        assert err["details"]["criu_log"] == str(logs / "dump.log")
        assert (logs / "dump.log").is_file() and not img.exists()
        last = json.loads((tmp_path / "state" / "history.jsonl").read_text().splitlines()[-1])
        assert last["op"] == "dump" and last["exit_code"] == 6 and last["result"] == "failed"
    finally:
        if conn is not None:
            conn.close()
        listener.close()
        kill_pid(pid, marker="tcp_job.py")


def test_a_hostile_command_line_is_shown_escaped_by_every_command(
    sim: Sim, runtime_dir: Path, tmp_path: Path
) -> None:
    """A job whose command line holds rich markup, ANSI escapes and a newline: ps, status, inspect
    and restore --dry-run print it as text (no markup error, exit 1), escaped, on one line."""
    env = {**workload_env(sim, runtime_dir, NPUSNAP_STATE_DIR=str(tmp_path / "state")), "COLUMNS": "1000"}
    hostile = ["[/]", "\x1b[2J\x1b[31mred", "two\nlines"]
    out = tmp_path / "job.log"
    workload = str(write_workload(tmp_path))
    proc = subprocess.run(
        [*NPUSNAP, "run", "--detach", "--output", str(out), "--", PY, workload, *hostile],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout)
    try:
        wait_socket(runtime_dir, pid)
        img = tmp_path / "img"
        dumped = npusnap(env, "dump", "--leave-running", str(pid), str(img))
        assert dumped.returncode == 0, dumped.stderr
        for args, code in (
            (["ps"], 0),
            (["status", str(pid)], 0),
            (["inspect", str(img)], 0),
            (["restore", "--dry-run", str(img)], 11),  # the original still runs: its pids are busy
        ):
            shown = npusnap(env, *args)
            assert shown.returncode == code, (args, shown.stdout, shown.stderr)
            text = shown.stdout + shown.stderr
            assert "\x1b" not in text, (args, text)
            if args[0] != "restore":
                assert "[/] \\x1b[2J\\x1b[31mred two\\nlines" in text, (args, text)
            assert not any(line.startswith("lines") for line in text.splitlines())
    finally:
        kill_pid(pid)
