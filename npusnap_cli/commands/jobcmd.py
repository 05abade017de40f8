"""The job-image side of `dump` and `restore` (pipelines/jobsnap/; docs/distributed.md);
`inspect` and `verify` show a job image themselves (commands/inspect.py).

The commands call these for several PIDs (dump) or for a job image, which ``image.open`` tells
apart from the other kinds (``Kind.JOB``: ``npusnap-job.json``, image/job.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from npusnap_cli.commands._progress import fmt_s
from npusnap_cli.errors import UsageError
from npusnap_cli.jsontypes import JSONObject
from npusnap_cli.pipelines import jobsnap, netcoord
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.dump import DumpOptions
from npusnap_cli.pipelines.netcoord import NetLink
from npusnap_cli.pipelines.restore import RestoreOptions
from npusnap_cli.units import human_bytes

if TYPE_CHECKING:
    from npusnap_cli.ui import Output

NetSpec = tuple[tuple[str, int], int, int]  # (coordinator address, node, nodes)


def net_options(coordinator: Optional[str], node: int, nodes: int) -> Optional[NetSpec]:
    """(address, node, nodes) for a job across nodes, or None; checks the combination."""

    if coordinator is None:
        if nodes > 1 or node > 0:
            raise UsageError("--node/--nodes need --coordinator HOST:PORT", fix="add --coordinator")
        return None
    if node >= nodes:
        raise UsageError(f"--node {node} is not below --nodes {nodes}", fix="nodes are numbered 0..N-1")
    return netcoord.parse_addr(coordinator), node, nodes


@contextlib.contextmanager
def _net(spec: Optional[NetSpec], phases: tuple[str, ...]) -> Iterator[Optional[NetLink]]:
    """Node 0 serves the coordinator; every node connects to it. None without --coordinator."""
    if spec is None:
        yield None
        return

    addr, node, nodes = spec
    server = (
        netcoord.CoordServer(addr, nodes, phases, jobsnap.DEFAULT_BARRIER_TIMEOUT_S) if node == 0 else None
    )
    link = None
    try:
        link = netcoord.NetLink(addr, node, jobsnap.DEFAULT_BARRIER_TIMEOUT_S)
        yield link
    finally:
        if link is not None:
            link.close()
        if server is not None:
            server.close()


def dump_job(
    out: Output,
    pids: list[int],
    directory: Path,
    options: DumpOptions,
    callbacks: PipelineCallbacks,
    net: Optional[NetSpec] = None,
) -> None:

    with _net(net, jobsnap.PHASES) as link:
        result = jobsnap.dump_job(
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


def parse_rank_netns(values: Optional[list[str]]) -> dict[int, str]:

    found: dict[int, str] = {}
    for v in values or []:
        rank, sep, path = v.partition("=")
        if not sep or not rank.isdigit() or not path:
            raise UsageError(
                f"--rank-netns {v!r} is not RANK=PATH",
                fix="e.g. --rank-netns 1=/run/netns/node1",
            )
        found[int(rank)] = path
    return found


def restore_job(
    out: Output,
    directory: Path,
    options: RestoreOptions,
    callbacks: PipelineCallbacks,
    rank_netns: dict[int, str],
    net: Optional[NetSpec] = None,
) -> tuple[list[int], JSONObject]:

    with _net(net, jobsnap.RESTORE_PHASES) as link:
        result = jobsnap.restore_job(directory, options, callbacks, rank_netns=rank_netns, net=link)
    out.ok(f"restored a job of {len(result.ranks)} ranks from {result.image}; every rank is running")
    out.table(
        "ranks",
        ["rank", "root pid", "NPU pids", "network namespace"],
        [
            [str(r["rank"]), str(r["root_pid"]), " ".join(map(str, r["npu_pids"])), r["netns"] or "(ours)"]
            for r in result.ranks
        ],
        stream="stderr",
    )
    out.table(
        "phases",
        ["phase", "time"],
        [
            ["verify", fmt_s(result.verify_s)],
            ["CRIU restore (all ranks)", fmt_s(result.criu_restore_s)],
            ["device restore + unlock (all ranks)", fmt_s(result.device_restore_s)],
            ["total", fmt_s(result.total_s)],
        ],
        stream="stderr",
    )
    for r in result.ranks:
        out.data(str(r["root_pid"]))  # one root pid per rank, in rank order
    return [int(r["root_pid"]) for r in result.ranks], result.to_dict()


def wait_and_report(out: Output, roots: list[int], data: JSONObject, wait: bool) -> Optional[int]:
    """Without --wait: print the result. With it: wait for the roots to exit first."""
    if not wait:
        out.result(data)
        return None

    out.info(f"waiting for pid(s) {', '.join(map(str, roots))} to exit (signals are forwarded)")
    codes = jobsnap.wait_for_exit(roots, out.warn)
    failed = [c for p, c in sorted(codes.items()) if c != 0]
    out.line("exit codes: " + ", ".join(f"pid {p}: {c}" for p, c in sorted(codes.items())))
    data = {**data, "exit_codes": {str(p): c for p, c in sorted(codes.items())}}
    code = 0 if not failed else (failed[0] if failed[0] > 0 else 128 - failed[0])
    out.result(data, exit_code=code)
    return code
