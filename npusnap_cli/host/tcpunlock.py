"""Give a rolled-back tree its TCP connections back after a ``--tcp-established`` CRIU dump.

npusnap asks CRIU to leave a dumped tree *stopped* (it is killed only once the image is
published). For that final state CRIU keeps the tree's established TCP connections locked: each
socket stays in TCP repair mode, and CRIU's nftables table (``inet CRIU-<run id>``, a set
``conns4``/``conns6`` of 4-tuples dropped on input and output) stays in the namespace. That is
right when the tree is then killed or restored, but if the dump is rolled back (a later step
failed: another rank of a job, the publish) the resumed process would find every connection
dead (``EPERM`` on send). ``release(pids)`` undoes it, before the tree is resumed:

* every established TCP socket of the tree is taken out of repair mode (``pidfd_getfd`` to get
  it, then ``setsockopt(TCP_REPAIR, TCP_REPAIR_OFF)``, as CRIU's own ``libsoccr_resume``);
* its 4-tuples are deleted from CRIU's tables in the caller's network namespace (the tree's:
  the caller is the thread that ran CRIU there), and a table left with no element is deleted.

Only CRIU's nftables lock is undone (the default where CRIU has libnftables); with
``--network-lock iptables`` the iptables rules stay (reported).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
from pathlib import Path
from typing import Optional

from npusnap_cli import criuimages

TCP_REPAIR = 19
TCP_REPAIR_OFF = 0
_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 (the generic syscall table)
_ESTABLISHED = "01"


def _hex_addr(text: str) -> tuple[str, int]:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:
        # /proc/net/tcp6: four 32-bit words, each in host (little-endian) order.
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[len("::ffff:") :]
    return ip, int(port, 16)


def established(pid: int) -> dict[int, tuple[str, int, str, int]]:
    """inode -> (local ip, port, remote ip, port) of the established TCP sockets in pid's netns."""
    found: dict[int, tuple[str, int, str, int]] = {}
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{name}", encoding="ascii") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) > 9 and fields[3] == _ESTABLISHED:
                    lip, lport = _hex_addr(fields[1])
                    rip, rport = _hex_addr(fields[2])
                    found[int(fields[9])] = (lip, lport, rip, rport)
    return found


def _socket_fds(pid: int) -> dict[int, int]:
    """fd -> socket inode for ``pid``."""
    fds: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    fds[int(fd)] = int(target[len("socket:[") : -1])
    return fds


Conn = tuple[str, int, str, int]


def tree_connections(pids: list[int]) -> dict[int, tuple[int, list[Conn]]]:
    """pid -> (its network namespace's inode, the established TCP connections (local ip, port,
    remote ip, port) its descriptors hold). Each process's own namespace is read (a rank in a
    container has its own)."""
    tables: dict[int, dict[int, Conn]] = {}  # netns inode -> socket inode -> 4-tuple
    held: dict[int, tuple[int, list[Conn]]] = {}
    for pid in pids:
        inodes = set(_socket_fds(pid).values())
        if not inodes:
            continue
        try:
            ns = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            continue
        if ns not in tables:
            tables[ns] = established(pid)
        conns = [tables[ns][i] for i in sorted(inodes) if i in tables[ns]]
        if conns:
            held[pid] = (ns, conns)
    return held


def outside_peers(held: dict[int, tuple[int, list[Conn]]]) -> list[tuple[int, Conn]]:
    """(pid, connection) of each connection in ``held`` whose other end is not in ``held`` (in
    the same network namespace): a peer outside the tree, which CRIU does not dump."""
    ends = {(ns, c) for ns, conns in held.values() for c in conns}
    return [
        (pid, c)
        for pid, (ns, conns) in sorted(held.items())
        for c in conns
        if (ns, (c[2], c[3], c[0], c[1])) not in ends
    ]


def _repair_off(pid: int, fds: list[int]) -> list[str]:
    libc = ctypes.CDLL(None, use_errno=True)
    problems: list[str] = []
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        return [f"pid {pid}: pidfd_open: {exc.strerror}"]
    try:
        for fd in fds:
            got = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
            if got < 0:
                problems.append(f"pid {pid} fd {fd}: pidfd_getfd: {os.strerror(ctypes.get_errno())}")
                continue
            try:
                sk = socket.socket(fileno=got)
                try:
                    sk.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF)
                finally:
                    sk.detach()
            except OSError as exc:
                problems.append(f"pid {pid} fd {fd}: TCP_REPAIR off: {exc.strerror}")
            finally:
                os.close(got)
    finally:
        os.close(pidfd)
    return problems


class _Nft:
    """libnftables through ctypes (the library CRIU itself uses; no `nft` binary needed)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnftables.so.1")
        self.lib.nft_ctx_new.restype = ctypes.c_void_p
        self.lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        self.lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        self.lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        self.lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        self.lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self.lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        self.lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        self.lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        self.lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]

    def run(self, cmd: str) -> tuple[int, str, str]:
        ctx = self.lib.nft_ctx_new(0)
        if not ctx:
            return -1, "", "nft_ctx_new failed"
        try:
            self.lib.nft_ctx_buffer_output(ctx)
            self.lib.nft_ctx_buffer_error(ctx)
            rc = int(self.lib.nft_run_cmd_from_buffer(ctx, cmd.encode()))
            out = (self.lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            err = (self.lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
            return rc, out, err
        finally:
            self.lib.nft_ctx_free(ctx)


_ELEMENT = re.compile(r"([0-9a-fA-F:.]+) \. (\d+) \. ([0-9a-fA-F:.]+) \. (\d+)")


def _unlock_nftables(conns: set[tuple[str, int, str, int]]) -> list[str]:
    try:
        nft = _Nft()
    except OSError as exc:
        return [f"libnftables not available ({exc}): CRIU's network lock could not be removed"]
    rc, out, err = nft.run("list tables")
    if rc != 0:
        return [f"nft list tables: {err.strip()}"]
    problems: list[str] = []
    wanted = conns | {(b, bp, a, ap) for a, ap, b, bp in conns}
    for table in re.findall(r"^table inet (CRIU-\S+)$", out, flags=re.M):
        rc, text, err = nft.run(f"list table inet {table}")
        if rc != 0:
            problems.append(f"nft list table {table}: {err.strip()}")
            continue
        ours, others = [], 0
        for fam, body in re.findall(r"set conns([46]) \{.*?elements = \{(.*?)\}", text, flags=re.S):
            for a, ap, b, bp in _ELEMENT.findall(body):
                key = (a, int(ap), b, int(bp))
                if key in wanted:
                    ours.append((fam, key))
                else:
                    others += 1
        if not ours:
            continue
        if others == 0:
            rc, _o, err = nft.run(f"delete table inet {table}")
        else:
            elems: dict[str, list[str]] = {}
            for fam, (a, ap, b, bp) in ours:
                elems.setdefault(fam, []).append(f"{a} . {ap} . {b} . {bp}")
            rc = 0
            for fam, items in elems.items():
                r, _o, err = nft.run(f"delete element inet {table} conns{fam} {{ {', '.join(items)} }}")
                rc = rc or r
        if rc != 0:
            problems.append(f"nft: removing the lock of table {table}: {err.strip()}")
    return problems


def release(pids: list[int], network_lock: Optional[str] = None) -> list[str]:
    """Take the established TCP sockets of ``pids`` out of CRIU's lock; problems as text."""
    problems: list[str] = []
    conns: set[tuple[str, int, str, int]] = set()
    for pid in pids:
        est = established(pid)
        mine = {fd: ino for fd, ino in _socket_fds(pid).items() if ino in est}
        if not mine:
            continue
        conns |= {est[ino] for ino in mine.values()}
        problems += _repair_off(pid, sorted(mine))
    if conns:
        if network_lock in (None, "nftables"):
            problems += _unlock_nftables(conns)
        elif network_lock == "iptables":
            problems.append("CRIU's iptables rules for the connections were left in place")
    return problems


# --------------------------------------------------------------------------------------------
# Restore of both ends at once: no RST while the other end is not restored yet
# --------------------------------------------------------------------------------------------


def image_connections(criu_dir: str) -> list[tuple[str, int, str, int]]:
    """(local ip, port, remote ip, port) of the established TCP sockets in a CRIU image."""
    try:
        found = criuimages.tcp_connections(Path(criu_dir))
    except (OSError, criuimages.Undecodable, ValueError):
        return []  # a missing or undecodable files.img: nothing to protect
    return [(c.src, c.src_port, c.dst, c.dst_port) for c in found]


class ResetHold:
    """In the caller's network namespace: drop the TCP resets this namespace would send on
    ``conns`` while their sockets are not restored yet.

    When two ends of a connection are restored by two CRIUs (two ranks, maybe two nodes), the
    first restored end sends a window probe as its socket leaves repair mode; if the other end's
    socket does not exist yet, its kernel answers with a reset and the connection is lost. With
    the resets dropped, the probe simply goes unanswered and TCP retries once both are there.
    """

    def __init__(self, conns: list[tuple[str, int, str, int]]) -> None:
        self.table = f"npusnap-hold-{os.getpid()}-{id(self) & 0xFFFF:x}"
        self.active = False
        if not conns:
            return
        nft = _Nft()
        cmds = [
            f"add table inet {self.table}",
            f"add chain inet {self.table} output {{ type filter hook output priority 0; policy accept; }}",
        ]
        for lip, lport, rip, rport in conns:
            v = "ip6" if ":" in lip else "ip"
            cmds.append(
                f"add rule inet {self.table} output {v} saddr {lip} tcp sport {lport} {v} daddr {rip} "
                f"tcp dport {rport} tcp flags & rst == rst drop"
            )
        for cmd in cmds:
            rc, _out, err = nft.run(cmd)
            if rc != 0:
                nft.run(f"delete table inet {self.table}")
                raise OSError(f"nft {cmd!r}: {err.strip()}")
        self.active = True

    def release(self) -> None:
        if self.active:
            _Nft().run(f"delete table inet {self.table}")
            self.active = False
