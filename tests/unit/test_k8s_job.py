"""`npusnap k8s checkpoint`'s coordinator without a runtime: members stand in for the plugin's side
of the barriers (netcoord's protocol, as npusnap_plugin.c speaks it)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import pytest

from npusnap_cli.errors import CriuError, DeviceError, ExitCode, UsageError
from npusnap_cli.k8s import jobcheckpoint as jc
from npusnap_cli.pipelines import netcoord


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PluginLikeBackend:
    """Member 0 joins the barriers like the plugin and fails its dump when aborted; member 1's
    device backup fails before it reaches a barrier (it aborts the job, as the plugin's fini does)."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.alive = {0: True, 1: True}

    def checkpoint(self, member: jc.Member, location: Path, timeout_s: float) -> Path:
        link = netcoord.NetLink(self.addr, member.index, 10)
        try:
            if member.index == 1:
                link.abort("backup of pid 7: ACL_ERROR_RT_FAILURE")
                raise DeviceError(f"{member.name}: backup of pid 7 failed")
            try:
                link.sync("locked")
            except netcoord.NodeAborted as exc:
                raise CriuError(f"{member.name}: job member 0: {exc.message}") from None
            raise AssertionError("member 0 passed 'locked' although member 1 failed")
        finally:
            link.close()

    def running(self, member: jc.Member) -> Optional[bool]:
        return self.alive[member.index]


def test_a_failing_member_aborts_the_job_and_leaves_nothing(tmp_path: Path) -> None:
    addr = ("127.0.0.1", _port())
    members = [jc.parse_member(0, "default/a/trainer"), jc.parse_member(1, "default/b/trainer")]
    with pytest.raises(CriuError) as info:
        jc.checkpoint_job(members, tmp_path / "job", PluginLikeBackend(addr), addr, barrier_timeout_s=10)
    err = info.value
    assert err.message.startswith("member 1 (default/b/trainer) failed"), err.message
    assert err.exit_code == ExitCode.DEVICE
    assert set(err.details["failed"]) == {"default/a/trainer", "default/b/trainer"}
    assert err.details["running"] == {"default/a/trainer": True, "default/b/trainer": True}
    assert list(tmp_path.iterdir()) == []


def test_a_container_that_stopped_is_state_unknown(tmp_path: Path) -> None:
    addr = ("127.0.0.1", _port())
    backend = PluginLikeBackend(addr)
    backend.alive[0] = False
    members = [jc.parse_member(0, "default/a/trainer"), jc.parse_member(1, "default/b/trainer")]
    with pytest.raises(Exception) as info:
        jc.checkpoint_job(members, tmp_path / "job", backend, addr, barrier_timeout_s=10)
    assert getattr(info.value, "exit_code", None) == ExitCode.STATE_UNKNOWN
    assert "default/a/trainer is not running" in str(info.value)


@pytest.mark.parametrize("text", ["default/a", "a/b/c/d", "/a/b", "default//c"])
def test_member_syntax(text: str) -> None:
    with pytest.raises(UsageError):
        jc.parse_member(0, text)


def test_member_with_node() -> None:
    m = jc.parse_member(3, "ns/pod-1/ctr@node-a")
    assert (m.index, m.namespace, m.pod, m.container, m.node) == (3, "ns", "pod-1", "ctr", "node-a")
    assert m.archive_name("T") == "checkpoint-pod-1_ns-ctr-T.tar"


def test_several_members_need_listen(tmp_path: Path) -> None:
    members = [jc.parse_member(0, "d/a/c"), jc.parse_member(1, "d/b/c")]
    with pytest.raises(UsageError, match="--listen"):
        jc.checkpoint_job(members, tmp_path / "job", PluginLikeBackend(("127.0.0.1", 1)), None)
