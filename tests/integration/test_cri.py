"""Kubernetes' checkpoint path for real: containerd 2.1's CRI (what the kubelet calls) -> runc ->
CRIU -> npusnap's plugin, a restore into a new pod from the archive, and a job of two pods
checkpointed together behind the plugin's barriers (`npusnap k8s checkpoint`).

containerd runs privately (tests/integration/crilib.py); pods use the host's network (no CNI). The
workload is the C stepper (tests/data/npu_stepper.c): one line per step with a checksum of its
device buffer, so a lost or repeated step, or lost device memory, shows in its output.

Skips only where the CRI cannot run: NPUSNAP_NO_CRI=1, not root, or scripts/setup-cri.sh's
downloads absent (scripts/test.sh runs it as root).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from npusnap_cli import paths
from tests.conftest import requires_root
from tests.integration import crilib, podmanlib
from tests.integration.crilib import Containerd, Pod, Registry
from tests.integration.podmanlib import assert_continuous

SKIP = crilib.skip_reason()
# serial: one containerd on the host.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.serial,
    requires_root,
    pytest.mark.skipif(SKIP is not None, reason=str(SKIP)),
]

NPUSNAP = str(paths.REPO_ROOT / ".venv" / "bin" / "npusnap")


@pytest.fixture(scope="module")
def cri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Containerd, str]]:
    """containerd with the CRI, its registry and the workload image (module-wide: ~2 s)."""
    subprocess.run(["make", "-s", "-C", str(paths.native_src_dir())], check=True, timeout=300)
    work = tmp_path_factory.mktemp("cri")
    reg = Registry(work / "registry")
    ctrd = None
    try:
        image = f"{reg.host}/npusnap-test:{uuid.uuid4().hex[:8]}"
        ctrd = Containerd(work / "containerd", sandbox_image=image)
        crilib.push_image(ctrd, work / "image", image)
        yield ctrd, image
    finally:
        if ctrd is not None:
            ctrd.stop()
        reg.stop()


@pytest.fixture
def criu_conf(tmp_path: Path) -> Path:
    """runc's CRIU configuration for the test's containers (the node's /etc/criu/runc.conf):
    npusnap's plugin directory named explicitly."""
    conf = tmp_path / "runc-criu.conf"
    conf.write_text(f"libdir {podmanlib.plugin_dir()}\ntimeout 600\n")
    return conf


def _npusnap(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NPUSNAP, *args], capture_output=True, text=True, timeout=timeout)


def test_checkpoint_through_cri_and_restore_into_a_new_pod(
    cri: tuple[Containerd, str], sim_env: dict[str, str], criu_conf: Path, tmp_path: Path
) -> None:
    ctrd, image = cri
    pod = Pod(ctrd, f"single-{uuid.uuid4().hex[:6]}", image, sim_env, criu_conf)
    pod.wait_steps(3)
    archive = tmp_path / f"checkpoint-{pod.name}_default-trainer.tar"
    ctrd.cri.checkpoint(pod.cid, str(archive), timeout=120)  # what the kubelet's checkpoint API sends

    # The kubelet's checkpoints leave the container running: the plugin unlocked it.
    assert pod.running()
    pod.wait_unlocked()
    pod.wait_steps(5)
    assert_continuous(pod.steps())

    verify = _npusnap("verify", str(archive))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    inspect = json.loads(_npusnap("inspect", "--json", str(archive)).stdout)["result"]
    assert [p["ns_pid"] for p in inspect["processes"]] == [1]
    assert {"config.dump", "spec.dump", "status.dump", "dump.log"} <= set(inspect["engine_files"])
    dump_log = subprocess.run(
        ["tar", "-xOf", str(archive), "dump.log"], capture_output=True, text=True
    ).stdout
    assert "locked and backed up" in dump_log and "npusim-plugin: socket" in dump_log, dump_log[-2000:]

    # Restore as Kubernetes does: a new pod whose container's image is the checkpoint archive.
    pod.remove()
    restored = Pod(ctrd, f"{pod.name}-restored", image, sim_env, criu_conf, checkpoint=archive)
    assert restored.running()
    restored.wait_steps(10)
    # containerd puts the archive's copy of the log first (copied after the original ran on, so it
    # may end a step or two past the checkpoint), then the restored process's own output.
    saved_log = subprocess.run(["tar", "-xOf", str(archive), "container.log"], capture_output=True, text=True)
    saved = len(saved_log.stdout.splitlines())
    output = restored.output()
    assert output[:saved] == crilib.cri_log_lines_of(saved_log.stdout)
    assert_resumed(
        podmanlib.parse_steps("\n".join(output[:saved])), podmanlib.parse_steps("\n".join(output[saved:]))
    )
    st = restored.wait_unlocked()
    assert st["restored"] is True
    restored.remove()  # a restore needs its device free of every other process: free it


def assert_resumed(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> None:
    """``after`` (the restored process's output) goes on from the checkpoint: it starts within the
    steps the original printed after the cut, repeats them identically, and together with
    ``before`` has every step once with the right checksum (device memory intact)."""
    assert before and after, (before, after)
    last = before[-1][0]
    assert before[-1][0] - 3 <= after[0][0] <= last + 1, (
        f"restored at step {after[0][0]}, saved log ends at {last}"
    )
    overlap = [s for s in after if s[0] <= last]
    assert overlap == before[len(before) - len(overlap) :], (overlap, before[-5:])
    assert_continuous(before + after[len(overlap) :])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(
    ctrd: Containerd,
    image: str,
    sim_env: dict[str, str],
    criu_confs: list[Path],
    port: int,
    faults: Optional[Path] = None,
) -> list[Pod]:
    """Two pods of one job, one NPU each (member N on device N), naming the coordinator."""
    job = uuid.uuid4().hex[:6]
    pods = []
    for member in (0, 1):
        env = {"NPUSNAP_JOB_COORDINATOR": f"127.0.0.1:{port}", "NPUSNAP_JOB_MEMBER": str(member)}
        fault = faults / str(member) if faults else None
        pods.append(
            Pod(
                ctrd,
                f"job-{job}-{member}",
                image,
                sim_env,
                criu_confs[member],
                env=env,
                fault_file=fault,
                device=member,
            )
        )
    for p in pods:
        p.wait_steps(3)
    return pods


def _checkpoint_job(
    ctrd: Containerd, pods: list[Pod], port: int, out: Path
) -> subprocess.CompletedProcess[str]:
    members = [a for p in pods for a in ("--member", f"default/{p.name}/trainer")]
    return _npusnap(
        "--json", "k8s", "checkpoint", str(out), *members, "--listen", f"127.0.0.1:{port}",
        "--cri-endpoint", ctrd.endpoint, "--barrier-timeout", "60", "--timeout", "120",
    )  # fmt: skip


def _resumed_from(pod: Pod, archive: Path) -> None:
    """``pod`` was restored from ``archive`` and goes on from its checkpoint (assert_resumed)."""
    saved = subprocess.run(["tar", "-xOf", str(archive), "container.log"], capture_output=True, text=True)
    n = len(saved.stdout.splitlines())
    lines = pod.output()
    assert lines[:n] == crilib.cri_log_lines_of(saved.stdout)
    assert_resumed(podmanlib.parse_steps("\n".join(lines[:n])), podmanlib.parse_steps("\n".join(lines[n:])))


@pytest.fixture
def faults(tmp_path: Path) -> Path:
    """Per-member fault files (the simulated device's NPUSIM_FAULT_FILE), empty: no fault yet."""
    d = tmp_path / "faults"
    d.mkdir()
    for member in (0, 1):
        (d / str(member)).write_text("")
    return d


def test_job_of_two_pods_is_checkpointed_together(
    cri: tuple[Containerd, str], sim_env: dict[str, str], criu_conf: Path, tmp_path: Path
) -> None:
    ctrd, image = cri
    port = _free_port()
    pods = _job(ctrd, image, sim_env, [criu_conf, criu_conf], port)
    out = tmp_path / "job-ckpt"
    res = _checkpoint_job(ctrd, pods, port, out)
    assert res.returncode == 0, res.stdout + res.stderr
    manifest = json.loads((out / "npusnap-k8s-job.json").read_text())
    assert manifest["barriers"] == ["locked", "saved"]
    assert [m["member"] for m in manifest["members"]] == [0, 1]
    assert [m["pod"] for m in manifest["members"]] == [p.name for p in pods]
    for m in manifest["members"]:
        assert len(m["sha256"]) == 64 and (out / m["archive"]).stat().st_size == m["size"]
        assert m["npu_processes"] == 1
        log = subprocess.run(
            ["tar", "-xOf", str(out / m["archive"]), "dump.log"], capture_output=True, text=True
        )
        # Each container's CRIU waited for the other at both barriers.
        assert f"job member {m['member']}: every member locked" in log.stdout, log.stdout[-2000:]
        assert f"job member {m['member']}: every member saved" in log.stdout, log.stdout[-2000:]
    for cmd in (("k8s", "verify"), ("verify",)):
        verify = _npusnap(*cmd, str(out))
        assert verify.returncode == 0, verify.stdout + verify.stderr
    inspect = json.loads(_npusnap("--json", "inspect", str(out)).stdout)["result"]
    assert [m["sha256"] for m in inspect["members"]] == [m["sha256"] for m in manifest["members"]]
    # A modified archive is found.
    first = out / manifest["members"][0]["archive"]
    with open(first, "r+b") as f:
        f.seek(first.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    assert _npusnap("k8s", "verify", str(out)).returncode == 8
    with open(first, "r+b") as f:
        f.seek(first.stat().st_size // 2)
        f.write(byte)
    for p in pods:
        assert p.running()
        p.wait_unlocked()
        p.wait_steps(5)
        assert_continuous(p.steps())

    # The job back from its archives, each member in a new pod, released together: npusnap k8s
    # restore serves the "restored" barrier (on the address the restored processes name) while
    # the pods are created from the archives at once, as kubectl would; no member is unlocked
    # before both are back. (The runbook and the next test let it create the pods, --run.)
    for p in pods:
        p.remove()
    server = subprocess.Popen(
        [NPUSNAP, "--json", "k8s", "restore", str(out), "--barrier-timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            restored = list(
                pool.map(
                    lambda pm: Pod(
                        ctrd, f"{pm[0].name}-r", image, sim_env, criu_conf, checkpoint=out / pm[1]["archive"]
                    ),
                    zip(pods, manifest["members"]),
                )
            )
        stdout, stderr = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    assert server.returncode == 0, stdout + stderr
    assert json.loads(stdout)["result"]["coordinator"] == f"127.0.0.1:{port}"
    for p, m in zip(restored, manifest["members"]):
        p.wait_steps(5)
        _resumed_from(p, out / m["archive"])
        assert p.wait_unlocked()["restored"] is True
    for p in restored:
        p.remove()


def test_a_member_that_cannot_be_restored_keeps_the_other_locked(
    cri: tuple[Containerd, str], sim_env: dict[str, str], criu_conf: Path, tmp_path: Path
) -> None:
    """Member 1's restore fails in CRIU (its new pod lacks the device's mount): member 0, restored
    and waiting at the "restored" barrier, is not let go: its NPU process stays locked."""
    ctrd, image = cri
    port = _free_port()
    pods = _job(ctrd, image, sim_env, [criu_conf, criu_conf], port)
    out = tmp_path / "job-ckpt"
    res = _checkpoint_job(ctrd, pods, port, out)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = []
    for p in pods:
        pod_cfg, ctr_cfg = p.config_dicts(f"{p.name}-r")
        if p is pods[1]:
            ctr_cfg["mounts"] = []  # CRIU cannot restore the bind mount the process had
        (tmp_path / f"{p.name}.pod.json").write_text(json.dumps(pod_cfg))
        (tmp_path / f"{p.name}.ctr.json").write_text(json.dumps(ctr_cfg))
        runs += ["--run", f"{tmp_path / f'{p.name}.pod.json'}:{tmp_path / f'{p.name}.ctr.json'}"]
        p.remove()
    res = _npusnap("--json", "k8s", "restore", str(out), "--cri-endpoint", ctrd.endpoint, *runs)
    assert res.returncode == 6, res.stdout + res.stderr
    error = json.loads(res.stdout)["error"]
    assert error["details"]["barrier"].startswith("member 1"), error
    member0 = Pod.existing(ctrd, f"{pods[0].name}-r")
    st = member0.agent_status()
    assert st["state"] != "RUNNING" and st["owner"]["command"] == "criu-plugin", st
    member0.remove()


@pytest.mark.parametrize("fault", ["device-backup", "runtime-after-barriers"])
def test_a_fault_in_one_pod_rolls_back_the_whole_job(
    cri: tuple[Containerd, str],
    sim_env: dict[str, str],
    criu_conf: Path,
    tmp_path: Path,
    faults: Path,
    fault: str,
) -> None:
    """Member 1 fails: before any barrier (its device backup), or after both barriers (a CRIU
    post-dump action script vetoes its dump). Both containers run on, unlocked, with continuous
    output; no archive is kept."""
    ctrd, image = cri
    port = _free_port()
    confs = [criu_conf, criu_conf]
    if fault == "runtime-after-barriers":
        veto = tmp_path / "veto.sh"
        veto.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && exit 3\nexit 0\n')
        veto.chmod(0o755)
        confs[1] = tmp_path / "runc-criu-veto.conf"
        confs[1].write_text(criu_conf.read_text() + f"action-script {veto}\n")
    pods = _job(ctrd, image, sim_env, confs, port, faults)
    if fault == "device-backup":
        (faults / "1").write_text("NPUSIM_FAULT_BACKUP=1\n")
    out = tmp_path / "job-ckpt"
    res = _checkpoint_job(ctrd, pods, port, out)
    (faults / "1").write_text("")
    env = json.loads(res.stdout)
    failed = env["error"]["details"]["failed"]
    if fault == "device-backup":
        # Exit 7 (device), named by member 1's plugin in its CRIU log; member 0 was locked and
        # waited at "locked" until member 1's abort released it, and its dump failed.
        assert res.returncode == 7, res.stdout + res.stderr
        assert env["error"]["message"].startswith(f"member 1 (default/{pods[1].name}/trainer) failed")
        assert "backup of pid" in env["error"]["message"], env["error"]
        member0 = failed[f"default/{pods[0].name}/trainer"]["message"]
        assert "job member 0: the job was aborted: member 1" in member0, member0
        assert set(failed) == {f"default/{p.name}/trainer" for p in pods}, failed
    else:
        # CRIU hands its plugins' fini the dump's result without the post-dump script's veto
        # (criu/cr-dump.c, cr_dump_finish): both plugins passed "saved", member 1's runtime then
        # failed its call. The coordinator keeps no archive of a job with a failed member.
        assert res.returncode == 6, res.stdout + res.stderr
        assert set(failed) == {f"default/{pods[1].name}/trainer"}, failed
        assert env["error"]["details"]["barriers"] == "ok", env["error"]["details"]
    assert all(env["error"]["details"]["running"].values()), env["error"]["details"]
    assert not out.exists() and not list(tmp_path.glob(".job-ckpt.tmp-*"))
    for p in pods:
        assert p.running()
        p.wait_unlocked()
        p.wait_steps(10)
        assert_continuous(p.steps())
        p.remove()


def test_a_job_member_checkpointed_alone_is_refused_and_runs_on(
    cri: tuple[Containerd, str], sim_env: dict[str, str], criu_conf: Path, tmp_path: Path
) -> None:
    """A pod that names a coordinator is a job member: the kubelet's checkpoint of it alone (no
    coordinator listening) fails before anything is locked, and the container runs on."""
    ctrd, image = cri
    port = _free_port()
    env = {"NPUSNAP_JOB_COORDINATOR": f"127.0.0.1:{port}", "NPUSNAP_JOB_MEMBER": "0"}
    pod = Pod(ctrd, f"alone-{uuid.uuid4().hex[:6]}", image, sim_env, criu_conf, env=env)
    pod.wait_steps(3)
    res = _npusnap(
        "--json", "k8s", "checkpoint", str(tmp_path / "ckpt"), "--member", f"default/{pod.name}/trainer",
        "--cri-endpoint", ctrd.endpoint,
    )  # fmt: skip
    assert res.returncode == 4, res.stdout + res.stderr
    error = json.loads(res.stdout)["error"]
    assert (
        "is member 0 of a job" in error["message"] and "cannot reach the job coordinator" in error["message"]
    )
    assert pod.running()
    st = pod.wait_unlocked()
    assert st["state"] == "RUNNING"
    pod.wait_steps(5)
    assert_continuous(pod.steps())
    pod.remove()
