"""What `dump` and `restore` share for jobs (pipelines/jobsnap/; docs/distributed.md): the
coordinator of a job across nodes and the ranks' network namespaces. The job side of each command
is its own module, so that a dump never loads the restore pipeline nor a restore the dump
pipeline: jobcmd_dump.py and jobcmd_restore.py; `inspect` and `verify` show a job image
themselves (commands/inspect.py).

The commands call these for several PIDs (dump) or for a job image, which ``image.open`` tells
apart from the other kinds (``Kind.JOB``: ``npusnap-job.json``, image/job.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

from npusnap_cli.errors import UsageError
from npusnap_cli.pipelines import netcoord
from npusnap_cli.pipelines.jobsnap.barriers import DEFAULT_BARRIER_TIMEOUT_S
from npusnap_cli.pipelines.netcoord import NetLink

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
def net_link(spec: Optional[NetSpec], phases: tuple[str, ...]) -> Iterator[Optional[NetLink]]:
    """Node 0 serves the coordinator; every node connects to it. None without --coordinator."""
    if spec is None:
        yield None
        return

    addr, node, nodes = spec
    server = netcoord.CoordServer(addr, nodes, phases, DEFAULT_BARRIER_TIMEOUT_S) if node == 0 else None
    link = None
    try:
        link = netcoord.NetLink(addr, node, DEFAULT_BARRIER_TIMEOUT_S)
        yield link
    finally:
        if link is not None:
            link.close()
        if server is not None:
            server.close()


def parse_rank_netns(values: Optional[list[str]]) -> dict[int, str]:
    """``--rank-netns RANK=PATH`` values: the network namespace to restore each rank into."""
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
