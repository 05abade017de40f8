"""The CLI side of the control socket: one connection to the agent inside one target process.

``AgentClient(pid)`` finds the agent's listening socket (``paths.find_agent_socket``), connects,
and checks with SO_PEERCRED that the process serving it *is* ``pid`` (a squatter that bound the
name first is refused) and runs as the target's uid or root. Each operation of the protocol is a
method returning the agent's result, decoded and checked as the contract's reply record of that op
(``replies.LockReply``, ...): a reply not of its op's shape is an ``AgentError`` like any
malformed answer.

Failures are typed: ``AgentError`` (or ``AgentOpError``) for socket/protocol/hook trouble,
``AgentDeviceError`` (a ``DeviceError``) carrying the ACL code and name when a CANN call failed,
``TargetError`` when the process is gone or has no CANN runtime loaded.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

from npusnap_cli import contract, paths, replies
from npusnap_cli.device import protocol
from npusnap_cli.errors import (
    NO_SPACE_ERRNOS,
    AgentError,
    BusyError,
    DeviceError,
    ExitCode,
    TargetError,
    no_space,
)
from npusnap_cli.jsontypes import JSONObject, JSONValue

R = TypeVar("R")

DEFAULT_TIMEOUT = 30.0
# Lock waits up to 60 s for the runtime's threads to park; Backup/Restore copy device memory.
# lock copies the job's device memory once the runtime is locked, unlock writes it back: both
# scale with it.
# hccl_rebuild waits for every rank of the communicator to join (HCCL_CONNECT_TIMEOUT, 120 s by default).
OP_TIMEOUTS = {
    "lock": 900.0,
    "backup": 900.0,
    "restore": 900.0,
    "rollback": 900.0,
    "unlock": 900.0,
    "hccl_rebuild": 900.0,
}
_UCRED = struct.Struct("3i")
BUSY_POLL_S = 0.05  # how often a request refused as BUSY is sent again, within busy_wait_s
# How long a command waits for another client only passing by (`ps`, `status`: milliseconds of
# work, longer on a loaded node) before it reports the agent busy.
PASSING_CLIENT_WAIT_S = 2.0

NO_AGENT_FIX = (
    "start the program with `npusnap run -- <command>`, call `npusnap_cli.agent.start()` in it, "
    "or inject an agent with `npusnap attach {pid}`"
)


class AgentOpError(AgentError):
    """The agent answered with an error that is not a device failure (hook, protocol, internal)."""

    def __init__(
        self, message: str, *, pid: int, op: str, error: replies.ErrorReply, why: str = "", fix: str = ""
    ):
        details: JSONObject = {"pid": pid, "op": op, "agent_error": error.to_json()}
        super().__init__(message, why=why, fix=fix, details=details)
        self.pid = pid
        self.op = op
        self.error_type = error.type
        self.error = error


class AgentBusyError(AgentOpError):
    """The agent serves another client (one at a time): another npusnap command is talking to
    the process. Exit 11 like every "in use for now" (docs/exit-codes.md): retry later."""

    exit_code = ExitCode.BUSY
    kind = "busy"
    refused_at_accept = False  # the agent closed the connection unread: nothing of the request ran


class AgentDeviceError(DeviceError):
    """A CANN snapshot call failed inside the target, or the op is not legal in its state."""

    def __init__(
        self, message: str, *, pid: int, op: str, error: replies.ErrorReply, why: str = "", fix: str = ""
    ):
        details: JSONObject = {"pid": pid, "op": op, "agent_error": error.to_json()}
        super().__init__(message, why=why, fix=fix, details=details)
        self.pid = pid
        self.op = op
        self.code = error.code
        self.name = error.name
        self.error = error


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that created the peer end of a unix socket."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


def _process_uid(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def pid_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


class AgentClient:
    """A connection to the agent of ``pid``. Use as a context manager or call ``close()``."""

    def __init__(
        self,
        pid: int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        socket_path: Optional[Path] = None,
        connect: bool = True,
        connect_retry_s: float = 2.0,
        busy_wait_s: float = 0.0,
        held_by_command: Callable[[], bool] = lambda: False,
    ) -> None:
        """``busy_wait_s``: how long a request refused at accept time because another client is
        connected (BUSY: nothing of it ran) is sent again on a fresh connection, for a client
        that is only passing by (`npusnap ps`, `status`, a restore asking which devices are in
        use). ``held_by_command``: true when another npusnap command works on the process now:
        then the refusal stands at once, since such a client holds the agent for the length of
        an operation."""
        self.pid = pid
        self.timeout = timeout
        self.socket_path = socket_path
        self.connect_retry_s = connect_retry_s
        self.busy_wait_s = busy_wait_s
        self.held_by_command = held_by_command
        self._sock: Optional[socket.socket] = None
        self._buf = protocol.LineBuffer()
        self._next_id = 1
        # The token of the lock this client took (or was handed: restore, thaw); sent with every
        # op that changes a lock, so that only its owner can release it (docs/internals.md).
        self.token: Optional[str] = None
        if connect:
            self.connect()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # -- connection ---------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect (retrying briefly: around a checkpoint the socket may be in flux)."""
        self.close()
        if not pid_exists(self.pid):
            raise TargetError(
                f"no process with pid {self.pid}",
                why="it exited, or it lives in another PID namespace",
                fix="check the pid with `ps -p PID` and rerun",
            )
        deadline = time.monotonic() + self.connect_retry_s
        last: Optional[OSError] = None
        while True:
            path = self.socket_path or paths.find_agent_socket(self.pid)
            if path is None:
                last = FileNotFoundError(errno.ENOENT, "no listening agent socket")
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                try:
                    sock.connect(str(path))
                except OSError as exc:
                    sock.close()
                    last = exc
                    if exc.errno in (errno.EACCES, errno.EPERM):
                        raise AgentError(
                            f"permission denied connecting to the agent of pid {self.pid} at {path}",
                            why="the socket and its directory are private to the target's user (0700/0600)",
                            fix=f"run npusnap as the user that owns pid {self.pid}, or as root",
                        ) from None
                else:
                    self._verify_peer(sock, path)
                    self._sock = sock
                    self._buf = protocol.LineBuffer()
                    return
            if time.monotonic() >= deadline or not pid_exists(self.pid):
                break
            time.sleep(0.1)
        if path is None:
            raise AgentError(
                f"process {self.pid} has no npusnap agent",
                why="no listening control socket for this pid was found in /proc/net/unix",
                fix=NO_AGENT_FIX.format(pid=self.pid),
                details={"pid": self.pid},
            )
        raise AgentError(
            f"cannot connect to the agent of pid {self.pid} at {path}: {last}",
            why="the agent is not accepting connections (restarting, or its process is frozen)",
            fix=f"retry; `npusnap status {self.pid}` shows whether the agent is alive",
            details={"pid": self.pid, "socket": str(path)},
        )

    def _verify_peer(self, sock: socket.socket, path: Path) -> None:
        try:
            peer_pid, peer_uid, _gid = peer_credentials(sock)
        except OSError as exc:
            sock.close()
            raise AgentError(f"cannot read the peer credentials of {path}: {exc}") from None
        if peer_pid != self.pid:
            sock.close()
            raise AgentError(
                f"refusing {path}: it is served by pid {peer_pid}, not by the target pid {self.pid}",
                why="another process bound the agent's socket name (stale name reuse or a squatter)",
                fix=f"check `ls -l {path}` and the owner of pid {peer_pid}; restart the target's agent",
                details={"pid": self.pid, "peer_pid": peer_pid, "socket": str(path)},
            )
        target_uid = _process_uid(self.pid)
        if peer_uid not in (target_uid, 0):
            sock.close()
            raise AgentError(
                f"refusing {path}: its server runs as uid {peer_uid}, the target as uid {target_uid}",
                why="the socket is not served with the target's credentials",
                fix=f"inspect pid {self.pid} and its agent socket before trusting it",
            )

    def abort(self) -> None:
        """Wake a request blocked on this connection from another thread (it fails at once).

        Used when the command is interrupted: shutdown() makes the blocked recv return, close()
        alone would not. The agent finishes the operation it was doing; its lease covers it."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    # -- requests -----------------------------------------------------------------------------
    def _request(
        self,
        op: str,
        args: Optional[JSONObject] = None,
        timeout: Optional[float] = None,
        fd: Optional[int] = None,
    ) -> JSONObject:
        """Send one request and return its result as the JSON object the agent sent; raise a typed
        error for a failure. ``fd`` goes with the request line (SCM_RIGHTS), for the ops that take
        a file. The methods below decode the result as their op's reply record (``_call``).

        A refusal at accept time for a passing client is retried until ``busy_wait_s``."""
        until = time.monotonic() + self.busy_wait_s
        while True:
            try:
                return self._request_once(op, args, timeout, fd)
            except AgentBusyError as exc:
                if not exc.refused_at_accept or time.monotonic() >= until or self.held_by_command():
                    raise
                time.sleep(BUSY_POLL_S)

    def _request_once(
        self,
        op: str,
        args: Optional[JSONObject],
        timeout: Optional[float],
        fd: Optional[int],
    ) -> JSONObject:
        if self._sock is None:
            self.connect()
        sock = self._sock
        assert sock is not None
        msg_id = self._next_id
        self._next_id += 1
        try:
            data = protocol.encode_request(msg_id, op, args)
        except protocol.ProtocolError as exc:
            raise AgentError(f"bad request {op!r}: {exc.message}", why="a bug in the caller") from None
        wait = timeout if timeout is not None else max(self.timeout, OP_TIMEOUTS.get(op, 0.0))
        try:
            sock.settimeout(wait)
            try:
                if fd is not None:
                    sent = socket.send_fds(sock, [data], [fd])
                    if sent < len(data):
                        sock.sendall(data[sent:])
                else:
                    sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                # The agent refused us at accept time (BUSY, PERMISSION_DENIED) and closed the
                # connection before our request arrived: its one-line refusal is still readable.
                sock.settimeout(0.5)
            line = self._read_line(sock, op)
        except socket.timeout:
            self.close()
            raise AgentError(
                f"the agent of pid {self.pid} did not answer {op!r} within {wait:g}s",
                why="the operation is still running in the target (a hung stream hangs Backup) "
                "or the agent is stuck",
                fix=f"check `npusnap status {self.pid}`; if it stays locked run `npusnap thaw {self.pid}`",
                details={"pid": self.pid, "op": op},
            ) from None
        except OSError as exc:
            self.close()
            raise AgentError(
                f"lost the connection to the agent of pid {self.pid} during {op!r}: {exc}",
                why="the target exited or was frozen/restored while we talked to it",
                fix=f"check `npusnap status {self.pid}`",
                details={"pid": self.pid, "op": op},
            ) from None
        try:
            reply_id, ok, body = protocol.decode_response(line)
            error = None if ok else replies.ErrorReply.from_json(body, f"{op} error")
        except protocol.ProtocolError as exc:
            self.close()
            raise self._malformed(op, exc) from None
        if error is not None:
            refused = reply_id == 0 and error.type == protocol.ERR_PROTOCOL
            if refused:
                self.close()  # a refusal at accept time: the agent closed the connection
            err = self._error(op, error)
            if isinstance(err, AgentBusyError):
                err.refused_at_accept = refused
            raise err
        if reply_id != msg_id:
            self.close()
            raise AgentError(f"answer id {reply_id} does not match request id {msg_id} ({op})")
        return body

    def _call(
        self,
        op: str,
        decode: Callable[[object], R],
        args: Optional[JSONObject] = None,
        timeout: Optional[float] = None,
        fd: Optional[int] = None,
    ) -> R:
        """``_request``, its result decoded once, here, as ``op``'s reply record (``decode``: its
        ``from_json``); a result not of that shape is a malformed answer."""
        result = self._request(op, args, timeout, fd)
        try:
            return decode(result)
        except protocol.ProtocolError as exc:
            self.close()
            raise self._malformed(op, exc) from None

    def _malformed(self, op: str, exc: protocol.ProtocolError) -> AgentError:
        return AgentError(
            f"the agent of pid {self.pid} sent a malformed answer to {op!r}: {exc.message}",
            why="agent and CLI are different npusnap versions, or not an npusnap agent",
            fix="use the same npusnap version for the target's agent and the CLI",
        )

    def _read_line(self, sock: socket.socket, op: str) -> bytes:
        while True:
            try:
                line = self._buf.next_line()
            except protocol.ProtocolError as exc:
                raise OSError(errno.EPROTO, exc.message) from None
            if line is not None:
                return line
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError(errno.ECONNRESET, f"agent closed the connection during {op}")
            self._buf.feed(chunk)

    def _error(self, op: str, error: replies.ErrorReply) -> Exception:
        kind = error.type
        name = error.name
        message = error.message
        pid = self.pid
        if kind == protocol.ERR_ACL:
            return AgentDeviceError(
                f"{op} failed in pid {pid}: {message}",
                pid=pid,
                op=op,
                error=error,
                why="the CANN runtime refused the snapshot call",
                fix=f"run `npusnap status {pid}` to see its state; `npusnap thaw {pid}` gets it running",
            )
        if kind == protocol.ERR_STATE and name in (protocol.ALREADY_LOCKED, protocol.NOT_OWNER):
            return locked_error(pid, op, error)
        if kind == protocol.ERR_STATE and name == contract.E_NO_ACL_RUNTIME:
            return TargetError(
                f"pid {pid} has not loaded the CANN runtime: {message}",
                why="the process has an agent but does not use the NPU (yet)",
                fix="target the process that runs on the NPU (see `npusnap status PID`)",
                details={"pid": pid, "op": op, "agent_error": error.to_json()},
            )
        if kind == protocol.ERR_STATE and name == protocol.DEVICE_BUSY:
            return AgentDeviceError(
                f"{op} failed in pid {pid}: {message}",
                pid=pid,
                op=op,
                error=error,
                why="after Lock the devices must finish their queued work before their memory is copied; "
                "a kernel or a collective still ran at the deadline (a collective waits for its other "
                "ranks, whose launches the lock holds)",
                fix="the job runs on, nothing stayed locked: dump again (a quieter moment), or stop the "
                "training loop at a step boundary in a pre_lock hook",
            )
        if kind == protocol.ERR_STATE and name == protocol.DEVICE_MEMORY_SAVE_FAILED:
            why, fix = _save_failed(error.code)
            if -error.code in NO_SPACE_ERRNOS:
                return no_space(
                    f"{op} in pid {pid} (the agent's copy of the device memory)",
                    "the image",
                    cause=message,
                    why=why,
                    fix=fix,
                    details={"pid": pid, "op": op, "agent_error": error.to_json()},
                )
            return AgentDeviceError(
                f"{op} failed in pid {pid}: {message}",
                pid=pid,
                op=op,
                error=error,
                why=why,
                fix=fix,
            )
        if kind == protocol.ERR_STATE:
            return AgentDeviceError(
                f"{op} is not possible in pid {pid} now: {message}",
                pid=pid,
                op=op,
                error=error,
                why="the process's snapshot state does not allow this operation",
                fix=f"run `npusnap status {pid}` to see its state",
            )
        if kind == protocol.ERR_HOOK:
            return AgentOpError(
                f"{op} aborted in pid {pid}: {message}",
                pid=pid,
                op=op,
                error=error,
                why=f"the application's {error.stage} hook {error.hook} raised {error.exception}",
                fix="fix the hook in the application (traceback: the agent log in `npusnap status`); retry",
            )
        if kind == protocol.ERR_PROTOCOL and name == contract.E_BUSY:
            return AgentBusyError(
                f"the agent of pid {pid} is busy: {message}",
                pid=pid,
                op=op,
                error=error,
                why="another npusnap command is talking to this process",
                fix="wait for the other npusnap command to finish and retry",
            )
        if kind == protocol.ERR_PROTOCOL and name == contract.E_PERMISSION_DENIED:
            return AgentOpError(
                f"the agent of pid {pid} refused us: {message}",
                pid=pid,
                op=op,
                error=error,
                why="only the target's own user or root may control it",
                fix=f"run npusnap as the user that owns pid {pid}, or as root",
            )
        return AgentOpError(
            f"{op} failed in the agent of pid {pid}: {name}: {message}",
            pid=pid,
            op=op,
            error=error,
            why="protocol or agent failure",
            fix="use the same npusnap version for agent and CLI; see the agent log `npusnap status` names",
        )

    # -- one method per operation -------------------------------------------------------------
    def hello(self, timeout: Optional[float] = None) -> replies.HelloReply:
        return self._call("hello", replies.HelloReply.from_json, timeout=timeout)

    def status(self, timeout: Optional[float] = None) -> replies.StatusReply:
        return self._call("status", replies.StatusReply.from_json, timeout=timeout)

    def lock(
        self,
        lease_s: Optional[float] = None,
        command: str = "unknown",
        device_memory: Optional[str] = None,
        device_memory_file: Optional[tuple[int, str]] = None,
        drain_timeout_s: Optional[float] = None,
        since: Optional[str] = None,
        check_writes: bool = False,
        concurrent: int = 0,
    ) -> replies.LockReply:
        """Lock, recording ``npusnap COMMAND`` (this pid) as the owner; keeps the token.
        ``drain_timeout_s``: how long the agent waits for the devices to finish their queued work
        after Lock (None: its default, 10 s).
        ``device_memory``: the agent's mode (preserve/app/discard; None: its default, preserve).
        ``device_memory_file``: (fd open for writing, the file's name once the image is
        published): the agent writes its copy of the device memory there, not into the
        process's memory. ``since``: the id of an earlier save of this process (its agent's
        lineage): the agent copies only the pieces written since (an incremental image);
        ``check_writes``: it copies everything all the same and still says which pieces it could
        have left out (a test of its write tracking)."""
        args: JSONObject = {"lease_s": lease_s, "owner": {"command": command, "pid": os.getpid()}}
        if since is not None:
            args["device_memory_since"] = since
        if check_writes:
            args["device_memory_check_writes"] = True
        if concurrent:
            # 1: copied after the unlock while the job runs; 2: and now as well (a test's reference)
            args["device_memory_concurrent"] = True
            if concurrent == 2:
                args["device_memory_check_concurrent"] = True
        if device_memory is not None:
            args["device_memory"] = device_memory
        if drain_timeout_s is not None:
            args["drain_timeout_s"] = drain_timeout_s
        fd = None
        if device_memory_file is not None:
            fd, args["device_memory_file"] = device_memory_file
        result = self._call("lock", replies.LockReply.from_json, args, fd=fd)
        self.token = result.token
        return result

    def _owned(self, **args: JSONValue) -> JSONObject:
        if self.token is not None:
            args["token"] = self.token
        return args

    def backup(self, lease_s: Optional[float] = None) -> replies.BackupReply:
        return self._call("backup", replies.BackupReply.from_json, self._owned(lease_s=lease_s))

    def renew(self, lease_s: Optional[float] = None) -> replies.RenewReply:
        return self._call("renew", replies.RenewReply.from_json, self._owned(lease_s=lease_s))

    def release(self) -> replies.ReleaseReply:
        return self._call("release", replies.ReleaseReply.from_json, self._owned())

    def restore(self, device_memory_file: Optional[tuple[int, str]] = None) -> replies.RestoreReply:
        """Restore; ``device_memory_file``: (fd open for reading, its name) of this process's
        device-memory file in the image, which the agent writes back after Unlock."""
        decode = replies.RestoreReply.from_json
        if device_memory_file is None:
            return self._call("restore", decode, self._owned())
        fd, path = device_memory_file
        return self._call("restore", decode, self._owned(device_memory_file=path), fd=fd)

    def hccl_root(self, key: str) -> str:
        """New root info (hex) for HCCL communicator ``key``, from the process of its rank 0."""
        return self._call("hccl_root", replies.HcclRootReply.from_json, {"key": key}).root

    def hccl_rebuild(self, key: str, root: str) -> replies.HcclRebuildReply:
        """Make communicator ``key`` anew from ``root``; returns once every rank joined."""
        return self._call("hccl_rebuild", replies.HcclRebuildReply.from_json, {"key": key, "root": root})

    def unlock(
        self, force: bool = False, device_memory_file: Optional[tuple[int, str]] = None
    ) -> replies.UnlockReply:
        """Unlock; ``device_memory_file``: (fd open for writing, its name): the concurrent copy
        the lock planned goes there, started before the Unlock (``copy_wait`` waits for it)."""
        args: JSONObject = {"force": True} if force else self._owned()
        fd = None
        if device_memory_file is not None:
            fd, args["device_memory_file"] = device_memory_file
        result = self._call("unlock", replies.UnlockReply.from_json, args, fd=fd)
        self.token = None
        return result

    def copy_wait(self, timeout_s: float) -> replies.CopyWaitReply:
        """Wait at most ``timeout_s`` for the concurrent copy of the device memory: its
        ``complete``, and the pieces ``left``, copied first for a write (``cow_pieces``) and in
        the background (``background_pieces``)."""
        return self._call(
            "copy_wait", replies.CopyWaitReply.from_json, {"timeout_s": timeout_s}, timeout=timeout_s + 30
        )

    def rollback(self, force: bool = False) -> replies.RollbackReply:
        args: JSONObject = {"force": True} if force else self._owned()
        result = self._call("rollback", replies.RollbackReply.from_json, args)
        self.token = None
        return result


def owner_text(owner: Optional[replies.Owner]) -> str:
    """``npusnap freeze (pid 123) since 2026-...`` for an agent's ``owner`` object."""
    if owner is None:
        return "another program (no npusnap owner recorded)"
    return f"`npusnap {owner.command}` (pid {owner.pid}) since {owner.since}"


def locked_error(pid: int, op: str, error: replies.ErrorReply) -> BusyError:
    """The job is locked by someone else: say by whom and since when, and how to go on."""
    owner = error.owner
    who = owner_text(owner)
    holder = owner.pid if owner is not None else None
    alive = holder is not None and pid_exists(holder)
    return BusyError(
        f"pid {pid} is locked by {who}; {op} refused, nothing was changed",
        why="every lock has an owner and only its owner may release it"
        + ("" if alive or holder is None else f" (its owner, pid {holder}, is gone: its lease will thaw it)"),
        # The same next step as `npusnap status` gives for the same lock: a gone owner will
        # finish nothing, so waiting for it is not offered first.
        fix=(
            f"wait for that command to finish (see `npusnap status {pid}`); to take the lock away: "
            f"npusnap thaw --force {pid}"
            if alive or holder is None
            else f"`npusnap thaw --force {pid}` returns the process now (or wait for its lease)"
        ),
        details={
            "pid": pid,
            "op": op,
            "owner": owner.to_json() if owner is not None else None,
            "agent_error": error.to_json(),
        },
    )


def _save_failed(code: int) -> tuple[str, str]:
    """(why, fix) of an agent that could not copy the device memory after Lock (``code``:
    -errno); the agent unlocked it again, so nothing stays locked."""
    n = -code if code < 0 else 0
    if n in (errno.ENOSPC, errno.EDQUOT):
        return (
            "the disk where the image is written filled up while the agent wrote the device memory into it",
            "free space where the image is written (or write it elsewhere) and dump again; the job runs on",
        )
    if n == errno.ENOMEM:
        return (
            "the process had no host memory left for the copy",
            "free host memory (or dump with --device-memory discard, losing it) and dump again",
        )
    why = (
        "a device call of the job did not finish in time (the agent waits for calls in flight)"
        if n == errno.ETIMEDOUT
        else "the agent could not copy the job's device memory (the device or the image file failed)"
    )
    fix = "the job runs on, nothing was locked: dump again; `npusnap status PID` shows its device memory"
    return why, fix
