"""The image's checksums, computed while the checks and CRIU run: the tree stays stopped, and
its device memory unloaded, until they matched."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from npusnap_cli.errors import NpusnapError
from npusnap_cli.host import lazypages
from npusnap_cli.image import devchunks, digest, integrity
from npusnap_cli.image.manifest import FileEntry, Manifest
from npusnap_cli.pipelines.restore.options import RestoreCallbacks


def verify_entries(
    image: Path, entries: list[FileEntry], progress: Optional[Callable[[int], None]] = None
) -> None:
    """The checksum of each of ``entries`` (sizes were checked by ``integrity.verify``); ImageError if
    one differs."""
    digests = digest.of_files([(image / e.path, e.algo) for e in entries], progress)
    bad = [digest.mismatch(e.path, e.algo) for e, d in zip(entries, digests) if d != e.digest]
    if bad:
        raise integrity.verification_error(image, bad)


class Checksums:
    """``integrity.verify`` with checksums (or the checksums of ``entries`` only), on its own thread.

    ``on_error`` runs on that thread as soon as a file does not match (lazy restore: the job is
    already running and must be stopped at once)."""

    def __init__(
        self,
        image: Path,
        progress: Optional[Callable[[int], None]],
        entries: Optional[list[FileEntry]] = None,
        threads: int = 1,
    ) -> None:
        self.error: Optional[BaseException] = None
        self.on_error: Optional[Callable[[BaseException], None]] = None
        self.done_at: Optional[float] = None
        self._stop = threading.Event()
        opened = None
        if entries is not None:
            # Opened now: removing the image while the job is paged in changes nothing (the
            # daemon holds its own fds of the same files).
            opened = lazypages.open_files(image, entries)
        self._threads = threads
        self._thread = threading.Thread(
            target=self._run, args=(image, progress, opened), name="npusnap-verify"
        )
        self._thread.daemon = True
        self._thread.start()

    def _run(
        self,
        image: Path,
        progress: Optional[Callable[[int], None]],
        opened: Optional[list[tuple[FileEntry, int]]],
    ) -> None:
        try:
            if opened is None:
                integrity.verify(image, checksums=True, progress=progress)
            else:
                lazypages.verify_open_files(image, opened, progress, self._stop, threads=self._threads)
        except BaseException as exc:
            self.error = exc
            if self.on_error is not None:
                self.on_error(exc)
        finally:
            self.done_at = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop hashing the page files (lazy restore: the tree was killed for another reason)."""
        self._stop.set()

    def join(self) -> Optional[BaseException]:
        self._thread.join()
        return self.error


def _device_files_verified(
    manifest: Manifest, device_checks: list[Checksums | devchunks.Assembly], cb: RestoreCallbacks
) -> Callable[[], None]:
    """What runs after each agent's Restore and before its Unlock (which writes the device
    memory back): wait for the device-memory files' checksums; on a mismatch kill the tree, whose
    device memory was never loaded, and raise (exit 8)."""
    lock = threading.Lock()
    killed: list[int] = []

    def wait() -> None:
        with lock:
            error = next((e for e in (c.join() for c in device_checks) if e is not None), None)
            if error is None:
                return
            if not killed:
                killed.extend(p.pid for p in manifest.processes)
                for pid in killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if isinstance(error, NpusnapError):
                    error.message += " (the restored tree was killed before its device memory was loaded)"
                    error.details["killed_before_device_memory"] = list(killed)
            raise error

    # No note: verifying alongside is how every restore runs (its phase table says so), not a
    # warning.
    return wait


def _release_when_verified(
    manifest: Manifest, checksums: Checksums, cb: RestoreCallbacks, stays_stopped: set[int]
) -> None:
    """CRIU left the tree stopped: let it run if every checksum matched, else kill it unrun. A
    process stopped when it was dumped stays stopped, as CRIU restores it."""
    cb.phase("checksums")
    error = checksums.join()
    pids = [p.pid for p in manifest.processes]
    sig = signal.SIGKILL if error is not None else signal.SIGCONT
    for pid in pids:
        if sig == signal.SIGCONT and pid in stays_stopped:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if error is not None:
        if isinstance(error, NpusnapError):
            error.message += " (the restored tree was killed before it ran)"
            error.details["killed_unrun"] = pids
        raise error
