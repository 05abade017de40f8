"""The CRIU plugin (native/criu-plugin -> npusnap_plugin.so) driven by podman + runc, and by a
plain `criu dump`: no npusnap command is typed. The workload is the C stepper of
tests/data/npu_stepper.c, which keeps its buffer in (simulated) device memory and prints a
checksum per step, so a lost step or lost device memory shows in its output.

podman, runc and busybox-static are installed by scripts/test.sh (as root). The tests skip only
where podman cannot run at all (not root, or the packages are absent and could not be installed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from npusnap_cli import paths
from npusnap_cli.device.agent_client import AgentClient, AgentOpError
from npusnap_sim import wire
from tests.conftest import plugin_dir_with, requires_root
from tests.integration import podmanlib
from tests.integration.dumplib import kill, wait_until
from tests.integration.podmanlib import Container, assert_continuous, podman, wait_unlocked

MISSING = [t for t in ("podman", "runc", "busybox", "criu") if shutil.which(t) is None]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.serial,  # one podman and one CRIU plugin directory on the host
    requires_root,
    pytest.mark.skipif(bool(MISSING), reason=f"podman cannot run here: {', '.join(MISSING)} missing "
                       "(scripts/test.sh installs podman, runc and busybox-static as root)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def plugin() -> Path:
    subprocess.run(["make", "-s", "-C", str(paths.native_src_dir())], check=True, timeout=300)
    so = podmanlib.plugin_dir() / "npusnap_plugin.so"
    assert so.is_file()
    return so


@pytest.fixture(scope="module")
def image(plugin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tag = f"localhost/npusnap-test:{uuid.uuid4().hex[:8]}"
    podmanlib.build_image(tmp_path_factory.mktemp("podman-image"), tag)
    yield tag
    podman("rmi", "-f", tag, check=False)


@pytest.fixture
def container_factory(image: str, sim_env: dict[str, str], tmp_path: Path) -> Iterator[list[Container]]:
    made: list[Container] = []
    yield made
    for c in made:
        c.remove()


def start(
    made: list[Container], image: str, sim_env: dict[str, str], tmp_path: Path, **kw: object
) -> Container:
    c = Container(image, sim_env, tmp_path, **kw)  # type: ignore[arg-type]
    made.append(c)
    c.wait_steps(3)
    return c


def test_checkpoint_and_restore_through_podman_alone(
    container_factory: list[Container], image: str, sim_env: dict[str, str], tmp_path: Path
) -> None:
    c = start(container_factory, image, sim_env, tmp_path)
    podman("container", "checkpoint", "--keep", c.name)
    assert not c.running()
    ckpt = c.static_dir() / "checkpoint"
    state = json.loads((ckpt / "npusnap-plugin.json").read_text())
    assert state["kind"] == "npusnap-criu-plugin"
    assert [p["ns_pid"] for p in state["processes"]] == [1]
    assert len(state["processes"][0]["lock_token"]) == 32
    assert {f["path"] for f in state["files"]} >= {"inventory.img", "pstree.img", "pages-1.img"}
    dump_log = (c.static_dir() / "dump.log").read_text(errors="replace")
    assert "npusnap-plugin: pid" in dump_log and "locked and backed up" in dump_log, dump_log[-2000:]
    # The simulated device's handle (the runtime's daemon connection, bind-mounted socket path).
    assert "npusim-plugin: socket" in dump_log and "recorded in npusim-dev-" in dump_log, dump_log[-2000:]
    assert len(list(ckpt.glob("npusim-dev-*.img"))) == 1
    # npusnap reads the checkpoint directory: checksums verified
    verify = subprocess.run(
        [str(paths.REPO_ROOT / ".venv/bin/npusnap"), "verify", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    before = len(c.steps())
    podman("container", "restore", "--keep", c.name)
    assert c.running()
    c.wait_steps(10)
    steps = c.steps()
    assert len(steps) > before + 5
    assert_continuous(steps)
    st = wait_unlocked(c)
    assert st["restored"] is True
    restore_log = (c.static_dir() / "restore.log").read_text(errors="replace")
    assert "device state restored, unlocked" in restore_log, restore_log[-2000:]
    # Reconnected from inside the restored container (its mount namespace, its pid 1).
    assert "reconnected to the npusim daemon" in restore_log and "(pid 1)" in restore_log, restore_log[-2000:]


def test_leave_running_unlocks(
    container_factory: list[Container], image: str, sim_env: dict[str, str], tmp_path: Path
) -> None:
    c = start(container_factory, image, sim_env, tmp_path)
    podman("container", "checkpoint", "--leave-running", c.name)
    assert c.running()
    wait_unlocked(c)
    c.wait_steps(10)
    assert_continuous(c.steps())


def test_export_and_import_as_another_container(
    container_factory: list[Container], image: str, sim_env: dict[str, str], tmp_path: Path
) -> None:
    c = start(container_factory, image, sim_env, tmp_path)
    archive = tmp_path / "ckpt.tar.zst"
    podman("container", "checkpoint", f"--export={archive}", c.name)
    assert not c.running()
    with tarfile.open(archive, "r") if not str(archive).endswith(".zst") else _zstd_tar(archive) as tar:
        names = tar.getnames()
    assert "checkpoint/npusnap-plugin.json" in [n.lstrip("./") for n in names], names
    verify = subprocess.run(
        [str(paths.REPO_ROOT / ".venv/bin/npusnap"), "verify", str(archive)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    before = c.steps()
    other = f"{c.name}-imported"
    c.names.append(other)
    podman("container", "restore", f"--import={archive}", "--name", other)
    assert c.running(other)
    c.wait_steps(10, name=other)
    steps = c.steps(other)
    assert steps[: len(before)] == before  # the log travels in the archive
    assert_continuous(steps)
    wait_unlocked(c, name=other)


def _zstd_tar(archive: Path) -> tarfile.TarFile:
    plain = archive.with_suffix("")
    subprocess.run(["zstd", "-q", "-d", "-f", str(archive), "-o", str(plain)], check=True, timeout=60)
    return tarfile.open(plain, "r")


def test_failed_backup_leaves_the_container_running_and_unlocked(
    container_factory: list[Container], image: str, sim_env: dict[str, str], tmp_path: Path
) -> None:
    faults = tmp_path / "faults" / "file"
    faults.parent.mkdir()
    faults.write_text("")
    c = start(container_factory, image, sim_env, tmp_path, fault_file=faults)
    faults.write_text("NPUSIM_FAULT_BACKUP=1\n")
    res = podman("container", "checkpoint", c.name, check=False)
    faults.write_text("")
    assert res.returncode != 0
    log = (c.static_dir() / "dump.log").read_text(errors="replace")
    assert "npusnap-plugin: FAILED, npusnap exit 7 (device" in log, res.stderr + log[-2000:]
    assert c.running()
    wait_unlocked(c)
    c.wait_steps(10)
    assert_continuous(c.steps())


def test_criu_failure_after_the_lock_is_rolled_back(
    container_factory: list[Container], image: str, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """CRIU fails after PAUSE_DEVICES locked and backed up the task (its post-dump action script
    vetoes the dump): CRIU lets the task run again and the plugin's helper unlocks it."""
    script = tmp_path / "veto.sh"
    script.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && exit 3\nexit 0\n')
    script.chmod(0o755)
    c = start(container_factory, image, sim_env, tmp_path, criu_conf_extra=f"action-script {script}\n")
    res = podman("container", "checkpoint", c.name, check=False)
    assert res.returncode != 0
    assert c.running()
    st = wait_unlocked(c)
    assert st["state"] == "RUNNING"
    c.wait_steps(10)
    assert_continuous(c.steps())


def test_two_npu_processes_in_one_container(
    container_factory: list[Container], image: str, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """A container whose init runs one NPU job and has forked another (on the second device):
    the plugin locks, backs up, restores and unlocks both."""
    command = ["/bin/sh", "-c", "/opt/npu/npu_stepper --device 1 --interval-ms 50 >>/tmp/second.log 2>&1 & "
               "exec /opt/npu/npu_stepper --device 0 --interval-ms 50"]  # fmt: skip
    c = start(container_factory, image, sim_env, tmp_path, command=command)

    def second_log() -> str:
        return (Path(f"/proc/{c.host_pid()}/root") / "tmp/second.log").read_text()

    wait_until(lambda: len(podmanlib.parse_steps(second_log())) >= 3, what="second job's steps")
    podman("container", "checkpoint", "--keep", c.name)
    state = json.loads((c.static_dir() / "checkpoint" / "npusnap-plugin.json").read_text())
    assert len(state["processes"]) == 2, state["processes"]
    podman("container", "restore", c.name)
    c.wait_steps(10)
    n = len(podmanlib.parse_steps(second_log()))
    wait_until(lambda: len(podmanlib.parse_steps(second_log())) > n + 10, what="second job after restore")
    assert_continuous(c.steps())
    assert_continuous(podmanlib.parse_steps(second_log()))
    root = c.host_pid()
    for pid in [root, *podmanlib.children(root)]:
        st = c.agent_status(host_pid=pid)
        assert st["state"] == "RUNNING" and st["owner"] is None and st["restored"] is True, st


# ---- a bare process and plain `criu` -------------------------------------------------------------


@pytest.fixture
def stepper(plugin: Path, tmp_path: Path) -> str:
    out = tmp_path / "npu_stepper"
    lib64 = paths.sim_cann_home() / "lib64"
    subprocess.run(
        ["cc", "-O1", "-Wall", "-Werror", "-o", str(out), str(podmanlib.STEPPER), f"-L{lib64}", "-lacl_rt"],
        check=True,
        timeout=120,
    )
    return str(out)


def _bare(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path, **extra_env: str
) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "out.txt"
    env = dict(os.environ, **sim_env, **extra_env)
    env.update(
        NPUSNAP_AGENT="1",
        NPUSNAP_RUNTIME_DIR=str(runtime_dir),
        LD_PRELOAD=str(paths.build_dir() / "agent" / "libnpusnap_agent.so"),
    )
    with open(out, "ab") as f:
        proc = subprocess.Popen(
            [stepper, "--interval-ms", "30"], stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env,
            start_new_session=True,
        )  # fmt: skip
    wait_until(lambda: out.read_text().count("step ") >= 3, what="first steps")
    wait_until(lambda: (runtime_dir / f"{proc.pid}.sock").exists(), what="agent socket")
    return proc, out


def _steps(out: Path) -> list[tuple[int, int]]:
    return [
        (int(p[1]), int(p[3]))
        for p in (ln.split() for ln in out.read_text().splitlines())
        if p[:1] == ["step"]
    ]


def test_raw_criu_dump_and_restore_with_the_plugin(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    proc, out = _bare(stepper, sim_env, runtime_dir, tmp_path)
    pid = proc.pid
    img = tmp_path / "img"
    img.mkdir()
    libdir = str(podmanlib.plugin_dir())
    conf = tmp_path / "criu-plugin.conf"
    conf.write_text("# the plugin's settings\nlease_s = 77\ndevice_memory=preserve\n")
    helper_log = tmp_path / "plugin-helper.log"
    env = dict(os.environ, NPUSNAP_PLUGIN_CONFIG=str(conf), NPUSNAP_PLUGIN_LOG=str(helper_log))
    try:
        subprocess.run(
            ["criu", "dump", "-t", str(pid), "-D", str(img), "-L", libdir, "-v4", "-o", "dump.log"],
            check=True,
            timeout=120,
            env=env,
        )
        dump_log = (img / "dump.log").read_text(errors="replace")
        assert "lease 77s" in dump_log
        # The simulated device's plugin took the runtime's daemon connection (its device handle).
        assert "npusim-plugin: socket" in dump_log and "recorded in npusim-dev-" in dump_log, dump_log[-2000:]
        assert len(list(img.glob("npusim-dev-*.img"))) == 1
        assert json.loads((img / "npusnap-plugin.json").read_text())["lease_s"] == 77
        proc.wait(timeout=20)  # CRIU kills it after a good dump
        assert (img / "npusnap-plugin.json").is_file()
        n = len(_steps(out))
        subprocess.run(
            ["criu", "restore", "-d", "-D", str(img), "-L", libdir, "-v4", "-o", "restore.log"],
            check=True,
            timeout=120,
        )
        restore_log = (img / "restore.log").read_text(errors="replace")
        assert "device state restored, unlocked" in restore_log
        assert "reconnected to the npusim daemon" in restore_log, restore_log[-2000:]
        wait_until(lambda: len(_steps(out)) > n + 10, what="steps after restore")
        assert_continuous(_steps(out))
        with AgentClient(pid, timeout=10) as c:
            st = c.status().to_json()
        assert st["state"] == "RUNNING" and st["owner"] is None and st["restored"] is True
        # The daemon knows the restored process (a new start time) over its new connection.
        owners = [o for o in wire.query_status(sim_env["NPUSIM_SOCKET"])["owners"] if o["pid"] == pid]
        assert len(owners) == 1 and owners[0]["alive"] and owners[0]["device_connections"] == 1, owners
        # The dump's rollback helper saw the dumped task die; the restored one (same pid, same
        # token) is not its business, however fast the restore came (a race to lose when it is quick).
        wait_until(lambda: "exited" in helper_log.read_text(), what="the dump helper's verdict")
        assert "rolled back" not in helper_log.read_text(), helper_log.read_text()
    finally:
        kill(pid)


def test_raw_criu_dump_without_the_plugin_is_refused_and_harmless(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """Without the plugin nobody locks or backs up the device: the simulated runtime's connection
    to its device (a unix socket to the daemon, outside the dumped tree) makes CRIU refuse, the
    way stock CRIU refuses a real NPU's device files. The process runs on, untouched."""
    proc, out = _bare(stepper, sim_env, runtime_dir, tmp_path)
    pid = proc.pid
    img = tmp_path / "img"
    img.mkdir()
    empty = tmp_path / "no-plugins"
    empty.mkdir()
    try:
        res = subprocess.run(
            ["criu", "dump", "-t", str(pid), "-D", str(img), "-L", str(empty), "-v4", "-o", "dump.log"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode != 0
        assert "External socket is used" in (img / "dump.log").read_text(errors="replace")
        n = len(_steps(out))
        wait_until(lambda: len(_steps(out)) > n + 5, what="steps after the refused dump")
        assert_continuous(_steps(out))
    finally:
        kill(pid)


def test_raw_criu_dump_with_only_npusnaps_plugin_is_refused_after_the_backup_and_rolled_back(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """npusnap's plugin locks and backs up the device, but the runtime keeps its device connection
    open (as real CANN keeps /dev/davinci*): without the simulated device's plugin CRIU refuses it,
    the failed dump is marked, and the plugin's helper rolls the job back: it runs on."""
    proc, out = _bare(stepper, sim_env, runtime_dir, tmp_path)
    pid = proc.pid
    img = tmp_path / "img"
    img.mkdir()
    only_npusnap = plugin_dir_with(tmp_path, "npusnap_plugin.so")
    try:
        res = subprocess.run(
            [
                "criu",
                "dump",
                "-t",
                str(pid),
                "-D",
                str(img),
                "-L",
                str(only_npusnap),
                "-v4",
                "-o",
                "dump.log",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode != 0
        log = (img / "dump.log").read_text(errors="replace")
        assert "locked and backed up" in log, log[-2000:]
        assert "External socket is used" in log, log[-2000:]
        assert not list(img.glob("npusim-dev-*.img"))
        wait_unlocked_pid(pid)
        n = len(_steps(out))
        wait_until(lambda: len(_steps(out)) > n + 5, what="steps after the refused dump")
        assert_continuous(_steps(out))
    finally:
        kill(pid)


def wait_unlocked_pid(pid: int) -> None:
    def unlocked() -> bool:
        try:
            with AgentClient(pid, timeout=10) as c:
                st = c.status().to_json()
        except AgentOpError as exc:
            if exc.error.name == "BUSY":
                return False  # the plugin's rollback helper is talking to the agent right now
            raise
        return bool(st["state"] == "RUNNING" and st["owner"] is None)

    wait_until(unlocked, timeout=30, what="the dump's rollback to unlock the job")


def test_plugin_stands_aside_for_npusnap_dump(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """A process locked by another owner (here `npusnap freeze`) is not the plugin's: -ENOTSUP,
    so installing the plugin in CRIU's default directory does not disturb `npusnap dump`."""
    proc, out = _bare(stepper, sim_env, runtime_dir, tmp_path)
    pid = proc.pid
    env = dict(os.environ, **sim_env, NPUSNAP_RUNTIME_DIR=str(runtime_dir))
    cli = str(paths.REPO_ROOT / ".venv/bin/npusnap")
    img = tmp_path / "img"
    img.mkdir()
    try:
        subprocess.run([cli, "freeze", str(pid)], check=True, env=env, timeout=60, capture_output=True)
        res = subprocess.run(
            ["criu", "dump", "-t", str(pid), "-D", str(img), "-L", str(podmanlib.plugin_dir()), "-v4", "-o",
             "dump.log", "-R"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        log = (img / "dump.log").read_text(errors="replace")
        assert "the plugin leaves it alone" in log, log[-2000:]
        assert not (img / "npusnap-plugin.json").exists()
        del res  # frozen by npusnap: CRIU may or may not dump it; the plugin must not touch it
        subprocess.run([cli, "thaw", str(pid)], check=True, env=env, timeout=60, capture_output=True)
        n = len(_steps(out))
        wait_until(lambda: len(_steps(out)) > n + 5, what="steps after thaw")
        assert_continuous(_steps(out))
    finally:
        kill(pid)


def test_failed_device_restore_is_logged_and_the_lease_finishes_it(
    stepper: str, sim_env: dict[str, str], runtime_dir: Path, tmp_path: Path
) -> None:
    """CRIU has resumed the tasks when the plugin restores the device state: a CANN Restore that
    fails cannot fail CRIU's restore. The plugin logs it (npusnap exit 7) and the agent's lease,
    restarted for the restored process, restores and unlocks it by itself once it can."""
    faults = tmp_path / "faults"
    faults.write_text("")
    proc, out = _bare(stepper, sim_env, runtime_dir, tmp_path, NPUSIM_FAULT_FILE=str(faults))
    pid = proc.pid
    img = tmp_path / "img"
    img.mkdir()
    libdir = str(podmanlib.plugin_dir())
    conf = tmp_path / "criu-plugin.conf"
    conf.write_text("lease_s=4\n")
    env = dict(os.environ, NPUSNAP_PLUGIN_CONFIG=str(conf))
    try:
        subprocess.run(
            ["criu", "dump", "-t", str(pid), "-D", str(img), "-L", libdir, "-v4", "-o", "dump.log"],
            check=True,
            timeout=120,
            env=env,
        )
        proc.wait(timeout=20)
        n = len(_steps(out))
        faults.write_text("NPUSIM_FAULT_RESTORE=1\n")
        subprocess.run(
            ["criu", "restore", "-d", "-D", str(img), "-L", libdir, "-v4", "-o", "restore.log"],
            check=True,
            timeout=120,
            env=env,
        )
        log = (img / "restore.log").read_text(errors="replace")
        assert "npusnap-plugin: FAILED, npusnap exit 7 (device" in log, log[-2000:]
        faults.write_text("")
        with AgentClient(pid, timeout=10) as c:
            assert c.status().state == "BACKED_UP"  # still held: no device call got through
        assert len(_steps(out)) <= n + 1
        wait_until(lambda: len(_steps(out)) > n + 10, timeout=30, what="steps after the lease's restore")
        assert_continuous(_steps(out))
        with AgentClient(pid, timeout=10) as c:
            st = c.status().to_json()
        assert st["state"] == "RUNNING" and st["owner"] is None, st
    finally:
        kill(pid)
