"""The dump pipeline's pieces that need no root: signal handling, simulator status parsing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from npusnap_cli.errors import ExitCode, InterruptedError_, PreflightError
from npusnap_cli.pipelines import dump, engine
from npusnap_cli.pipelines.jobsnap import barriers
from tests import replies


def test_signal_guard_defers_then_raises_and_restores_handlers() -> None:
    notes: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with engine.SignalGuard(notes.append) as guard:
        guard.check("before", "nothing")  # nothing received: no error
        os.kill(os.getpid(), signal.SIGTERM)  # handled: we are still here
        assert guard.received == signal.SIGTERM
        assert notes and "SIGTERM received" in notes[0]
        with pytest.raises(InterruptedError_) as exc:
            guard.check("during lock+backup", "rolled back")
    assert exc.value.exit_code == ExitCode.INTERRUPTED
    assert "dump interrupted by SIGTERM during lock+backup" in exc.value.message
    assert signal.getsignal(signal.SIGTERM) == before


def test_device_memory_unseen_by_the_agent_is_found_in_proc_maps() -> None:
    """A process whose agent tracked nothing (attached) but whose /proc maps show device memory
    is refused in preserve mode: the signal is the host's, not the simulator daemon's."""
    from npusnap_cli.errors import TargetError
    from npusnap_cli.host.devmaps import DeviceMemory

    hello = {10: replies.hello(device_memory={"interposed": False, "bytes": 0})}
    mapped = {10: DeviceMemory(mappings=2, bytes=1 << 21)}
    with pytest.raises(TargetError, match="does not know"):
        dump.check_device_memory("preserve", hello, mapped)
    assert dump.check_device_memory("app", hello, mapped)["processes"]["10"]["device_mappings"] == 2
    # Nothing mapped, no devices, no records: a process without device memory passes.
    dump.check_device_memory("preserve", hello, {10: DeviceMemory(mappings=0, bytes=0)})


def test_devmaps_reads_device_mappings_of_proc_maps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from npusnap_cli.host import devmaps

    assert "/dev/svm0".startswith(devmaps.DEVICE_MAPPING_PREFIXES)
    assert "/memfd:npusim-dev0-0x100000000 (deleted)".startswith(devmaps.DEVICE_MAPPING_PREFIXES)
    assert not "/usr/lib/libc.so.6".startswith(devmaps.DEVICE_MAPPING_PREFIXES)
    assert "/dev/davinci_manager".startswith(devmaps.DEVICE_FILE_PREFIXES)
    assert devmaps.device_files(os.getpid()) == []
    dm = devmaps.device_memory(os.getpid())
    assert dm is not None and dm.mappings == 0


def test_free_space_check_names_sizes(tmp_path: Path) -> None:
    target = tmp_path / "img"
    with pytest.raises(PreflightError) as exc:
        dump._check_space_and_memory(target, 1 << 62, 0)
    assert "not enough free space" in exc.value.message
    assert exc.value.details["needed_bytes"] > exc.value.details["free_bytes"]
    dump._check_space_and_memory(target, 1024, 0)  # a small image fits


def test_criu_options_are_the_dump_options_as_given_plus_the_dumps_own() -> None:
    """CRIU's options come from DumpOptions.criu, never copied field by field: the dump adds
    leave_stopped (the original is killed only once the image is published) and skips a network
    lock that would lock nothing; a --network-lock given wins."""
    from npusnap_cli.criu import CriuOptions
    from npusnap_cli.host.proctree import ProcInfo

    me = ProcInfo(
        pid=os.getpid(),
        ppid=os.getppid(),
        depth=0,
        uid=os.getuid(),
        name="pytest",
        cmdline=("pytest",),
        agent_socket=None,
        acl_library=None,
    )
    given = CriuOptions(shell_job=True, external=("mnt[]:m",), timeout=7)
    c = dump.DumpOptions(criu=given).criu_for((me,))
    assert c.leave_stopped and not c.leave_running
    assert (c.shell_job, c.external, c.timeout) == (True, ("mnt[]:m",), 7)
    assert c.network_lock == "skip"  # a tree in our network namespace, no --tcp-established
    running = dump.DumpOptions(criu=CriuOptions(leave_running=True, network_lock="iptables"))
    assert running.leave_running
    c = running.criu_for((me,))
    assert c.leave_running and not c.leave_stopped and c.network_lock == "iptables"
    tcp = dump.DumpOptions(criu=CriuOptions(tcp_established=True)).criu_for((me,))
    assert tcp.network_lock is None  # CRIU's own method locks the connections


def test_the_rollback_resumes_the_tree_before_the_devices_and_discards_the_image_last() -> None:
    """The engine undoes the dump's steps in reverse: CRIU's stopped tree runs again first (its
    agents cannot answer the device rollback while SIGSTOP holds them), then the devices are
    rolled back, the agents' connections closed, the partial image removed. Nothing is undone
    past the kill of the original (a commit), and a signal after the publish no longer rolls back."""
    undos = [s.undo for s in reversed(dump.STEPS) if s.undo is not None]
    assert undos == [dump._resume, dump._roll_back_devices, dump._disconnect, dump._discard]
    at = {s.name: i for i, s in enumerate(dump.STEPS)}
    assert at["work area"] < at["connect"] < at["lock+backup"] < at["criu"] < at["publish"]
    by_name = {s.name: s for s in dump.STEPS}
    assert by_name["publish"].finishing and not by_name["publish"].commit
    assert by_name["stop original"].commit
    # A job dump's barriers are its phases (barriers.JobCoordinator), in the steps' order.
    assert tuple(s.barrier for s in dump.STEPS if s.barrier) == barriers.PHASES
