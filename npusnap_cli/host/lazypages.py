"""`npusnap restore --lazy`: the checks before it, and the supervision of the page-in after it.

CRIU's lazy restore (``criu restore --lazy-pages`` + a ``criu lazy-pages`` daemon) recreates the
tree without copying its private anonymous memory; the daemon fills each page on its first touch
through userfaultfd and copies the rest in the background, then exits by itself. The job computes
again as soon as CRIU, the device restore and the unlock are done, long before the last page is in.

The contract (docs/reference/restore.md, "--lazy"):

* before anything runs: the lazy preflight (``check_lazy``), the image's structure and sizes, and
  the checksum of every file except CRIU's page files (``criu/pages-*.img``);
* the page files are hashed while the job runs; a mismatch kills the tree (SIGKILL) at once and the
  restore fails with exit 8, saying how long the job ran on unverified pages;
* the daemon is npusnap's child; npusnap holds a duplicate of every userfaultfd it serves, so that
  if the daemon dies early a fault on a missing page waits (instead of reading zeros, which is what
  the kernel does once the last reference to a userfaultfd is gone) — and kills the tree at once:
  exit 6, never "ok";
* the restore returns only when every page is in and verified (or it failed): a returned
  ``restore --lazy`` never leaves a job whose memory is still owed. Every wait has a deadline
  (``lazy_timeout_s``), past which the tree and the daemon are killed.

Core module: never prints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Any, Optional

from npusnap_cli import criu
from npusnap_cli.errors import CriuError, ImageError, NpusnapError, PreflightError, UsageError
from npusnap_cli.image import digest, integrity, layout
from npusnap_cli.image.manifest import FileEntry, Manifest
from npusnap_cli.jsontypes import JSONObject


def check_lazy(image: Path, manifest: Manifest, binary: Any) -> None:
    """What must hold before a lazy restore may start (raises PreflightError / UsageError)."""
    ok, words = criu.lazy_pages_supported(binary)
    if not ok:
        raise PreflightError(
            "this host cannot restore lazily: CRIU's userfaultfd check failed "
            f"(`criu check --feature {criu.LAZY_FEATURE}`: {words.splitlines()[-1] if words else '?'})",
            why="CRIU's lazy pages need userfaultfd with its non-cooperative events (kernel 4.11+, "
            "CONFIG_USERFAULTFD) and the right to open one (root, or vm.unprivileged_userfaultfd=1)",
            fix="restore without --lazy (nothing was touched)",
            details={"criu_check": words},
        )
    pages, _rest = split_page_files(manifest)
    if not pages:
        raise UsageError(
            f"the image {image} has no page files (criu/pages-*.img): there is nothing to page in lazily",
            fix="restore without --lazy",
        )
    for entry in pages:
        path = image / entry.path
        # npusnap stores CRIU's page files as CRIU wrote them (never compressed or encrypted in an
        # image directory; an export archive is imported into one first): the daemon reads them
        # in place. The size was checked against the manifest already; this is the format.
        if not path.is_file():
            raise ImageError(f"{entry.path} is missing", fix="do not use this image; dump again")


def split_page_files(manifest: Manifest) -> tuple[list[FileEntry], list[FileEntry]]:
    """(CRIU's page files ``criu/pages-*.img``, every other file of the manifest)."""
    prefix = f"{layout.CRIU_SUBDIR}/pages-"
    pages = [f for f in manifest.files if f.path.startswith(prefix) and f.path.endswith(".img")]
    return pages, [f for f in manifest.files if f not in pages]


def open_files(image: Path, entries: list[FileEntry]) -> list[tuple[FileEntry, int]]:
    """Open each file (O_NOFOLLOW, regular files only) for ``verify_open_files``."""
    import stat

    opened: list[tuple[FileEntry, int]] = []
    try:
        for e in entries:
            fd = os.open(image / e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            opened.append((e, fd))
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ImageError(f"refusing {e.path}: not a regular file", fix=_DUMP_AGAIN)
    except OSError as exc:
        for _e, fd in opened:
            os.close(fd)
        raise ImageError(f"cannot open {exc.filename}: {exc.strerror}", fix=_DUMP_AGAIN) from None
    except ImageError:
        for _e, fd in opened:
            os.close(fd)
        raise
    return opened


_CHUNK = 4 << 20
_MAPPED_ROUND = 64 << 20  # how much of a mapped file is hashed between two looks at ``stop``
_DUMP_AGAIN = "do not use this image; dump again"


def verify_open_files(
    image: Path,
    opened: list[tuple[FileEntry, int]],
    progress: Any = None,
    stop: Any = None,
    threads: int = 1,
) -> None:
    """Checksum of each opened file against the manifest (closes the fds); ImageError on a
    mismatch. ``stop`` (a threading.Event): give up early, the restore failed anyway. ``threads``:
    BLAKE3 hashes each file on that many threads. A file only this user can write is hashed from
    a mapping of it (digest.mappable), the others through reads."""
    bad: list[str] = []

    def stopped() -> None:
        if stop is not None and stop.is_set():
            raise ImageError("the files' verification was stopped: the restore failed")

    try:
        for e, fd in opened:
            h = digest.new(e.algo, threads)
            st = os.fstat(fd)
            size, offset = st.st_size, 0
            if size == e.size and digest.mappable(st):
                while offset < size:
                    stopped()
                    end = min(size, offset + _MAPPED_ROUND)
                    digest.update_mapped(h, fd, offset, end)  # releases the GIL
                    if progress is not None:
                        progress(end - offset)
                    offset = end
            else:
                while True:
                    stopped()
                    data = os.pread(fd, _CHUNK, offset)
                    if not data:
                        break
                    h.update(data)  # releases the GIL
                    offset += len(data)
                    if progress is not None:
                        progress(len(data))
            if offset != e.size or h.hexdigest() != e.digest:
                bad.append(digest.mismatch(e.path, e.algo))
    finally:
        for _e, fd in opened:
            os.close(fd)
    if bad:
        raise integrity.verification_error(image, bad)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# Test hook (unset in normal use): "hang" stops the daemon (SIGSTOP) before it serves anything and
# never continues it — a hung daemon, with pages surely still owed (a test kills it, or lets the
# deadline pass). Not continued: CRIU's daemon fails on the EINTR that SIGCONT gives its epoll_wait.
TEST_HOOK_ENV = "NPUSNAP_TEST_LAZY"


@dataclass(frozen=True)
class LazyReport:
    """How a lazy page-in went: the restore outcome's ``lazy`` field."""

    daemon_pid: int
    daemon_log: str
    daemon_status: Optional[int]  # the lazy-pages daemon's exit status (None: still running)
    uffds_held: int
    pages_copied: Optional[int]  # None: the daemon's log did not say
    pages_total: Optional[int]
    pages_verified: str
    complete_s: float
    killed: Optional[str]  # why the tree was killed

    def to_json(self) -> JSONObject:
        return {
            "daemon_pid": self.daemon_pid,
            "daemon_log": self.daemon_log,
            "daemon_status": self.daemon_status,
            "uffds_held": self.uffds_held,
            "pages_copied": self.pages_copied,
            "pages_total": self.pages_total,
            "pages_verified": self.pages_verified,
            "complete_s": self.complete_s,
            "killed": self.killed,
        }


class LazyPhase:
    """Watches a lazily restored tree until its memory is complete and verified (see module doc).

    ``checksums``: restore's _Checksums of the page files (None with --no-verify).
    """

    def __init__(
        self, daemon: Any, pids: list[int], checksums: Any, timeout_s: float, start: float, log: str
    ) -> None:
        self.daemon = daemon
        self.pids = pids
        self.checksums = checksums
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.start = start
        self.criu_log = log
        self.held = 0
        self.released_at: Optional[float] = None
        self.killed: Optional[str] = None  # why the tree was killed
        self.killed_at: Optional[float] = None
        self.daemon_status: Optional[int] = None
        self._lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None
        self._timer: Optional[threading.Timer] = None
        self._finished = False
        self._test_hang = os.environ.get(TEST_HOOK_ENV) == "hang"

    def on_notify(self, script: str, _pid: Optional[int]) -> None:
        """CRIU's restore notifications; only the test hook uses them (post-restore comes before
        CRIU tells the daemon that the restore finished, i.e. before any background copy)."""
        if script == "post-restore" and self._test_hang:
            os.kill(self.daemon.pid, signal.SIGSTOP)

    # -- while the tree is still stopped -------------------------------------------------------

    def guard(self) -> None:
        """Hold the daemon's userfaultfds and start watching it; call before the tree runs."""
        self.held = self.daemon.hold_uffds(expected=len(self.pids))
        self._watcher = threading.Thread(target=self._watch_daemon, name="npusnap-lazy-pages", daemon=True)
        self._watcher.start()
        # The deadline holds even while the device restore waits on a job stuck on a missing page.
        self._timer = threading.Timer(max(0.0, self.deadline - time.monotonic()), self._deadline_passed)
        self._timer.daemon = True
        self._timer.start()
        if self.checksums is not None:
            self.checksums.on_error = self._bad_pages
            if self.checksums.error is not None:
                self._bad_pages(self.checksums.error)

    def release(self, stays_stopped: AbstractSet[int] = frozenset()) -> None:
        """Let the stopped tree run (SIGCONT), unless it was killed meanwhile; those stopped when
        they were dumped stay stopped."""
        with self._lock:
            if self.killed is None:
                for pid in self.pids:
                    if pid in stays_stopped:
                        continue
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                self.released_at = time.monotonic()

    # -- events (on their own threads) ------------------------------------------------------------

    def _kill_tree(self, why: str) -> None:
        with self._lock:
            if self.killed is not None:
                return
            _kill(self.pids)  # first: the held userfaultfds keep unserved pages from reading as zeros
            self.killed = why
            self.killed_at = time.monotonic()
        if self.checksums is not None and why != "checksum":
            self.checksums.cancel()
        self.daemon.kill()
        self.daemon.release_uffds()

    def _watch_daemon(self) -> None:
        status = self.daemon.wait(None)
        if status != 0:
            self._kill_tree("daemon")  # before daemon_status is set: finish() must not see success
        self.daemon_status = status
        if status == 0:
            # Every page is in: the duplicates must go now (a later fault on a range the job
            # gave back with madvise would otherwise wait for a reader that no longer exists).
            self.daemon.release_uffds()

    def _deadline_passed(self) -> None:
        if not self._finished:
            self._kill_tree("timeout")

    def _bad_pages(self, _exc: BaseException) -> None:
        self._kill_tree("checksum")

    # -- the end -----------------------------------------------------------------------------

    def finish(self) -> LazyReport:
        """Wait (until the deadline) for every page and every page file's checksum; raise if the
        tree had to be killed; return the report for the outcome's ``lazy`` field."""
        while True:
            daemon_done = self.daemon_status is not None
            sums_done = self.checksums is None or self.checksums.done()
            if self.killed is not None or (daemon_done and sums_done):
                break
            if time.monotonic() > self.deadline:
                self._kill_tree("timeout")
                break
            time.sleep(0.02)
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.join(timeout=15)
        self.daemon.close()
        if self.killed is not None:
            raise self._failure()
        return self.report()

    def abort(self) -> None:
        """The restore failed before the tree ran: stop the daemon (CRIU already killed the tree)."""
        self.daemon.close()

    def report(self) -> LazyReport:
        done = time.monotonic()
        xfer = self.daemon.transferred()
        return LazyReport(
            daemon_pid=self.daemon.pid,
            daemon_log=self.daemon.log_path,
            daemon_status=self.daemon_status,
            uffds_held=self.held,
            pages_copied=xfer[0] if xfer else None,
            pages_total=xfer[1] if xfer else None,
            pages_verified="no (--no-verify)" if self.checksums is None else "while the job ran",
            complete_s=round(done - self.start, 6),
            killed=self.killed,
        )

    def _ran_for(self) -> str:
        if self.released_at is None or self.killed_at is None:
            return "the job had not run yet"
        return f"the job had run for {self.killed_at - self.released_at:.2f} s"

    def _failure(self) -> NpusnapError:
        details: JSONObject = {
            "killed_pids": self.pids,
            "lazy": self.report().to_json(),
            "criu_restore_log": self.criu_log,
        }
        if self.killed == "checksum":
            err = self.checksums.error
            if isinstance(err, NpusnapError):
                err.message += (
                    f" — found while the job was being paged in lazily: {self._ran_for()} on pages not "
                    "yet verified and was killed (SIGKILL)"
                )
                err.why = (err.why + "; " if err.why else "") + (
                    "with --lazy the page files are verified while the job already runs: whatever it "
                    "did in that time (files written, messages sent) came from unverified memory"
                )
                err.details.update(details)
                return err
            return ImageError(f"the page files could not be verified: {err}", details=details)
        excerpt = criu.log_excerpt(self.daemon.log_path)
        details["criu_log_excerpt"] = excerpt
        if self.killed == "timeout":
            return CriuError(
                f"the lazy page-in did not finish within {self.timeout_s:.0f} s: the restored tree and "
                f"CRIU's lazy-pages daemon were killed ({self._ran_for()})",
                why="the daemon (or the page files' checksums) made too little progress: a very slow "
                "disk, or a daemon that stopped serving",
                fix=f"read {self.daemon.log_path}; restore again with a larger --lazy-timeout, or "
                "without --lazy",
                details=details,
            )
        status = self.daemon_status
        how = f"killed by signal {-status}" if status is not None and status < 0 else f"exit status {status}"
        reason = criu.first_error(excerpt)
        return CriuError(
            f"CRIU's lazy-pages daemon (pid {self.daemon.pid}) ended before every page was in ({how}"
            + (f": {reason}" if reason else "")
            + f"); the restored tree was killed ({self._ran_for()})",
            why="a lazily restored job cannot run on without the daemon: its pages that were not "
            "served yet are gone (the kernel would hand it zero-filled pages)",
            fix=f"read {self.daemon.log_path}; the image is unchanged: restore it again (without --lazy "
            "if this repeats)",
            details=details,
        )
