"""A client for the Container Runtime Interface (CRI): the gRPC API the kubelet drives containerd
or CRI-O with, here used for its ``CheckpointContainer`` call and, in tests, to run pods.

The protocol is not copied by hand: scripts/setup-cri.sh compiles the CRI's own ``api.proto``
(Debian's golang-k8s-cri-api-dev) with grpcio-tools into ``.build/cri/python`` (or the directory
``NPUSNAP_CRI_PYTHON`` names); this module loads those modules. grpc is imported lazily: the rest
of npusnap works without it.
"""

from __future__ import annotations

import base64
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import paths
from npusnap_cli.errors import PreflightError, TargetError, UsageError

# What CheckpointContainer is allowed before the call is abandoned (the runtime goes on; the
# plugin's lease bounds how long a container stays locked if its runtime dies).
DEFAULT_TIMEOUT_S = 600.0


def generated_dir() -> Path:
    return Path(os.environ.get("NPUSNAP_CRI_PYTHON") or (paths.build_dir() / "cri" / "python"))


def load_api() -> tuple[Any, Any]:
    """(api_pb2, api_pb2_grpc) generated from the CRI's api.proto."""
    where = generated_dir()
    if not (where / "api_pb2_grpc.py").is_file():
        raise PreflightError(
            f"the CRI client is not generated ({where}/api_pb2_grpc.py is missing)",
            why="npusnap talks CRI with modules compiled from the CRI's api.proto at setup time",
            fix="run scripts/setup-cri.sh (or set NPUSNAP_CRI_PYTHON to a directory holding api_pb2*.py)",
        )
    try:
        import grpc  # noqa: F401
    except ImportError:
        raise PreflightError(
            "grpcio is not installed",
            why="the CRI is a gRPC API",
            fix="pip install 'npusnap[k8s]' (or grpcio)",
        ) from None
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return importlib.import_module("api_pb2"), importlib.import_module("api_pb2_grpc")


class CriClient:
    """The RuntimeService and ImageService of one runtime endpoint (``unix:///run/x.sock``)."""

    def __init__(self, endpoint: str, timeout: float = 30.0) -> None:
        import grpc

        self.api, grpc_api = load_api()
        if not endpoint.startswith(("unix://", "unix:")):
            endpoint = "unix://" + endpoint
        self.endpoint = endpoint
        self.timeout = timeout
        self._grpc = grpc
        self.channel = grpc.insecure_channel(endpoint)
        self.runtime = grpc_api.RuntimeServiceStub(self.channel)
        self.images = grpc_api.ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, service: str, method: str, request: Any, timeout: Optional[float] = None) -> Any:
        """One RPC; a gRPC failure becomes a TargetError naming the call and the runtime's words."""
        stub = self.runtime if service == "runtime" else self.images
        try:
            return getattr(stub, method)(request, timeout=timeout or self.timeout)
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            raise TargetError(
                f"CRI {method} failed at {self.endpoint}: {detail}",
                why=f"the container runtime answered {code.name if code else 'an error'}",
                fix="read the runtime's log (containerd: journalctl -u containerd)",
                details={"endpoint": self.endpoint, "method": method, "code": code.name if code else None},
            ) from None

    def version(self) -> Any:
        return self.call("runtime", "Version", self.api.VersionRequest())

    def container_status(self, container_id: str) -> Any:
        return self.call(
            "runtime", "ContainerStatus", self.api.ContainerStatusRequest(container_id=container_id)
        )

    def find_container(self, namespace: str, pod: str, container: str) -> str:
        """The id of the running container ``container`` of pod ``namespace/pod`` (kubelet labels)."""
        labels = {
            "io.kubernetes.pod.namespace": namespace,
            "io.kubernetes.pod.name": pod,
            "io.kubernetes.container.name": container,
        }
        running = self.api.ContainerStateValue(state=self.api.CONTAINER_RUNNING)
        flt = self.api.ContainerFilter(state=running, label_selector=labels)
        found = self.call("runtime", "ListContainers", self.api.ListContainersRequest(filter=flt)).containers
        if len(found) != 1:
            raise TargetError(
                f"{len(found)} running containers named {namespace}/{pod}/{container} at {self.endpoint}",
                why="the kubelet labels each container with its pod's namespace and name and its own name",
                fix="check the names with `crictl ps` on the node",
            )
        return str(found[0].id)

    def run_pod(
        self, pod: dict[str, Any], container: dict[str, Any], timeout: float = 300
    ) -> tuple[str, str]:
        """What the kubelet does for a one-container pod, from the CRI's own JSON forms of
        PodSandboxConfig and ContainerConfig (crictl's pod.json/container.json): pull the image
        unless it is present, or is a checkpoint archive (a file: containerd restores from it),
        then RunPodSandbox, CreateContainer, StartContainer. Returns (pod id, container id)."""
        from google.protobuf import json_format

        api = self.api
        # The CRI's KeyValue.value (an environment variable's value) is bytes, base64 in JSON:
        # plain strings are taken as they are, as crictl's container.json has them.
        container = dict(container)
        container["envs"] = [
            {**e, "value": base64.b64encode(str(e.get("value", "")).encode()).decode()}
            for e in container.get("envs", [])
        ]
        try:
            pod_cfg = json_format.ParseDict(pod, api.PodSandboxConfig())
            ctr_cfg = json_format.ParseDict(container, api.ContainerConfig())
        except json_format.ParseError as exc:
            raise UsageError(
                f"not a CRI config: {exc}",
                fix="the JSON forms of the CRI's PodSandboxConfig and ContainerConfig (as crictl takes)",
            ) from None
        image = ctr_cfg.image.image
        if image and not os.path.exists(image):
            have = self.call(
                "images", "ImageStatus", api.ImageStatusRequest(image=api.ImageSpec(image=image))
            )
            if not have.image.id:
                self.call(
                    "images", "PullImage", api.PullImageRequest(image=api.ImageSpec(image=image)), timeout
                )
        pod_id = self.call(
            "runtime", "RunPodSandbox", api.RunPodSandboxRequest(config=pod_cfg), timeout
        ).pod_sandbox_id
        req = api.CreateContainerRequest(pod_sandbox_id=pod_id, config=ctr_cfg, sandbox_config=pod_cfg)
        cid = self.call("runtime", "CreateContainer", req, timeout).container_id
        self.call("runtime", "StartContainer", api.StartContainerRequest(container_id=cid), timeout)
        return str(pod_id), str(cid)

    def remove_pod(self, pod_id: str, timeout: float = 120) -> None:
        api = self.api
        self.call("runtime", "StopPodSandbox", api.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout)
        self.call("runtime", "RemovePodSandbox", api.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout)

    def checkpoint(self, container_id: str, location: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """CheckpointContainer: what the kubelet's checkpoint API calls (the container keeps running)."""
        req = self.api.CheckpointContainerRequest(
            container_id=container_id, location=location, timeout=int(timeout)
        )
        self.call("runtime", "CheckpointContainer", req, timeout=timeout + 30)
