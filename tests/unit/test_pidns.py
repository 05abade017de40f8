"""host/pidns.py without a namespace: device maps, the manifest's pid_ns, the CRIU image view."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from npusnap_cli.errors import ExitCode, ImageError, PreflightError, UsageError
from npusnap_cli.host import pidns
from npusnap_cli.image.manifest import check_pid_ns
from npusnap_cli.pipelines import replicas
from tests.unit import criufake as fake


def test_device_maps_parse_and_refuse_bad_ones() -> None:
    assert pidns.parse_device_map("0=1") == ((0, 1),)
    assert pidns.parse_device_map("0=2, 1=3") == ((0, 2), (1, 3))
    for bad in ("0", "a=1", "0=1,0=2", "=1", "0=-1"):
        with pytest.raises(UsageError):
            pidns.parse_device_map(bad)


def test_a_container_holds_the_mapped_devices_in_physical_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver numbers a container's devices from 0 in physical order: image devices 0..n-1
    can reach n ascending devices, nothing else. (On a node of 8 devices, whatever simulator
    runs here now.)"""
    from types import SimpleNamespace

    from npusnap_cli.device import occupancy

    monkeypatch.setattr(occupancy, "node_devices", lambda simulated=False: list(range(8)))

    def image(*devs: int) -> SimpleNamespace:
        return SimpleNamespace(npu_processes=[SimpleNamespace(devices=list(devs))])

    assert pidns.container_devices(image(0), ((0, 3),)) == [3]
    assert pidns.container_devices(image(0, 1), ((0, 2), (1, 3))) == [2, 3]
    assert pidns.container_devices(image(0, 1), ((1, 3),)) == [0, 3]
    for img, dm in (
        (image(0, 1), ((0, 3), (1, 2))),  # not ascending
        (image(0, 1), ((0, 1),)),  # device 1 twice
        (image(1), ((1, 0),)),  # ids 0 and 1 would both reach device 0
        (image(0), ((2, 1),)),  # not a device of the image
    ):
        with pytest.raises(UsageError):
            pidns.container_devices(img, dm)


def test_manifest_pid_ns_is_checked() -> None:
    assert check_pid_ns(None) == {}
    assert check_pid_ns({"4321": 1, "4322": 2}) == {"4321": 1, "4322": 2}
    for bad in ({"x": 1}, {"4321": 0}, {"4321": 2}, [1], {"4321": "1"}):
        with pytest.raises(ImageError):
            check_pid_ns(bad)


def test_a_tree_in_our_own_namespace_has_no_map() -> None:
    assert pidns.namespace_pids(os.getpid(), [os.getpid()]) == {}
    assert pidns.ns_pids(os.getpid())[-1] > 1 or pidns.ns_pids(os.getpid()) == [1]


def test_the_view_renames_only_the_agent_sockets_of_the_image(tmp_path: Path) -> None:
    """files.img rewritten (through pycriu) in a view of symlinks; the image itself untouched."""
    import pycriu

    criu = tmp_path / "criu"
    criu.mkdir()
    sk = {
        "id": 1,
        "ino": 10,
        "type": 1,
        "state": 10,
        "flags": 2,
        "uflags": 0,
        "backlog": 8,
        "peer": 0,
        "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0},
        "opts": {
            "so_sndbuf": 1,
            "so_rcvbuf": 1,
            "so_snd_tmo_sec": 0,
            "so_snd_tmo_usec": 0,
            "so_rcv_tmo_sec": 0,
            "so_rcv_tmo_usec": 0,
        },
    }
    entries = [
        {"type": "UNIXSK", "id": 1, "usk": {**sk, "name": "/run/npusnap/4321.sock=00"}},
        {"type": "UNIXSK", "id": 2, "usk": {**sk, "id": 2, "name": "/tmp/pymp-x/listener-y=00"}},
        {"type": "UNIXSK", "id": 3, "usk": {**sk, "id": 3, "name": "/run/npusnap/999.sock=00"}},
    ]
    with open(criu / "files.img", "wb") as f:
        pycriu.images.dump({"magic": "FILES", "entries": entries}, f)
    (criu / "pages-1.img").write_bytes(b"x")

    class P:
        pid = 4321

    class M:
        processes = (P(),)

    before = (criu / "files.img").read_bytes()
    view = pidns.criu_view(criu, M())
    try:
        assert os.readlink(view / "pages-1.img") == str(criu / "pages-1.img")
        with open(view / "files.img", "rb") as f:
            names = [e["usk"]["name"] for e in pycriu.images.load(f)["entries"]]
        assert names[0].startswith("/run/npusnap/4321-") and names[0].endswith(".sock=00")
        assert names[1:] == ["/tmp/pymp-x/listener-y=00", "/run/npusnap/999.sock=00"]
        assert (criu / "files.img").read_bytes() == before
    finally:
        pidns.drop_view(view)
    assert not view.exists()


def test_the_view_renames_agent_sockets_in_a_runtime_dir_of_any_name(tmp_path: Path) -> None:
    """NPUSNAP_RUNTIME_DIR may name any directory: the agent sockets are known from the manifest,
    and a restored copy must not bind its original's name there either."""
    import pycriu

    fake.unix_image(tmp_path / "criu", [("/srv/rt/4321.sock=00", 1, 10), ("/srv/rt/999.sock=00", 1, 10)])

    class P:
        pid = 4321
        agent_socket = "/srv/rt/4321.sock"

    class M:
        processes = (P(),)

    view = pidns.criu_view(tmp_path / "criu", M())
    try:
        with open(view / "files.img", "rb") as f:
            names = [e["usk"]["name"] for e in pycriu.images.load(f)["entries"]]
        assert names[0].startswith("/srv/rt/4321-") and names[0].endswith(".sock=00"), names
        assert names[1] == "/srv/rt/999.sock=00"
    finally:
        pidns.drop_view(view)


def test_image_listeners_are_the_bound_listening_streams_but_the_agents(tmp_path: Path) -> None:
    from npusnap_cli.host import hostres

    fake.unix_image(
        tmp_path / "criu",
        [
            ("/run/npusnap/4321.sock=00", 1, 10),  # the agent: renamed at restore
            ("/tmp/pymp-x/listener-y=00", 1, 10),  # a DataLoader worker's listener
            ("/tmp/pymp-x/conn=00", 1, 1),  # bound, connected: not a listener
            ("/run/sim/npusim.sock=00", 2, 10),  # a datagram socket: never listens
        ],
    )
    got = hostres.image_listeners(tmp_path / "criu", ["/run/npusnap/4321.sock"])
    assert got == ["/tmp/pymp-x/listener-y"]
    assert hostres.live_listeners(got) == {}
    assert hostres.image_listeners(tmp_path / "nothing") == []


def test_live_listeners_names_the_process_listening_on_a_path(tmp_path: Path) -> None:
    import socket

    from npusnap_cli.host import hostres

    path = str(tmp_path / "listener")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sk:
        sk.bind(path)
        assert hostres.live_listeners([path]) == {}  # bound, not listening: nothing to take over
        sk.listen(1)
        got = hostres.live_listeners([path, str(tmp_path / "other")])
        assert list(got) == [path] and got[path][0] == os.getpid(), got
    assert hostres.live_listeners([path]) == {}  # closed: its file is stale


def test_the_output_file_is_the_regular_file_at_fd_1(tmp_path: Path) -> None:
    from types import SimpleNamespace

    m = SimpleNamespace(pid_ns=False, root_pid=40)
    assert pidns.output_file_of(tmp_path, m) is None
    fake.write(tmp_path / "ids-40.img", "IDS", [fake.ids(1, 9)])
    fake.write(tmp_path / "fdinfo-9.img", "FDINFO", [fake.fdinfo(5, 0, "TTY"), fake.fdinfo(6, 1, "REG")])
    fake.write(tmp_path / "files.img", "FILES", [fake.reg(5, "/dev/null"), fake.reg(6, "/srv/out.log")])
    assert pidns.output_file_of(tmp_path, m) == "/srv/out.log"
    fake.write(tmp_path / "files.img", "FILES", [fake.usk(6, "/run/x.sock=00")])
    assert pidns.output_file_of(tmp_path, m) is None
    fake.write(
        tmp_path / "files.img", "FILES", [fake.reg(6, "out.log")]
    )  # not a path: not a file of the host
    assert pidns.output_file_of(tmp_path, m) is None
    assert pidns.output_file_of(tmp_path, SimpleNamespace(pid_ns=True, root_pid=40)) is None  # no ids-1.img


def _real_cann_image() -> object:
    return SimpleNamespace(
        pid_ns={"root": 1},
        versions=SimpleNamespace(cann_simulated=False, cann="8.0.RC3"),
        npu_processes=[SimpleNamespace(devices=[0], visible_devices=None)],
        processes=[],
    )


def test_a_device_map_of_a_real_cann_image_is_refused_saying_why() -> None:
    """On a real node the container decides which device an id reaches: npusnap makes none."""
    with pytest.raises(PreflightError) as err:
        pidns.check_device_map(_real_cann_image(), ((0, 1),))
    assert err.value.exit_code == ExitCode.PREFLIGHT
    assert "--device-map is only possible on the simulated NPU" in err.value.message
    assert "container" in (err.value.why or "") and "container" in (err.value.fix or "")
    pidns.check_device_map(_real_cann_image(), ())  # no map: nothing to refuse


def test_replicas_of_a_real_cann_npu_image_are_refused_before_asking_for_device_maps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Asking for --device-map first would send the operator to an option refused in turn."""
    monkeypatch.setattr(replicas, "load_manifest", lambda directory: _real_cann_image())
    with pytest.raises(PreflightError) as err:
        replicas.check(tmp_path, 2, [])
    assert err.value.message.startswith("--replicas 2 is only possible on the simulated NPU")
