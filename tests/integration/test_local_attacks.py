"""A local user against root's writes: symlinks and pre-created names at every path that restore,
export, import and --pidfile write as root, and crafted images and archives.

The attacker is a real unprivileged user (``nobody``, or one made with useradd), acting through
processes of their own; root's side is npusnap's own code (safefs.py, hostres/, pidfile.py,
archive.py) or its CLI. Every test checks that the victim (a root-only directory or file) is
untouched, not only that an error came out.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from npusnap_cli import safefs
from npusnap_cli.errors import ExitCode, ImageError, PreflightError, UsageError
from npusnap_cli.host import hostres, pidfile
from npusnap_cli.image import archive, digest, layout, publishing
from npusnap_cli.image.manifest import load_manifest
from tests.integration.dumplib import NPUSNAP, cli
from tests.unit.test_image import _build, _manifest

pytestmark = pytest.mark.integration


def _attacker() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", "npusnap-attacker"], check=True)
        pw = pwd.getpwnam("npusnap-attacker")
    return pw.pw_uid, pw.pw_gid


@pytest.fixture
def attacker() -> tuple[int, int]:
    if os.geteuid() != 0:
        pytest.skip("root's writes are what is attacked: needs root")
    return _attacker()


def as_user(ids: tuple[int, int], script: str) -> None:
    """Run ``sh -c script`` as the attacker (their own process: their own rights only)."""
    subprocess.run(["sh", "-c", script], user=ids[0], group=ids[1], check=True, timeout=30)


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A root-only directory the attacker wants root to write into."""
    d = tmp_path / "root-only"
    d.mkdir(mode=0o700)
    (d / "precious").write_text("root's\n")
    yield d
    assert (d / "precious").read_text() == "root's\n"


def _untouched(victim: Path) -> None:
    assert sorted(p.name for p in victim.iterdir()) == ["precious"], list(victim.iterdir())


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory the attacker can reach (pytest's tmp_path sits under a root-only one)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="npusnap-atk-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir(attacker: tuple[int, int]) -> Iterator[Path]:
    d = Path("/dev/shm") / f"npusnap-atk-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    with __import__("contextlib").suppress(FileNotFoundError):
        d.unlink()
    as_user(attacker, f"mkdir {d}")
    yield d
    if d.is_symlink():
        d.unlink()
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(f"{d}.away", ignore_errors=True)


def _host_file(image_dir: Path, path: str, uid: int, gid: int, mode: int = 0o600) -> hostres.HostFile:
    copy = image_dir / ("hostfiles" + path)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(b"job data\n")
    return hostres.HostFile(
        path=path, size=9, mode=mode, uid=uid, gid=gid, digest=digest.of_file(copy, digest.DEFAULT)
    )


# --------------------------------------------------------------------------------------------
# restore's put-back of tmpfs files
# --------------------------------------------------------------------------------------------


def test_put_back_writes_the_file_as_the_job_had_it(
    attacker: tuple[int, int], shm_dir: Path, tmp_path: Path
) -> None:
    f = _host_file(tmp_path, f"{shm_dir}/sub/data", *attacker, mode=0o640)
    todo = hostres.check_put_back((f,), replace=False, uids={attacker[0]})
    assert hostres.put_back(todo, tmp_path) == [f.path]
    st = os.lstat(f.path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (*attacker, 0o640)
    assert os.stat(shm_dir / "sub").st_uid == attacker[0]  # a missing parent is made theirs
    assert Path(f.path).read_bytes() == b"job data\n"


@pytest.mark.parametrize("when", ["before the check", "between the check and the write"])
def test_put_back_never_follows_a_symlinked_parent(
    attacker: tuple[int, int], shm_dir: Path, victim: Path, tmp_path: Path, when: str
) -> None:
    """The user swaps their directory for a symlink to a root-only one: root must not write there."""
    f = _host_file(tmp_path, f"{shm_dir}/data", *attacker)
    swap = f"mv {shm_dir} {shm_dir}.away && ln -s {victim} {shm_dir}"
    if when == "before the check":
        as_user(attacker, swap)
        with pytest.raises(PreflightError) as exc:
            hostres.check_put_back((f,), replace=False, uids={attacker[0]})
    else:
        todo = hostres.check_put_back((f,), replace=False, uids={attacker[0]})
        as_user(attacker, swap)
        with pytest.raises(PreflightError) as exc:
            hostres.put_back(todo, tmp_path)
    assert "symbolic link" in exc.value.message
    _untouched(victim)


def test_put_back_refuses_another_users_directory(
    attacker: tuple[int, int], shm_dir: Path, tmp_path: Path
) -> None:
    """A file of uid X is never written into a directory a third user owns (they could swap it)."""
    f = _host_file(tmp_path, f"{shm_dir}/data", 4242, 4242)
    with pytest.raises(PreflightError) as exc:
        hostres.check_put_back((f,), replace=False, uids={4242})
    assert "owned by uid" in exc.value.message
    assert not Path(f.path).exists()


def test_put_back_replaces_a_planted_symlink_at_the_name(
    attacker: tuple[int, int], shm_dir: Path, victim: Path, tmp_path: Path
) -> None:
    f = _host_file(tmp_path, f"{shm_dir}/data", *attacker)
    as_user(attacker, f"ln -s {victim}/precious {shm_dir}/data")
    with pytest.raises(PreflightError):  # not a regular file: refused without --replace
        hostres.check_put_back((f,), replace=False, uids={attacker[0]})
    hostres.put_back([f], tmp_path)  # with --replace-tmpfs-files: the link is replaced, not followed
    assert not os.path.islink(f.path) and Path(f.path).read_bytes() == b"job data\n"


# --------------------------------------------------------------------------------------------
# --pidfile and export
# --------------------------------------------------------------------------------------------


def test_pidfile_never_writes_through_a_users_link(
    attacker: tuple[int, int], victim: Path, open_dir: Path
) -> None:
    shared = open_dir / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o1777)  # like /tmp
    # A planted symlink at the name itself is replaced, never followed.
    as_user(attacker, f"ln -s {victim}/precious {shared}/job.pid")
    pidfile.write(shared / "job.pid", 4321)
    assert not (shared / "job.pid").is_symlink() and (shared / "job.pid").read_text() == "4321\n"
    # A predictable temporary name (".NAME.tmp-PID") planted for every pid we might have: unused.
    as_user(attacker, f"ln -s {victim}/precious {shared}/.job2.pid.tmp-{os.getpid()}")
    pidfile.write(shared / "job2.pid", 4322)
    # A directory of the path swapped for the user's symlink: refused.
    as_user(attacker, f"mkdir {shared}/d && ln -s {victim} {shared}/link")
    with pytest.raises(UsageError) as exc:
        pidfile.write(shared / "link" / "job.pid", 1)
    assert "symbolic link" in exc.value.why
    _untouched(victim)


@pytest.fixture
def small_image(tmp_path: Path) -> Path:
    tmp, final = _build(tmp_path, "img")
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    return final


def test_export_never_writes_through_a_planted_temporary_name(
    attacker: tuple[int, int], victim: Path, open_dir: Path, small_image: Path
) -> None:
    out = open_dir / "out"
    out.mkdir()
    os.chmod(out, 0o1777)
    dest = out / "a.tar.zst"
    as_user(attacker, f"ln -s {victim}/precious {out}/.a.tar.zst.npusnap-tmp-{os.getpid()}")
    archive.export(small_image, dest)
    assert archive.verify(dest).files_checked == len(load_manifest(small_image).files)
    assert sorted(p.name for p in out.iterdir()) == [
        ".a.tar.zst.npusnap-tmp-" + str(os.getpid()),
        "a.tar.zst",
    ]


def test_safefs_refuses_links_at_every_depth(attacker: tuple[int, int], victim: Path, open_dir: Path) -> None:
    base = open_dir / "tree"
    base.mkdir()
    os.chown(base, *attacker)
    as_user(attacker, f"mkdir -p {base}/a/b && ln -s {victim} {base}/a/c")
    for path in (f"{base}/a/c/x", f"{base}/a/c/b/x"):
        with pytest.raises(safefs.UnsafePath):
            safefs.write_file(path, iter([b"x"]), owner=attacker[0], create_dirs=True)
    safefs.write_file(f"{base}/a/b/x", iter([b"x"]), owner=attacker[0])
    _untouched(victim)


# --------------------------------------------------------------------------------------------
# crafted images and archives
# --------------------------------------------------------------------------------------------


def _crafted(tmp_path: Path, host_path: str, mode: int, uid: int = 0) -> Path:
    """A well-formed image (self-hash right, checksums right) whose host_files aim at host_path."""
    from dataclasses import replace

    tmp, final = _build(tmp_path, "crafted")
    hf = _host_file(tmp, host_path, uid, uid, mode=mode)
    m = replace(_manifest(publishing.file_entries(tmp)), host_files=(hf,))
    publishing.publish(tmp, final, m)
    return final


def _tar(src: Path, dest: Path) -> None:
    """The archive export would write, made without export's checks (as an attacker would)."""
    import tarfile

    import zstandard

    with (
        open(dest, "wb") as fh,
        zstandard.ZstdCompressor().stream_writer(fh) as zw,
        tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
    ):
        tar.add(layout.manifest_path(src), f"{src.name}/{layout.MANIFEST_NAME}")
        for entry in _entries(src):
            tar.add(src / entry, f"{src.name}/{entry}", recursive=False)


def _entries(src: Path) -> list[str]:
    import json

    return [f["path"] for f in json.loads(layout.manifest_path(src).read_text())["files"]]


@pytest.mark.parametrize(
    ("where", "mode", "needle"),
    [
        ("victim", 0o6755, "set-user/group-id"),
        ("victim", 0o755, "not on a tmpfs mount"),
        ("shm", 0o644, "no process of the dumped job"),
    ],
)
def test_crafted_archive_host_files_are_refused_everywhere(
    sim_env: dict[str, str],
    attacker: tuple[int, int],
    victim: Path,
    tmp_path: Path,
    where: str,
    mode: int,
    needle: str,
) -> None:
    target = f"{victim}/evil-suid" if where == "victim" else f"/dev/shm/npusnap-atk-{os.getpid()}-evil"
    uid = 0 if where == "victim" else attacker[0]  # the crafted job runs as root
    crafted = _crafted(tmp_path, target, mode, uid)
    rc, out, err = cli(sim_env, "verify", str(crafted))
    assert rc == ExitCode.IMAGE and out is not None, err
    assert needle in str(out["error"]), out["error"]
    rc, out, err = cli(sim_env, "inspect", str(crafted))
    if rc == 0:  # (a set-id mode is refused even by inspect: the manifest does not parse)
        assert out is not None and out["result"]["host_files"][0]["path"] == target
    if mode & 0o6000 == 0:
        with pytest.raises(ImageError):
            archive.export(crafted, tmp_path / "x.tar.zst")  # export verifies: it does not travel
    arch = tmp_path / "crafted.tar.zst"
    _tar(crafted, arch)
    rc, out, err = cli(sim_env, "import", str(arch), str(tmp_path / "imported"))
    assert rc == ExitCode.IMAGE and out is not None, (rc, err)
    assert not (tmp_path / "imported").exists()
    rc, out, err = cli(sim_env, "restore", str(crafted))
    assert rc in (ExitCode.IMAGE, ExitCode.IMAGE_INCOMPATIBLE), (rc, out, err)
    assert not Path(target).exists()
    _untouched(victim)


def test_pipe_to_never_appends_through_a_users_link(
    attacker: tuple[int, int], victim: Path, open_dir: Path
) -> None:
    """restore --pipe-to FILE appends the job's output as root: not through a user's symlinked
    directory, nor into a symlink or a hard link planted at FILE."""
    shared = open_dir / "logs"
    shared.mkdir()
    os.chown(shared, *attacker)
    as_user(attacker, f"ln -s {victim} {shared}/dir && ln -s {victim}/precious {shared}/sym.log")
    for path in (f"{shared}/dir/job.log", f"{shared}/sym.log"):
        with pytest.raises(OSError):
            safefs.open_append(path)
    theirs = open_dir / "theirs"
    theirs.write_text("another file\n")
    os.link(theirs, shared / "hard.log")  # (root makes it: protected_hardlinks stops the user)
    with pytest.raises(safefs.UnsafePath):
        safefs.open_append(str(shared / "hard.log"))
    fd = safefs.open_append(str(shared / "job.log"))
    os.write(fd, b"line\n")
    os.close(fd)
    assert (shared / "job.log").read_text() == "line\n"
    # The job's user's own log (restore --pipe-to passes the job's uids): theirs to receive; a
    # file of anyone else's is refused.
    as_user(attacker, f"touch {shared}/user.log")
    with pytest.raises(safefs.UnsafePath, match="owned by uid"):
        safefs.open_append(str(shared / "user.log"))
    os.close(safefs.open_append(str(shared / "user.log"), owners={0, attacker[0]}))
    _untouched(victim)


def _crafted_nodes(tmp_path: Path, nodes: tuple[hostres.HostNode, ...], job_uid: int) -> Path:
    """A well-formed image whose manifest asks restore to create ``nodes``; its launcher process
    runs as ``job_uid`` (its worker stays root's)."""
    from dataclasses import replace

    tmp, final = _build(tmp_path, "crafted-nodes")
    m = _manifest(publishing.file_entries(tmp))
    procs = (replace(m.processes[0], uid=job_uid), *m.processes[1:])
    publishing.publish(tmp, final, replace(m, processes=procs, host_nodes=nodes))
    return final


@pytest.mark.parametrize(
    ("job_is_theirs", "mode", "needle"),
    [
        (True, 0o777, "world-writable"),
        (True, 0o700, "could not have created it there"),
        (False, 0o700, "no process of the dumped job"),
    ],
)
def test_crafted_host_nodes_in_a_system_directory_are_refused_everywhere(
    sim_env: dict[str, str],
    attacker: tuple[int, int],
    tmp_path: Path,
    job_is_theirs: bool,
    mode: int,
    needle: str,
) -> None:
    """A manifest is the user's word: a directory and a FIFO it names in a root-only directory
    (here /usr/lib, as /etc would be), owned by another user, are refused by verify, import and
    restore (--dry-run included) and never created."""
    uid, gid = attacker
    where = Path(f"/usr/lib/npusnap-atk-{os.getpid()}")
    nodes = (
        hostres.HostNode(path=str(where), kind="dir", mode=mode, uid=uid, gid=gid, why="unix socket"),
        hostres.HostNode(path=f"{where}/fifo", kind="fifo", mode=0o666, uid=uid, gid=gid, why="fifo"),
    )
    crafted = _crafted_nodes(tmp_path, nodes, uid if job_is_theirs else 0)
    try:
        rc, out, err = cli(sim_env, "verify", str(crafted))
        assert rc == ExitCode.IMAGE and out is not None, err
        assert needle in str(out["error"]), out["error"]
        arch = tmp_path / "crafted.tar.zst"
        _tar(crafted, arch)
        rc, out, err = cli(sim_env, "import", str(arch), str(tmp_path / "imported"))
        assert rc == ExitCode.IMAGE and out is not None, (rc, err)
        assert not (tmp_path / "imported").exists()
        for extra in (["--dry-run"], []):
            rc, out, err = cli(sim_env, "restore", *extra, str(crafted))
            assert rc == ExitCode.IMAGE and out is not None, (extra, rc, out, err)
            assert needle in str(out.get("error") or out["result"]["checks"]), out
        assert not where.exists()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_restore_rechecks_a_host_node_right_before_it_makes_it(
    attacker: tuple[int, int], victim: Path
) -> None:
    """A node the preflight saw present (so it passed) but gone by the time restore makes it is
    checked again as one to create."""
    node = hostres.HostNode(path=f"{victim}/planted", kind="dir", mode=0o777, uid=attacker[0], gid=0, why="x")
    with pytest.raises(ImageError, match="no process of the dumped job"):
        hostres.make_host_nodes([node], uids={0})
    node = hostres.HostNode(path=f"{victim}/planted", kind="dir", mode=0o777, uid=0, gid=0, why="x")
    with pytest.raises(ImageError, match="world-writable"):
        hostres.make_host_nodes([node], uids={0})
    _untouched(victim)


@pytest.mark.parametrize("plant", ["symlink", "hard link", "their file", "fifo"])
def test_run_detach_output_never_appends_through_a_planted_name(
    sim_env: dict[str, str],
    attacker: tuple[int, int],
    victim: Path,
    open_dir: Path,
    tmp_path: Path,
    plant: str,
) -> None:
    """run --detach --output FILE in a world-writable directory (symlink protection may be off):
    refused with exit 2 before anything starts, the file it names untouched."""
    shared = open_dir / "logs"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    out = shared / "job.log"
    if plant == "symlink":
        as_user(attacker, f"ln -s {victim}/precious {out}")
    elif plant == "hard link":
        os.link(victim / "precious", out)  # (root makes it: protected_hardlinks stops the user)
    elif plant == "their file":
        as_user(attacker, f"touch {out}")
    else:
        as_user(attacker, f"mkfifo -m 666 {out}")
    marker = tmp_path / "started"
    try:
        p = subprocess.run(
            [NPUSNAP, "--json", "run", "--detach", "--output", str(out), "--",
             "/bin/sh", "-c", f"echo owned; touch {marker}"],
            env=sim_env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == ExitCode.USAGE, (p.returncode, p.stdout, p.stderr)
        assert json.loads(p.stdout)["error"]["kind"] == "usage"
        time.sleep(0.3)
        assert not marker.exists()  # nothing was started
        if plant == "their file":
            assert out.read_text() == ""
    finally:
        out.unlink()
    _untouched(victim)
    # The same directory and a fresh name: created as ours, the job's output in it.
    p = subprocess.run(
        [NPUSNAP, "run", "--detach", "--output", str(out), "--", "/bin/sh", "-c", "echo mine"],
        env=sim_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout, p.stderr)
    deadline = time.monotonic() + 10
    while "mine" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "mine\n" and out.stat().st_uid == 0


def test_keep_last_in_a_shared_directory_spares_what_a_user_planted(
    attacker: tuple[int, int], open_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dump --keep-last into a sticky directory: a user's folders with forged manifests dated in
    the future neither make root's images look old nor get removed (they are not root's)."""
    import dataclasses

    monkeypatch.setenv("NPUSNAP_STATE_DIR", str(tmp_path / "state"))
    shared = open_dir / "snaps"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    from npusnap_cli.image import imagestore

    ours = []
    for i in range(3):
        tmp, final = _build(shared, f"root-{i}")
        m = dataclasses.replace(
            _manifest(publishing.file_entries(tmp)), created_at=f"2026-11-30T10:0{i}:00+00:00"
        )
        publishing.publish(tmp, final, m)
        assert imagestore.record_own(final)
        ours.append(final)
    forged = (ours[0] / layout.MANIFEST_NAME).read_text().replace("2026-11-30T10:00", "2099-01-01T00:00")
    for i in range(3):
        as_user(
            attacker, f"mkdir -p {shared}/zz-{i}/criu && cat > {shared}/zz-{i}/npusnap.json <<'X'\n{forged}X"
        )
    removed = imagestore.rotate(shared, 2, keep=ours[2])
    assert removed == [str(ours[0])]
    assert ours[1].is_dir() and ours[2].is_dir()
    assert all((shared / f"zz-{i}" / "npusnap.json").is_file() for i in range(3))


def test_criu_never_writes_its_log_through_a_planted_name(victim: Path, tmp_path: Path) -> None:
    """CRIU opens its log and statistics by name, following links and truncating: a hard link or
    symlink planted as restore.log is refused before CRIU runs; the last run's own log is replaced."""
    from npusnap_cli import criu

    work = tmp_path / "logs"
    work.mkdir(mode=0o700)
    os.link(victim / "precious", work / "restore.log")
    with pytest.raises(PreflightError, match="hard link"):
        criu.open_work_dir(str(work), ("restore.log", "stats-restore"))
    (work / "restore.log").unlink()
    (work / "stats-restore").symlink_to(victim / "precious")
    with pytest.raises(PreflightError, match="not a regular file"):
        criu.open_work_dir(str(work), ("restore.log", "stats-restore"))
    (work / "stats-restore").unlink()
    (work / "restore.log").write_text("the last run's log\n")
    os.close(criu.open_work_dir(str(work), ("restore.log", "stats-restore")))
    assert (work / "restore.log").read_text() == "" and (work / "stats-restore").stat().st_nlink == 1
    _untouched(victim)


def test_restore_leaves_a_file_hard_linked_into_the_images_logs_alone(
    sim_env: dict[str, str], runtime_dir: Path, victim: Path, tmp_path: Path
) -> None:
    """A real image whose logs/restore.log is a second name of a file outside it: restore exits 3
    and the file keeps its bytes; with the name removed the same image restores."""
    from tests.integration.dumplib import PY, TRAIN, TRAIN_ARGS, Job, job_env

    env = job_env(sim_env, runtime_dir)
    job = Job(tmp_path, env, [PY, TRAIN, "--steps", "400", *TRAIN_ARGS, "--device", "0"])
    img = tmp_path / "img"
    try:
        job.wait_lines(3)
        rc, out, err = cli(env, "dump", "--leave-running", str(job.pid), str(img))
        assert rc == 0, (out or {}).get("error") or err
        job.proc.kill()
        job.reap()
        log = layout.logs_dir(img) / layout.RESTORE_LOG
        assert not log.exists()
        os.link(victim / "precious", log)
        rc, out, err = cli(env, "restore", str(img))
        assert rc == ExitCode.PREFLIGHT and out is not None, (rc, out, err)
        assert "hard link" in out["error"]["message"], out["error"]
        assert (victim / "precious").read_text() == "root's\n"
        log.unlink()
        rc, out, err = cli(env, "restore", str(img))
        assert rc == 0, (rc, out, err)
        job.restored_pid = job.pid  # (the same pid: the original is gone)
        assert log.stat().st_nlink == 1 and log.stat().st_size > 0
    finally:
        job.cleanup()


def _attackers_python() -> str:
    """A python3 of the system's for the attacker (the venv's is under root-only directories)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("the attacker needs a python3 of the system's: none in /usr/bin or /bin")
    return python


def _attackers_dir(attacker: tuple[int, int], path: str) -> Path:
    """A fresh directory of the attacker's own at ``path``."""
    shutil.rmtree(path, ignore_errors=True)
    as_user(attacker, f"mkdir {path}")
    return Path(path)


def _script(path: Path, text: str) -> Path:
    """``text`` as a script anyone may read."""
    path.write_text(text)
    os.chmod(path, 0o644)
    return path


def _roots_job(
    sim_env: dict[str, str], tmp_path: Path, runtime_dir: Path
) -> tuple[dict[str, str], subprocess.Popen[bytes]]:
    """A workload of root's under `npusnap run`, its agent in ``runtime_dir`` (made here)."""
    from tests.integration.agentlib import PY, workload_env, write_workload
    from tests.integration.conftest import Sim

    runtime_dir.mkdir(mode=0o700)
    env = workload_env(Sim(sim_env), runtime_dir, NPUSNAP_STATE_DIR=str(tmp_path / "state"))
    real = subprocess.Popen(
        [PY, "-m", "npusnap_cli", "run", "--", PY, str(write_workload(tmp_path))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    return env, real


SILENT_AGENTS = """
import os, socket, sys, time
d, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    if os.fork() == 0:
        s = socket.socket(socket.AF_UNIX)
        # One of them named as a replica's agent socket is (<original pid>-<tag>.sock).
        s.bind(f"{d}/{os.getpid()}.sock" if i else f"{d}/1-abcdef01.sock")
        s.listen(128)
        open(f"{d}/ready-{i}", "w").close()
        time.sleep(120)  # accepts (the kernel does), never answers
        os._exit(0)
time.sleep(120)
"""


def test_ps_is_not_slowed_by_silent_fake_agents(
    sim_env: dict[str, str], attacker: tuple[int, int], open_dir: Path, tmp_path: Path
) -> None:
    """A hundred listening sockets of an unprivileged user that look like agents and never
    answer: root's ps still ends within 3 s, names each of them in a warning, and lists a real
    agent of root's with its state."""
    from tests.integration.agentlib import wait_socket

    n = 100
    python = _attackers_python()
    fakes = _attackers_dir(attacker, f"/tmp/npusnap-fake-{os.getpid()}")  # agent-looking
    script = _script(open_dir / "silent.py", SILENT_AGENTS)
    faker = subprocess.Popen(
        [python, str(script), str(fakes), str(n)], user=attacker[0], group=attacker[1], start_new_session=True
    )
    runtime_dir = tmp_path / "run"
    env, real = _roots_job(sim_env, tmp_path, runtime_dir)
    try:
        deadline = time.monotonic() + 30
        while len(list(fakes.glob("ready-*"))) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(fakes.glob("*.sock"))) == n
        wait_socket(runtime_dir, real.pid)
        start = time.monotonic()
        p = subprocess.run([NPUSNAP, "ps", "--json"], env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - start
        assert p.returncode == 0, p.stderr
        body = json.loads(p.stdout)
        listed = {e["pid"]: e for e in body["result"]["processes"]}
        assert took < 3.0, took
        assert listed[real.pid]["state"] == "RUNNING" and listed[real.pid]["agent_error"] is None
        theirs = pwd.getpwuid(attacker[0]).pw_name
        fake_pids = [pid for pid, e in listed.items() if e["user"] == theirs]
        assert len(fake_pids) == n, sorted(listed)
        assert [listed[p]["replica_of"] for p in fake_pids if listed[p]["replica_of"]] == [1]
        for pid in fake_pids:
            assert listed[pid]["agent_error"], listed[pid]
            assert any(w.startswith(f"pid {pid}: ") for w in body["warnings"]), pid
    finally:
        real.kill()
        os.killpg(faker.pid, signal.SIGKILL)  # the faker and the children it forked
        real.wait()
        faker.wait()
        shutil.rmtree(fakes, ignore_errors=True)


SPOOF_AGENT = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(128)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(120)  # accepts (the kernel does), never answers
"""


def test_a_socket_named_after_roots_job_in_a_users_directory_is_not_its_agent(
    sim_env: dict[str, str], attacker: tuple[int, int], open_dir: Path, tmp_path: Path
) -> None:
    """A user listens as ``/tmp/npusnap-x/<pid of root's job>.sock``: root's ps and status still
    find the job's own agent (the fake one's directory is not the job's user's), and ps does
    not report the job's agent as failing."""
    from tests.integration.agentlib import wait_socket

    python = _attackers_python()
    fakes = _attackers_dir(attacker, f"/tmp/npusnap-spoof-{os.getpid()}")
    script = _script(open_dir / "spoof.py", SPOOF_AGENT)
    runtime_dir = tmp_path / "npusnap-run"  # an agent directory others can find (npusnap*)
    env, real = _roots_job(sim_env, tmp_path, runtime_dir)
    faker = None
    try:
        wait_socket(runtime_dir, real.pid)
        fake = fakes / f"{real.pid}.sock"
        faker = subprocess.Popen(
            [python, str(script), str(fake)], user=attacker[0], group=attacker[1], start_new_session=True
        )
        deadline = time.monotonic() + 20
        while not Path(f"{fake}.ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.exists()
        for _ in range(3):  # whatever order /proc/net/unix lists the two sockets in
            p = subprocess.run([NPUSNAP, "ps", "--json"], env=env, capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            listed = {e["pid"]: e for e in json.loads(p.stdout)["result"]["processes"]}
            assert listed[real.pid]["state"] == "RUNNING" and listed[real.pid]["agent_error"] is None
        # status from a directory that is not the job's runtime dir: it has to look for the socket
        other = {k: v for k, v in env.items() if k != "NPUSNAP_RUNTIME_DIR"}
        status = [NPUSNAP, "--json", "status", str(real.pid)]
        st = subprocess.run(status, env=other, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stdout + st.stderr
        assert str(fakes) not in st.stdout
    finally:
        real.kill()
        real.wait()
        if faker is not None:
            faker.kill()
            faker.wait()
        shutil.rmtree(fakes, ignore_errors=True)


def test_undoing_host_nodes_never_follows_a_swapped_directory(
    attacker: tuple[int, int], victim: Path, open_dir: Path
) -> None:
    """A failed restore removes the directories and FIFOs it made; their owner may have swapped a
    directory of the path for a symlink to root's meanwhile: nothing there is removed."""
    base = open_dir / "nodes"
    base.mkdir()
    os.chown(base, *attacker)
    uid, gid = attacker
    nodes = [
        hostres.HostNode(path=f"{base}/d", kind="dir", mode=0o700, uid=uid, gid=gid, why="x"),
        hostres.HostNode(path=f"{base}/d/fifo", kind="fifo", mode=0o600, uid=uid, gid=gid, why="x"),
    ]
    made = hostres.make_host_nodes(nodes, uids={uid})
    assert made == [n.path for n in nodes]
    os.mkfifo(victim / "fifo")  # root's FIFO of the same name elsewhere
    as_user(attacker, f"mv {base}/d {base}/d.away && ln -s {victim} {base}/d")
    hostres.remove_host_nodes(made)
    assert stat.S_ISFIFO(os.lstat(victim / "fifo").st_mode)
    os.unlink(victim / "fifo")
    _untouched(victim)


def test_latest_is_never_a_users_planted_name(
    attacker: tuple[int, int], open_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dump --latest in a sticky directory: a `latest` another user put there, or a file at the
    temporary name an older npusnap used, is neither replaced nor removed."""
    from npusnap_cli.image import imagestore

    shared = open_dir / "snaps"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    tmp, final = _build(shared, "root-0")
    publishing.publish(tmp, final, _manifest(publishing.file_entries(tmp)))
    as_user(attacker, f"touch {shared}/.latest.npusnap-tmp-{os.getpid()} && ln -s /etc {shared}/latest")
    with pytest.raises(UsageError, match="belongs to uid"):
        imagestore.update_latest(final)
    assert os.readlink(shared / "latest") == "/etc"
    (shared / "latest").unlink()
    assert os.readlink(imagestore.update_latest(final)) == "root-0"
    assert (shared / f".latest.npusnap-tmp-{os.getpid()}").stat().st_uid == attacker[0]
