"""Progress bars tell the truth: totals never below the count, a stalled count says what it waits
for, a finished phase's bar is complete, and a label never gets a second bar."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import pytest

from npusnap_cli.commands import _progress as dump_cmd


class FakeBar:
    def __init__(self, label: str, total: Optional[int]) -> None:
        self.label = label
        self.descriptions = [label]
        self.updates: list[tuple[int, Optional[int]]] = []

    def update(self, done: int, total: Optional[int] = None) -> None:
        self.updates.append((done, total))

    def describe(self, text: str) -> None:
        self.descriptions.append(text)


class FakeOut:
    def __init__(self) -> None:
        self.bars: list[FakeBar] = []

    @contextlib.contextmanager
    def progress(self, label: str, total: Optional[int]) -> Iterator[Any]:
        bar = FakeBar(label, total)
        self.bars.append(bar)
        yield bar


def test_total_is_never_below_the_count() -> None:
    out = FakeOut()
    bars = dump_cmd.ProgressBars(out)
    bars.update("checksums", 11, 10)
    assert out.bars[0].updates[-1] == (11, 11)


def test_a_stalled_bar_says_what_it_waits_for_and_ends_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    out = FakeOut()
    bars = dump_cmd.ProgressBars(out)
    bars.update("device memory copy", 8, 2048)
    clock[0] += dump_cmd.ProgressBars.STALL_S + 1
    bars.update("device memory copy", 8, 2048)
    bar = out.bars[0]
    assert "waiting: the agents report" in bar.descriptions[-1]
    bars.update("device memory copy", 100, 2048)  # it moves again: the plain label
    assert bar.descriptions[-1] == "device memory copy"
    bars.close()  # the phase ended: its work is done
    assert bar.updates[-1] == (2048, 2048)


def test_background_work_says_so_and_gets_no_second_bar() -> None:
    out = FakeOut()
    bars = dump_cmd.ProgressBars(out)
    bars.update("verifying", 1, 12)
    bars.close()  # a phase change while the checksums go on
    assert out.bars[0].descriptions[-1] == "verifying (goes on in the background)"
    bars.update("verifying", 5, 12)
    bars.update("criu restore", 1, 2)
    assert [b.label for b in out.bars] == ["verifying", "criu restore"]


def test_two_threads_reporting_one_label_share_one_bar() -> None:
    """The restore's host and device checksums report "verifying" from two threads at once."""
    import threading
    import time

    class SlowOut(FakeOut):
        @contextlib.contextmanager
        def progress(self, label: str, total: Optional[int]) -> Iterator[Any]:
            time.sleep(0.05)  # widen the window in which a second bar could be opened
            with super().progress(label, total) as bar:
                yield bar

    out = SlowOut()
    bars = dump_cmd.ProgressBars(out)
    threads = [threading.Thread(target=bars.update, args=("verifying", n, 12)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out.bars) == 1
