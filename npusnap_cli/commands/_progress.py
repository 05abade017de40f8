"""What the commands show while a pipeline runs and after: progress bars, times, CRIU's log."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Optional, Protocol

if TYPE_CHECKING:
    from npusnap_cli.image.manifest import Timings
    from npusnap_cli.ui import Output


class _Bar(Protocol):
    """What Output.progress yields: a bar (or its stand-in in JSON mode, or in a log)."""

    def describe(self, text: str) -> None: ...

    def update(self, completed: int, total: Optional[int] = None) -> None: ...


class ProgressBars:
    """One Output.progress bar per label, opened on first use, all closed at a phase change.

    A bar must tell the truth: when its count stops moving it says what it waits for (a device
    copy of device memory reports no bytes until it is done, CRIU writes in bursts) instead of looking hung; a
    bar whose phase ended is shown complete (the phase finished its work), except one whose work
    goes on in the background (the restore's checksums, alongside CRIU), which says so; and a
    label never gets a second bar after its first was closed. Threads share it (the restore's
    host and device checksums report the same label at once): one lock, so one bar per label.
    """

    STALL_S = 3.0
    WAITS_FOR: ClassVar[dict[str, str]] = {
        "device memory copy": "the agents report their bytes only when done",
        "writing image": "CRIU is between writes",
        "checksums": "the disk",
        "verifying": "the disk",
        "exporting": "the compressor",
        "importing": "the archive",
    }
    BACKGROUND = frozenset({"verifying"})

    def __init__(self, out: Output) -> None:
        self._out = out
        self._stack = contextlib.ExitStack()
        self._bars: dict[str, _Bar] = {}
        self._state: dict[str, tuple[int, Optional[int], float, bool]] = {}  # done, total, moved, stalled
        self._closed: set[str] = set()
        self._lock = threading.Lock()

    def update(self, label: str, done: int, total: Optional[int]) -> None:
        with self._lock:
            self._update(label, done, total)

    def _update(self, label: str, done: int, total: Optional[int]) -> None:
        if label in self._closed:
            return
        bar = self._bars.get(label)
        if bar is None:
            bar = self._stack.enter_context(self._out.progress(label, total))
            self._bars[label] = bar
        if total is not None and done > total:
            total = done  # never "11.6 MiB / 10.6 MiB"
        now = time.monotonic()
        last_done, _total, moved, stalled = self._state.get(label, (-1, total, now, False))
        if done != last_done:
            moved = now
            if stalled:
                bar.describe(label)
                stalled = False
        elif not stalled and now - moved >= self.STALL_S:
            bar.describe(f"{label} (waiting: {self.WAITS_FOR.get(label, 'no progress reported')})")
            stalled = True
        self._state[label] = (done, total, moved, stalled)
        bar.update(done, total)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for label, bar in self._bars.items():
            done, total, _moved, _stalled = self._state.get(label, (0, None, 0.0, False))
            if label in self.BACKGROUND and (total is None or done < total):
                bar.describe(f"{label} (goes on in the background)")
            elif total is not None and done < total:
                bar.describe(label)
                bar.update(total, total)  # the phase is over: its work is done
            self._closed.add(label)
        self._stack.close()
        self._bars.clear()


def fmt_s(value: Optional[float]) -> str:
    return "-" if value is None else f"{float(value):.3f}s"


def dump_phase_rows(t: Timings) -> list[list[str]]:
    """A dump's phases, as `dump` shows them when it ends and `inspect --stats` from the manifest."""
    return [
        ["runtime Lock", fmt_s(t.lock_s)],
        ["drain (the job's queued device work)", fmt_s(t.drain_s)],
        ["device memory copy (npusnap, locked)", fmt_s(t.device_copy_s)],
        ["runtime Backup", fmt_s(t.backup_s)],
        ["CRIU freeze", fmt_s(t.criu_freeze_s)],
        ["CRIU memory dump", fmt_s(t.criu_memdump_s)],
        ["CRIU write", fmt_s(t.criu_memwrite_s)],
        ["CRIU total", fmt_s(t.criu_total_s)],
        ["unlock (leave-running)", fmt_s(t.unlock_s)],
    ]


def show_log(out: Output, logs: Path) -> None:
    """-vv: the end of CRIU's log on stderr (the whole log stays in the image)."""
    if out.verbose < 2 or out.json_mode:
        return
    for log in sorted(logs.glob("*.log")):
        if out.command == "restore" and log.name != "restore.log":
            continue
        try:
            lines = log.read_text(errors="replace").splitlines()[-30:]
        except OSError:
            continue
        out.debug(f"--- last {len(lines)} lines of {log}")
        for text in lines:
            out.debug(text)
