"""Dump and restore through pycriu, with a ``criu swrk`` of npusnap's own: its work directory made
safe for CRIU's log, its notifications answered."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from npusnap_cli import paths, safefs
from npusnap_cli.criu.binary import CriuBinary, find_criu
from npusnap_cli.criu.failures import _criu_error
from npusnap_cli.criu.options import CriuOptions, _apply_options
from npusnap_cli.criu.results import (
    STATS_DUMP_FILE,
    STATS_RESTORE_FILE,
    DumpResult,
    RestoreResult,
    read_dump_stats,
    read_restore_stats,
)
from npusnap_cli.errors import PreflightError

# -v: what npusnap hands CRIU and what CRIU reports (cli.py sets the level).
_LOG = logging.getLogger("npusnap.criu")


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
