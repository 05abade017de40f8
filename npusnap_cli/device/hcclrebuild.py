"""After a restore: the job's HCCL communicators, made anew behind the handles the job holds.

A Restore leaves every HCCL communicator invalid (HCCL's RESTORE_POST callback; on a device its
links are gone). Each restored agent stands behind the communicators its process made
(native/agent/hccl.c): their calls wait, their async error stays clear, until this module has
them rebuilt through HCCL's public calls, as torch_npu's own ``reinit_process_group`` would --
without the job's help:

1. every restored NPU process's agent lists its communicators (``status`` → ``hccl``: key, rank,
   size); the key is a hash of the root info the ranks shared, so equal keys are one communicator;
2. per communicator, the process of rank 0 makes new root info (``hccl_root``);
3. every rank makes the new communicator from it at the same time (``hccl_rebuild``, one thread
   per rank: HCCL's init returns once every rank joined).

Communicators are rebuilt one after the other (an agent serves one request at a time). A
communicator whose ranks are not all among the restored processes (ranks on other nodes, or
restored by other commands) cannot be rebuilt here: it is given up at once, and its calls answer
HCCL_E_UNAVAIL as they would without npusnap (a job that rebuilds its own communicators then
does). docs/distributed.md.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Callable, Iterable

from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import DeviceError, NpusnapError
from npusnap_cli.host import procfs

CONNECT_RETRY_S = 1.0  # the agents answered the unlock a moment ago


@dataclass
class Communicator:
    key: str
    nranks: int
    members: dict[int, int] = field(default_factory=dict)  # rank -> pid

    def missing(self) -> list[int]:
        return [r for r in range(self.nranks) if r not in self.members]


def stale_communicators(pids: Iterable[int]) -> list[Communicator]:
    """The communicators that await a rebuild in the processes ``pids``, grouped by key."""
    found: dict[str, Communicator] = {}
    for pid in pids:
        try:
            with AgentClient(pid, timeout=10.0, connect_retry_s=CONNECT_RETRY_S) as client:
                status = client.status()
        except NpusnapError:
            if procfs.state(pid) in (None, "Z", "X"):
                continue  # it died after its unlock: the restore's settle reports that
            raise
        for c in status.hccl:
            if c.state != "stale":
                continue
            comm = found.setdefault(c.key, Communicator(c.key, c.nranks))
            comm.members[c.rank] = pid
    return sorted(found.values(), key=lambda c: c.key)


def _rebuild_one(comm: Communicator) -> None:
    with AgentClient(comm.members[0], timeout=30.0, connect_retry_s=CONNECT_RETRY_S) as root_client:
        root = root_client.hccl_root(comm.key)

    def join(pid: int) -> None:
        with AgentClient(pid, timeout=30.0, connect_retry_s=CONNECT_RETRY_S) as client:
            client.hccl_rebuild(comm.key, root)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(comm.members)) as pool:
        futures = {pool.submit(join, pid): (rank, pid) for rank, pid in comm.members.items()}
        failures = []
        for fut in concurrent.futures.as_completed(futures):
            rank, pid = futures[fut]
            exc = fut.exception()
            if exc is not None:
                failures.append(f"rank {rank} (pid {pid}): {getattr(exc, 'message', exc)}")
    if failures:
        raise DeviceError(
            f"HCCL communicator {comm.key[:12]} ({comm.nranks} ranks) could not be made anew: "
            + "; ".join(sorted(failures)),
            why="HCCL's init failed on a rank (a rank that died, or a timeout joining the others)",
            fix="the job's next collective on it fails: restore the image again, or let the job "
            "rebuild its process groups (torch_npu.distributed.reinit_process_group)",
            details={"communicator": comm.key, "failures": sorted(failures)},
        )


def rebuild(pids: Iterable[int], note: Callable[[str], None]) -> None:
    """Rebuild every communicator of the restored processes ``pids`` (which already run). One
    with ranks outside ``pids`` (other nodes, other commands) cannot be: it is given up at once
    (its calls answer HCCL_E_UNAVAIL, as without npusnap) and ``note`` says so."""
    for comm in stale_communicators(pids):
        if comm.missing():
            for pid in comm.members.values():
                with AgentClient(pid, timeout=30.0, connect_retry_s=CONNECT_RETRY_S) as client:
                    client.hccl_rebuild(comm.key, "")
            note(
                f"HCCL communicator {comm.key[:12]} has ranks {comm.missing()} outside the restored "
                f"processes (pids {sorted(comm.members.values())}): not made anew; its calls fail "
                "(HCCL_E_UNAVAIL) until the job builds a new one (restore every rank with one command: "
                "a job image)"
            )
            continue
        _rebuild_one(comm)
