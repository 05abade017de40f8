"""CRIU's zdtm static tests, raw CRIU against npusnap, each test an NPU process.

    python -m tests.zdtm.parity [--jobs N] [--only NAME ...] [--report FILE] [--late-after FILE] [--keep]

For every host-flavour test of CRIU's own suite (test/zdtm/static of the CRIU source the setup
fetched), as zdtm.py runs it in its default mode (start, dump, restore, SIGTERM, the test's own
check, the test's hook at each of zdtm.py's points): through npusnap (`npusnap run`, `npusnap
dump`, `npusnap restore`) with tests/zdtm/npu_preload.c making the test an NPU process that must
read its device memory back at exit, and, for the reference, with raw CRIU on the plain test
wherever npusnap's outcome needs one: a test npusnap failed (after it), or one expected.txt
refuses (before it: some cgroup tests fail their first run on a machine, whichever side runs
it). A pass through npusnap needs no reference: the claim is that npusnap passes wherever raw
CRIU does.
The outcomes are compared with tests/zdtm/expected.txt, the one list of tests npusnap refuses on
purpose (with the reason); the run fails (exit 1) on:

- a test that passes raw and fails through npusnap, unless expected.txt lists it;
- a listed test that now passes (the list must shrink with the product);
- a dump that exited 0 whose image restore then refused (never allowed, listed or not);
- a refused dump that did not leave the job running (it must pass its own check after, unless
  raw CRIU's run of the test failed too: then the test cannot pass its check on this machine).

The counts go to the report (JSON) and are what docs/supported.md quotes.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import ctypes
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from npusnap_cli import criupass
from tests.integration.dumplib import private_sim, wait_until
from tests.node import isolate_node

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected.txt"
PRELOAD_SRC = HERE / "npu_preload.c"
NPUSNAP = str(Path(sys.executable).parent / "npusnap")
CRIU_VERSION = "4.2.1"
CRIU_SRC = Path(os.environ.get("NPUSNAP_CACHE", "/var/cache/npusnap")) / f"criu-{CRIU_VERSION}"
# zdtm.py's own numbers (test/zdtm.py, zdtm_test.start): a non-suid test drops to these.
ZDTM_IDS = {"ZDTM_UID": "18943", "ZDTM_GID": "58467", "ZDTM_GROUPS": "27495 48244"}
TEST_TIMEOUT = 30.0
HOOK_TIMEOUT = 60.0
# How long the late tests wait for --late-after's file: longer than pytest's workers ever take.
LATE_WAIT_S = 60 * 60.0


@dataclass
class Outcome:
    status: str  # pass | fail | skip
    stage: str = ""  # start | dump | restore | check | npu
    detail: str = ""
    dump_rc: Optional[int] = None
    restore_rc: Optional[int] = None
    seconds: float = 0.0


@dataclass
class TestResult:
    name: str
    raw: Optional[Outcome] = None  # not run where npusnap passed a test expected.txt does not refuse
    npusnap: Optional[Outcome] = None
    # ok | expected | regression | unexpected-pass | never | skip | raw-fails | unsettled-pass|fail
    verdict: str = ""
    notes: list[str] = field(default_factory=list)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Building


def build(work: Path) -> Path:
    """CRIU's zdtm library and static tests, copied out of the setup's CRIU source and built
    (make -k: a test that needs a library this machine lacks is simply not built)."""
    src = CRIU_SRC / "test" / "zdtm"
    if not src.is_dir():
        raise SystemExit(f"{src} is missing: run ./scripts/setup.sh (it fetches CRIU's source)")
    # Where CRIU's tree has it: a few tests build against ../../../criu/include (criu-rtc.so).
    zdtm = work / "criu" / "test" / "zdtm"
    if not (zdtm / "static").is_dir():
        shutil.copytree(src, zdtm, symlinks=True)
    # Hooks written in Python import pycriu from ../lib, as in CRIU's tree.
    for sub in ("criu", "lib"):
        if not (work / "criu" / sub).exists():
            (work / "criu" / sub).symlink_to(CRIU_SRC / sub)
    jobs = str(os.cpu_count() or 2)
    for sub in ("lib", "static"):
        p = subprocess.run(
            ["make", "-k", "-j", jobs, "-C", str(zdtm / sub)], capture_output=True, text=True, timeout=1200
        )
        (work / f"build-{sub}.log").write_text(p.stdout + p.stderr)
        if sub == "lib" and p.returncode != 0:
            raise SystemExit(f"zdtm's library did not build: {work / 'build-lib.log'}")
    return zdtm


def build_preload(work: Path, cann: Path) -> Path:
    out = work / "npu_preload.so"
    link = [f"-L{cann}/lib64", "-lacl_rt", "-ldl"]
    subprocess.run(
        ["cc", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(PRELOAD_SRC), *link],
        check=True,
        timeout=120,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Which tests, and how zdtm.py would run them


def read_desc(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    # The .desc files are Python (zdtm.py evals them): nearly all are literals, taken as data; the
    # few that compute (mnt_ext_dev reads its device from the environment) get what zdtm.py gives.
    text = path.read_text()
    try:
        value = ast.literal_eval(text)
    except ValueError:
        value = eval(text, {"os": os})  # CRIU's own test descriptions, as zdtm.py reads them
    return {str(k): str(v) for k, v in value.items()}


def all_tests(zdtm: Path) -> list[str]:
    """zdtm.py's all_tests() for the static set: its executables, less zdtm.desc's exclusions."""
    excluded = {"route_rules", "criu-rtc.so"}
    names = []
    for f in sorted((zdtm / "static").iterdir()):
        if not f.is_file() or f.is_symlink() or not os.access(f, os.X_OK):
            continue
        if f.name.endswith((".checkskip", ".hook")) or "." in f.name or f.name in excluded:
            continue
        names.append(f.name)
    return names


_features: dict[str, bool] = {}


def criu_has(feature: str) -> bool:
    if feature not in _features:
        p = subprocess.run(
            ["criu", "check", "--no-default-config", "-v0", "--feature", feature],
            capture_output=True,
            timeout=60,
        )
        _features[feature] = p.returncode == 0
    return _features[feature]


def why_skipped(zdtm: Path, name: str, desc: dict[str, str]) -> Optional[str]:
    """zdtm.py's reasons not to run a test in the host flavour here, or None."""
    flags = desc.get("flags", "").split()
    if "h" not in desc.get("flavor", "h ns uns").split():
        return "no host flavour"
    if "noauto" in flags:
        return "noauto (zdtm.py runs it only by name)"
    arch = desc.get("arch")
    if arch and os.uname().machine not in arch.split():
        return f"arch {arch}"
    for feature in desc.get("feature", "").split():
        if not criu_has(feature):
            return f"criu check --feature {feature} fails here"
    checkskip = zdtm / "static" / f"{name}.checkskip"
    if checkskip.exists():
        p = subprocess.run([str(checkskip)], cwd=checkskip.parent, capture_output=True, timeout=60)
        if p.returncode != 0:
            return f"{name}.checkskip says no"
    return None


def criu_opts(static: Path, desc: dict[str, str], which: str) -> list[str]:
    """zdtm.py's __getcropts + getdopts/getropts for the host flavour (less --pidfile)."""
    opts = desc.get("opts", "").split()
    if "crlib" in desc.get("flags", "").split():
        opts += ["--libdir", str(static / "lib")]
    return opts + desc.get(which, "").split()


# CRIU options of the tests' .desc files, as npusnap's own: dump options, restore options.
DUMP_OPTS = {"--tcp-established", "--file-locks", "--ext-unix-sk", "--link-remap"}
DUMP_OPTS_WITH_VALUE = {"--network-lock", "--external"}
RESTORE_OPTS = {"--tcp-close"}


def npusnap_opts(opts: list[str], dump: bool) -> tuple[list[str], list[str]]:
    """(npusnap's options, CRIU options npusnap has no equivalent for). A dump option named at
    restore (zdtm's "opts" go to both) is carried by the image; the allow-listed rest goes
    through ``--criu-opt``."""
    command = "dump" if dump else "restore"
    out: list[str] = []
    missing: list[str] = []
    i = 0
    while i < len(opts):
        o = opts[i]
        name, eq, value = o.lstrip("-").partition("=")
        passed = criupass.ALLOWED.get(name)
        takes_next = passed is not None and passed.value is not None and not passed.value_optional and not eq
        if o in DUMP_OPTS or (o in DUMP_OPTS_WITH_VALUE and i + 1 < len(opts)):
            if dump:
                out += [o, opts[i + 1]] if o in DUMP_OPTS_WITH_VALUE else [o]
            i += 1 if o in DUMP_OPTS_WITH_VALUE else 0
        elif not dump and o in RESTORE_OPTS:
            out.append(o)
        elif passed is not None:
            if takes_next and i + 1 < len(opts):
                value, eq = opts[i + 1], "="
                i += 1
            if command in passed.commands:
                out += ["--criu-opt", f"{name}={value}" if eq else name]
        else:
            missing.append(o)
            if i + 1 < len(opts) and not opts[i + 1].startswith("-"):
                missing[-1] += " " + opts[i + 1]
                i += 1
        i += 1
    return out, missing


# ---------------------------------------------------------------------------------------------
# Running one test

CAP_SYS_RESOURCE = 24


def has_cap(cap: int) -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def drops_uid(desc: dict[str, str]) -> bool:
    """zdtm.py runs a test without the suid flag as ZDTM_UID. CRIU cannot read another user's
    rlimits without CAP_SYS_RESOURCE ("Can't get rlimit": every such dump fails, raw or not), and
    machines like this one run without it: there, every test runs as root, as suid tests do."""
    return "suid" not in desc.get("flags", "").split() and has_cap(CAP_SYS_RESOURCE)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


# The harness is its tests' subreaper (PR_SET_CHILD_SUBREAPER): a test daemon, orphaned when it
# daemonized, is reparented here when it dies instead of to the machine's init, which may reap
# late (about 1.5 s here) while the restore waits for the pid to be free. Only orphans are reaped
# here: a child subprocess waits for is its own to reap (reaping it here would hand subprocess
# an ECHILD and a made-up exit code), so every Popen is registered under a lock before a reap
# can see its pid.
PR_SET_CHILD_SUBREAPER = 36
_popen_lock = threading.Lock()
_popens: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()


class _RegisteredPopen(subprocess.Popen):  # type: ignore[type-arg]
    def __init__(self, *args: object, **kwargs: object) -> None:
        with _popen_lock:
            super().__init__(*args, **kwargs)  # type: ignore[call-overload]
            _popens.add(self)


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    subprocess.Popen = _RegisteredPopen  # type: ignore[misc]


def reap_orphans() -> None:
    """Reap this process's dead children that no subprocess.Popen waits for."""
    me = os.getpid()
    with _popen_lock:
        waited = {p.pid for p in _popens if p.returncode is None}
        for pid, fields in proc_stats():
            if pid not in waited and fields[0] == "Z" and int(fields[1]) == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def wait_reaped(pid: int, timeout: float) -> bool:
    """Gone from /proc, not only dead: the restore needs the pid free (zdtm.py's wait_pid_die)."""
    end = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        reap_orphans()
        if not os.path.exists(f"/proc/{pid}"):
            break
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def uses_port(static: Path, name: str) -> bool:
    src = static / f"{name}.c"
    text = src.read_text(errors="replace") if src.exists() else ""
    return "TEST_OPTION(port" in text or re.search(r"\bport = \d", text) is not None


# CRIU's iptables network lock marks its own packets with SOCCR_MARK (soccr/soccr.h)
# and drops the rest of a locked connection: its rules say "! --mark 0xc114".
SOCCR_MARK_RULE = "0xc114"
ZDTM_PORT = 8880  # the port zdtm's TCP tests listen on (static int port = 8880)


def drop_lock_rules() -> None:
    """The DROP rules CRIU's iptables network lock left for zdtm's fixed port (a dump that ended
    the tree, whose restore never came to unlock them), so that the next test on that port does
    not inherit them. Called holding Runner.port_lock: no test of the port is running."""
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        listed = subprocess.run([tool, "-S"], capture_output=True, text=True, timeout=30)
        for rule in listed.stdout.splitlines():
            if rule.startswith("-A ") and SOCCR_MARK_RULE in rule and f"port {ZDTM_PORT} " in rule + " ":
                subprocess.run([tool, "-D", *rule.split()[1:]], capture_output=True, timeout=30)


def uses_pty(static: Path, name: str) -> bool:
    """The test opens pseudo-terminals: CRIU restores a pty at its index (/dev/ptmx with the
    image's index), which another test's pty may have taken meanwhile."""
    src = static / f"{name}.c"
    text = src.read_text(errors="replace") if src.exists() else ""
    return any(w in text for w in ("/dev/ptmx", "openpty", "posix_openpt", "/dev/pts", "/dev/tty"))


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name: state first) of every process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    yield int(entry), f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue


def session_members(sid: int) -> list[int]:
    # field 6 of stat: the session id
    return [pid for pid, fields in proc_stats() if int(fields[3]) == sid]


def kill_tree(pid: int) -> None:
    """The test daemon and whatever it forked, also what outlived it: the test's session (the
    daemon calls setsid, so its session id is its pid)."""
    if pid <= 1:
        return
    for _ in range(3):
        members = session_members(pid)
        if not members:
            return
        for m in members:
            try:
                os.kill(m, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for m in members:
            wait_gone(m, 10)
        reap_orphans()  # the members' zombies, reparented here: their pids free


class Runner:
    def __init__(self, zdtm: Path, work: Path, sim_env: dict[str, str], preload: Path, devices: int) -> None:
        self.devices: queue.Queue[int] = queue.Queue()
        for d in range(devices):
            self.devices.put(d)
        self.static = zdtm / "static"
        self.port_lock = threading.Lock()
        self.pty_lock = threading.Lock()
        self.work = work
        self.sim_env = sim_env
        self.preload = preload
        self.pause_before_restore = 0.0  # --pause-before-restore: the dump-to-restore gap, for --repeat

    def env(self, name: str, desc: dict[str, str], npu: bool, device: int = 0) -> dict[str, str]:
        env = dict(self.sim_env if npu else os.environ)
        env["TMPDIR"] = os.environ.get("TMPDIR", "/tmp")
        env["ZDTM_THREAD_BOMB"] = "5"  # zdtm.py: with any freezer but the kernel's
        if drops_uid(desc):
            env.update(ZDTM_IDS)
        if npu:
            env["ZDTM_NPU_TEST"] = name
            env["ZDTM_NPU_DEVICE"] = str(device)
            env["ZDTM_NPU_OUT"] = str(self.npu_out(name))
            env["LD_PRELOAD"] = str(self.preload)
        else:
            env.pop("CRIU_LIBS_DIR", None)
        return env

    def npu_out(self, name: str) -> Path:
        return self.work / "npu" / f"{name}.npu"

    def make(self, name: str, action: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = ["make", "--no-print-directory", "-C", str(self.static), f"{name}.{action}"]
        return subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT, stdin=subprocess.DEVNULL
        )

    def start(self, name: str, env: dict[str, str], npu: bool) -> tuple[Optional[str], Optional[str]]:
        """zdtm.py's start: `make NAME.pid`, with the test's --post-start hook run while make
        waits for the test to report its pid (a test may wait for its hook before it
        daemonizes: net_lock_socket_*). Returns (why the start failed, what the hook said)."""
        argv = ["make", "--no-print-directory", "-C", str(self.static), f"{name}.pid"]
        if npu:
            argv = [NPUSNAP, "run", "--keep-session", "--", *argv]
        with subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        ) as make:
            bad = self.hook(name, "--post-start", env)
            try:
                out, _ = make.communicate(timeout=TEST_TIMEOUT)
            except subprocess.TimeoutExpired:
                make.kill()
                make.communicate()
                return "make timed out", bad
        return (None if make.returncode == 0 else out.strip()[-300:]), bad

    def kill_strays(self, name: str) -> None:
        """Whatever a test that never reported its pid left running (its executable's)."""
        exe = str(self.static / name)
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/exe") == exe:
                        os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    continue

    def kill_hook_daemons(self, name: str) -> None:
        """What the test's hook forked and left running (netns_lock_*'s TCP server, which the
        hook leaves "for zdtm to SIGKILL")."""
        hook = str(self.static / f"{name}.hook").encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if hook in f.read().split(b"\0"):
                            os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    continue

    @staticmethod
    def hook_env(env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
        # The hook is a helper of the test, not an NPU process; a Python hook finds pycriu's
        # protobuf modules in this interpreter's environment.
        out = {k: v for k, v in {**env, **extra}.items() if k != "LD_PRELOAD"}
        out["PATH"] = f"{Path(sys.executable).parent}:{out.get('PATH', os.defpath)}"
        return out

    def hook(self, name: str, stage: str, env: dict[str, str], **extra: str) -> Optional[str]:
        """zdtm.py's try_run_hook: the test's own NAME.hook, when it has one, run from the
        directory zdtm.py runs from; None when it passed (or there is none), else what it said."""
        path = self.static / f"{name}.hook"
        if not os.access(path, os.X_OK):
            return None
        # Its output to a file, not a pipe: zdtm.py waits for the hook, not for the end of its
        # output, which a helper it forks and leaves running keeps open (net_lock_socket_*).
        with tempfile.TemporaryFile("w+") as out:
            hook = subprocess.Popen(
                [str(path), stage],
                cwd=self.static.parent.parent,
                env=self.hook_env(env, extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            try:
                rc = hook.wait(timeout=HOOK_TIMEOUT)
            except subprocess.TimeoutExpired:
                hook.kill()
                hook.wait()
                return f"hook {stage} timed out"
            if rc != 0:
                out.seek(0)
                return f"hook {stage} exited {rc}: {out.read().strip()[-200:]}"
        return None

    def read_pid(self, name: str) -> int:
        return int((self.static / f"{name}.pid").read_text().split()[0])

    def stop_and_check(self, name: str, pid: int, desc: dict[str, str]) -> tuple[bool, str]:
        """zdtm.py's stop(): SIGTERM, wait for the task to die, PASS in the .out file."""
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return False, "the test is gone before SIGTERM"
        timeout = float(desc.get("timeout") or TEST_TIMEOUT)
        if not wait_gone(pid, timeout):
            kill_tree(pid)
            return False, f"still alive {timeout:.0f}s after SIGTERM"
        out = self.static / f"{name}.out"
        text = out.read_text(errors="replace") if out.exists() else ""
        if "PASS" not in text.split():
            return False, "no PASS: " + " | ".join(text.strip().splitlines()[-3:])
        return True, ""

    def npu_line(self, name: str, pid: int) -> str:
        f = self.npu_out(name)
        lines = f.read_text().splitlines() if f.exists() else []
        mine = [ln for ln in lines if ln.split()[1:2] == [str(pid)]]
        return mine[-1] if mine else ""

    def unmount_leftovers(self, name: str) -> None:
        """Mounts a test made under its own files and left (cgroup_ignore's cgroup2 outlives a
        restore): the next run of the test could not mount there again."""
        prefix = f"{self.static}/{name}."
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
        for point in reversed(points):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)

    def fresh(self, name: str, desc: dict[str, str], env: dict[str, str]) -> None:
        self.unmount_leftovers(name)
        self.make(name, "cleanout", env)
        for suffix in (".pid", ".out", ".out.inprogress"):
            (self.static / f"{name}{suffix}").unlink(missing_ok=True)
        npu = self.npu_out(name)
        npu.parent.mkdir(exist_ok=True)
        npu.unlink(missing_ok=True)
        npu.touch()
        os.chmod(npu, 0o666)
        # zdtm.py's __add_wperms: a test that drops to ZDTM_UID writes its .out and .pid here.
        if drops_uid(desc):
            os.chmod(self.static, self.static.stat().st_mode | 0o222)

    def run(self, name: str, desc: dict[str, str], npu: bool) -> Outcome:
        t0 = time.monotonic()
        # A device of its own: CANN's Restore needs the device free of other processes (the
        # simulator's halProcessResRestore claims it exclusively), so two tests restoring on
        # one device at once would refuse each other.
        device = self.devices.get(timeout=600)
        # Tests of one fixed TCP/UDP port (zdtm's 8880 and its neighbours) take turns.
        port = self.port_lock if uses_port(self.static, name) else contextlib.nullcontext()
        # So do tests of pseudo-terminals (a restore needs the image's pty index free).
        pty = self.pty_lock if uses_pty(self.static, name) else contextlib.nullcontext()
        try:
            with port, pty:
                out = self._run(name, desc, npu, device)
            with self.port_lock:  # no test of the port runs: its rules left now are leftovers
                drop_lock_rules()
        finally:
            self.devices.put(device)
        out.seconds = round(time.monotonic() - t0, 2)
        return out

    def _run(self, name: str, desc: dict[str, str], npu: bool, device: int) -> Outcome:
        env = self.env(name, desc, npu, device)
        self.fresh(name, desc, env)
        img = self.work / ("npusnap" if npu else "raw") / name
        shutil.rmtree(img, ignore_errors=True)
        img.parent.mkdir(parents=True, exist_ok=True)
        crfail = "crfail" in desc.get("flags", "").split()
        failed, bad = self.start(name, env, npu)
        if failed is not None:
            self.kill_strays(name)
            self.hook(name, "--clean", env)
            return Outcome("fail", "start", failed)
        pid = self.read_pid(name)
        try:
            if bad:
                return Outcome("fail", "start", bad)
            return self._cr(name, desc, npu, pid, img, crfail, env)
        finally:
            kill_tree(pid)
            self.unmount_leftovers(name)
            # zdtm.py runs it however the test ended; what it leaves is the next run's problem.
            self.hook(name, "--clean", env)
            self.kill_hook_daemons(name)

    def _cr(
        self,
        name: str,
        desc: dict[str, str],
        npu: bool,
        pid: int,
        img: Path,
        crfail: bool,
        env: dict[str, str],
    ) -> Outcome:
        pidfile = str(self.static / f"{name}.pid")
        dopts = criu_opts(self.static, desc, "dopts")
        ropts = criu_opts(self.static, desc, "ropts")
        if npu:
            nd, missing_d = npusnap_opts(dopts, dump=True)
            nr, missing_r = npusnap_opts(ropts, dump=False)
            if missing_d or missing_r:
                ok, why = self.stop_and_check(name, pid, desc)
                return Outcome(
                    "fail",
                    "options",
                    f"npusnap has no equivalent of: {' '.join(missing_d + missing_r)}"
                    + ("" if ok else f"; and the job failed its own check: {why}"),
                )
            dump = [NPUSNAP, "dump", str(pid), str(img), "--timeout", "10", "--json", *nd]
            restore = [NPUSNAP, "restore", str(img), "--json", "--pidfile", pidfile, *nr]
        else:
            dump = [
                "criu",
                "dump",
                "--tree",
                str(pid),
                "-D",
                str(img),
                "-o",
                "dump.log",
                "-v4",
                "--timeout",
                "10",
            ]
            dump += ["--pidfile", pidfile, *dopts]
            img.mkdir(parents=True, exist_ok=True)
            restore = ["criu", "restore", "-D", str(img), "-o", "restore.log", "-v4", "--pidfile", pidfile]
            restore += [*ropts, "--restore-detached"]
        bad = self.hook(name, "--pre-dump", env, ZDTM_TEST_PID=str(pid))
        if bad:
            return Outcome("fail", "dump", bad)
        try:
            d = subprocess.run(
                dump, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return Outcome("fail", "dump", "dump timed out")
        if d.returncode != 0:
            alive = pid_alive(pid)
            ok, why = self.stop_and_check(name, pid, desc) if alive else (False, "")
            detail = error_of(d.stdout, d.stderr)
            if crfail:
                # zdtm.py: the dump must fail and the test then pass its own check.
                return Outcome("pass" if ok else "fail", "check", "" if ok else why, dump_rc=d.returncode)
            if not alive:
                return Outcome(
                    "fail", "dump-lost", f"the job is gone after a failed dump: {detail}", d.returncode
                )
            if not ok:
                return Outcome("fail", "dump-rollback", f"{detail}; after the rollback: {why}", d.returncode)
            return Outcome("fail", "dump", detail, dump_rc=d.returncode)
        if crfail:
            kill_tree(pid)
            return Outcome("fail", "dump", "zdtm expects this dump to fail; it exited 0", dump_rc=0)
        if pid_alive(pid):
            # CRIU (and npusnap without --leave-running) kills the tree after a dump.
            return Outcome("fail", "dump", "the tree is still alive after the dump", dump_rc=0)
        if not wait_reaped(pid, 10):
            return Outcome("fail", "dump", f"pid {pid} is still taken (not reaped) 10s after the dump", 0)
        Path(pidfile).unlink()  # zdtm.py's gone(): the restore writes it anew
        time.sleep(self.pause_before_restore)
        bad = self.hook(name, "--pre-restore", env)
        if bad:
            return Outcome("fail", "restore", bad, dump_rc=0)
        try:
            r = subprocess.run(
                restore, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return Outcome("fail", "restore", "restore timed out", dump_rc=0)
        if r.returncode != 0:
            return Outcome(
                "fail", "restore", error_of(r.stdout, r.stderr), dump_rc=0, restore_rc=r.returncode
            )
        pid = self.read_pid(name)
        bad = self.hook(name, "--post-restore", env, ZDTM_TEST_PID=str(pid), ZDTM_IMG_DIR=str(img))
        if bad:
            kill_tree(pid)
            return Outcome("fail", "restore", bad, dump_rc=0, restore_rc=0)
        ok, why = self.stop_and_check(name, pid, desc)
        if not ok:
            return Outcome("fail", "check", why, dump_rc=0, restore_rc=0)
        if npu:
            line = self.npu_line(name, pid)
            if not line.endswith(" ok"):
                return Outcome(
                    "fail", "npu", line or "no device-memory line at exit", dump_rc=0, restore_rc=0
                )
        return Outcome("pass", dump_rc=0, restore_rc=0)


def oneline(text: str) -> str:
    return " ".join(text.split())


def error_of(stdout: str, stderr: str) -> str:
    try:
        env = json.loads(stdout)
        err = env.get("error") or {}
        return str(err.get("message") or err)[:300]
    except (json.JSONDecodeError, AttributeError):
        pass
    lines = [ln for ln in (stderr + stdout).splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[:300]


# ---------------------------------------------------------------------------------------------
# The run


# A name in expected.txt that ends with "?": a known failure that does not always happen (a bug
# being looked for); either outcome is accepted and reported.
UNSETTLED = "?"


def load_expected() -> dict[str, str]:
    """expected.txt: "NAME: reason" per line ("NAME?: reason": unsettled); # starts a comment line.
    The key keeps the "?" of an unsettled name."""
    found = {}
    for line in EXPECTED.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, sep, reason = line.partition(":")
            if not sep or not reason.strip():
                raise SystemExit(f"{EXPECTED}: not NAME: reason: {line!r}")
            found[name.strip()] = reason.strip()
    return found


def listed(name: str, expected: dict[str, str]) -> Optional[str]:
    """How expected.txt lists ``name``: "refused", "unsettled" or None."""
    if name in expected:
        return "refused"
    return "unsettled" if name + UNSETTLED in expected else None


def judge(res: TestResult, expected: dict[str, str]) -> None:
    raw, npu = res.raw, res.npusnap
    if npu is not None and npu.dump_rc == 0 and npu.stage == "restore":
        res.verdict = "never"  # a dump that exited 0, an image its own restore refused
        return
    if npu is not None and npu.stage == "dump-lost":
        res.verdict = "never"  # a refused dump after which the job was gone
        return
    if npu is not None and npu.stage == "dump-rollback" and (raw is None or raw.status == "pass"):
        # A refused dump after which the job failed its own check, where raw CRIU's run passed it
        # (where raw CRIU's failed too, the test cannot pass its check on this machine).
        res.verdict = "never"
        return
    if raw is None:  # npusnap passed, and expected.txt does not refuse the test: no reference needed
        assert npu is not None and npu.status == "pass" and listed(res.name, expected) != "refused"
        res.verdict = "unsettled-pass" if listed(res.name, expected) == "unsettled" else "ok"
        return
    if raw.status != "pass":
        res.verdict = "skip" if raw.status == "skip" else "raw-fails"
        return
    assert npu is not None
    how = listed(res.name, expected)
    if how == "unsettled":
        res.verdict = "unsettled-" + ("pass" if npu.status == "pass" else "fail")
    elif npu.status == "pass":
        res.verdict = "unexpected-pass" if how else "ok"
    else:
        res.verdict = "expected" if how else "regression"


def is_late(name: str, desc: dict[str, str]) -> bool:
    """Run alone, after the shared ones: the tests zdtm.py runs exclusively, every cgroup test
    (cgroup_stray is not marked exclusive but mounts cgroup v1 hierarchies too), and the
    socket-tcpbuf ones: megabytes in flight on local TCP connections, whose restored connections
    stall by a kernel regression, raw CRIU's too, the more often the longer dump and restore take
    (docs/supported.md)."""
    flags = desc.get("flags", "").split()
    return "excl" in flags or name.startswith(("cgroup", "socket-tcpbuf"))


def repeat(args: argparse.Namespace, runner: Runner, zdtm: Path, names: list[str]) -> int:
    """--repeat: each test run N times on each side asked, one run at a time; the pass counts."""
    if not args.only:
        raise SystemExit("--repeat measures the tests named with --only")
    runner.pause_before_restore = args.pause_before_restore
    sides = {"raw": [False], "npusnap": [True], "both": [False, True]}[args.side]
    for name in names:
        desc = read_desc(zdtm / "static" / f"{name}.desc")
        for npu in sides:
            side = "npusnap" if npu else "raw"
            passed = 0
            for k in range(args.repeat):
                out = runner.run(name, desc, npu=npu)
                passed += out.status == "pass"
                detail = oneline(out.detail)[:160]
                log(f"{name} {side} run {k + 1}: {out.status} {out.stage} {out.seconds}s {detail}")
            pause = args.pause_before_restore
            log(f"{name} {side}: {passed} of {args.repeat} passed (pause before restore {pause}s)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="build and image directory (default: a temp dir)")
    ap.add_argument("--jobs", "-j", type=int, default=2, help="tests run side by side (exclusive ones alone)")
    ap.add_argument("--only", nargs="*", default=None, help="these tests only")
    ap.add_argument("--report", type=Path, default=None, help="write the results here (JSON)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument(
        "--repeat",
        type=int,
        default=0,
        metavar="N",
        help="measure instead of judging: run each --only test N times, one at a time, on the --side"
        " asked, and print how many passed (how docs/supported.md measured the socket-tcpbuf tests)",
    )
    ap.add_argument("--side", choices=("raw", "npusnap", "both"), default="both", help="with --repeat")
    ap.add_argument(
        "--pause-before-restore",
        type=float,
        default=0.0,
        metavar="S",
        help="with --repeat: wait S seconds between a test's dump and its restore",
    )
    ap.add_argument(
        "--late-after",
        type=Path,
        default=None,
        metavar="FILE",
        help="run the exclusive, cgroup and socket-tcpbuf tests only once FILE exists (scripts/test.sh"
        " creates it when pytest's workers are done: those tests mount cgroup v1 hierarchies and set"
        " iptables rules that other CRIU dumps on the host would trip on, or stall under load)",
    )
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root (CRIU)")
    # A node of its own: its jobs never make another run's devices occupied.
    node = isolate_node("zdtm")
    # A work directory of our own goes at the end, however the run ended (unless --keep).
    made = args.work is None
    if made:
        args.work = Path(tempfile.mkdtemp(prefix="zdtm-"))
    try:
        return run(args)
    finally:
        shutil.rmtree(node, ignore_errors=True)
        if made and not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    # The tests drop to ZDTM_UID: every directory on the way to the tests must be searchable.
    os.chmod(work, 0o755)
    become_subreaper()
    t0 = time.monotonic()
    zdtm = build(work)
    names = all_tests(zdtm)
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            raise SystemExit(f"not built or not a test: {' '.join(unknown)}")
        names = [n for n in names if n in args.only]
    expected = load_expected()
    stale = sorted({n.rstrip(UNSETTLED) for n in expected} - set(all_tests(zdtm)))
    supported = (REPO / "docs" / "supported.md").read_text()
    undocumented = sorted(n for n in (n.rstrip(UNSETTLED) for n in expected) if f"`{n}`" not in supported)
    if undocumented:
        raise SystemExit(f"docs/supported.md does not name these refused tests: {' '.join(undocumented)}")
    log(f"zdtm: {len(names)} built tests, built in {time.monotonic() - t0:.0f}s")
    results: list[TestResult] = []
    lock = threading.Lock()
    jobs = max(1, args.jobs)
    with private_sim(devices=jobs, capacity_bytes=256 << 20) as sim_env:
        cann = Path(sim_env["ASCEND_HOME_PATH"])
        preload = build_preload(work, cann)
        sim_env = dict(sim_env)
        sim_env["NPUSNAP_RUNTIME_DIR"] = str(work / "rt")
        (work / "rt").mkdir(mode=0o700, exist_ok=True)
        runner = Runner(zdtm, work, sim_env, preload, jobs)
        if args.repeat:
            return repeat(args, runner, zdtm, names)
        plan: list[tuple[str, dict[str, str]]] = []
        for name in names:
            desc = read_desc(zdtm / "static" / f"{name}.desc")
            why = why_skipped(zdtm, name, desc)
            if why:
                results.append(TestResult(name, Outcome("skip", detail=why), verdict="skip"))
                continue
            plan.append((name, desc))

        def one(item: tuple[str, dict[str, str]]) -> TestResult:
            name, desc = item
            res = TestResult(name)
            if listed(name, expected) == "refused":
                # Both always, raw CRIU first as zdtm.py would run it: some of these tests (the
                # cgroup ones) fail their first run on a machine, whichever side it is.
                res.raw = runner.run(name, desc, npu=False)
            res.npusnap = runner.run(name, desc, npu=True)
            if res.raw is None and res.npusnap.status != "pass":
                res.raw = runner.run(name, desc, npu=False)
            judge(res, expected)
            with lock:
                n, r = res.npusnap, res.raw
                tail = f" | raw {r.status} {r.stage} {oneline(r.detail)[:100]}" if r else " | raw not needed"
                took = f"{n.seconds + (r.seconds if r else 0):5.1f}s"
                head = f"[{res.verdict:>15}] {took} {name}: npusnap {n.status} {n.stage}"
                log(f"{head} {oneline(n.detail)[:160]}{tail}")
            return res

        late = [p for p in plan if is_late(p[0], p[1])]
        shared = [p for p in plan if p not in late]
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            results += list(pool.map(one, shared))
        if args.late_after is not None:
            log(f"zdtm: {len(shared)} done; {len(late)} late ones (is_late) await {args.late_after}")
            wait_until(args.late_after.exists, LATE_WAIT_S, f"{args.late_after} (pytest's workers done)")
        results += [one(p) for p in late]
    results.sort(key=lambda r: r.name)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    raw_run = sum(1 for r in results if r.raw is not None and r.verdict != "skip")
    raw_pass = sum(1 for r in results if r.raw is not None and r.raw.status == "pass")
    npu_pass = sum(1 for r in results if r.npusnap is not None and r.npusnap.status == "pass")
    summary = {
        "tests_built": len(names),
        "ran": len(names) - counts.get("skip", 0),
        "raw_run": raw_run,  # the tests whose verdict needed raw CRIU's outcome
        "raw_passed": raw_pass,
        "npusnap_passed": npu_pass,
        "verdicts": counts,
        "expected_not_built": stale,
        "seconds": round(time.monotonic() - t0, 1),
    }
    log(json.dumps(summary))
    if args.report:
        args.report.write_text(
            json.dumps({"summary": summary, "tests": [asdict(r) for r in results]}, indent=1)
        )
    bad = [r for r in results if r.verdict in ("regression", "unexpected-pass", "never")]
    for r in bad:
        log(f"FAIL {r.verdict}: {r.name}: {r.npusnap}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
