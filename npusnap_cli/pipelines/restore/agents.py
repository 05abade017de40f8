"""The device half of the restore: Restore + Unlock of every NPU process through its agent, what
to say when one fails, and the job's HCCL communicators made anew."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from npusnap_cli import contract
from npusnap_cli.device import hcclrebuild
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.device.devicegroup import DeviceGroup, status_now
from npusnap_cli.errors import DeviceError, ImageError, InterruptedError_, NpusnapError
from npusnap_cli.host import procfs
from npusnap_cli.image.manifest import Manifest
from npusnap_cli.jsontypes import as_int, obj
from npusnap_cli.pipelines import restoreguard
from npusnap_cli.pipelines.engine import SignalGuard
from npusnap_cli.pipelines.restore.options import RestoreOptions


def _check_none_left_locked(manifest: Manifest, root_pid: int, log: str) -> None:
    """A restored process with an agent that the manifest says has no device state must be
    RUNNING: one still locked means the manifest's ``npu`` flag lied (an edited image), and a
    restore that exits 0 must not leave a process BACKED_UP forever."""
    locked = []
    for p in manifest.processes:
        if p.npu or not p.agent:
            continue
        stop = procfs.stop_state(p.pid)
        if stop is not None and stop[1] == 0:
            continue  # restored stopped, as dumped: it runs no agent code (and was locked by no dump)
        try:
            with AgentClient(p.pid, connect_retry_s=1.0) as client:
                state = client.status().state
        except NpusnapError:
            continue  # no agent to ask: nothing was locked through one
        if state not in (None, contract.SnapshotState.RUNNING.name):
            locked.append(p.pid)
    if locked:
        hint = " ; ".join(f"npusnap thaw --force {p}" for p in locked)
        raise DeviceError(
            f"CRIU restored the tree (root pid {root_pid}), but pid(s) {locked} came back locked although "
            "the manifest says they have no device state",
            why="the image's manifest was edited (its npu flags), or was written by a broken dump",
            fix=f"those processes stay locked; to run them anyway: {hint}; do not trust this image",
            details={"locked_pids": locked, "restored_root_pid": root_pid, "criu_restore_log": log},
        )


def _state_now(pid: int, group: Optional[DeviceGroup]) -> tuple[Optional[str], str]:
    """(state, who unlocked it) that ``pid``'s agent reports now; (None, "") if it cannot say
    within devicegroup.STATE_NOW_S. Asked over the group's own connection when it has one."""
    st = status_now(pid, group.clients.get(pid) if group is not None else None)
    if st is None:
        return None, ""
    events = " ".join(st.events)
    by = (
        "its agent's lease, which ran out meanwhile,"
        if "lease rollback done" in events
        else "another command"
    )
    return st.state, by


def _strip_stay_locked(message: str) -> str:
    """The message without DeviceGroup's note that the failed pids stay locked."""
    head, sep, _tail = message.partition(" (pid(s) ")
    return head if sep else message


def _restore_and_unlock(
    npu_pids: tuple[int, ...],
    options: RestoreOptions,
    root_pid: int,
    log: str,
    tokens: dict[int, str],
    device_memory_files: dict[int, tuple[int, str]],
    before_unlock: Optional[Callable[[], None]] = None,
    guard: Optional[SignalGuard] = None,
) -> None:
    """Restore + Unlock each NPU process; ``device_memory_files``: pid -> (fd, name) of the
    image's device-memory file (the agent writes it back to the device after Unlock)."""
    group = None
    # A signal, or a restored process that stays stopped, ends the waits (restoreguard.py).
    wait = restoreguard.DeviceWait(npu_pids, guard)
    try:
        group = DeviceGroup(npu_pids, lease_s=options.lease_s, command="restore", interrupted=wait)
        # The restored agents still record the dump as their lock's owner: present its tokens.
        group.set_tokens(tokens)
        group.restore_and_unlock(device_memory_files, before_unlock)
    except ImageError:
        raise  # the device-memory files did not match: the tree was killed (before_unlock)
    except NpusnapError as first:
        err = restoreguard.after_failure(first, wait, npu_pids, root_pid)
        if err is not first:
            err.details.setdefault("criu_restore_log", log)
            if group is not None:
                group.hand_over(npu_pids)
            raise err from None
        err.details.setdefault("restored_root_pid", root_pid)
        err.details.setdefault("criu_restore_log", log)
        # DeviceGroup's failures are keyed by pid (as strings, like in the JSON); else the error's pid.
        failed = [int(p) for p in obj(err.details.get("failures"))] or [
            as_int(err.details.get("pid")) or npu_pids[0]
        ]
        # What the agents say now, not what the failure suggests: a lease that ran out while this
        # restore was stopped (or slow) restored and unlocked its process by itself. Not asked
        # when the restore was told to stop: it answers at once, and its requests are in flight.
        now: dict[int, tuple[Optional[str], str]]
        if isinstance(err, InterruptedError_):
            now = {p: (None, "") for p in failed}
        else:
            now = {p: _state_now(p, group) for p in failed}
        running = sorted(p for p, (state, _by) in now.items() if state == contract.SnapshotState.RUNNING.name)
        locked = sorted(p for p in now if p not in running)
        err.details["locked_pids"] = locked
        err.details["running_pids"] = running
        if group is not None and locked:
            # The failed processes stay locked, owned by the dump's token: hand it to `thaw`.
            group.hand_over(locked)
        if "CRIU restored" not in err.message:
            err.message = (
                f"CRIU restored the tree (root pid {root_pid}), but the device restore failed: {err.message}"
            )
        if running:
            err.message = (
                _strip_stay_locked(err.message)
                + "; "
                + "; ".join(
                    f"pid {p} runs: {now[p][1]} restored its device state and unlocked it" for p in running
                )
            )
        if locked:
            hint = " ; ".join(f"npusnap status {p} ; npusnap thaw {p}" for p in locked)
            err.fix = (
                f"pid(s) {', '.join(map(str, locked))} stay locked, the others run. Look at them and "
                f"retry: {hint} (thaw restores the device state if needed, then unlocks)"
            )
        else:
            err.fix = (
                "nothing is left locked: "
                + " ; ".join(f"npusnap status {p}" for p in running)
                + (" shows it running; give the job a longer lease at dump (--lease) if the restore may wait")
            )
        raise
    finally:
        if group is not None:
            group.close()


def rebuild_communicators(npu_pids: tuple[int, ...], root_pid: int, note: Callable[[str], None]) -> None:
    """The job's HCCL communicators made anew behind its handles (device/hcclrebuild.py); the
    processes run already: their collectives wait for this."""
    try:
        hcclrebuild.rebuild(npu_pids, note)
    except NpusnapError as err:
        err.message = f"CRIU restored the tree (root pid {root_pid}) and it runs, but {err.message}"
        err.details.setdefault("restored_root_pid", root_pid)
        raise
