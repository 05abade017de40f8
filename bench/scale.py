"""The report's copy-rate, target and scale sections, and the fits they state.

Kept apart from ``report.py`` because they share the fits (``fit_line``, ``fit_quadratic``) with
``plot.py``. Every function takes the run's ``Samples`` and returns Markdown lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from bench.common import MiB, Samples, write_window_s
from bench.measure import Plan

GB = 1e9

# The figures whose growth the report states: (metric of npusnap, metric of raw CRIU, label).
SIZE_FIGURES = (
    ("dump_wall", "raw_dump_wall", "dump command (raw: criu dump + sync)"),
    ("dump_frozen_s", "raw_criu_frozen_s", "frozen"),
    ("restore_first_tick", "raw_restore_first_tick", "restore until the job computes again"),
)
RANK_FIGURES = (
    ("dump_wall", "raw_dump_wall", "dump command (raw: criu dump + sync)"),
    ("restore_first_tick", "raw_restore_first_tick", "restore until every rank computes again"),
)
# A quadratic term that adds more than this share of the time at the largest size is reported
# as super-linear (a bug to find).
SUPERLINEAR_SHARE = 0.10
# Where each figure's bytes meet the page cache (vmstat.py): the dump figures are written through
# it (name of the watched command, the image's bytes), the restore figures read through it.
PAGE_CACHE_OF = {
    "dump_wall": ("dump", "dump_image_bytes"),
    "dump_frozen_s": ("dump", "dump_image_bytes"),
    "raw_dump_wall": ("raw_dump", "raw_image_bytes"),
    "raw_criu_frozen_s": ("raw_dump", "raw_image_bytes"),
    "restore_first_tick": ("restore", "dump_image_bytes"),
    "raw_restore_first_tick": ("raw_restore", "raw_image_bytes"),
}
# The dump figures judged against the machine's floor (floor.py): each is fitted against the time
# the machine takes to write() the same bytes into its page cache. The fsync after it (a dump
# command's wait for durability, the floor's too) flushes at most the dirty limit's worth and
# carries none of the growth.
FLOOR_JUDGED = ("dump_wall", "raw_dump_wall", "dump_frozen_s", "raw_criu_frozen_s")
FLOOR_FIGURES = (
    ("floor_write_s", "write() of the same bytes (the machine)"),
    ("floor_durable_s", "write() + fsync of the same bytes (the machine)"),
)
# The image whose bytes each watched command moves.
IMAGE_OF_WHAT = {what: image for what, image in PAGE_CACHE_OF.values()}
# A restore that read more than this share of its image from the disk did not find it in the
# page cache.
DISK_READ_SHARE = 0.10
GiB = 1 << 30


def _s(v: Optional[float], digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return [*out, ""]


@dataclass(frozen=True)
class Line:
    intercept: float  # seconds
    slope: float  # seconds per unit of x

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(xs: list[float], ys: list[float]) -> Optional[Line]:
    """Least squares y = a + b x; None with fewer than two distinct x."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return Line(my - b * mx, b)


def fit_quadratic(xs: list[float], ys: list[float]) -> Optional[tuple[float, float, float]]:
    """Least squares y = a + b x + c x² (normal equations, Cramer's rule); None under 3 x."""
    if len(set(xs)) < 3:
        return None
    s = [sum(x**k for x in xs) for k in range(5)]
    t = [sum(y * x**k for x, y in zip(xs, ys)) for k in range(3)]
    m = [[s[0], s[1], s[2]], [s[1], s[2], s[3]], [s[2], s[3], s[4]]]

    def det(a: list[list[float]]) -> float:
        return (
            a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
            - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
        )

    d = det(m)
    if d == 0:
        return None
    coef = []
    for col in range(3):
        mc = [row[:] for row in m]
        for i in range(3):
            mc[i][col] = t[i]
        coef.append(det(mc) / d)
    return coef[0], coef[1], coef[2]


def size_points(plan: Plan, data: Samples, name: str) -> tuple[list[float], list[float]]:
    """(device bytes, median seconds) of one figure over the sizes measured."""
    xs, ys = [], []
    for sz in plan.sizes:
        v = data.med(sz, name)
        if v is not None:
            xs.append(float(sz * MiB))
            ys.append(v)
    return xs, ys


def rank_points(plan: Plan, data: Samples, name: str) -> tuple[list[float], list[float]]:
    """(ranks, median seconds) of one figure over the trees measured."""
    xs, ys = [], []
    for n in plan.ranks:
        v = data.med(0, f"ranks{n}_{name}")
        if v is not None:
            xs.append(float(n))
            ys.append(v)
    return xs, ys


def square_share(xs: list[float], ys: list[float], of: Optional[float] = None) -> Optional[float]:
    """What a quadratic fit's x² term adds at the largest x, as a share of ``of`` (default: the
    time at the largest x); 0 for a term that bends down; None under three sizes."""
    quad = fit_quadratic(xs, ys)
    if quad is None:
        return None
    ref = ys[xs.index(max(xs))] if of is None else of
    return max(quad[2], 0.0) * max(xs) ** 2 / max(ref, 1e-9)


def growth(xs: list[float], ys: list[float]) -> tuple[str, str, str]:
    """(slope as GB/s, intercept s, super-linear verdict) of time against bytes."""
    line = fit_line(xs, ys)
    if line is None:
        return "–", "–", "needs two sizes"
    rate = "– (no growth)" if line.slope <= 0 else f"{1 / line.slope / GB:.2f}"
    share = square_share(xs, ys)
    if share is None:
        verdict = "needs three sizes"
    elif share > SUPERLINEAR_SHARE:
        verdict = f"**super-linear**: x² term {share:.0%} of the time at the largest size"
    else:
        verdict = f"linear (x² term {share:.0%} at the largest size)"
    return rate, _s(line.intercept), verdict


# A command during which the kernel reclaimed more than this share of its image's bytes ran short
# of free memory.
RECLAIM_SHARE = 0.10


# The watched commands that allocate about their image's bytes anew: the image's page cache (a
# dump), the process's memory (raw CRIU's restore). Not npusnap's restore: the simulated device
# gives a Restore the memory a dump left when it still keeps it, so what that restore allocates
# is not known here.
COLD_KNOWN = ("dump", "raw_dump", "raw_restore")


def _crossed(plan: Plan, data: Samples, name: str) -> dict[int, list[str]]:
    """The sizes at which a figure's bytes left the page cache's fast path, and how: its writer was
    throttled at the dirty limit (``dirty``), its reader read a share of the image from the disk
    (``disk``), the kernel reclaimed memory meanwhile (``reclaim``), or it ran partly unwarmed
    (``cold``). Time waited on I/O is shown beside them but explains nothing by itself: a dump
    command waits on I/O by design (npusnap's fsync, raw CRIU's ``sync -f``)."""
    what, image = PAGE_CACHE_OF[name]
    out: dict[int, list[str]] = {}
    for sz in plan.sizes:
        size = data.med(sz, image) or 0
        how = []
        if what.endswith("dump") and any(data.flags.get(sz, {}).get(f"{what}_dirty_throttled", [])):
            how.append("dirty")
        read = data.med(sz, f"{what}_disk_read_bytes")
        if not what.endswith("dump") and read is not None and size and read > DISK_READ_SHARE * size:
            how.append("disk")
        reclaimed = data.med(sz, f"{what}_reclaimed_bytes")
        if reclaimed is not None and size and reclaimed > RECLAIM_SHARE * size:
            how.append("reclaim")
        warmed = data.med(sz, f"{what}_warmed_bytes")
        if what in COLD_KNOWN and warmed is not None and size and size - warmed > RECLAIM_SHARE * size:
            how.append("cold")
        if how:
            out[sz] = how
    return out


def _why(data: Samples, what: str, crossed: dict[int, list[str]]) -> str:
    m, parts = data.med, []
    for how, text in (
        ("dirty", "the image's dirty pages passed the kernel's dirty limit (peak {peak:.1f} GiB against a "
         "free-run point of {free:.1f} GiB) and the writer was held to the disk's pace"),
        ("disk", "the restore read up to {read:.0f} MiB of the image from the disk instead of the page "
         "cache"),
        ("reclaim", "the kernel reclaimed up to {reclaimed:.0f} MiB of memory meanwhile (free memory ran "
         "out beside the image, the process and the memory warmed before the command)"),
        ("cold", "only {warmed:.1f} GiB could be warmed before the command, against about {touched:.1f} "
         "GiB it allocates, and the rest came cold: a VM whose host takes freed memory back (free page "
         "reporting) backs it again on first touch, at a fraction of memory speed (*Cold memory* below)"),
    ):  # fmt: skip
        sizes = [sz for sz, hows in crossed.items() if how in hows]
        if not sizes:
            continue
        values = {
            "peak": max(m(sz, f"{what}_peak_dirty_bytes") or 0 for sz in sizes) / GiB,
            "free": min(m(sz, f"{what}_dirty_freerun_bytes") or 0 for sz in sizes) / GiB,
            "read": max(m(sz, f"{what}_disk_read_bytes") or 0 for sz in sizes) / MiB,
            "reclaimed": max(m(sz, f"{what}_reclaimed_bytes") or 0 for sz in sizes) / MiB,
            "warmed": min(m(sz, f"{what}_warmed_bytes") or 0 for sz in sizes) / GiB,
            "touched": max(m(sz, IMAGE_OF_WHAT[what]) or 0 for sz in sizes) / GiB,
        }
        parts.append(f"at {', '.join(str(sz) for sz in sizes)} MiB " + text.format(**values))
    return "; ".join(parts)


def page_cache_note(plan: Plan, data: Samples, name: str, who: str, label: str) -> str:
    """Why a figure flagged super-linear grew so, from the kernel's counters of the same run: the
    sizes past the dirty limit, read from the disk or short of free memory, the growth past them
    against the disk's rate, and the fit of the sizes below; or that none of it explains it."""
    return f"*{label}, {who}*: {_page_cache_why(plan, data, name)}"


def _page_cache_why(plan: Plan, data: Samples, name: str) -> str:
    what, image = PAGE_CACHE_OF[name]
    m = data.med
    if m(plan.sizes[0], f"{what}_peak_dirty_bytes") is None:
        return "the page cache was not watched in this run (an older run's data)."
    crossed = _crossed(plan, data, name)
    below = [sz for sz in plan.sizes if sz < min(crossed)] if crossed else plan.sizes
    if not crossed or not below:
        none = (
            "stayed clear of them"
            if crossed
            else "passed the dirty limit, read from the disk, ran short of free memory or ran unwarmed"
        )
        return f"**not explained by the page cache or the machine's memory** (no size {none}): a bug to find."
    lo, hi = max(below), max(plan.sizes)
    t_lo, t_hi, b_lo, b_hi = m(lo, name), m(hi, name), m(lo, image), m(hi, image)
    rate = ""
    if t_lo is not None and t_hi is not None and b_lo is not None and b_hi is not None and t_hi > t_lo:
        per_s = (b_hi - b_lo) / MiB / (t_hi - t_lo)
        rate = f"; from {lo} to {hi} MiB it grew by {per_s:.0f} MiB of image a second"
        disk = m(0, "disk_mib_s")
        if disk is not None:
            rate += f" (the disk's sequential write: {disk:.0f} MiB/s)"
    xs, ys = size_points(plan, data, name)
    sub = [(x, y) for x, y in zip(xs, ys) if x <= lo * MiB]
    fit = ""
    if len(sub) >= 3:
        _rate, _icpt, verdict = growth([x for x, _ in sub], [y for _, y in sub])
        fit = f". Up to {lo} MiB: {verdict.replace('**', '')}"
    why = _why(data, what, crossed)
    return f"piecewise, from the machine's memory rather than the program: {why}{rate}{fit}."


def floor_note(plan: Plan, data: Samples, name: str, who: str, label: str) -> Optional[str]:
    """A super-linear dump figure against the machine's floor measured in the same run (floor.py):
    fitted against the time the machine takes to write() the same bytes, time = a + b × that. A
    figure linear in it grows as the machine's page cache does (b: its time per byte against a
    plain write's); one that is still super-linear against it has a term of its own. None for a
    figure not judged so, or without three sizes of the floor (an older run's data)."""
    if name not in FLOOR_JUDGED:
        return None
    pts = [
        (w, f)
        for sz in plan.sizes
        if (f := data.med(sz, name)) is not None and (w := data.med(sz, "floor_write_s")) is not None
    ]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    against = square_share(xs, ys)
    line = fit_line(xs, ys)
    if against is None or line is None:
        return None
    base = f"*{label}, {who}*: time = {line.intercept:.2f} s + {line.slope:.2f} × the machine's write() time"
    if against <= SUPERLINEAR_SHARE:
        faster = (
            " (below 1: npusnap's agent writes the device memory on several threads, into blocks "
            "reserved first, `native/agent/devmem.c`)"
            if who == "npusnap" and line.slope < 1
            else ""
        )
        return (
            f"{base}{faster}, linear in it (x² term {against:.0%} of the time at the largest size): "
            "the machine's page cache, not the program."
        )
    return (
        f"{base}, and still super-linear against it (x² term {against:.0%} of the time at the "
        "largest size), which the machine does not explain. The page cache: "
        + _page_cache_why(plan, data, name)
    )


FLOOR_EXPLAINED = (
    "*The machine's write() time* (`bench/floor.py`, the last column of the size table above) is itself "
    "super-linear in bytes (x² term {share:.0%}): writes into the page cache run at memory speed "
    "until the dirty pages reach the kernel's background threshold, and from there, with "
    "writeback running beside the writer, at about the disk's pace; the more memory a process "
    "holds, the lower that threshold (the free-run point in the table below lies halfway between "
    "it and the dirty limit). A "
    "figure fitted as a + b × that time, linear in it, grows as the machine does: *b* is its "
    "time per second of one plain writer's. What this cannot see: a cost of the program's own "
    "that grew in just the machine's shape."
)


def page_cache_table(plan: Plan, data: Samples) -> list[str]:
    """Per size: the dumps' peak dirty pages against the dirty limit, the restores' disk reads."""
    m = data.med

    def dirty(sz: int, what: str) -> str:
        peak, free = m(sz, f"{what}_peak_dirty_bytes"), m(sz, f"{what}_dirty_freerun_bytes")
        if peak is None or free is None:
            return "–"
        n = data.flags.get(sz, {}).get(f"{what}_dirty_throttled", [])
        return f"{peak / GiB:.1f} / {free / GiB:.1f}" + (f" (throttled {sum(n)}/{len(n)})" if any(n) else "")

    def mib(sz: int, name: str) -> str:
        v = m(sz, name)
        return "–" if v is None else f"{v / MiB:.0f}"

    def both(sz: int, a: str, b: str, counter: str) -> str:
        return f"{mib(sz, f'{a}_{counter}')} / {mib(sz, f'{b}_{counter}')}"

    def secs(sz: int, name: str) -> str:
        v = m(sz, name)
        return "–" if v is None else f"{v:.2f}"

    def gib(sz: int, name: str) -> str:
        v = m(sz, name)
        return "–" if v is None else f"{v / GiB:.1f}"

    rows = [
        [f"{sz} MiB", f"{gib(sz, 'dump_warmed_bytes')} / {gib(sz, 'raw_dump_warmed_bytes')}",
         dirty(sz, "dump"), dirty(sz, "raw_dump"),
         f"{secs(sz, 'dump_io_stall_s')} / {secs(sz, 'raw_dump_io_stall_s')}",
         both(sz, "dump", "raw_dump", "reclaimed_bytes"),
         both(sz, "restore", "raw_restore", "disk_read_bytes"),
         both(sz, "restore", "raw_restore", "reclaimed_bytes")]
        for sz in plan.sizes
    ]  # fmt: skip
    head = ["device memory", "warmed before the dump GiB, npusnap / raw",
            "npusnap dump: peak dirty / free-run GiB", "raw dump: peak dirty / free-run GiB",
            "dump: waited on I/O s, npusnap / raw", "dump: reclaimed MiB, npusnap / raw",
            "restore: read from disk MiB, npusnap / raw",
            "restore: reclaimed MiB, npusnap / raw"]  # fmt: skip
    return [
        *_table(head, rows),
        "From `/proc/vmstat`, sampled every 50 ms during each timed command (`bench/vmstat.py`), "
        "medians: *warmed* is the memory touched and freed right before the command (free memory "
        "only, and at most what leaves a fifth of the memory, plus 512 MiB, available); *peak dirty* "
        "is the most dirty and under-writeback memory seen; the *free-run* "
        "point, (`nr_dirty_threshold` + `nr_dirty_background_threshold`) / 2, is where the kernel "
        "starts holding writers to the disk's pace (*throttled n/N*: in n of N repetitions the peak "
        "passed it); the device memory, shared memory of the simulator, shrinks it. *Reclaimed*: "
        "`pgsteal_kswapd` + `pgsteal_direct`, memory the kernel took back from caches and processes "
        "because free memory ran out. *Waited on I/O*: `/proc/pressure/io` (some), time some task "
        "was stalled on I/O: a writer held to the disk's pace below the global limit, and the "
        "command's own fsync or `sync -f`; a share of the command that grows with size would point "
        "at writeback, one that stays flat does not. "
        "*Read from disk*: `pgpgin` during the restore.",
        "",
    ]


def copy_rates(data: Samples, plan: Plan) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(memcpy, host→device, device→host) in GB/s."""
    m = data.med
    return m(0, "copy_memcpy_gb_s"), m(0, "copy_host_to_device_gb_s"), m(0, "copy_device_to_host_gb_s")


def copy_section(plan: Plan, data: Samples) -> list[str]:
    mc, h2d, d2h = copy_rates(data, plan)
    L = ["## Copy rates: the simulated device against this machine's memcpy", ""]
    rows = [
        ["memcpy (host to host, this machine)", _s(mc), "1.00"],
        ["simulator `aclrtMemcpy` host → device", _s(h2d), _s(None if not (h2d and mc) else h2d / mc)],
        ["simulator `aclrtMemcpy` device → host", _s(d2h), _s(None if not (d2h and mc) else d2h / mc)],
    ]
    L += _table(["copy", "GB/s", "of memcpy"], rows)
    L += [
        f"`bench/copyrate.py`, {plan.copy_mib} MiB per copy, best of 3, in a process of its own. The "
        "simulated device's memory is shared memory (a memfd per allocation, owned by the simulator "
        "daemon, mapped by the runtime), so its copies run at this machine's memory speed, the "
        "upper bound of any copy here (a real NPU's copies run at its PCIe link's rate, tens of "
        "GB/s). "
        "The link can be modelled with `npusnap sim start --bandwidth-mbps MBPS` (every process) or "
        "`NPUSIM_COPY_MBPS` (one process); this run used neither. *Device copy* in the targets "
        "below is the device bytes at these rates.",
        "",
    ]
    return L


def targets_section(plan: Plan, data: Samples) -> list[str]:
    """Issue 16's targets at 1 GiB and 4 GiB (or what of them was measured), with how far."""
    m = data.med
    _mc, h2d, d2h = copy_rates(data, plan)
    L = ["## Targets at 1 GiB and 4 GiB (beside raw CRIU)", ""]
    at = [sz for sz in (1024, 4096) if sz in plan.sizes]
    if not at:
        return [*L, "Neither 1024 nor 4096 MiB was measured in this run: no verdicts.", ""]
    disk = m(0, "disk_mib_s")
    rows = []
    for sz in at:
        nbytes = sz * MiB
        copy_out = None if not d2h else nbytes / (d2h * GB)
        copy_in = None if not h2d else nbytes / (h2d * GB)

        def verdict(got: Optional[float], limit: Optional[float]) -> str:
            if got is None or limit is None:
                return "not measured"
            ok = got <= limit
            return ("met" if ok else "**missed**") + f" ({got / limit:.2f} × the limit)"

        raw_dump, frozen, raw_frozen = (
            m(sz, "raw_dump_wall"),
            m(sz, "dump_frozen_s"),
            m(sz, "raw_criu_frozen_s"),
        )
        restore, raw_restore = m(sz, "restore_first_tick"), m(sz, "raw_restore_first_tick")
        lim_dump = None if raw_dump is None or copy_out is None else 1.10 * (raw_dump + copy_out)
        lim_frozen = None if raw_frozen is None or copy_out is None else raw_frozen + copy_out + 0.05
        lim_restore = None if raw_restore is None or copy_in is None else 1.15 * (raw_restore + copy_in)
        b, window = m(sz, "dump_image_bytes"), write_window_s(data, sz)
        write = None if b is None or not window else b / MiB / window
        rows += [
            [f"{sz} MiB", "dump ≤ 1.10 × (raw dump + sync + device copy)", _s(m(sz, "dump_wall")),
             _s(lim_dump), verdict(m(sz, "dump_wall"), lim_dump)],
            [f"{sz} MiB", "frozen ≤ raw frozen + device copy + 50 ms", _s(frozen), _s(lim_frozen),
             verdict(frozen, lim_frozen)],
            [f"{sz} MiB", "restore → computes ≤ 1.15 × (raw restore → computes + device copy)",
             _s(restore), _s(lim_restore), verdict(restore, lim_restore)],
            [f"{sz} MiB", "image written ≥ 80 % of the disk's sequential write (MiB/s)", _s(write, 0),
             _s(None if disk is None else 0.8 * disk, 0),
             "not measured" if write is None or disk is None
             else ("met" if write >= 0.8 * disk else "**missed**") + f" ({write / disk:.0%} of the disk)"],
        ]  # fmt: skip
    hlp = m(0, "startup_help")
    rows.append(
        ["–", "`npusnap --help` ≤ 100 ms", _s(None if hlp is None else hlp * 1000, 0), "100",
         "not measured" if hlp is None else ("met" if hlp <= 0.1 else "**missed**") + f" ({hlp / 0.1:.2f} ×)"]
    )  # fmt: skip
    L += _table(["size", "target", "npusnap", "limit", "verdict"], rows)
    L += [
        "Seconds unless said. *Device copy*: the device bytes at the simulator's copy rate measured "
        "above (device → host for the dump, host → device for the restore). Raw CRIU's figures are "
        "the baseline's in the same run (dump: `criu dump` + `sync -f`; frozen: CRIU's `frozen_time`; "
        "restore: `criu restore -d` until the restored process prints its next tick). The image "
        "rate is the image's bytes over the time from the lock (the agents write the device memory "
        "first) until the image is durable.",
        "",
    ]
    return L


def scale_section(plan: Plan, data: Samples, plot: Optional[str]) -> list[str]:
    m = data.med
    L = ["## Scale: with size and with the number of NPU processes", ""]
    if plot:
        L += [f"![time against device bytes and against ranks]({plot})", ""]
    L += ["### With size", ""]
    rows = []
    for sz in plan.sizes:
        rows.append(
            [f"{sz} MiB"]
            + [f"{_s(m(sz, a))} / {_s(m(sz, b))}" for a, b, _label in SIZE_FIGURES]
            + [f"{_s(m(sz, 'floor_write_s'))} / {_s(m(sz, 'floor_durable_s'))}"]
        )
    L += _table(
        ["device memory", *[f"{label}: npusnap / raw s" for _a, _b, label in SIZE_FIGURES],
         "the machine: write() / + fsync of the same bytes s"],
        rows,
    )  # fmt: skip
    rows, notes = [], []
    for a, b, label in SIZE_FIGURES:
        for who, name in (("npusnap", a), ("raw CRIU", b)):
            xs, ys = size_points(plan, data, name)
            rate, icpt, verdict = growth(xs, ys)
            rows.append([label, who, rate, icpt, verdict])
            if verdict.startswith("**super-linear**"):
                note = floor_note(plan, data, name, who, label)
                notes.append(note or page_cache_note(plan, data, name, who, label))
    for name, label in FLOOR_FIGURES:
        rows.append([label, "", *growth(*size_points(plan, data, name))])
    L += _table(["figure", "", "slope GB/s", "intercept s", "growth"], rows)
    L += [
        "Fits over the sizes of this run (medians): time = intercept + bytes / slope, by least squares; "
        f"a quadratic fit's x² term above {SUPERLINEAR_SHARE:.0%} of the time at the largest size is "
        "flagged **super-linear** (a bug to find). Raw CRIU holds the same bytes in host memory "
        f"(size + {plan.host_mib} MiB). *The machine* (`bench/floor.py`): raw CRIU's workload, right "
        "before its dump, writes the bytes it holds from its own memory into a file in the image "
        "directory with plain `write()` calls, then `fsync` (the same bytes, the same memory held, "
        "so the same dirty thresholds): what one plain writer takes for these bytes on this "
        "machine.",
        "",
    ]
    if notes:
        L += ["Each super-linear flag, against the machine's floor and the page cache in the same run:", ""]
        L += [f"* {n}" for n in notes] + [""]
        machine = square_share(*size_points(plan, data, "floor_write_s"))
        if machine is not None and any("the machine's write() time" in n for n in notes):
            L += [FLOOR_EXPLAINED.format(share=machine), ""]
    L += page_cache_table(plan, data)
    L += [
        "### With the number of NPU processes",
        "",
    ]
    if not plan.ranks:
        return [*L, "Not measured in this run.", ""]
    rows = []
    for n in plan.ranks:
        rows.append(
            [str(n), f"{plan.ranks_mib // n} MiB"]
            + [f"{_s(m(0, f'ranks{n}_{a}'))} / {_s(m(0, f'ranks{n}_{b}'))}" for a, b, _l in RANK_FIGURES]
            + [_s(m(0, f"ranks{n}_dump_frozen_s"))]
        )
    L += _table(
        ["ranks", "device memory each", *[f"{label}: npusnap / raw s" for _a, _b, label in RANK_FIGURES],
         "npusnap frozen s"],
        rows,
    )  # fmt: skip
    rows = []
    for a, b, label in RANK_FIGURES:
        for who, name in (("npusnap", a), ("raw CRIU", b)):
            line = fit_line(*rank_points(plan, data, name))
            rows.append([label, who, "–" if line is None else f"{line.slope * 1000:.0f}",
                         "–" if line is None else _s(line.intercept)])  # fmt: skip
    L += _table(["figure", "", "per process ms", "intercept s"], rows)
    L += [
        f"A tree (`bench/tree.py`) of N ranks, rank R on device R (CANN's Restore needs a device "
        f"that no other process holds), that share {plan.ranks_mib} MiB of device memory (and "
        f"{plan.host_mib} MiB of host memory) evenly, so the bytes stay the same and the slope is the "
        "cost of one more NPU process. npusnap dumps the tree with one `npusnap dump ROOT` (the "
        "ranks' device parts in parallel) and restores it with one `npusnap restore`; raw CRIU "
        "dumps and restores the same tree of `hostalloc.py` processes. *Computes again*: every "
        "rank has printed a tick after the restore began.",
        "",
    ]
    return L
