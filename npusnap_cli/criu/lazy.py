"""Lazy restore: `criu lazy-pages` serves the image's pages through userfaultfd."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from typing import Optional

from npusnap_cli.criu.binary import CriuBinary
from npusnap_cli.criu.failures import HARMLESS_ERRORS, first_error, log_excerpt
from npusnap_cli.criu.options import DEFAULT_LOG_LEVEL
from npusnap_cli.criu.session import open_work_dir
from npusnap_cli.errors import CriuError
from npusnap_cli.host import procfs

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
                    self._held.append(procfs.pidfd_getfd(self._pidfd, fd))
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
