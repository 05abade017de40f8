"""hostres: pipes/terminals to outside the tree, tmpfs files; criu: failures with a known cause."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from npusnap_cli import criu
from npusnap_cli.criu import binary as criu_binary
from npusnap_cli.errors import ImageError, PreflightError
from npusnap_cli.host import hostres
from npusnap_cli.image import hostrecords


def test_a_pipe_to_a_process_outside_the_tree_is_found_and_refused() -> None:
    reader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        writer = subprocess.Popen(["sleep", "30"], stdout=reader.stdin)
        try:
            found = hostres.find_external_stdio([writer.pid])
            pipes = [e for e in found if e.kind == "pipe" and e.fd == 1]
            assert pipes and reader.pid in pipes[0].peers, found
            err = hostres.external_stdio_error(found, shell_job=False)
            assert isinstance(err, PreflightError)
            assert "--external-pipes" in err.fix and "pipe to a process outside" in err.message
            # The same pipe with both ends inside the tree is fine.
            assert not [e for e in hostres.find_external_stdio([writer.pid, reader.pid]) if e.kind == "pipe"]
        finally:
            writer.kill()
            writer.wait()
    finally:
        reader.kill()
        reader.wait()


def test_a_stray_pipe_on_another_fd_is_only_warned_about() -> None:
    e = hostres.ExternalStdio(pid=1, fd=7, key="pipe:[1]", kind="pipe", peers=(2,))
    assert hostres.external_stdio_error([e], shell_job=False) is None
    assert hostres.stray_pipes([e]) == [e]


def test_a_terminal_needs_shell_job() -> None:
    e = hostres.ExternalStdio(pid=1, fd=1, key="/dev/pts/3", kind="tty", peers=())
    err = hostres.external_stdio_error([e], shell_job=False)
    assert err is not None and "--shell-job" in err.fix
    assert hostres.external_stdio_error([e], shell_job=True) is None


def test_tmpfs_files_are_saved_and_changes_refused(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or "/dev/shm" not in hostres.tmpfs_mounts():
        pytest.skip("/dev/shm is not a tmpfs mount here")
    seg = shm / f"npusnap-unit-{os.getpid()}"
    seg.write_bytes(b"dump-time contents")
    holder = subprocess.Popen(["sleep", "30"], stdin=open(seg, "rb"))  # noqa: SIM115
    try:
        assert str(seg) in hostres.find_tmpfs_files([holder.pid])
        image = tmp_path / "img"
        image.mkdir()
        (saved,) = hostres.save_files([str(seg)], image)
        assert (image / saved.rel).read_bytes() == b"dump-time contents"
        assert hostres.check_put_back((saved,), replace=False) == []  # unchanged: nothing to do
        seg.write_bytes(b"changed")
        with pytest.raises(PreflightError, match="changed since the dump"):
            hostres.check_put_back((saved,), replace=False)
        assert hostres.check_put_back((saved,), replace=True) == [saved]
        seg.unlink()
        todo = hostres.check_put_back((saved,), replace=False)
        assert hostres.put_back(todo, image) == [str(seg)]
        assert seg.read_bytes() == b"dump-time contents"
    finally:
        holder.kill()
        holder.wait()
        seg.unlink(missing_ok=True)


def test_a_lock_file_where_root_alone_may_write_passes_only_while_it_is_there(tmp_path: Path) -> None:
    """Restore never writes a host file as root where its owner could not have made it; one that
    is there as the image has it needs no writing and passes. Gone, changed, another owner's or
    reached through a symlink, it is refused, and the refusal names its copy in the image."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the rule is about a root job's file in a root-only directory")
    private = tmp_path / "private"
    private.mkdir(mode=0o755)
    lock = private / "job.lock"
    lock.write_bytes(b"locked by the job\n")
    image = tmp_path / "img"
    image.mkdir()
    (saved,) = hostres.save_files([str(lock)], image)
    # Only a directory of the owner's own (not root's) or a sticky one counts as one they could
    # have made the file in: for a root job, tmp_path's parents (a sticky /tmp) must not count.
    mounts = [m for m in hostres.tmpfs_mounts() if not str(lock).startswith(m.rstrip("/") + "/")]
    os.chmod(tmp_path, 0o755)
    problem = hostrecords.place_problem(saved, mounts)
    if problem is not None and "could not have created" not in problem:
        pytest.skip(f"tmp_path is in a place root's files may be written anyway: {problem}")
    assert problem is None, problem
    assert hostres.check_put_back((saved,), replace=False) == []
    lock.write_bytes(b"changed\n")
    problem = hostrecords.place_problem(saved, mounts)
    assert problem is not None and "hostfiles" + str(lock) in problem, problem
    lock.unlink()
    assert hostrecords.place_problem(saved, mounts) is not None
    other = tmp_path / "elsewhere.lock"
    other.write_bytes(b"locked by the job\n")
    lock.symlink_to(other)
    assert hostrecords.place_problem(saved, mounts) is not None
    lock.unlink()
    lock.write_bytes(b"locked by the job\n")
    os.chown(lock, 1, 1)
    assert hostrecords.place_problem(saved, mounts) is not None


def test_host_file_paths_in_a_manifest_are_checked() -> None:
    good = {"path": "/dev/shm/x", "size": 1, "mode": 0o600, "uid": 0, "gid": 0, "sha256": "0" * 64}
    assert hostres.HostFile.from_dict(good).rel == "hostfiles/dev/shm/x"
    for bad in ("dev/shm/x", "/dev/shm/../../etc/passwd", "/dev//shm/x"):
        with pytest.raises(ImageError):
            hostres.HostFile.from_dict(dict(good, path=bad))


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        (
            "(00.1) Error (criu/files-reg.c:2175): File tmp/j.log has bad size 30 (expect 10)",
            "/tmp/j.log changed",
        ),
        (
            "(00.1) Error (criu/files-reg.c:1122): Can't create link remap for /dev/shm/sem.x. Use",
            "deleted file",
        ),
        ("(00.1) Error (criu/sockets.c:1): sockets: Can't get 1:16 opt: Operation not supported", "TCP/UDP"),
        (
            "(00.1) Error (criu/files-reg.c:1159): Can't link remap to /dev/shm/sem.x: File exists",
            "left in /dev/shm by an earlier dump",
        ),
    ],
)
def test_criu_failures_with_a_known_cause_get_their_own_message(line: str, expect: str) -> None:
    known = criu._known_failure([line])
    assert known is not None and expect in known[0]
    assert known[2]  # a fix


def test_criu_below_4_2_cannot_dump_inet_sockets_on_kernels_that_refuse_passcred(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(criu_binary, "kernel_refuses_inet_passcred", lambda: True)
    assert not criu.inet_sockets_supported(criu.CriuBinary("/x", "4.1.1"))
    assert criu.inet_sockets_supported(criu.CriuBinary("/x", "4.2.1"))
    monkeypatch.setattr(criu_binary, "kernel_refuses_inet_passcred", lambda: False)
    assert criu.inet_sockets_supported(criu.CriuBinary("/x", "4.1.1"))


def _node(path: str, kind: str = "dir", mode: int = 0o750) -> hostres.HostNode:
    return hostres.HostNode(path=path, kind=kind, mode=mode, uid=os.getuid(), gid=os.getgid(), why="test")


def test_host_nodes_are_made_parents_first_with_mode_and_undone(tmp_path: Path) -> None:
    nodes = [_node(str(tmp_path / "a")), _node(str(tmp_path / "a" / "b"), mode=0o711)]
    nodes.append(_node(str(tmp_path / "a" / "b" / "f"), kind="fifo", mode=0o640))
    todo = hostres.check_host_nodes(nodes)
    assert todo == nodes
    made = hostres.make_host_nodes(todo)
    assert made == [n.path for n in nodes]
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == 0o711
    assert stat.S_ISFIFO(os.stat(tmp_path / "a" / "b" / "f").st_mode)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b" / "f").st_mode) == 0o640
    assert hostres.check_host_nodes(nodes) == []
    hostres.remove_host_nodes(made)
    assert not (tmp_path / "a").exists()


def test_host_nodes_never_follow_a_planted_symlink(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "a").symlink_to(tmp_path / "elsewhere")
    if os.geteuid() == 0:
        os.lchown(tmp_path / "a", 65534, 65534)  # root's own symlinks (/var/run) are followed
    node = _node(str(tmp_path / "a" / "b"))
    with pytest.raises(PreflightError):
        hostres.make_host_nodes([node])
    assert not (tmp_path / "elsewhere" / "b").exists()


def test_host_node_of_a_wrong_type_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(PreflightError, match="is not a directory"):
        hostres.check_host_nodes([_node(str(tmp_path / "f"))])


def test_host_node_paths_from_a_manifest_are_checked() -> None:
    good = _node("/tmp/pymp-x").to_dict()
    assert hostres.HostNode.from_dict(good).path == "/tmp/pymp-x"
    for path in ("tmp/x", "/tmp/../etc", "/", "/tmp//x"):
        with pytest.raises(ImageError):
            hostres.HostNode.from_dict({**good, "path": path})
    with pytest.raises(ImageError):
        hostres.HostNode.from_dict({**good, "kind": "socket"})


def test_a_leftover_semaphore_nobody_holds_gets_its_dump_time_value_back(tmp_path: Path) -> None:
    """A killed --pid-ns job's spawn semaphores stay in /dev/shm, changed since the dump: put
    back when no process holds one; refused while one does (a running original's)."""
    if "/dev/shm" not in hostres.tmpfs_mounts():
        pytest.skip("/dev/shm is not a tmpfs mount here")
    sem = Path("/dev/shm") / f"sem.npusnap-unit-{os.getpid()}"
    sem.write_bytes(b"\x01" * 32)
    try:
        image = tmp_path / "img"
        image.mkdir()
        (saved,) = hostres.save_files([str(sem)], image)
        sem.write_bytes(b"\x00" * 32)
        holder = subprocess.Popen(["sleep", "30"], stdin=open(sem, "rb"))  # noqa: SIM115
        try:
            with pytest.raises(PreflightError, match="changed since the dump"):
                hostres.check_put_back((saved,), replace=False)
        finally:
            holder.kill()
            holder.wait()
        assert hostres.check_put_back((saved,), replace=False) == [saved]
        hostres.put_back([saved], image)
        assert sem.read_bytes() == b"\x01" * 32
    finally:
        sem.unlink(missing_ok=True)


def test_host_records_read_back_what_they_write_and_name_a_bad_field() -> None:
    stdio = hostrecords.ExternalStdio(pid=7, fd=1, key="pipe:[42]", kind="pipe", peers=(3, 4))
    assert list(stdio.to_dict()) == ["pid", "fd", "key", "kind", "peers"]
    assert hostrecords.ExternalStdio.from_dict(stdio.to_dict()) == stdio
    assert hostrecords.ExternalStdio.from_dict({**stdio.to_dict(), "peers": None}).peers == ()
    saved = {"path": "/dev/shm/x", "size": 1, "mode": 0o600, "uid": 0, "gid": 0, "sha256": "0" * 64}
    f = hostrecords.HostFile.from_dict({**saved, "remap": True})
    assert f.remap and f.to_dict()["remap"] is True and hostrecords.HostFile.from_dict(f.to_dict()) == f
    node = _node("/tmp/pymp-x")
    assert hostrecords.HostNode.from_dict(node.to_dict()) == node
    assert hostrecords.HostNode.from_dict({**node.to_dict(), "why": None}).why == ""
    bad = [
        (
            hostrecords.ExternalStdio,
            {k: v for k, v in stdio.to_dict().items() if k != "fd"},
            "'fd' is missing",
        ),
        (hostrecords.ExternalStdio, {**stdio.to_dict(), "peers": ["3"]}, "'peers' holds a str"),
        (hostrecords.HostFile, {**saved, "size": "1"}, "'size' is a str, not an integer"),
        (hostrecords.HostFile, {**saved, "remap": 1}, "'remap' is a int, not a boolean"),
        (hostrecords.HostNode, {**node.to_dict(), "uid": True}, "'uid' is a bool, not an integer"),
    ]
    for cls, data, why in bad:
        with pytest.raises(ImageError, match=why):
            cls.from_dict(data)  # type: ignore[attr-defined]
