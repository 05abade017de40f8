"""Helpers for the podman + runc tests of the CRIU plugin (tests/integration/test_podman.py).

A container image is built locally, without a registry: a rootfs with busybox, the C workload
(tests/data/npu_stepper.c), the simulated CANN library, libnpusnap_agent.so and the shared
libraries they need (found with ldd), imported with `podman import`. The simulator's socket
directory is bind-mounted at the same path, so the runtime inside reaches the host's daemon.
CRIU gets the plugin directory through a per-container `org.criu.config` annotation (podman
scrubs the environment it hands to runc and CRIU; /etc/criu/default.conf is never written).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import paths
from npusnap_cli.device.agent_client import AgentClient
from tests.integration.agentlib import expected_checksums

REPO = Path(__file__).resolve().parents[2]
STEPPER = REPO / "tests" / "data" / "npu_stepper.c"
RUN_FLAGS = [
    "--runtime",
    "runc",
]
# These machines lack CAP_SYS_RESOURCE: CRIU cannot raise its limits inside the container.
CONTAINER_FLAGS = ["--network=none", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["podman", *RUN_FLAGS, *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
        )
    return res


def plugin_dir() -> Path:
    return paths.build_dir() / "criu-plugin"


def _needed_libs(files: list[Path], lib_path: str) -> set[str]:
    libs: set[str] = set()
    for f in files:
        out = subprocess.run(
            ["ldd", str(f)], capture_output=True, text=True, env={"LD_LIBRARY_PATH": lib_path}, timeout=30
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
                libs.add(parts[2])
            elif parts and parts[0].startswith("/"):
                libs.add(parts[0])  # the dynamic loader
    return libs


def build_image(work: Path, tag: str) -> None:
    """rootfs -> tarball -> `podman import` as ``tag``."""
    podman("import", str(build_rootfs(work)), tag)


def build_rootfs(work: Path) -> Path:
    """The workload's rootfs as a tarball (``work/rootfs.tar``); also used by the CRI tests."""
    root = work / "rootfs"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("bin", "opt/npu", "run", "tmp", "proc", "sys", "dev", "etc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox")
    assert busybox, "busybox is missing (scripts/test.sh installs busybox-static)"
    shutil.copy2(busybox, root / "bin" / "busybox")
    for tool in ("sh", "sleep", "cat", "ls"):
        (root / "bin" / tool).symlink_to("busybox")
    cann = paths.sim_cann_home()
    shutil.copytree(cann, root / "opt/npu/cann", symlinks=True)
    shutil.copy2(paths.build_dir() / "agent" / "libnpusnap_agent.so", root / "opt/npu/libnpusnap_agent.so")
    subprocess.run(
        ["cc", "-O1", "-Wall", "-Werror", "-o", str(root / "opt/npu/npu_stepper"), str(STEPPER),
         f"-L{cann / 'lib64'}", "-lacl_rt"],
        check=True,
        timeout=120,
    )  # fmt: skip
    files = [
        root / "opt/npu/npu_stepper",
        root / "opt/npu/libnpusnap_agent.so",
        *(cann / "lib64").glob("*.so"),
    ]
    for lib in _needed_libs(files, str(cann / "lib64")):
        if lib.startswith(str(cann)):
            continue
        dest = root / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dest, follow_symlinks=True)
    tarball = work / "rootfs.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(root, arcname=".")
    return tarball


class Container:
    """One workload container: the C stepper under the agent, on the simulated NPU."""

    def __init__(
        self,
        tag: str,
        sim_env: dict[str, str],
        work: Path,
        *,
        fault_file: Optional[Path] = None,
        criu_conf_extra: str = "",
        interval_ms: int = 50,
        command: Optional[list[str]] = None,
    ) -> None:
        self.name = f"npusnap-test-{uuid.uuid4().hex[:10]}"
        self.names = [self.name]
        self.work = work
        sim_dir = str(Path(sim_env["NPUSIM_SOCKET"]).parent)
        self.conf = work / f"{self.name}.criu.conf"
        self.conf.write_text(f"libdir {plugin_dir()}\n{criu_conf_extra}")
        env = {
            "LD_PRELOAD": "/opt/npu/libnpusnap_agent.so",
            "NPUSNAP_AGENT": "1",
            "ASCEND_HOME_PATH": "/opt/npu/cann",
            "LD_LIBRARY_PATH": "/opt/npu/cann/lib64",
            "NPUSIM_SOCKET": sim_env["NPUSIM_SOCKET"],
        }
        args = [
            "run",
            "-d",
            "--name",
            self.name,
            "--annotation",
            f"org.criu.config={self.conf}",
            *CONTAINER_FLAGS,
        ]
        args += ["-v", f"{sim_dir}:{sim_dir}"]
        if fault_file is not None:
            args += ["-v", f"{fault_file.parent}:{fault_file.parent}"]
            env["NPUSIM_FAULT_FILE"] = str(fault_file)
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        args += [tag, *(command or ["/opt/npu/npu_stepper", "--interval-ms", str(interval_ms)])]
        podman(*args)

    def remove(self) -> None:
        for n in self.names:
            podman("rm", "-f", "-t", "0", n, check=False)

    def logs(self, name: Optional[str] = None) -> str:
        return podman("logs", name or self.name).stdout

    def steps(self, name: Optional[str] = None) -> list[tuple[int, int]]:
        out = []
        for line in self.logs(name).splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "step":
                out.append((int(parts[1]), int(parts[3])))
        return out

    def wait_steps(self, n: int, name: Optional[str] = None, timeout: float = 30) -> int:
        """Wait until the log shows ``n`` more steps than now; returns the last step number."""
        start = len(self.steps(name))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = self.steps(name)
            if len(steps) >= start + n:
                return steps[-1][0]
            time.sleep(0.2)
        raise AssertionError(
            f"{name or self.name}: fewer than {n} new steps in {timeout}s:\n{self.logs(name)[-800:]}"
        )

    def inspect(self, name: Optional[str] = None) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(podman("inspect", name or self.name).stdout)
        return data[0]

    def running(self, name: Optional[str] = None) -> bool:
        return bool(self.inspect(name)["State"]["Running"])

    def host_pid(self, name: Optional[str] = None) -> int:
        return int(self.inspect(name)["State"]["Pid"])

    def static_dir(self, name: Optional[str] = None) -> Path:
        return Path(self.inspect(name)["StaticDir"])

    def agent_status(self, name: Optional[str] = None, host_pid: Optional[int] = None) -> dict[str, Any]:
        """The agent's status, through the container's mount namespace (pid 1 inside, or the
        process ``host_pid``)."""
        pid = host_pid or self.host_pid(name)
        sock = Path(f"/proc/{pid}/root/run/npusnap/{ns_pid(pid)}.sock")
        with AgentClient(pid, socket_path=sock, timeout=10) as c:
            return dict(c.status().to_json())  # the agent's JSON, as tests read it


def ns_pid(pid: int) -> int:
    """The pid of a host pid inside its own pid namespace (last field of NSpid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def parse_steps(text: str) -> list[tuple[int, int]]:
    return [(int(p[1]), int(p[3])) for p in (ln.split() for ln in text.splitlines()) if p[:1] == ["step"]]


def assert_continuous(steps: list[tuple[int, int]]) -> None:
    """No step lost or repeated, every checksum right (device memory survived)."""
    assert steps, "no steps"
    numbers = [s for s, _ in steps]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), f"steps skipped/repeated: {numbers}"
    expected = expected_checksums(numbers[-1])
    for step, checksum in steps:
        assert checksum == expected[step], f"step {step}: checksum {checksum} != {expected[step]}"


def wait_unlocked(c: Container, timeout: float = 15, name: Optional[str] = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            last = c.agent_status(name)
        except Exception as exc:  # the agent may still be thawing
            last = {"error": str(exc)}
        if last.get("state") == "RUNNING" and last.get("owner") is None:
            return last
        time.sleep(0.2)
    raise AssertionError(f"agent of {name or c.name} not unlocked within {timeout}s: {last}")
