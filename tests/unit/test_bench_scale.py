"""The fits that the benchmark report states growth with (bench/scale.py)."""

from __future__ import annotations

import pytest

from bench.common import MiB, Samples
from bench.measure import Plan
from bench.scale import (
    fit_line,
    fit_quadratic,
    floor_note,
    growth,
    page_cache_note,
    page_cache_table,
    scale_section,
    size_points,
)

GiB = 1 << 30


def test_a_line_is_fitted_exactly() -> None:
    xs = [1.0, 2.0, 4.0, 8.0]
    line = fit_line(xs, [0.5 + 0.25 * x for x in xs])
    assert line is not None
    assert line.intercept == pytest.approx(0.5) and line.slope == pytest.approx(0.25)
    assert fit_line([1.0, 1.0], [2.0, 3.0]) is None  # one distinct x: no slope


def test_quadratic_fit_finds_the_square_term() -> None:
    xs = [1.0, 2.0, 3.0, 5.0]
    a, b, c = fit_quadratic(xs, [1 + 2 * x + 3 * x * x for x in xs]) or (0.0, 0.0, 0.0)
    assert (a, b, c) == (pytest.approx(1), pytest.approx(2), pytest.approx(3))
    assert fit_quadratic([1.0, 2.0], [1.0, 2.0]) is None


def test_growth_states_the_rate_and_flags_a_super_linear_term() -> None:
    xs = [g * GiB for g in (0.0625, 0.25, 1.0, 4.0, 8.0)]
    rate, intercept, verdict = growth(xs, [0.3 + x / 2e9 for x in xs])  # 2 GB/s + 0.3 s
    assert rate == "2.00" and intercept == "0.30" and verdict.startswith("linear")
    square = [0.3 + x / 2e9 + (x / GiB) ** 2 * 0.5 for x in xs]  # 32 s of x² at 8 GiB
    assert "super-linear" in growth(xs, square)[2]
    assert growth(xs[:1], [1.0])[2] == "needs two sizes"


def _plan(sizes: list[int]) -> Plan:
    return Plan(sizes=sizes, reps=1, host_mib=64, interval=0.05, disk_mib=1024, startup_runs=1)


def _dump_samples(sizes: list[int], throttled_from: int) -> Samples:
    """A dump at memory speed (4 GB/s) below the dirty limit, at the disk's 1 GB/s past it."""
    data = Samples()
    data.add(0, "disk_mib_s", 1000.0)
    for sz in sizes:
        image = sz * MiB
        fast = min(sz, throttled_from) * MiB
        data.add(sz, "dump_image_bytes", image)
        data.add(sz, "dump_wall", 0.2 + fast / 4e9 + (image - fast) / (1000 * MiB))
        data.add(sz, "dump_peak_dirty_bytes", min(image, 3 * GiB))
        data.add(sz, "dump_dirty_freerun_bytes", 2.5 * GiB)
        data.add(sz, "dump_disk_read_bytes", 0)
        data.flag(sz, "dump_dirty_throttled", sz > throttled_from)
    return data


def test_a_super_linear_dump_past_the_dirty_limit_is_explained_by_the_page_cache() -> None:
    sizes = [64, 256, 1024, 4096, 8192]
    plan, data = _plan(sizes), _dump_samples(sizes, throttled_from=4096)
    assert "super-linear" in growth(*size_points(plan, data, "dump_wall"))[2]
    note = page_cache_note(plan, data, "dump_wall", "npusnap", "dump")
    assert "piecewise" in note and "at 8192 MiB" in note, note
    assert "from 4096 to 8192 MiB it grew by 1000 MiB of image a second" in note, note
    assert "the disk's sequential write: 1000 MiB/s" in note
    assert "Up to 4096 MiB: linear" in note  # the sizes below the limit fit a line
    table = "\n".join(page_cache_table(plan, data))
    assert "| 8192 MiB | – / – | 3.0 / 2.5 (throttled 1/1) |" in table, table
    assert "| 1024 MiB | – / – | 1.0 / 2.5 |" in table


def test_a_super_linear_figure_the_page_cache_does_not_explain_is_called_a_bug() -> None:
    sizes = [64, 256, 1024, 4096, 8192]
    plan, data = _plan(sizes), _dump_samples(sizes, throttled_from=1 << 20)  # never throttled
    note = page_cache_note(plan, data, "dump_wall", "npusnap", "dump")
    assert "not explained by the page cache" in note and "a bug to find" in note
    # A restore that read its image from the disk at the largest size only.
    for sz in sizes:
        data.add(sz, "restore_first_tick", 0.1 + sz * MiB / 2e9 + (sz == 8192) * 2.0)
        data.add(sz, "restore_disk_read_bytes", (sz == 8192) * 1300 * MiB)
        data.add(sz, "restore_peak_dirty_bytes", 0)
    note = page_cache_note(plan, data, "restore_first_tick", "npusnap", "restore")
    assert "at 8192 MiB the restore read up to 1300 MiB of the image from the disk" in note, note


def test_a_dump_that_ran_short_of_free_memory_is_explained_by_the_reclaim() -> None:
    sizes = [64, 256, 1024, 4096, 8192]
    plan, data = _plan(sizes), _dump_samples(sizes, throttled_from=1 << 20)  # never throttled
    for sz in sizes:
        data.add(sz, "dump_reclaimed_bytes", (sz == 8192) * 2048 * MiB)
        data.by_size[sz]["dump_wall"] = [0.2 + sz * MiB / 4e9 + (sz == 8192) * 6.0]
    assert "super-linear" in growth(*size_points(plan, data, "dump_wall"))[2]
    note = page_cache_note(plan, data, "dump_wall", "raw CRIU", "dump")
    assert "at 8192 MiB the kernel reclaimed up to 2048 MiB of memory" in note, note
    assert "dirty limit" not in note and "Up to 4096 MiB: linear" in note


def test_a_dump_that_ran_partly_unwarmed_is_explained_by_cold_memory() -> None:
    sizes = [64, 256, 1024, 4096, 8192]
    plan, data = _plan(sizes), _dump_samples(sizes, throttled_from=1 << 20)  # never throttled
    for sz in sizes:
        # Warmed: twice the image, except at 8192 MiB, where only 6 GiB could be.
        data.add(sz, "raw_dump_warmed_bytes", 6 * GiB if sz == 8192 else 2 * sz * MiB)
        data.add(sz, "raw_image_bytes", sz * MiB)
        data.add(sz, "raw_dump_wall", 0.1 + sz * MiB / 2e9 + (sz == 8192) * 6.0)
        data.add(sz, "raw_dump_peak_dirty_bytes", GiB)
        data.add(sz, "raw_dump_dirty_freerun_bytes", 2 * GiB)
    note = page_cache_note(plan, data, "raw_dump_wall", "raw CRIU", "dump")
    assert "piecewise" in note and "at 8192 MiB only 6.0 GiB could be warmed" in note, note
    assert "against about 8.0 GiB it allocates" in note and "Up to 4096 MiB: linear" in note
    # Fully warmed, the same growth is a bug to find.
    for sz in sizes:
        data.by_size[sz]["raw_dump_warmed_bytes"] = [2 * sz * MiB]
    assert "a bug to find" in page_cache_note(plan, data, "raw_dump_wall", "raw CRIU", "dump")


def test_the_time_waited_on_io_is_shown_and_explains_nothing_by_itself() -> None:
    sizes = [64, 256, 1024, 4096, 8192]
    plan, data = _plan(sizes), _dump_samples(sizes, throttled_from=1 << 20)  # never past the limit
    for sz in sizes:
        extra = (sz == 8192) * 2.0
        data.by_size[sz]["dump_wall"] = [0.2 + sz * MiB / 4e9 + extra]
        data.add(sz, "dump_io_stall_s", 0.01 + extra)
    note = page_cache_note(plan, data, "dump_wall", "raw CRIU", "dump")
    assert "a bug to find" in note, note  # a dump's fsync waits on I/O too: no cause by itself
    assert "| 8192 MiB | – / – | 3.0 / 2.5 | – | 2.01 / – |" in "\n".join(page_cache_table(plan, data))


def _floor_samples(sizes: list[int], program_square: float) -> tuple[Plan, Samples]:
    """The machine's write() of the same bytes: memory speed up to 2 GiB, then the disk's 1 GB/s
    (super-linear in a quadratic fit). Raw CRIU's frozen time: 0.05 s + 1.5 × the machine's
    (its path per byte slower than one plain writer's) + ``program_square`` s per GiB² of its own."""
    plan, data = _plan(sizes), Samples()
    for sz in sizes:
        b = sz * MiB
        fast = min(b, 2 * GiB)
        write = fast / 4e9 + (b - fast) / 1e9
        data.add(sz, "floor_write_s", write)
        data.add(sz, "floor_durable_s", write + fast / 1e9)
        data.add(sz, "raw_criu_frozen_s", 0.05 + 1.5 * write + program_square * (b / GiB) ** 2)
        data.add(sz, "raw_image_bytes", b)
        data.add(sz, "raw_dump_peak_dirty_bytes", min(b, 2 * GiB))
        data.add(sz, "raw_dump_dirty_freerun_bytes", 3 * GiB)
    return plan, data


def test_a_figure_linear_in_the_machines_own_write_grows_as_the_machine_does() -> None:
    sizes = [64, 256, 1024, 4096, 8192]
    plan, data = _floor_samples(sizes, program_square=0.0)
    assert "super-linear" in growth(*size_points(plan, data, "raw_criu_frozen_s"))[2]
    note = floor_note(plan, data, "raw_criu_frozen_s", "raw CRIU", "frozen")
    assert note == (
        "*frozen, raw CRIU*: time = 0.05 s + 1.50 × the machine's write() time, linear in it (x² "
        "term 0% of the time at the largest size): the machine's page cache, not the program."
    ), note
    # Only the dump figures are judged so: a restore reads, it does not write.
    assert floor_note(plan, data, "restore_first_tick", "npusnap", "restore") is None
    table = "\n".join(scale_section(plan, data, None))
    assert "| write() + fsync of the same bytes (the machine) |" in table, table
    assert "| 8192 MiB | – / – | – / 10.52 | – / – | 6.98 / 9.13 |" in table, table
    assert (
        "*The machine's write() time* (`bench/floor.py`, the last column of the size table above) is itself"
        in table
    )


def test_a_super_linear_term_beyond_the_machines_own_write_is_the_programs() -> None:
    sizes = [64, 256, 1024, 4096, 8192]
    plan, data = _floor_samples(sizes, program_square=0.1)  # 6.4 s of its own x² at 8 GiB
    note = floor_note(plan, data, "raw_criu_frozen_s", "raw CRIU", "frozen")
    assert note is not None and "still super-linear against it" in note, note
    assert "The page cache: **not explained by the page cache" in note and "a bug to find" in note
    # Without the floor's samples (an older run), the page cache alone is consulted.
    for sz in sizes:
        del data.by_size[sz]["floor_write_s"]
    assert floor_note(plan, data, "raw_criu_frozen_s", "raw CRIU", "frozen") is None
