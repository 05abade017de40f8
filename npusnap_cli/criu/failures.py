"""What CRIU's log says when it failed: the lines worth showing, and the error the failure
becomes (its cause and fix where they are certain, a full disk as in every command)."""

from __future__ import annotations

import os
import re
from typing import Optional

from npusnap_cli.errors import NO_SPACE_ERRNOS, CriuError, ExitCode, NpusnapError, no_space
from npusnap_cli.jsontypes import JSONObject

# How many trailing log lines an error carries (besides every "Error" line).
LOG_TAIL_LINES = 20


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
    details: JSONObject = {"criu_log": log_path, "criu_log_excerpt": excerpt}
    if errno_:
        details["errno"] = errno_
    free = _free_bytes(os.path.dirname(log_path))
    # Prefixes: CRIU's log is often on the disk that filled, and its last line is cut short
    # ("page-xfer: Unable to spice data: No space left o").
    full = errno_ in NO_SPACE_ERRNOS or any(
        "No space left" in line or "Disk quota" in line for line in excerpt
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


def _known_failure(lines: list[str]) -> Optional[tuple[str, str, str, JSONObject]]:
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
