"""The job side of `npusnap dump PID PID ... DIR` (pipelines/jobsnap/jobdump.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from npusnap_cli.commands import jobcmd
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.dump import DumpOptions
from npusnap_cli.pipelines.jobsnap import jobdump
from npusnap_cli.pipelines.jobsnap.barriers import PHASES
from npusnap_cli.units import human_bytes

if TYPE_CHECKING:
    from npusnap_cli.ui import Output


def dump_job(
    out: Output,
    pids: list[int],
    directory: Path,
    options: DumpOptions,
    callbacks: PipelineCallbacks,
    net: Optional[jobcmd.NetSpec] = None,
) -> None:
    """Dump the job whose rank i is ``pids[i]`` into ``directory`` and show its ranks."""
    with jobcmd.net_link(net, PHASES) as link:
        result = jobdump.dump_job(
            pids,
            directory,
            options,
            callbacks,
            net=link,
            node=net[1] if net else 0,
            nodes=net[2] if net else 1,
        )
    out.ok(f"dumped a job of {len(pids)} ranks (pids {', '.join(map(str, pids))}) into {result.image}")
    out.table(
        "ranks",
        ["rank", "pid", "NPU pids", "image", "frozen", "image size"],
        [
            [
                str(i),
                str(r.manifest.root_pid),
                " ".join(str(p.pid) for p in r.manifest.npu_processes),
                f"{result.manifest.ranks[i].dir}/",
                "-" if r.manifest.timings.frozen_s is None else f"{r.manifest.timings.frozen_s:.3f}s",
                human_bytes(r.manifest.bytes.image_bytes),
            ]
            for i, r in enumerate(result.ranks)
        ],
        stream="stderr",
    )
    out.line(
        "originals: still running"
        if options.leave_running
        else f"originals: gone (bring the job back: npusnap restore {result.image})"
    )
    out.data(result.image)
    out.result(result.to_dict())
