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

import json
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from npusnap_cli import paths
from tests.conftest import requires_root
from tests.integration import crilib, podmanlib
from tests.integration.crilib import Containerd, Pod, Registry
from tests.integration.podmanlib import assert_continuous

SKIP = crilib.skip_reason()
pytestmark = [pytest.mark.integration, requires_root, pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]

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
    ctrd: Containerd, image: str, sim_env: dict[str, str], criu_conf: Path, port: int, faults: Path
) -> list[Pod]:
    job = uuid.uuid4().hex[:6]
    pods = []
    for member in (0, 1):
        env = {"NPUSNAP_JOB_COORDINATOR": f"127.0.0.1:{port}", "NPUSNAP_JOB_MEMBER": str(member)}
        pods.append(
            Pod(
                ctrd,
                f"job-{job}-{member}",
                image,
                sim_env,
                criu_conf,
                env=env,
                fault_file=faults / str(member),
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


@pytest.fixture
def faults(tmp_path: Path) -> Path:
    d = tmp_path / "faults"
    d.mkdir()
    for member in (0, 1):
        (d / str(member)).write_text("")
    return d


def test_job_of_two_pods_is_checkpointed_together(
    cri: tuple[Containerd, str], sim_env: dict[str, str], criu_conf: Path, tmp_path: Path, faults: Path
) -> None:
    ctrd, image = cri
    port = _free_port()
    pods = _job(ctrd, image, sim_env, criu_conf, port, faults)
    out = tmp_path / "job-ckpt"
    res = _checkpoint_job(ctrd, pods, port, out)
    assert res.returncode == 0, res.stdout + res.stderr
    manifest = json.loads((out / "npusnap-k8s-job.json").read_text())
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
    verify = _npusnap("k8s", "verify", str(out))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    for p in pods:
        assert p.running()
        p.wait_unlocked()
        p.wait_steps(5)
        assert_continuous(p.steps())


def test_a_fault_in_one_pod_rolls_back_the_whole_job(
    cri: tuple[Containerd, str], sim_env: dict[str, str], criu_conf: Path, tmp_path: Path, faults: Path
) -> None:
    ctrd, image = cri
    port = _free_port()
    pods = _job(ctrd, image, sim_env, criu_conf, port, faults)
    (faults / "1").write_text("NPUSIM_FAULT_BACKUP=1\n")  # member 1's device backup fails
    out = tmp_path / "job-ckpt"
    res = _checkpoint_job(ctrd, pods, port, out)
    (faults / "1").write_text("")
    # Exit 7 (device), named by member 1's plugin in its CRIU log.
    assert res.returncode == 7, res.stdout + res.stderr
    env = json.loads(res.stdout)
    assert env["error"]["message"].startswith(f"member 1 (default/{pods[1].name}/trainer) failed"), env[
        "error"
    ]
    assert "backup of pid" in env["error"]["message"], env["error"]
    failed = env["error"]["details"]["failed"]
    assert (
        "job member 0: the job was aborted: member 1" in failed[f"default/{pods[0].name}/trainer"]["message"]
    )
    # Member 0 was locked and waited at the barrier; member 1's failure released it, rolled back.
    assert set(failed) == {f"default/{p.name}/trainer" for p in pods}, failed
    assert all(env["error"]["details"]["running"].values()), env["error"]["details"]
    assert not out.exists() and not list(tmp_path.glob(".job-ckpt.tmp-*"))
    for p in pods:
        assert p.running()
        p.wait_unlocked()
        p.wait_steps(10)
        assert_continuous(p.steps())
