"""The pieces that keep a dump from publishing an image its restore would refuse: zombies in the
tree and the manifest, CRIU's process tree against the manifest, the agent socket name of a
restored copy, and publishing that verifies before the rename. No root, no CRIU."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from npusnap_cli.errors import BusyError, ImageError
from npusnap_cli.host import proctree
from npusnap_cli.image import imagetrust, integrity, layout, publishing
from npusnap_cli.image.manifest import Manifest, ProcessEntry
from tests.unit.test_image import _build, _manifest


def _write_pstree(tmp: Path, pids: list[int]) -> None:
    import pycriu

    entries = [
        {"pid": p, "ppid": 0 if i == 0 else pids[0], "pgid": pids[0], "sid": pids[0]}
        for i, p in enumerate(pids)
    ]
    with open(layout.criu_dir(tmp) / "pstree.img", "wb") as f:
        pycriu.images.dump({"magic": "PSTREE", "entries": entries}, f)


def test_a_zombie_is_listed_only_when_it_is_one() -> None:
    m = _manifest()
    plain = m.processes[0]
    assert "zombie" not in plain.to_dict()  # the common manifest is unchanged
    z = ProcessEntry(pid=1236, ppid=1234, cmdline=(), uid=0, agent=False, zombie=True)
    assert z.to_dict()["zombie"] is True
    back = Manifest.from_json(replace(m, processes=(*m.processes, z)).to_json())
    assert [p.zombie for p in back.processes] == [False, False, True]


def test_a_zombie_with_an_agent_is_refused() -> None:
    m = _manifest()
    z = replace(m.processes[0], zombie=True)
    with pytest.raises(ImageError, match="zombie"):
        imagetrust.check_manifest(replace(m, processes=(z, m.processes[1])))


def test_a_restored_copys_socket_name_is_accepted_only_in_a_pid_ns_image() -> None:
    m = _manifest()
    npu = replace(m.processes[1], agent_socket="/run/npusnap/20803-0a1b2c3d.sock")
    copy = replace(m, processes=(m.processes[0], npu))
    with pytest.raises(ImageError, match="agent_socket"):
        imagetrust.check_manifest(copy)  # a job in the host's pid namespace listens as <pid>.sock
    imagetrust.check_manifest(replace(copy, pid_ns={"1234": 1, "1235": 2}))
    for bad in ("20803-0a1b2c3.sock", "20803-0A1B2C3D.sock", "x-0a1b2c3d.sock", "20803-0a1b2c3d.sock.x"):
        odd = replace(
            copy,
            pid_ns={"1234": 1, "1235": 2},
            processes=(m.processes[0], replace(npu, agent_socket=f"/run/npusnap/{bad}")),
        )
        with pytest.raises(ImageError, match="agent_socket"):
            imagetrust.check_manifest(odd)


def test_verify_checks_criu_s_process_tree_against_the_manifest(tmp_path: Path) -> None:
    tmp, final = _build(tmp_path)
    _write_pstree(tmp, [1234, 1235, 1236])  # CRIU dumped a child the manifest does not list
    m = _manifest(publishing.file_entries(tmp))
    with pytest.raises(ImageError) as exc:
        publishing.publish(
            tmp, final, m, check=lambda work: integrity.verify(work, checksums=False, unpublished=True)
        )
    assert "are not the image's [1234, 1235, 1236]" in exc.value.message
    assert not final.exists() and tmp.is_dir(), "an image that fails its check is not published"
    z = ProcessEntry(pid=1236, ppid=1234, cmdline=(), uid=0, agent=False, zombie=True)
    m = replace(m, processes=(*m.processes, z))
    publishing.publish(
        tmp, final, m, check=lambda work: integrity.verify(work, checksums=False, unpublished=True)
    )
    assert integrity.verify(final).manifest.processes[-1].zombie


def test_a_failing_check_leaves_the_old_image_in_place(tmp_path: Path) -> None:
    tmp, final = _build(tmp_path)
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    before = (final / layout.MANIFEST_NAME).read_bytes()
    tmp2 = layout.create_temp_image(final)
    (layout.criu_dir(tmp2) / "pages-1.img").write_bytes(b"\x03" * 10)

    def refuse(_work: Path) -> None:
        raise ImageError("planted")

    with pytest.raises(ImageError, match="planted"):
        publishing.publish(tmp2, final, _manifest(publishing.file_entries(tmp2)), force=True, check=refuse)
    assert (final / layout.MANIFEST_NAME).read_bytes() == before
    integrity.verify(final)


def test_a_work_directory_is_not_an_image_unless_the_dump_checks_it(tmp_path: Path) -> None:
    tmp, _final = _build(tmp_path)
    from npusnap_cli.image.manifest import write_manifest

    write_manifest(tmp, _manifest(publishing.file_entries(tmp)))
    with pytest.raises(ImageError, match="work directory"):
        integrity.verify(tmp)
    assert integrity.verify(tmp, checksums=False, unpublished=True).leftovers == ()


def test_the_process_tree_lists_an_unreaped_child() -> None:
    child = os.fork()
    if child == 0:  # pragma: no cover - the child exits at once
        os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            tree = {p.pid: p for p in proctree.process_tree(os.getpid())}
            if child in tree and tree[child].zombie:
                break
            time.sleep(0.01)
        info = tree[child]
        assert info.zombie and info.cmdline == () and not info.has_agent and not info.uses_npu
        assert info.ppid == os.getpid()
    finally:
        os.waitpid(child, 0)


def test_a_pid_still_used_as_a_session_id_is_not_free() -> None:
    """The leader of a session exited and was reaped; a process it left in its session keeps the
    number taken (CRIU's clone of that pid fails with EEXIST): restore's pid check finds it."""
    import subprocess

    from npusnap_cli.pipelines import restore

    leader = subprocess.Popen(
        ["sh", "-c", "sleep 30 & echo $!"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert leader.stdout is not None
    left = int(leader.stdout.readline())
    leader.wait()
    try:
        assert restore._group_ids_in_use({leader.pid}) == {leader.pid: left}
        m = replace(
            _manifest(), root_pid=leader.pid, processes=(replace(_manifest().processes[0], pid=leader.pid),)
        )
        with pytest.raises(BusyError) as exc:
            restore.check_pids_free(m, [leader.pid])
        assert f"the session or process group of pid {left}" in str(exc.value)
    finally:
        os.kill(left, 9)  # not our child: init reaps it
