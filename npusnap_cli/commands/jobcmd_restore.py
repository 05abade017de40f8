"""The job side of `npusnap restore DIR` for a job image (pipelines/jobsnap/jobrestore.py), and
``--wait`` for any restore."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from npusnap_cli.commands import jobcmd
from npusnap_cli.commands._progress import fmt_s
from npusnap_cli.jsontypes import JSONObject
from npusnap_cli.pipelines.callbacks import PipelineCallbacks
from npusnap_cli.pipelines.jobsnap import jobrestore
from npusnap_cli.pipelines.jobsnap.barriers import RESTORE_PHASES
from npusnap_cli.pipelines.restore import RestoreOptions

if TYPE_CHECKING:
    from npusnap_cli.ui import Output


def restore_job(
    out: Output,
    directory: Path,
    options: RestoreOptions,
    callbacks: PipelineCallbacks,
    rank_netns: dict[int, str],
    net: Optional[jobcmd.NetSpec] = None,
) -> tuple[list[int], JSONObject]:
    """Restore every rank of the job image ``directory`` and show them; their root pids (in rank
    order) and the result."""
    with jobcmd.net_link(net, RESTORE_PHASES) as link:
        result = jobrestore.restore_job(directory, options, callbacks, rank_netns=rank_netns, net=link)
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
    codes = jobrestore.wait_for_exit(roots, out.warn)
    failed = [c for p, c in sorted(codes.items()) if c != 0]
    out.line("exit codes: " + ", ".join(f"pid {p}: {c}" for p, c in sorted(codes.items())))
    data = {**data, "exit_codes": {str(p): c for p, c in sorted(codes.items())}}
    code = 0 if not failed else (failed[0] if failed[0] > 0 else 128 - failed[0])
    out.result(data, exit_code=code)
    return code
