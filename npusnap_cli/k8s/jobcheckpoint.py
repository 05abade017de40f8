"""`npusnap k8s checkpoint` and `restore`: a job's containers across pods, checkpointed as one cut
and restored together.

The barriers live where the runtime's call reaches: each container's checkpoint (the kubelet's
checkpoint API, or CRI ``CheckpointContainer``) runs runc and CRIU, whose npusnap plugin finds
``NPUSNAP_JOB_COORDINATOR`` / ``NPUSNAP_JOB_MEMBER`` in the job's environment and joins the
coordinator served here (netcoord's protocol, each container one "node"):

    locked  every container's NPU processes locked, backed up and frozen (CHECKPOINT_DEVICES):
            no container's memory is dumped before every container got there
    saved   every container's CRIU images written (fini): none is let go before all are saved

A member that fails aborts the others: their dumps fail at ``locked`` and CRIU lets every task run
again (the plugin unlocks it), so the job goes on. The checkpoints are the runtime's archives
(``--leave-running`` always, as the kubelet asks); this module checks each one (the plugin's
record of every image file, the member it joined as) and writes ``npusnap-k8s-job.json`` naming
each archive with its sha256. Any failure removes the archives of the attempt and says whether every
container is still running.

At restore each member's plugin reads its member and coordinator from its archive and waits at
``restored`` (its processes back, still locked) until every member is back; then each restores its
device state and unlocks (``restore_job``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from npusnap_cli import __version__
from npusnap_cli.errors import (
    CriuError,
    ExitCode,
    ImageError,
    NpusnapError,
    PreflightError,
    StateUnknownError,
    UsageError,
)
from npusnap_cli.image import containers
from npusnap_cli.image.k8sjob import MANIFEST, MANIFEST_FORMAT, MANIFEST_KIND, read_manifest, verify_job
from npusnap_cli.image.k8sjob import sha256_of as _sha256
from npusnap_cli.jsontypes import JSONObject
from npusnap_cli.k8s.cri import CriClient
from npusnap_cli.pipelines import netcoord

PHASES = ("locked", "saved")
DEFAULT_BARRIER_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Member:
    """One container of the job: member ``index`` is the NPUSNAP_JOB_MEMBER its pod sets."""

    index: int
    namespace: str
    pod: str
    container: str
    node: str = ""  # the kubelet's host (kubelet API only)

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    def archive_name(self, when: str) -> str:
        # The kubelet's own naming: checkpoint-<pod>_<namespace>-<container>-<time>.tar
        return f"checkpoint-{self.pod}_{self.namespace}-{self.container}-{when}.tar"


def parse_member(index: int, text: str) -> Member:
    """``NAMESPACE/POD/CONTAINER[@NODE]``."""
    spec, _, node = text.partition("@")
    parts = spec.split("/")
    if len(parts) != 3 or not all(parts):
        raise UsageError(
            f"--member {text!r} is not NAMESPACE/POD/CONTAINER[@NODE]",
            fix="e.g. --member default/trainer-0/trainer@node-a (members in NPUSNAP_JOB_MEMBER order)",
        )
    return Member(index, parts[0], parts[1], parts[2], node)


class Backend(Protocol):
    """Where the checkpoint calls go: a node's CRI runtime, or the kubelets."""

    def checkpoint(self, member: Member, location: Path, timeout_s: float) -> Path: ...

    def running(self, member: Member) -> Optional[bool]: ...


class CriBackend:
    """CRI ``CheckpointContainer`` at one runtime endpoint (every member on this node)."""

    def __init__(self, endpoint: str) -> None:
        self.client = CriClient(endpoint)
        self.ids: dict[int, str] = {}

    def resolve(self, member: Member) -> str:
        if member.index not in self.ids:
            self.ids[member.index] = self.client.find_container(
                member.namespace, member.pod, member.container
            )
        return self.ids[member.index]

    def checkpoint(self, member: Member, location: Path, timeout_s: float) -> Path:
        cid = self.resolve(member)
        try:
            self.client.checkpoint(cid, str(location), timeout_s)
        except NpusnapError as exc:
            raise plugin_failure(member, exc) from None
        return location

    def running(self, member: Member) -> Optional[bool]:
        try:
            st = self.client.container_status(self.resolve(member)).status
        except NpusnapError:
            return None
        return bool(st.state == self.client.api.CONTAINER_RUNNING)


_CRIU_LOG = re.compile(r"path= (/\S+\.log)")
_PLUGIN_FAILED = re.compile(r"npusnap-plugin: FAILED, npusnap exit (\d+) \([^)]*\): (.*)")


def plugin_failure(member: Member, exc: NpusnapError) -> CriuError:
    """The runtime's error, with the plugin's own words and exit code where its CRIU log (named in
    runc's message, on this node) has them."""
    err = CriuError(
        f"the runtime could not checkpoint {member.name}: {exc.message}",
        why="runc's CRIU (or npusnap's plugin in it) failed; the container was let go and runs on",
        fix="read the plugin's lines (npusnap-plugin:) in the runtime's CRIU log for this container",
        details=dict(exc.details),
    )
    m = _CRIU_LOG.search(exc.message)
    if m is None:
        return err
    try:
        lines = Path(m.group(1)).read_text(errors="replace").splitlines()
    except OSError:
        return err
    failed = [f for f in (_PLUGIN_FAILED.search(line) for line in lines) if f is not None]
    err.details["criu_log"] = m.group(1)
    if failed:
        code, text = int(failed[0].group(1)), failed[0].group(2)
        err.message = f"{member.name}: {text}"
        err.why = f"npusnap's CRIU plugin failed in this container (its CRIU log: {m.group(1)})"
        err.details["plugin"] = [f.group(0) for f in failed]
        if code in {int(c) for c in ExitCode} and code > 3:
            err.exit_code = ExitCode(code)
    return err


class KubeletBackend:
    """The kubelet's checkpoint API, ``POST https://NODE:10250/checkpoint/NS/POD/CONTAINER``: the
    archive stays on the node (under /var/lib/kubelet/checkpoints), the answer names it."""

    def __init__(self, cert: Path, key: Path, ca: Optional[Path], port: int = 10250) -> None:
        import ssl

        self.ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
        if ca is None:
            # A kubelet's serving certificate is usually self-signed per node.
            self.ctx.check_hostname = False
            self.ctx.verify_mode = ssl.CERT_NONE
        self.ctx.load_cert_chain(str(cert), str(key))
        self.port = port

    def checkpoint(self, member: Member, location: Path, timeout_s: float) -> Path:
        import urllib.error
        import urllib.parse
        import urllib.request

        if not member.node:
            raise UsageError(f"member {member.name} has no @NODE", fix="--member NS/POD/CONTAINER@NODE")
        path = "/".join(
            urllib.parse.quote(p, safe="") for p in (member.namespace, member.pod, member.container)
        )
        url = f"https://{member.node}:{self.port}/checkpoint/{path}?timeout={int(timeout_s)}"
        req = urllib.request.Request(url, method="POST")
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=timeout_s + 30) as resp:
                body = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise CriuError(
                f"the kubelet on {member.node} could not checkpoint {member.name}: HTTP {exc.code} "
                f"{exc.read()[:500].decode(errors='replace')}",
                why="the kubelet's ContainerCheckpoint API answered with an error",
                fix="read the kubelet's and the runtime's logs on that node",
            ) from None
        except OSError as exc:
            raise PreflightError(
                f"cannot reach the kubelet on {member.node}:{self.port}: {exc}",
                fix="check the node name, the port and the client certificate",
            ) from None
        items = body.get("items") if isinstance(body, dict) else None
        if not items:
            raise CriuError(f"the kubelet on {member.node} named no archive for {member.name}: {body}")
        return Path(str(items[0]))  # a path on that node

    def running(self, member: Member) -> Optional[bool]:
        return None  # the kubelet's API does not say; `kubectl get pod` does


@dataclass
class MemberResult:
    member: Member
    archive: Optional[Path] = None
    error: Optional[NpusnapError] = None
    seconds: float = 0.0
    verified: Optional[containers.ContainerVerifyResult] = None


@dataclass(frozen=True)
class JobCheckpoint:
    directory: Path
    manifest: dict[str, Any]


def _check_archive(res: MemberResult, job: bool = True) -> None:
    """The plugin's record in the archive: present, every image file intact, this member's job."""
    assert res.archive is not None
    ckpt = containers.find(res.archive)
    if ckpt is None:
        raise ImageError(
            f"{res.archive}: no {containers.STATE_FILE}: member {res.member.name} was checkpointed without "
            "npusnap's CRIU plugin",
            why="runc's CRIU did not load npusnap_plugin.so, or no NPU process of the container has an agent",
            fix="install the plugin where the node's CRIU finds it (libdir in /etc/criu/runc.conf)",
        )
    res.verified = containers.verify(ckpt)
    record = ckpt.state.job or {}
    if not job and not record:
        return
    if record.get("member") != res.member.index:
        raise ImageError(
            f"{res.archive}: the plugin joined as member {record.get('member')}, expected {res.member.index} "
            f"({res.member.name})",
            why="NPUSNAP_JOB_MEMBER in the pod spec does not match the order of --member",
            fix="give --member in NPUSNAP_JOB_MEMBER order (0, 1, ...)",
        )


def checkpoint_job(
    members: list[Member],
    directory: Path,
    backend: Backend,
    listen: Optional[tuple[str, int]],
    *,
    timeout_s: float = 600.0,
    barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
    local_archives: bool = True,
) -> JobCheckpoint:
    """Checkpoint every member at once behind the plugin's barriers; write the job manifest."""
    if not members:
        raise UsageError("no --member given", fix="name every container of the job with --member")
    if sorted(m.index for m in members) != list(range(len(members))):
        raise UsageError("members must be numbered 0..N-1")
    if listen is None:
        if len(members) > 1:
            raise UsageError(
                "a job of several containers needs --listen HOST:PORT",
                fix="the address the pods name in NPUSNAP_JOB_COORDINATOR",
            )
        listen = ("127.0.0.1", 0)  # one container: a coordinator nobody needs to find
    if directory.exists() and any(directory.iterdir()):
        raise UsageError(f"{directory} exists and is not empty", fix="choose a new directory")
    work = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, mode=0o700)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    server = netcoord.CoordServer(listen, len(members), PHASES, barrier_timeout_s)
    results = [MemberResult(m) for m in members]
    started = time.monotonic()
    try:

        def one(res: MemberResult) -> None:
            t0 = time.monotonic()
            try:
                res.archive = backend.checkpoint(res.member, work / res.member.archive_name(when), timeout_s)
            except NpusnapError as exc:
                res.error = exc
                # The others wait at a barrier for this member: release them now.
                server.abort(f"member {res.member.index} ({res.member.name}): {exc.message}")
            finally:
                res.seconds = time.monotonic() - t0

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(members)) as pool:
            list(pool.map(one, results))
        # Every plugin has passed or left the barriers by now; the server's verdict follows its
        # last message at once (none at all for one container that named no coordinator).
        server.decided.wait(5 if len(members) > 1 else 0)
        failed = [r for r in results if r.error is not None]
        if not failed and len(members) == 1 and server.outcome is None and local_archives:
            # One container whose pod names no coordinator: a plain checkpoint, no barrier needed.
            _check_archive(results[0], job=False)
        elif not failed and server.outcome != "ok":
            # Every runtime said yes but the barriers did not all pass (a member without the
            # job's environment never joined): these archives are no coordinated cut.
            raise CriuError(
                f"the job's barriers did not complete: {server.outcome or 'no member joined'}",
                why="every container's checkpoint must join the coordinator (NPUSNAP_JOB_COORDINATOR="
                f"{listen[0]}:{listen[1]} and NPUSNAP_JOB_MEMBER in each pod's environment)",
                fix="set both in every member's pod spec, then checkpoint again",
                details={"members": [m.name for m in members]},
            )
        if failed:
            # Lead with the member whose failure aborted the others: the barrier's verdict names
            # it, as "member N (...)" when npusnap saw it fail first, or as "node N: ..." when its
            # plugin's abort got there first (a member joins the barriers as node N).
            m = re.match(r"(?:member (\d+) |node (\d+): )", server.outcome or "")
            culprit = int(m.group(1) or m.group(2)) if m else None
            first = next((r for r in failed if r.member.index == culprit), failed[0])
            assert first.error is not None
            err = CriuError(
                f"member {first.member.index} ({first.member.name}) failed: {first.error.message}",
                why="a coordinated checkpoint is every container or none: the others were rolled back",
                fix=first.error.fix or "read the runtime's log on that member's node",
                details={
                    "failed": {r.member.name: r.error.to_dict() for r in failed if r.error is not None},
                    "barriers": server.outcome,
                },
            )
            if first.error.exit_code > 3:
                err.exit_code = first.error.exit_code
            raise err
        if local_archives and results[0].verified is None:
            for res in results:
                _check_archive(res)
        manifest = _manifest(results, when, listen, local_archives, time.monotonic() - started)
        manifest["barriers"] = list(PHASES) if server.outcome == "ok" else []
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if directory.exists():
            directory.rmdir()
        work.rename(directory)
        return JobCheckpoint(directory, manifest)
    except BaseException as exc:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(exc, NpusnapError):
            _check_running(exc, backend, members)
        raise
    finally:
        server.close()


def _check_running(exc: NpusnapError, backend: Backend, members: list[Member]) -> None:
    """After a failure every container must be running; say loudly which is not."""
    state = {m.name: backend.running(m) for m in members}
    exc.details["running"] = state
    stopped = [name for name, up in state.items() if up is False]
    if stopped:
        raise StateUnknownError(
            f"after the failed job checkpoint, {', '.join(stopped)} is not running",
            why=exc.message,
            fix="look at the pod (kubectl describe pod) and the runtime's log; restore it from a checkpoint",
            details=exc.details,
        ) from exc


def _manifest(
    results: list[MemberResult], when: str, listen: tuple[str, int], local: bool, seconds: float
) -> JSONObject:
    members: list[JSONObject] = []
    for r in results:
        assert r.archive is not None
        entry: JSONObject = {
            "member": r.member.index,
            "namespace": r.member.namespace,
            "pod": r.member.pod,
            "container": r.member.container,
            "node": r.member.node or socket.gethostname(),
            "seconds": round(r.seconds, 3),
        }
        if local:
            digest, size = _sha256(r.archive)
            entry.update(
                archive=r.archive.name,
                sha256=digest,
                size=size,
                image_files=r.verified.files_checked if r.verified else None,
                npu_processes=r.verified.processes if r.verified else None,
            )
        else:
            entry.update(archive=str(r.archive), sha256=None, size=None)  # on the member's node
        members.append(entry)
    return {
        "kind": MANIFEST_KIND,
        "format": MANIFEST_FORMAT,
        "tool_version": __version__,
        "created": when,
        "coordinator": f"{listen[0]}:{listen[1]}",
        "barriers": list(PHASES),
        "seconds": round(seconds, 3),
        "members": members,
    }


def parse_listen(text: str) -> tuple[str, int]:
    return netcoord.parse_addr(text)


RESTORE_PHASES = ("restored",)


def restore_job(
    directory: Path,
    listen: Optional[tuple[str, int]],
    run: Optional[Callable[[dict[str, Any], Path], Any]] = None,
    *,
    barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
) -> dict[str, Any]:
    """Serve the "restored" barrier for every member of a job checkpoint: each member's plugin,
    once CRIU has restored its tasks (locked), waits there, so that no member's NPU processes are
    unlocked before every member is back. ``run(member, archive)`` creates a member's container
    from its archive (CRI); without it the pods are created by someone else (kubectl) meanwhile.
    The restored processes name the coordinator they were checkpointed with (their environment is
    restored memory): by default this listens there."""
    manifest = read_manifest(directory)
    verify_job(directory)
    members = manifest["members"]
    if listen is None:
        listen = netcoord.parse_addr(str(manifest["coordinator"]))
    server = netcoord.CoordServer(listen, len(members), RESTORE_PHASES, barrier_timeout_s)
    errors: dict[str, NpusnapError] = {}
    made: dict[int, Any] = {}
    try:
        if run is not None:

            def one(m: dict[str, Any]) -> None:
                try:
                    made[int(m["member"])] = run(m, directory / str(m["archive"]))
                except NpusnapError as exc:
                    errors[f"{m['namespace']}/{m['pod']}/{m['container']}"] = exc
                    server.abort(f"member {m['member']}: {exc.message}")

            with concurrent.futures.ThreadPoolExecutor(max_workers=len(members)) as pool:
                list(pool.map(one, members))
        server.decided.wait(netcoord.CONNECT_S + barrier_timeout_s + 10)
        if errors or server.outcome != "ok":
            raise CriuError(
                f"the job was not restored together: {server.outcome or 'the barrier did not complete'}",
                why="a member could not be restored, or did not reach the coordinator in time; the "
                "restored members' NPU processes stay locked until their agents' leases run out",
                fix="remove the restored pods and restore the job again",
                details={"failed": {k: e.to_dict() for k, e in errors.items()}, "barrier": server.outcome},
            )
        return {
            "directory": str(directory),
            "members": len(members),
            "coordinator": f"{listen[0]}:{listen[1]}",
            "created": [made[i] for i in sorted(made)],
        }
    finally:
        server.close()
