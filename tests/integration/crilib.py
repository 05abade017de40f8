"""A private containerd 2.x with its CRI, for the Kubernetes tests (tests/integration/test_cri.py).

What the kubelet would do on a node, done here through the same CRI calls: pod sandboxes, containers,
``CheckpointContainer`` and a restore by ``CreateContainer`` from the checkpoint archive.

* containerd 2.1 (Debian's unstable suite, unpacked by scripts/setup-cri.sh) runs with its own
  socket, root and state directories and a config enabling the CRI with runc; nothing of the host's
  containerd (if any) is touched. Pods use the host's network (``NamespaceMode.NODE``): no CNI.
* The image is built locally (podmanlib's rootfs: busybox, the C stepper, the simulated CANN tree),
  written as an OCI layout and pushed to a private registry on 127.0.0.1 (Debian's
  docker-registry): containerd's CRI restore pulls the checkpoint's base image by digest even when
  it is present, so a registry must answer. The same image is the pod sandbox's image.
* runc reads CRIU's options from the file named by the ``org.criu.config`` annotation (passed
  through by the runtime's ``container_annotations``): ``libdir`` names npusnap's plugin directory.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import paths
from npusnap_cli.k8s.cri import CriClient
from tests.integration import podmanlib

NAMESPACE = "k8s.io"  # the containerd namespace the CRI uses


def cri_dir() -> Path:
    return paths.build_dir() / "cri"


def skip_reason() -> Optional[str]:
    """Why the CRI tests cannot run here, or None."""
    if os.environ.get("NPUSNAP_NO_CRI") == "1":
        return "NPUSNAP_NO_CRI=1: the containerd CRI tests are disabled"
    if os.geteuid() != 0:
        return "containerd needs root"
    missing = [
        str(p)
        for p in (
            cri_dir() / "bin" / "containerd",
            cri_dir() / "docker-registry",
            cri_dir() / "python" / "api_pb2.py",
        )
        if not p.exists()
    ]
    if missing:
        return f"{', '.join(missing)} missing: run scripts/setup-cri.sh (scripts/test.sh does, as root)"
    for tool in ("runc", "criu", "busybox"):
        if shutil.which(tool) is None:
            return f"{tool} missing (scripts/setup-containers.sh installs it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred: Any, what: str, timeout: float, log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"{what} not ready within {timeout}s\n{tail}")


class Registry:
    """Debian's docker-registry on 127.0.0.1:PORT, storage in ``work``."""

    def __init__(self, work: Path) -> None:
        self.port = _free_port()
        self.host = f"localhost:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        conf = work / "registry.yml"
        conf.write_text(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {work / 'data'}\nhttp:\n  addr: 127.0.0.1:{self.port}\n"
        )
        self.log = work / "registry.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(cri_dir() / "docker-registry"), "serve", str(conf)], stdout=log, stderr=log
            )
        _wait(self._up, "docker-registry", 30, self.log)

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True
        return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Containerd:
    """containerd with the CRI on a private socket; ``stop()`` removes every pod it ran."""

    def __init__(self, work: Path, sandbox_image: str) -> None:
        self.work = work
        self.root = work / "root"
        self.state = work / "state"
        self.sock = work / "containerd.sock"
        self.endpoint = f"unix://{self.sock}"
        self.log = work / "containerd.log"
        work.mkdir(parents=True, exist_ok=True)
        conf = work / "config.toml"
        rt = "plugins.'io.containerd.cri.v1.runtime'"
        conf.write_text(
            f"""version = 3
root = "{self.root}"
state = "{self.state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.erofs", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing", "io.containerd.nri.v1.nri"]
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[debug]
  address = "{work / "debug.sock"}"
  level = "info"
[plugins.'io.containerd.internal.v1.opt']
  path = "{work / "opt"}"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[{rt}]
  enable_cdi = false
  # These machines lack CAP_SYS_RESOURCE: a sandbox's oom_score_adj below containerd's own fails.
  restrict_oom_score_adj = true
[{rt}.containerd]
  default_runtime_name = "runc"
[{rt}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  container_annotations = ["org.criu.config"]
  pod_annotations = ["org.criu.config"]
[{rt}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{work / "runc"}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{sandbox_image}"
"""
        )
        env = {
            "PATH": f"{cri_dir() / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "NO_PROXY": "localhost,127.0.0.1",
        }
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(cri_dir() / "bin" / "containerd"), "--config", str(conf)],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        _wait(lambda: self._alive() and self.sock.exists(), "containerd", 60, self.log)
        self.cri = CriClient(self.endpoint, timeout=60)
        _wait(self._cri_up, "containerd's CRI", 60, self.log)
        self.pods: list[str] = []

    def _alive(self) -> bool:
        assert self.proc.poll() is None, f"containerd exited:\n{self.log.read_text(errors='replace')[-3000:]}"
        return True

    def _cri_up(self) -> bool:
        self._alive()
        try:
            self.cri.version()
            return True
        except Exception:
            return False

    def ctr(self, *args: str, timeout: float = 120) -> str:
        res = subprocess.run(
            [str(cri_dir() / "bin" / "ctr"), "--address", str(self.sock), "-n", NAMESPACE, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise AssertionError(
                f"ctr {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
            )
        return res.stdout

    def stop(self) -> None:
        # Every pod, also those made by `npusnap k8s restore|run`: a sandbox's process outlives
        # containerd otherwise.
        with contextlib.suppress(Exception):
            listed = self.cri.call("runtime", "ListPodSandbox", self.cri.api.ListPodSandboxRequest())
            self.pods += [p.id for p in listed.items if p.id not in self.pods]
        for pod in self.pods:
            with contextlib.suppress(Exception):
                self.cri.call(
                    "runtime", "StopPodSandbox", self.cri.api.StopPodSandboxRequest(pod_sandbox_id=pod)
                )
                self.cri.call(
                    "runtime", "RemovePodSandbox", self.cri.api.RemovePodSandboxRequest(pod_sandbox_id=pod)
                )
        self.cri.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # Mounts containerd leaves behind (a sandbox's shm, a snapshot) would keep the tmp dir busy.
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            target = line.split()[1]
            if target.startswith(str(self.work) + "/"):
                subprocess.run(["umount", "-l", target], check=False, timeout=30)


def push_image(ctrd: Containerd, work: Path, ref: str) -> None:
    """podmanlib's rootfs as a one-layer OCI image ``ref`` (``localhost:PORT/name:tag``), imported
    into containerd, pushed to the private registry and pulled through the CRI."""
    rootfs = podmanlib.build_rootfs(work)
    layout = work / "oci"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}", len(data)

    raw = rootfs.read_bytes()
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    layer, layer_size = blob(gzip.compress(raw, compresslevel=1))
    config = {
        "architecture": "amd64",
        "os": "linux",
        # The pod sandbox runs the image's command: a sleep stands in for the pause binary.
        "config": {"Cmd": ["/bin/sleep", "2147483647"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    cfg, cfg_size = blob(json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": cfg_size},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer, "size": layer_size}
        ],
    }
    man, man_size = blob(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": man,
                "size": man_size,
                "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    tarball = work / "image.oci.tar"
    subprocess.run(["tar", "-C", str(layout), "-cf", str(tarball), "."], check=True, timeout=120)
    ctrd.ctr("images", "import", "--no-unpack", str(tarball))
    ctrd.ctr("images", "push", "--plain-http", ref)
    # Pulled through the CRI as the kubelet does: the image then has its repo digest, the image
    # ref that a checkpoint records and its restore pulls.
    api = ctrd.cri.api
    ctrd.cri.call("images", "PullImage", api.PullImageRequest(image=api.ImageSpec(image=ref)), timeout=120)


def cri_log_lines_of(text: str) -> list[str]:
    """The container's output from a CRI log (``TIME STREAM TAG text`` per line)."""
    return [p[3] if len(p) == 4 else "" for p in (ln.split(" ", 3) for ln in text.splitlines())]


def cri_log_lines(path: Path) -> list[str]:
    return cri_log_lines_of(path.read_text()) if path.exists() else []


class Pod:
    """A pod sandbox (host network) with one container running the C stepper on the simulated NPU,
    set up as a device plugin would: the simulator's socket directory mounted, the agent preloaded."""

    def __init__(
        self,
        ctrd: Containerd,
        name: str,
        image: str,
        sim_env: dict[str, str],
        criu_conf: Path,
        *,
        env: Optional[dict[str, str]] = None,
        fault_file: Optional[Path] = None,
        checkpoint: Optional[Path] = None,
        container: str = "trainer",
        device: int = 0,
    ) -> None:
        api = ctrd.cri.api
        self.ctrd, self.name, self.container = ctrd, name, container
        self.logdir = ctrd.work / "pods" / name
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.log = self.logdir / f"{container}.log"
        self.config = api.PodSandboxConfig(
            metadata=api.PodSandboxMetadata(name=name, uid=f"uid-{name}", namespace="default"),
            log_directory=str(self.logdir),
            linux=api.LinuxPodSandboxConfig(
                # hostNetwork, and a pid namespace per container (the kubelet's default, without
                # shareProcessNamespace).
                security_context=api.LinuxSandboxSecurityContext(
                    namespace_options=api.NamespaceOption(network=api.NODE, pid=api.CONTAINER)
                )
            ),
        )
        self.id = ctrd.cri.call(
            "runtime", "RunPodSandbox", api.RunPodSandboxRequest(config=self.config), 120
        ).pod_sandbox_id
        ctrd.pods.append(self.id)
        sim_dir = str(Path(sim_env["NPUSIM_SOCKET"]).parent)
        mounts = [api.Mount(container_path=sim_dir, host_path=sim_dir)]
        envs = {
            "LD_PRELOAD": "/opt/npu/libnpusnap_agent.so",
            "NPUSNAP_AGENT": "1",
            "ASCEND_HOME_PATH": "/opt/npu/cann",
            "LD_LIBRARY_PATH": "/opt/npu/cann/lib64",
            "NPUSIM_SOCKET": sim_env["NPUSIM_SOCKET"],
            **(env or {}),
        }
        if fault_file is not None:
            mounts.append(api.Mount(container_path=str(fault_file.parent), host_path=str(fault_file.parent)))
            envs["NPUSIM_FAULT_FILE"] = str(fault_file)
        config = api.ContainerConfig(
            metadata=api.ContainerMetadata(name=container),
            # A restore names the checkpoint archive as its image; CreateContainer restores from it.
            image=api.ImageSpec(image=str(checkpoint) if checkpoint else image),
            command=[]
            if checkpoint
            else ["/opt/npu/npu_stepper", "--interval-ms", "50", "--device", str(device)],
            envs=[api.KeyValue(key=k, value=v.encode()) for k, v in envs.items()],
            mounts=mounts,
            log_path=f"{container}.log",
            labels={
                "io.kubernetes.pod.namespace": "default",
                "io.kubernetes.pod.name": name,
                "io.kubernetes.container.name": container,
            },
            annotations={"org.criu.config": str(criu_conf)},
            linux=api.LinuxContainerConfig(
                security_context=api.LinuxContainerSecurityContext(
                    namespace_options=api.NamespaceOption(network=api.NODE, pid=api.CONTAINER)
                )
            ),
        )
        self.container_config = config
        req = api.CreateContainerRequest(pod_sandbox_id=self.id, config=config, sandbox_config=self.config)
        self.cid = ctrd.cri.call("runtime", "CreateContainer", req, 120).container_id
        ctrd.cri.call("runtime", "StartContainer", api.StartContainerRequest(container_id=self.cid), 120)

    def config_dicts(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """This pod's configs in the CRI's JSON form, renamed ``name`` (for a restore elsewhere)."""
        from google.protobuf import json_format

        pod = json_format.MessageToDict(self.config, preserving_proto_field_name=True)
        ctr = json_format.MessageToDict(self.container_config, preserving_proto_field_name=True)
        logdir = self.ctrd.work / "pods" / name
        logdir.mkdir(parents=True, exist_ok=True)  # the kubelet makes it before the pod
        pod["metadata"].update(name=name, uid=f"uid-{name}")
        pod["log_directory"] = str(logdir)
        ctr["labels"]["io.kubernetes.pod.name"] = name
        ctr["envs"] = [
            {"key": e["key"], "value": base64.b64decode(e.get("value", "")).decode()} for e in ctr["envs"]
        ]
        return pod, ctr

    @classmethod
    def existing(cls, ctrd: Containerd, name: str, container: str = "trainer") -> Pod:
        """The running pod ``name`` (made by someone else: npusnap k8s restore)."""
        pod = cls.__new__(cls)
        pod.ctrd, pod.name, pod.container = ctrd, name, container
        api = ctrd.cri.api
        labels = {"io.kubernetes.pod.name": name, "io.kubernetes.container.name": container}
        req = api.ListContainersRequest(filter=api.ContainerFilter(label_selector=labels))
        (found,) = ctrd.cri.call("runtime", "ListContainers", req).containers
        pod.cid, pod.id = found.id, found.pod_sandbox_id
        ctrd.pods.append(pod.id)
        pod.logdir = ctrd.work / "pods" / name
        pod.log = pod.logdir / f"{container}.log"
        return pod

    def status(self) -> Any:
        api = self.ctrd.cri.api
        return self.ctrd.cri.call(
            "runtime", "ContainerStatus", api.ContainerStatusRequest(container_id=self.cid, verbose=True)
        )

    def running(self) -> bool:
        return bool(self.status().status.state == self.ctrd.cri.api.CONTAINER_RUNNING)

    def host_pid(self) -> int:
        return int(json.loads(self.status().info["info"])["pid"])

    def output(self) -> list[str]:
        return cri_log_lines(self.log)

    def steps(self) -> list[tuple[int, int]]:
        return podmanlib.parse_steps("\n".join(self.output()))

    def wait_steps(self, n: int, timeout: float = 30) -> int:
        start = len(self.steps())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = self.steps()
            if len(steps) >= start + n:
                return steps[-1][0]
            time.sleep(0.1)
        raise AssertionError(
            f"{self.name}: fewer than {n} new steps in {timeout}s:\n" + "\n".join(self.output()[-20:])
        )

    def agent_status(self) -> dict[str, Any]:
        from npusnap_cli.device.agent_client import AgentClient

        pid = self.host_pid()
        sock = Path(f"/proc/{pid}/root/run/npusnap/{podmanlib.ns_pid(pid)}.sock")
        with AgentClient(pid, socket_path=sock, timeout=10) as c:
            return dict(c.status().to_json())  # the agent's JSON, as tests read it

    def wait_unlocked(self, timeout: float = 15) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                last = self.agent_status()
            except Exception as exc:  # the agent may still be thawing
                last = {"error": str(exc)}
            if last.get("state") == "RUNNING" and last.get("owner") is None:
                return last
            time.sleep(0.1)
        raise AssertionError(f"agent of {self.name} not unlocked within {timeout}s: {last}")

    def remove(self) -> None:
        api = self.ctrd.cri.call
        a = self.ctrd.cri.api
        api("runtime", "StopPodSandbox", a.StopPodSandboxRequest(pod_sandbox_id=self.id), 60)
        api("runtime", "RemovePodSandbox", a.RemovePodSandboxRequest(pod_sandbox_id=self.id), 60)
        self.ctrd.pods.remove(self.id)
