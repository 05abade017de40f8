"""The CRIU boundary: finding and checking the criu binary, and (below) dump/restore via pycriu.

This is the only module that drives CRIU through pycriu (criuimages.py reads its image files).
pycriu raises exceptions that carry only an errno; the reason is in CRIU's log file, so every call
here sets a log file and failures are turned into ``CriuError`` with the log's relevant lines (see
``log_tail``).

Note (criu-here.md): ``pycriu.criu().check()`` over RPC returns an error with errno 0 on these
machines while ``criu check`` on the command line is fine, so the preflight runs the binary.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from npusnap_cli import criuimages, paths, safefs
from npusnap_cli.errors import NO_SPACE_ERRNOS, CriuError, ExitCode, NpusnapError, PreflightError, no_space

# -v: what npusnap hands CRIU and what CRIU reports (cli.py sets the level).
_LOG = logging.getLogger("npusnap.criu")

CRIU_MIN_VERSION = (4, 0)
# Where setup.sh installs CRIU built from source; searched before $PATH so that a too-old
# distribution criu (Debian 12 ships 3.17, which fails on recent kernels) does not win.
CRIU_SEARCH_PATHS = ("/usr/local/sbin/criu", "/usr/local/bin/criu", "/usr/sbin/criu", "/usr/bin/criu")


@dataclass(frozen=True)
class CriuBinary:
    path: str
    version: str

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return parse_version(self.version)


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def criu_version(path: str) -> Optional[str]:
    """The version a criu binary reports (``criu --version`` prints ``Version: 4.2.1``)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^Version:\s*(\S+)", out, re.MULTILINE)
    return m.group(1) if m else None


def _candidates() -> list[str]:
    seen: list[str] = []
    env = os.environ.get("NPUSNAP_CRIU")
    for path in [env, *CRIU_SEARCH_PATHS, shutil.which("criu")]:
        if path and path not in seen and os.access(path, os.X_OK):
            seen.append(path)
    return seen


def find_criu() -> CriuBinary:
    """The criu binary to use: ``NPUSNAP_CRIU``, /usr/local, then the system's; must be 4.0+.
    ``NPUSNAP_CRIU``, when set, is the only one: one it cannot run is an error, not a reason to
    take another."""
    env = os.environ.get("NPUSNAP_CRIU")
    if env:
        version = criu_version(env) if os.access(env, os.X_OK) else None
        if version and parse_version(version) >= CRIU_MIN_VERSION:
            return CriuBinary(path=env, version=version)
        raise PreflightError(
            f"NPUSNAP_CRIU={env} is not a CRIU 4.0 or newer that runs here"
            + (f" (it is {version})" if version else ""),
            why="when NPUSNAP_CRIU is set, npusnap uses that CRIU and no other",
            fix="point NPUSNAP_CRIU at a criu binary of version 4.0 or newer, or unset it",
            details={"npusnap_criu": env, "version": version},
        )
    found: list[tuple[str, Optional[str]]] = []
    for path in _candidates():
        version = criu_version(path)
        found.append((path, version))
        if version and parse_version(version) >= CRIU_MIN_VERSION:
            return CriuBinary(path=path, version=version)
    if not found:
        raise PreflightError(
            "CRIU is not installed",
            why="npusnap saves and restores the host side of a process with CRIU 4.0 or newer",
            fix="run ./scripts/setup.sh as root (it builds CRIU 4.2.1 from source), "
            "or set NPUSNAP_CRIU=/path/to/criu",
        )
    listing = ", ".join(f"{p} ({v or 'unknown version'})" for p, v in found)
    raise PreflightError(
        f"CRIU is too old: {listing}",
        why="CRIU before 4.0 fails on recent kernels (e.g. 'vdso: Unexpected rt vDSO area bounds')",
        fix="run ./scripts/setup.sh as root to build and install CRIU 4.2.1 under /usr/local",
    )


def run_criu_check(binary: CriuBinary, timeout: float = 60) -> tuple[bool, str]:
    """Run ``criu check``; return (passed, its output). Needs root to be meaningful."""
    return CriuCheck(binary).result(timeout)


class CriuCheck:
    """``criu check`` started now and read later, so that a command does other work while it
    runs (tens of milliseconds). ``result`` waits for it; ``cancel`` kills it if it is not wanted."""

    def __init__(self, binary: CriuBinary) -> None:
        self.binary = binary
        self.error: Optional[str] = None
        self.proc: Optional[subprocess.Popen[str]] = None
        try:
            # Its own session: a Ctrl-C meant for the command must not fail the check instead.
            self.proc = subprocess.Popen(
                [binary.path, "check"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            self.error = f"could not run {binary.path}: {exc}"

    def result(self, timeout: float = 60) -> tuple[bool, str]:
        """(passed, its output)."""
        if self.proc is None:
            return False, self.error or "criu check did not start"
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            return False, f"`{self.binary.path} check` did not finish within {timeout:.0f}s"
        return self.proc.returncode == 0, (out or "").strip()

    def cancel(self, timeout: float = 5) -> None:
        """The answer is not wanted (the command failed before it): let the check end on its own
        (it takes a tenth of a second), killing it only if it does not. Killing criu alone would
        leave the helpers it forks holding its output pipe open, and this wait with them."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()

    def _kill(self) -> None:
        """Kill criu check with every process it forked (its own session: one process group)."""
        assert self.proc is not None
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def preload() -> None:
    """Import pycriu (protobuf and CRIU's image descriptors: tens of milliseconds) ahead of the CRIU step,
    from a thread while the command waits for something else. A failure is left for the step
    itself to report."""
    try:
        import pycriu  # noqa: F401
    except Exception:
        pass


def pycriu_version() -> Optional[str]:
    """The installed pycriu's version, or None when pycriu cannot be imported."""
    try:
        import pycriu
    except Exception:
        return None
    version = getattr(pycriu, "__version__", None)
    return str(version) if version else "unknown"


# --------------------------------------------------------------------------------------------
# Dump and restore through pycriu (`criu swrk`)
# --------------------------------------------------------------------------------------------

# CRIU's log levels: 0 none .. 4 debug. Debug costs little next to the memory dump and is what a
# CRIU developer asks for first, so it is the default.
DEFAULT_LOG_LEVEL = 4
# How many trailing log lines an error carries (besides every "Error" line).
LOG_TAIL_LINES = 20
STATS_DUMP_FILE = "stats-dump"
STATS_RESTORE_FILE = "stats-restore"


@dataclass(frozen=True)
class CriuOptions:
    """CRIU options, named as in `criu dump` / `podman container checkpoint`.

    ``leave_running``: the tree keeps running after the dump. ``leave_stopped``: it stays stopped
    (SIGSTOP) after the dump, so the caller decides whether to kill it or let it go on; the dump
    pipeline uses it so that the image can be published before the original is killed.
    ``timeout``: seconds CRIU waits for the tree to freeze.
    """

    leave_running: bool = False
    leave_stopped: bool = False
    tcp_established: bool = False
    shell_job: bool = False
    file_locks: bool = False
    ext_unix_sk: bool = False
    external: tuple[str, ...] = ()
    timeout: Optional[int] = None
    log_level: int = DEFAULT_LOG_LEVEL
    # Unlinked files the tree still has open (multiprocessing's spawn/forkserver semaphores in
    # /dev/shm are the common case) are linked back under a temporary name at dump and unlinked
    # again at restore. Without it CRIU refuses such a tree ("Can't create link remap").
    link_remap: bool = True
    # How CRIU blocks the network around a dump of established TCP connections: "nftables"
    # (libnftables, no binary needed), "iptables" (needs the iptables binary in CRIU's netns),
    # "skip". None: nftables when CRIU supports it, else iptables.
    network_lock: Optional[str] = None
    # Restore only: (key, fd) pairs handed to the restored tree as CRIU's --inherit-fd (e.g. a
    # new file for a stdout pipe whose reader is gone).
    inherit_fd: tuple[tuple[str, int], ...] = ()
    # Restore only: leave the private anonymous memory to a `criu lazy-pages` daemon (it must be
    # listening in the restore's work directory: LazyPagesDaemon).
    lazy_pages: bool = False
    # Restore only: established TCP connections come back closed (CRIU's --tcp-close), for a copy
    # restored beside the original that still holds them.
    tcp_close: bool = False
    # CRIU options passed through unchanged (``--criu-opt``), checked by criupass.parse: the
    # lines of the configuration file CRIU reads after the RPC settings.
    passthrough: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            "leave_running": self.leave_running,
            "leave_stopped": self.leave_stopped,
            "tcp_established": self.tcp_established,
            "shell_job": self.shell_job,
            "file_locks": self.file_locks,
            "ext_unix_sk": self.ext_unix_sk,
            "external": list(self.external),
            "timeout": self.timeout,
            "log_level": self.log_level,
            "link_remap": self.link_remap,
            "network_lock": self.network_lock,
            "passthrough": list(self.passthrough),
        }


@dataclass(frozen=True)
class DumpStats:
    """CRIU's own dump statistics (the ``stats-dump`` image), times in microseconds."""

    freezing_time_us: int = 0
    frozen_time_us: int = 0
    memdump_time_us: int = 0
    memwrite_time_us: int = 0
    pages_scanned: int = 0
    pages_written: int = 0


@dataclass(frozen=True)
class RestoreStats:
    """CRIU's own restore statistics (the ``stats-restore`` image), times in microseconds."""

    forking_time_us: int = 0
    restore_time_us: int = 0
    pages_restored: int = 0


@dataclass(frozen=True)
class DumpResult:
    log_path: str
    wall_s: float
    stats: Optional[DumpStats]


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    log_path: str
    wall_s: float
    stats: Optional[RestoreStats]


def log_excerpt(log_path: str, tail: int = LOG_TAIL_LINES) -> list[str]:
    """The lines of a CRIU log worth showing: every error line, then the last ``tail`` lines."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as exc:
        return [f"(could not read {log_path}: {exc.strerror})"]
    errors = [ln for ln in lines if _ERROR_RE.search(ln) and not any(h in ln for h in HARMLESS_ERRORS)]
    last = lines[-tail:]
    out = [ln for ln in errors if ln not in last]
    if out:
        out.append("...")
    return out + last


# CRIU logs this on every run here (CAP_SYS_RESOURCE is missing, see criu-here.md); it is not why
# anything failed, so it must not be shown as the reason.
HARMLESS_ERRORS = ("Can't setup RLIMIT_NOFILE for self",)
_ERROR_RE = re.compile(r"Error \([^)]*\):\s*(.*)")


def first_error(lines: list[str]) -> Optional[str]:
    """The first meaningful ``Error (file:line): text`` of a CRIU log: usually the root cause."""
    for line in lines:
        m = _ERROR_RE.search(line)
        if m and not any(h in line for h in HARMLESS_ERRORS):
            return m.group(1).strip()
    return None


def load_stats(work_dir: str, name: str) -> Optional[dict[str, int]]:
    """Read a CRIU stats image (CRIU writes it into its work dir); None when absent or unreadable:
    statistics are informative only, a decoding problem must not fail a good dump."""
    return criuimages.stats(os.path.join(work_dir, name))


def read_dump_stats(work_dir: str) -> Optional[DumpStats]:
    raw = load_stats(work_dir, STATS_DUMP_FILE)
    if raw is None:
        return None
    return DumpStats(
        freezing_time_us=raw.get("freezing_time", 0),
        frozen_time_us=raw.get("frozen_time", 0),
        memdump_time_us=raw.get("memdump_time", 0),
        memwrite_time_us=raw.get("memwrite_time", 0),
        pages_scanned=raw.get("pages_scanned", 0),
        pages_written=raw.get("pages_written", 0),
    )


def read_restore_stats(work_dir: str) -> Optional[RestoreStats]:
    raw = load_stats(work_dir, STATS_RESTORE_FILE)
    if raw is None:
        return None
    return RestoreStats(
        forking_time_us=raw.get("forking_time", 0),
        restore_time_us=raw.get("restore_time", 0),
        pages_restored=raw.get("pages_restored", 0),
    )


# Called with the pid of each ``criu swrk`` started (restore's stop guard names it to its watcher).
SWRK_STARTED: list[Callable[[int], None]] = []


class _Swrk:
    """A ``criu swrk`` service process that we start ourselves.

    pycriu's ``use_binary`` forks CRIU in our process group, so a Ctrl-C at the terminal would
    kill CRIU in the middle of a dump, while its parasite code is inside the target. We start it
    in its own session instead (Ctrl-C and a SIGTERM to npusnap reach only npusnap, which then
    waits for CRIU to finish) and hand the socket to pycriu with ``use_fd``.
    """

    def __init__(
        self, binary: CriuBinary, extra_fds: tuple[int, ...] = (), mount_ns_of: Optional[int] = None
    ) -> None:
        import socket

        self._ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # npusnap's plugins live in a directory of their own, handed to CRIU explicitly: CRIU's
        # shared default (/usr/lib/criu) may hold plugins of the vendor's CRIU fork, built for
        # another hook table (host/criuplugin.py).
        env = dict(os.environ, CRIU_LIBS_DIR=str(paths.criu_plugin_dir()))
        # CRIU in the mount namespace of ``mount_ns_of`` (nsenter execs it, same pid): a tree in
        # that namespace is then in CRIU's own, and its image holds no mount namespace.
        enter = ["nsenter", f"--mount=/proc/{mount_ns_of}/ns/mnt", "--"] if mount_ns_of else []
        try:
            self.proc = subprocess.Popen(
                [*enter, binary.path, "swrk", str(theirs.fileno())],
                # --inherit-fd numbers are fds of the criu process itself: pass them on as they are.
                pass_fds=(theirs.fileno(), *extra_fds),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                env=env,
            )
        finally:
            theirs.close()
        for started in list(SWRK_STARTED):
            started(self.proc.pid)

    @property
    def sock(self) -> Any:
        return self._ours

    def fileno(self) -> int:
        return self._ours.fileno()

    def close(self) -> int:
        self._ours.close()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # swrk exits when its socket closes; if it does not, it is wedged: do not leave it.
            self.proc.kill()
            return self.proc.wait()


class CriuBusyError(CriuError):
    """CRIU failed because another command was talking to the job's agent while CRIU dumped it
    (its connection is a socket to outside the tree): in use for now, exit 11; retry."""

    exit_code = ExitCode.BUSY
    kind = "busy"


# An accepted connection on an agent's socket (it carries the listening socket's name), connected
# (state 1) to a peer: another command was talking to the agent when CRIU dumped the tree.
_AGENT_CONN_RE = re.compile(
    r"unix: \s*Dumping: ino \S+ peer_ino (\S+) .*state\s+1 name (\S+/\d+\.sock)$", re.M
)
_PLUGIN_BUSY_RE = re.compile(r"npusnap-plugin: FAILED.*(?:cannot send \w+ to the agent|is busy|BUSY)")


def _agent_in_use(log_path: str) -> Optional[str]:
    """The agent socket another client was connected to while CRIU dumped, from CRIU's log."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    if "External socket is used" in text:
        for m in _AGENT_CONN_RE.finditer(text):
            if m.group(1) not in ("0", "0x0") and "npusnap" in m.group(2):
                return m.group(2)
    m2 = _PLUGIN_BUSY_RE.search(text)
    return "the job's agent socket" if m2 else None


# CRIU's show_one_unix (criu/sk-unix.c) at log level 4: the outside peer of a refused socket.
_RUNAWAY_RE = re.compile(
    r"Runaway socket: ino \S+ peer_ino \S+ family\s+\d+ type\s+(\d+) state\s+\d+ name (\S+)"
)
SOCK_DGRAM = 2


def _ext_unix_fix(log_path: str) -> Optional[str]:
    """CRIU suggests --ext-unix-sk for any unix socket connected outside the tree, but with it
    dumps only a datagram socket whose outside peer has a name (__dump_external_socket): for a
    stream connection it fails again ("Can't dump half of stream unix connection"). The fix that
    holds for the socket CRIU refused, or None if its log does not say."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            m = _RUNAWAY_RE.search(f.read())
    except OSError:
        return None
    if m is None:
        return None
    kind, name = int(m.group(1)), m.group(2)
    peer = "a socket without a name" if name == "null" else name
    if kind == SOCK_DGRAM and name != "null":
        return (
            f"the job sends datagrams to {peer} outside its tree: rerun with --ext-unix-sk, and have "
            f"{name} there again when it is restored (CRIU reconnects to it by its name); details "
            f"in {log_path}"
        )
    return (
        f"the job holds a connection to {peer}, a unix socket outside its tree: CRIU cannot save one "
        "half of a connection, with or without --ext-unix-sk; close it before the dump (or dump "
        f"the peer's process in the same tree); details in {log_path}"
    )


def _criu_error(action: str, exc: Exception, log_path: str, *, pid: Optional[int] = None) -> NpusnapError:
    errno_ = getattr(exc, "errno", None)
    excerpt = log_excerpt(log_path)
    in_use = _agent_in_use(log_path) if action == "dump" else None
    if in_use is not None:
        target = f" of pid {pid}" if pid is not None else ""
        return CriuBusyError(
            f"CRIU dump{target} failed: another command was connected to the job's agent ({in_use}) "
            "while CRIU dumped it",
            why="a second npusnap command (a dump, status, freeze) talked to the agent during this "
            "dump; CRIU refuses a connection to outside the tree. It is not a socket of the job: "
            "--ext-unix-sk would not help",
            fix="wait for the other command to end (`npusnap status PID` shows who holds the job), then "
            f"dump again (CRIU log: {log_path})",
            details={"criu_log": log_path, "criu_log_excerpt": excerpt, "agent_socket": in_use},
        )
    target = f" of pid {pid}" if pid is not None else ""
    reason = first_error(excerpt) or str(exc)
    fix = f"read the CRIU log {log_path}; the lines below are its errors and its last lines"
    m = re.search(r"consider using (--[a-z-]+)", reason, re.IGNORECASE)
    if m:
        # CRIU names its own option; npusnap's flags have the same names and meanings.
        fix = f"if that is expected, rerun with {m.group(1)} (as CRIU suggests); details in {log_path}"
        if m.group(1) == "--ext-unix-sk":
            fix = _ext_unix_fix(log_path) or fix
    details: dict[str, object] = {"criu_log": log_path, "criu_log_excerpt": excerpt}
    if errno_:
        details["errno"] = errno_
    free = _free_bytes(os.path.dirname(log_path))
    full = errno_ in NO_SPACE_ERRNOS or any(
        "No space left on device" in line or "Disk quota exceeded" in line for line in excerpt
    )
    if full or (free is not None and free < FULL_DISK_BYTES and (not excerpt or "Unknown" in reason)):
        # A full disk (whatever else failed because of it, a plugin's write included) is exit 3
        # like in every command; CRIU may not even have written its log, so pycriu only says
        # "Error(0): Unknown".
        where = os.path.dirname(os.path.dirname(log_path)) or log_path
        details["free_bytes"] = free
        return no_space(
            f"CRIU {action}{target}",
            where,
            cause=f"{free if free is not None else '?'} bytes free",
            fix=f"free space there (df -h {where}) or choose another directory, then retry",
            details=details,
        )
    known = _known_failure(excerpt)
    if known is not None:
        reason, why_known, fix, extra = known
        details.update(extra)
        return CriuError(
            f"CRIU {action}{target} failed: {reason}",
            why=why_known,
            fix=f"{fix} (CRIU log: {log_path})",
            details=details,
        )
    return CriuError(
        f"CRIU {action}{target} failed: {reason}",
        why=f"CRIU stopped the {action}; the reason is its first error, from its log (pycriu: {exc})",
        fix=fix,
        details=details,
    )


_BAD_SIZE_RE = re.compile(r"File (\S+) has bad size (\d+) \(expect (\d+)\)")
_LINK_REMAP_RE = re.compile(r"Can't create link remap for (\S+)")
_REMAP_TAKEN_RE = re.compile(r"Can't link remap to (\S+): File exists")
_INET_OPT_RE = re.compile(r"sockets: Can't get 1:16 opt")
_NETLOCK_RE = re.compile(r"Failed to lock TCP connection|iptables-restore|Unable to create network lock")


def _known_failure(lines: list[str]) -> Optional[tuple[str, str, str, dict[str, object]]]:
    """CRIU failures whose cause and fix are certain: (reason, why, fix, details), else None."""
    text = "\n".join(lines)
    m = _BAD_SIZE_RE.search(text)
    if m:
        # CRIU logs paths relative to the root ("tmp/job.log").
        path, now, then = "/" + m.group(1).lstrip("/"), int(m.group(2)), int(m.group(3))
        return (
            f"{path} changed since the dump ({then} bytes then, {now} now)",
            "CRIU reopens every file the tree had open and requires a regular file opened for "
            "writing without O_APPEND to have its dump-time size; something wrote to it after the "
            "dump (with --leave-running, usually the original job itself)",
            f"put the file back as it was at dump time (a copy of it, or `truncate -s {then} {path}` "
            "if only lines were appended and losing them is fine), or open such logs with O_APPEND "
            "(`>>` in a shell) in the job",
            {"changed_file": path, "size_at_dump": then, "size_now": now},
        )
    m = _LINK_REMAP_RE.search(text)
    if m:
        return (
            f"the tree has the deleted file {m.group(1)} open",
            "CRIU links such a file back under a temporary name only with link-remap "
            "(multiprocessing's spawn/forkserver semaphores in /dev/shm are the usual case)",
            "drop --no-link-remap (link-remap is npusnap's default)",
            {"deleted_file": m.group(1)},
        )
    m = _REMAP_TAKEN_RE.search(text)
    if m:
        where = os.path.dirname("/" + m.group(1).lstrip("/"))
        return (
            f"a link_remap.N file left in {where} by an earlier dump is in the way",
            "CRIU names the link it makes for a deleted file the tree has open link_remap.N, N "
            "counted from the start of each dump, next to the file; an earlier dump by plain CRIU "
            "or an older npusnap left one with the same name (npusnap now keeps them in the image)",
            f"remove the link_remap.* files in {where} that no unrestored image needs, then dump again",
            {"deleted_file": "/" + m.group(1).lstrip("/")},
        )
    if _INET_OPT_RE.search(text):
        return (
            "this CRIU cannot dump TCP/UDP sockets on this kernel",
            "kernels 6.16 and later refuse getsockopt(SO_PASSCRED) on inet sockets; CRIU before 4.2 "
            "treats that as fatal",
            "install CRIU 4.2 or newer (./scripts/setup.sh builds 4.2.1), then dump again",
            {},
        )
    if _NETLOCK_RE.search(text):
        return (
            "CRIU could not lock the network around the TCP connections",
            "the iptables network lock needs the iptables binary in CRIU's network namespace",
            "rerun with --network-lock nftables (needs no binary), or install iptables",
            {},
        )
    return None


FULL_DISK_BYTES = 1 << 20  # below this much free space a failed CRIU run is taken as a full disk


def _free_bytes(path: str) -> Optional[int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# The configuration file of the passed-through options, in CRIU's work directory.
PASSTHROUGH_CONFIG = "criu-options.conf"


def _write_passthrough(work_fd: int, lines: tuple[str, ...]) -> str:
    """Write the options into the fresh file open_work_dir made; the path CRIU opens it by goes
    through our own descriptor of the directory (CRIU is our child and may read our fds)."""
    fd = os.open(PASSTHROUGH_CONFIG, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=work_fd)
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return f"/proc/{os.getpid()}/fd/{work_fd}/{PASSTHROUGH_CONFIG}"


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def open_work_dir(work_dir: str, names: tuple[str, ...]) -> int:
    """An fd of CRIU's work directory with each of ``names`` made a fresh file of ours.

    CRIU (run as root) opens its log and statistics in the work directory by name with O_CREAT |
    O_TRUNC, following links: a hard link or symlink planted there as ``restore.log`` would make
    it overwrite another file (an image's logs/ travels with the image). So the directory is
    taken as an fd (not a symlink; root's or ours, writable by nobody else unless sticky) and
    each name is a file we just created (safefs.fresh_file); the fd is what CRIU gets."""
    try:
        fd = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _unsafe_work_dir(work_dir, work_dir, "a symbolic link") from None
    try:
        try:
            safefs.check_dir(os.fstat(fd), work_dir, os.geteuid())
        except safefs.UnsafePath as exc:
            raise _unsafe_work_dir(work_dir, work_dir, exc.strerror or "unsafe") from None
        for name in names:
            try:
                safefs.fresh_file(fd, name)
            except safefs.UnsafePath as exc:
                raise _unsafe_work_dir(
                    work_dir, os.path.join(work_dir, name), exc.strerror or "unsafe"
                ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unsafe_work_dir(work_dir: str, path: str, what: str) -> PreflightError:
    return PreflightError(
        f"refusing to let CRIU write its log in {work_dir}: {path} is {what}",
        why="CRIU runs as root and opens its log and statistics there by name, following links and "
        "truncating: whatever that name points to, or is a second name of, would be overwritten",
        fix=f"look at it (ls -li {path}); remove it if it is not yours (rm {path}), or pass --logs "
        "with a private directory; then run the command again",
        details={"path": path},
    )


def _apply_options(opts: Any, options: CriuOptions) -> None:
    """Copy our options into pycriu's ``criu_opts`` protobuf message."""
    opts.leave_running = options.leave_running
    if options.leave_stopped:
        opts.leave_stopped = True
    opts.tcp_established = options.tcp_established
    opts.shell_job = options.shell_job
    opts.file_locks = options.file_locks
    opts.ext_unix_sk = options.ext_unix_sk
    for ext in options.external:
        opts.external.append(ext)
    if options.timeout:
        opts.timeout = int(options.timeout)
    opts.log_level = options.log_level
    opts.link_remap = options.link_remap
    method = options.network_lock or default_network_lock()
    opts.network_lock = _NETWORK_LOCKS[method]
    if options.lazy_pages:
        opts.lazy_pages = True
    if options.tcp_close:
        opts.tcp_close = True
    for key, fd in options.inherit_fd:
        item = opts.inherit_fd.add()
        item.key = key
        item.fd = fd


# criu_network_lock_method in CRIU's rpc.proto
_NETWORK_LOCKS = {"iptables": 1, "nftables": 2, "skip": 3}
NETWORK_LOCKS = tuple(_NETWORK_LOCKS)


def default_network_lock() -> str:
    """nftables unless only the iptables binary is there: the nftables lock needs no binary."""
    return "iptables" if shutil.which("iptables") and not has_nftables() else "nftables"


def has_nftables() -> bool:
    """libnftables is installed: CRIU can lock the network without any binary."""
    import ctypes.util

    return ctypes.util.find_library("nftables") is not None


# --------------------------------------------------------------------------------------------
# What this CRIU can do on this kernel
# --------------------------------------------------------------------------------------------

INET_SOCKETS_MIN_VERSION = (4, 2)


def kernel_refuses_inet_passcred() -> bool:
    """True on kernels (6.16+) that refuse getsockopt(SO_PASSCRED) on a TCP/UDP socket."""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED)
    except OSError as exc:
        return exc.errno == errno.EOPNOTSUPP
    return False


def inet_sockets_supported(binary: CriuBinary) -> bool:
    """Can this CRIU dump TCP/UDP sockets here? CRIU < 4.2 fails on every one on 6.16+ kernels."""
    return binary.version_tuple >= INET_SOCKETS_MIN_VERSION or not kernel_refuses_inet_passcred()


# A notification from CRIU (an action-script point) while it works: (script name, pid or None).
# Raising refuses it, which makes CRIU fail the dump/restore (and roll back what it did).
NotifyFn = Callable[[str, Optional[int]], None]


@dataclass
class _Session:
    """pycriu's options message plus our own socket to a ``criu swrk`` of ours."""

    opts: Any
    swrk: _Swrk
    notify_error: Optional[BaseException] = None

    def call(self, req_type: str, on_notify: Optional[NotifyFn]) -> Any:
        """Send one request and answer CRIU's notifications until its final response.

        pycriu's own calls cannot answer notifications (``notify_scripts``), which is how a
        client gets control at ``post-dump`` while the tree is still frozen.
        """
        import socket

        import pycriu
        from google.protobuf.message import DecodeError
        from pycriu import rpc_pb2 as rpc
        from pycriu.criu import CRIUExceptionInternal

        req = rpc.criu_req()
        req.type = getattr(rpc, req_type)
        req.opts.MergeFrom(self.opts)
        if on_notify is not None:
            req.opts.notify_scripts = True
        sk = self.swrk.sock
        try:
            sk.send(req.SerializeToString())
            while True:
                size = len(sk.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK))
                if size == 0:
                    raise CRIUExceptionInternal(req.type, "CRIU closed its socket (it crashed or was killed)")
                resp = rpc.criu_resp()
                resp.ParseFromString(sk.recv(size))
                if resp.type != rpc.NOTIFY:
                    break
                ok = True
                if on_notify is not None and self.notify_error is None:
                    pid = resp.notify.pid if resp.notify.HasField("pid") else None
                    try:
                        on_notify(resp.notify.script, pid)
                    except BaseException as exc:  # reported after CRIU has rolled back
                        self.notify_error = exc
                        ok = False
                reply = rpc.criu_req()
                reply.type = rpc.NOTIFY
                reply.notify_success = ok
                sk.send(reply.SerializeToString())
        except (OSError, DecodeError) as exc:
            raise CRIUExceptionInternal(req.type, str(exc)) from None
        if not resp.success:
            raise pycriu.CRIUExceptionExternal(req.type, resp.type, resp.cr_errno)
        return resp


@contextlib.contextmanager
def _session(
    binary: CriuBinary,
    images_dir: str,
    work_dir: str,
    log_name: str,
    options: CriuOptions,
    stats: str,
    mount_ns_of: Optional[int] = None,
) -> Iterator[_Session]:
    """Our own ``criu swrk`` with directories, log and options set."""
    from pycriu import rpc_pb2 as rpc

    img_fd = _open_dir(images_dir)
    swrk: Optional[_Swrk] = None
    config = (PASSTHROUGH_CONFIG,) if options.passthrough else ()
    try:
        work_fd = open_work_dir(work_dir, (log_name, stats, *config))
    except BaseException:
        os.close(img_fd)
        raise
    try:
        opts = rpc.criu_opts()
        swrk = _Swrk(binary, tuple(fd for _key, fd in options.inherit_fd), mount_ns_of)
        # CRIU opens these as /proc/<our pid>/fd/N, so they need not be inherited.
        opts.images_dir_fd = img_fd
        opts.work_dir_fd = work_fd
        opts.log_file = log_name
        _apply_options(opts, options)
        if options.passthrough:
            opts.config_file = _write_passthrough(work_fd, options.passthrough)
        yield _Session(opts=opts, swrk=swrk)
    finally:
        if swrk is not None:
            swrk.close()
        os.close(img_fd)
        os.close(work_fd)


def dump(
    pid: int,
    images_dir: str,
    work_dir: str,
    *,
    options: CriuOptions = CriuOptions(),
    log_name: str = "dump.log",
    binary: Optional[CriuBinary] = None,
    on_notify: Optional[NotifyFn] = None,
    in_mount_ns: bool = False,
) -> DumpResult:
    """Dump the tree rooted at ``pid`` into ``images_dir``; CRIU's log goes to ``work_dir/log_name``.

    ``in_mount_ns``: CRIU runs in the mount namespace of ``pid`` (one that differs from ours only
    by what CRIU need not restore), so that the image holds none.

    ``on_notify`` is called at CRIU's action-script points (``post-dump``: every task is still
    frozen); if it raises, CRIU fails the dump and the exception is re-raised here.
    Raises CriuError (with the log's relevant lines) when CRIU refuses or fails; CRIU then lets
    the tree run on (or, for a failure after the freeze, resumes it), as ``criu dump`` does.
    """
    import pycriu

    log_path = os.path.join(work_dir, log_name)
    start = time.monotonic()
    _LOG.info("CRIU dump of pid %d into %s, options %s; log %s", pid, images_dir, options.to_dict(), log_path)
    with _session(
        binary or find_criu(),
        images_dir,
        work_dir,
        log_name,
        options,
        STATS_DUMP_FILE,
        pid if in_mount_ns else None,
    ) as c:
        c.opts.pid = pid
        try:
            c.call("DUMP", on_notify)
        except pycriu.CRIUException as exc:
            if c.notify_error is not None:
                raise c.notify_error from None
            raise _criu_error("dump", exc, log_path, pid=pid) from None
    result = DumpResult(log_path=log_path, wall_s=time.monotonic() - start, stats=read_dump_stats(work_dir))
    _LOG.info("CRIU dump done in %.3fs: %s", result.wall_s, result.stats)
    return result


def restore(
    images_dir: str,
    work_dir: str,
    *,
    options: CriuOptions = CriuOptions(),
    log_name: str = "restore.log",
    binary: Optional[CriuBinary] = None,
    on_notify: Optional[NotifyFn] = None,
) -> RestoreResult:
    """Restore the tree in ``images_dir``, detached (reparented to init); return its root pid."""
    import pycriu

    log_path = os.path.join(work_dir, log_name)
    start = time.monotonic()
    _LOG.info("CRIU restore from %s, options %s; log %s", images_dir, options.to_dict(), log_path)
    with _session(binary or find_criu(), images_dir, work_dir, log_name, options, STATS_RESTORE_FILE) as c:
        try:
            resp = c.call("RESTORE", on_notify)
        except pycriu.CRIUException as exc:
            if c.notify_error is not None:
                raise c.notify_error from None
            raise _criu_error("restore", exc, log_path) from None
    wall_s = time.monotonic() - start
    _LOG.info("CRIU restore done in %.3fs: root pid %d", wall_s, int(resp.restore.pid))
    return RestoreResult(
        pid=int(resp.restore.pid), log_path=log_path, wall_s=wall_s, stats=read_restore_stats(work_dir)
    )


# --------------------------------------------------------------------------------------------
# Lazy restore: `criu lazy-pages` serves the image's pages through userfaultfd
# --------------------------------------------------------------------------------------------

LAZY_FEATURE = "uffd-noncoop"
LAZY_LOG = "lazy-pages.log"
LAZY_SOCKET = "lazy-pages.socket"  # CRIU's name (uffd.c), relative to the work directory
# How long the daemon may take to say it listens (it reads pstree.img and opens a socket).
LAZY_START_S = 10.0


def lazy_pages_supported(binary: CriuBinary, timeout: float = 30) -> tuple[bool, str]:
    """Can this CRIU restore lazily on this kernel? ``criu check --feature uffd-noncoop``.

    CRIU's lazy restore needs userfaultfd with the non-cooperative events (fork, mremap,
    munmap/madvise of a lazily restored range): the kernel must have them and this process must
    be allowed to open a userfaultfd (root, or vm.unprivileged_userfaultfd). Returns (yes, CRIU's
    words).
    """
    try:
        proc = subprocess.run(
            [binary.path, "check", "--feature", LAZY_FEATURE], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"`{binary.path} check --feature {LAZY_FEATURE}` did not finish within {timeout:.0f}s"
    except OSError as exc:
        return False, f"could not run {binary.path}: {exc}"
    text = (proc.stdout + proc.stderr).strip()
    lines = [ln for ln in text.splitlines() if not any(h in ln for h in HARMLESS_ERRORS)]
    return proc.returncode == 0, "\n".join(lines[-5:]) or f"exit status {proc.returncode}"


# x86_64 and the generic syscall table (arm64) agree on these numbers.
_SYS_PIDFD_OPEN = 434
_SYS_PIDFD_GETFD = 438


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    got = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.set_inheritable(got, False)
    return got


def _uffd_fds(pid: int) -> list[int]:
    """The fd numbers of ``pid`` that are userfaultfds."""
    out = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{name}") == "anon_inode:[userfaultfd]":
                out.append(int(name))
    return sorted(out)


class LazyPagesDaemon:
    """``criu lazy-pages -D IMAGES -W WORK``: the process that fills a lazily restored tree's memory.

    Started before ``restore(..., lazy_pages)``; CRIU's restore connects to its socket
    (``WORK/lazy-pages.socket``, so both must use the same work directory) and hands it one
    userfaultfd per restored process. It then serves each page on its first touch and copies
    the rest in the background; it exits 0 by itself once every page is in, non-zero on an error.

    **Its death before that is not harmless**: when the last reference to a userfaultfd goes
    away, the kernel unregisters the ranges and a page that was never served reads as ZEROS —
    the job computes on garbage (seen here: a checksum loop printed the CRC of a zero page for
    seconds before the process crashed). ``hold_uffds`` therefore keeps a duplicate of every
    userfaultfd (pidfd_getfd): if the daemon dies, a fault on a missing page waits instead
    (killably), and the supervisor kills the tree before anything reads a zero page.
    """

    def __init__(
        self, binary: CriuBinary, images_dir: str, work_dir: str, log_level: int = DEFAULT_LOG_LEVEL
    ) -> None:
        self.log_path = os.path.join(work_dir, LAZY_LOG)
        self._held: list[int] = []
        self._held_lock = threading.Lock()  # released from the supervisor's threads: never close twice
        self._pidfd: Optional[int] = None
        # CRIU leaves its socket behind; a crashed run's would make CRIU fail, and one left in the
        # image's logs/ would make `verify` refuse the image (no sockets in an image).
        self._socket = os.path.join(work_dir, LAZY_SOCKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket)
        os.close(open_work_dir(work_dir, (LAZY_LOG,)))  # (criu lazy-pages takes -W as a path)
        r, w = os.pipe()
        try:
            argv = [binary.path, "lazy-pages", "-D", images_dir, "-W", work_dir, "-o", LAZY_LOG]
            argv += [f"-v{log_level}", "--status-fd", str(w)]
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the terminal must not kill it mid-way
                close_fds=True,
            )
        except OSError as exc:
            os.close(r)
            os.close(w)
            raise CriuError(
                f"cannot start `criu lazy-pages`: {exc}", fix=f"check the CRIU binary {binary.path}"
            ) from None
        os.close(w)
        try:
            ready = self._wait_ready(r)
        finally:
            os.close(r)
        if not ready:
            self.kill()
            excerpt = log_excerpt(self.log_path)
            raise CriuError(
                f"CRIU's lazy-pages daemon did not start: {first_error(excerpt) or 'no reason in its log'}",
                why="`criu lazy-pages` must listen before the lazy restore can begin",
                fix=f"read its log {self.log_path}; restore without --lazy meanwhile",
                details={"lazy_pages_log": self.log_path, "criu_log_excerpt": excerpt},
            )
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(self.proc.pid)

    def _wait_ready(self, r: int) -> bool:
        """CRIU writes one byte to --status-fd once it listens; EOF without it means it failed."""
        import select

        end = time.monotonic() + LAZY_START_S
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                return bool(os.read(r, 1))

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def hold_uffds(self, expected: int, timeout: float = 5.0) -> int:
        """Duplicate the daemon's userfaultfds (one per restored process, zombies have none) into
        this process; returns how many are held. Waits (bounded) until ``expected`` are there."""
        if self._pidfd is None:
            return 0
        end = time.monotonic() + timeout
        fds = _uffd_fds(self.pid)
        # All arrived once there are as many as processes, or once the daemon logged receiving
        # each (a process it already filled completely has its userfaultfd closed again).
        while (
            len(fds) < expected
            and self._received() < expected
            and time.monotonic() < end
            and self.proc.poll() is None
        ):
            time.sleep(0.01)
            fds = _uffd_fds(self.pid)
        fds = _uffd_fds(self.pid)
        with self._held_lock:
            for fd in fds:
                with contextlib.suppress(OSError):  # closed meanwhile: that process is complete
                    self._held.append(_pidfd_getfd(self._pidfd, fd))
            return len(self._held)

    def _received(self) -> int:
        """How many userfaultfds the daemon says it received (its log, debug level)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read().count("uffd: Received PID: ")
        except OSError:
            return 0

    def release_uffds(self) -> None:
        """Let go of the duplicates (after the daemon exited, or after the tree was killed)."""
        with self._held_lock:
            held, self._held = self._held, []
        for fd in held:
            with contextlib.suppress(OSError):
                os.close(fd)

    def wait(self, timeout: Optional[float]) -> Optional[int]:
        """The daemon's exit status (``Popen.returncode``), or None if it still runs at ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self.release_uffds()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._socket)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def transferred(self) -> Optional[tuple[int, int]]:
        """(pages copied, pages to copy) summed over the processes, from the daemon's log (debug level)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                found = _XFER_RE.findall(f.read())
        except OSError:
            return None
        if not found:
            return None
        return sum(int(a) for a, _ in found), sum(int(b) for _, b in found)


_XFER_RE = re.compile(r"UFFD transferred pages: \((\d+)/(\d+)\)")
