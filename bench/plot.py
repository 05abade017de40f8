"""The scale plot: time against device bytes and against ranks, npusnap beside raw CRIU (PNG).

Needs matplotlib, an optional dependency of the benchmark only (the ``bench`` extra:
``.venv/bin/pip install 'matplotlib>=3.7'``); ``run.py`` checks for it before measuring anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bench.common import MiB, Samples
from bench.measure import Plan
from bench.scale import FLOOR_FIGURES, RANK_FIGURES, SIZE_FIGURES, fit_line, rank_points, size_points

PLOT_NAME = "benchmarks-scale.png"


def plot_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def draw(plan: Plan, data: Samples, path: Path) -> None:
    """Two panels: seconds against device GiB (log-log, with the linear fits), and against ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (by_size, by_ranks) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = ["tab:blue", "tab:orange", "tab:green"]
    for colour, (npu, raw, label) in zip(colours, SIZE_FIGURES):
        for name, style, who in ((npu, "-o", "npusnap"), (raw, "--s", "raw CRIU")):
            xs, ys = size_points(plan, data, name)
            if not xs:
                continue
            gib = [x / (1024 * MiB) for x in xs]
            by_size.plot(gib, ys, style, color=colour, label=f"{who}: {label}")
    for (name, label), style in zip(FLOOR_FIGURES, (":", "-.")):  # the machine's floor (floor.py)
        xs, ys = size_points(plan, data, name)
        if xs:
            by_size.plot([x / (1024 * MiB) for x in xs], ys, style, color="grey", label=label)
    by_size.set_xscale("log", base=2)
    by_size.set_yscale("log")
    by_size.set_xticks([sz / 1024 for sz in plan.sizes])
    by_size.set_xticklabels([f"{sz // 1024} GiB" if sz % 1024 == 0 else f"{sz} MiB" for sz in plan.sizes])
    by_size.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    by_size.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    by_size.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    by_size.set_xlabel("device memory (log scale)")
    by_size.set_ylabel("seconds (log scale)")
    by_size.set_title("With size (1 process)")
    by_size.grid(True, which="both", alpha=0.3)
    by_size.legend(fontsize=7)
    # The same colour for the same figure in both panels (dump, restore).
    for colour, (npu, raw, label) in zip((colours[0], colours[2]), RANK_FIGURES):
        for name, style, who in ((npu, "-o", "npusnap"), (raw, "--s", "raw CRIU")):
            xs, ys = rank_points(plan, data, name)
            if not xs:
                continue
            by_ranks.plot(xs, ys, style, color=colour, label=f"{who}: {label}")
            line = fit_line(xs, ys)
            if line is not None:
                by_ranks.plot(xs, [line.at(x) for x in xs], ":", color=colour, linewidth=0.8)
    by_ranks.set_xticks(list(plan.ranks))
    by_ranks.set_xlabel(f"NPU processes in the tree (sharing {plan.ranks_mib} MiB)")
    by_ranks.set_ylabel("seconds")
    by_ranks.set_title("With processes (dotted: linear fit)")
    by_ranks.set_ylim(bottom=0)
    by_ranks.grid(True, alpha=0.3)
    by_ranks.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
