"""Checkpoints made by container engines through npusnap's CRIU plugin (native/criu-plugin).

``podman container checkpoint`` (or CRI-O for the kubelet, or a plain ``criu dump`` with the
plugin) writes CRIU's images and, beside them, the plugin's ``npusnap-plugin.json``: the NPU
processes it locked and backed up, their lock tokens, and the size and sha256 of every image file
(taken at the end of the dump). ``npusnap inspect`` and ``npusnap verify`` read such a checkpoint
in three forms:

* the CRIU images directory itself (holds ``npusnap-plugin.json``);
* a directory with a ``checkpoint/`` subdirectory (podman's container directory, an unpacked
  export archive, a kubelet checkpoint unpacked);
* an export archive: ``podman container checkpoint --export=F.tar[.gz|.zst]`` or the kubelet's
  ``checkpoint-<pod>_<ns>-<container>-<time>.tar`` (read as a stream; ``.zst`` needs ``zstd``).

Beside ``checkpoint/``, every engine writes checkpointctl's ``config.dump`` (container id, name,
image, runtime, time) and ``spec.dump`` (the OCI spec). containerd's CRI (``CheckpointContainer``,
what the kubelet calls) adds ``status.dump`` (the CRI ContainerStatus, with the pod's labels) and
``status``; podman adds none of them. ``engine`` tells them apart.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

from npusnap_cli import contract
from npusnap_cli.errors import ImageError
from npusnap_cli.jsontypes import (
    JSONObject,
    JSONValue,
    ShapeError,
    as_record,
    obj,
    opt_int,
    opt_str,
    req_int,
    req_list,
    req_str,
)

# The plugin's state file: named and versioned in native/contract/npusnap.toml (the plugin, C,
# writes it; this module reads it).
STATE_FILE = contract.PLUGIN_STATE_FILE
STATE_FORMAT = contract.PLUGIN_STATE_FORMAT
KIND = contract.PLUGIN_STATE_KIND
_CHUNK = 1 << 20


@dataclass(frozen=True)
class PluginProcess:
    """An NPU process the plugin locked and backed up (its lock token stays in the file)."""

    pid: Optional[int]
    ns_pid: Optional[int]
    agent_socket: Optional[str]

    def to_json(self) -> JSONObject:
        return {"pid": self.pid, "ns_pid": self.ns_pid, "agent_socket": self.agent_socket}


@dataclass(frozen=True)
class PluginFile:
    """An image file as the plugin recorded it at the end of the dump."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PluginState:
    """The plugin's state file (``npusnap-plugin.json``), the fields npusnap reads."""

    processes: tuple[PluginProcess, ...]
    files: tuple[PluginFile, ...]
    created: Optional[str] = None
    hostname: Optional[str] = None
    lease_s: JSONValue = None  # a number, shown as the plugin wrote it
    job: Optional[JSONObject] = None  # the coordinated job it joined (member, ...), as written

    @classmethod
    def from_json(cls, data: JSONValue) -> PluginState:
        """ShapeError naming the field that is not what the plugin writes."""
        d = as_record(data, STATE_FILE)
        processes = []
        for p in req_list(d, "processes"):
            r = as_record(p, "an entry of 'processes'")
            processes.append(
                PluginProcess(opt_int(r, "pid"), opt_int(r, "ns_pid"), opt_str(r, "agent_socket"))
            )
        files = []
        for f in req_list(d, "files"):
            r = as_record(f, "an entry of 'files'")
            files.append(PluginFile(req_str(r, "path"), req_int(r, "size"), req_str(r, "sha256")))
        job = d.get("job")
        if job is not None and not isinstance(job, dict):
            raise ShapeError(f"'job' is a {type(job).__name__}, not an object")
        lease = d.get("lease_s")
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))):
            raise ShapeError(f"'lease_s' is a {type(lease).__name__}, not a number")
        return cls(
            processes=tuple(processes),
            files=tuple(files),
            created=opt_str(d, "created"),
            hostname=opt_str(d, "hostname"),
            lease_s=lease,
            job=job,
        )


@dataclass(frozen=True)
class ContainerVerifyResult:
    checkpoint: str
    form: str
    files_checked: int
    bytes_checked: int
    checksums: bool
    processes: int

    def to_dict(self) -> JSONObject:
        return {
            "checkpoint": self.checkpoint,
            "form": self.form,
            "ok": True,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "checksums": self.checksums,
            "processes": self.processes,
        }


@dataclass
class PluginCheckpoint:
    """What the plugin recorded, and where."""

    source: str
    form: str  # "directory" or "archive"
    state: PluginState
    prefix: str = ""  # path of the CRIU images inside the directory/archive ("" or "checkpoint/")
    extra_files: list[str] = field(default_factory=list)  # engine files beside the images (archive)
    # config.dump / status.dump, parsed: the engine's own JSON, read for a few fields and forwarded
    engine_meta: dict[str, JSONValue] = field(default_factory=dict)

    @property
    def engine(self) -> str:
        if "status.dump" in self.engine_meta:
            return "containerd (CRI)"
        if "config.dump" in self.engine_meta:
            return "podman / CRI-O"
        return "CRIU"

    def container(self) -> JSONObject:
        """What the engine recorded about the container (checkpointctl's config.dump; CRI labels)."""
        config = obj(self.engine_meta.get("config.dump"))
        status = obj(self.engine_meta.get("status.dump"))
        labels = obj(status.get("labels"))
        info: JSONObject = {
            "id": config.get("id"),
            "name": config.get("name"),
            "image": config.get("rootfsImageName"),
            "image_ref": config.get("rootfsImageRef"),
            "runtime": config.get("runtime"),
            "checkpointed_at": config.get("checkpointedTime"),
        }
        if labels:
            info.update(
                namespace=labels.get("io.kubernetes.pod.namespace"),
                pod=labels.get("io.kubernetes.pod.name"),
                container=labels.get("io.kubernetes.container.name"),
            )
        return {k: v for k, v in info.items() if v is not None}

    @property
    def processes(self) -> tuple[PluginProcess, ...]:
        return self.state.processes

    @property
    def files(self) -> tuple[PluginFile, ...]:
        return self.state.files

    def summary(self) -> JSONObject:
        return {
            "checkpoint": self.source,
            "form": self.form,
            "kind": KIND,
            "created": self.state.created,
            "hostname": self.state.hostname,
            "lease_s": self.state.lease_s,
            "processes": [p.to_json() for p in self.processes],  # tokens stay in the (root-only) file
            "files": len(self.files),
            "image_bytes": sum(f.size for f in self.files),
            "engine": self.engine,
            "container": self.container(),
            "job": self.state.job,
            "engine_files": sorted(self.extra_files),
        }


def _bad(source: str, message: str, why: str = "", fix: str = "") -> ImageError:
    return ImageError(
        f"{source}: {message}",
        why=why or "the checkpoint is truncated, was modified after the dump, or is not a plugin checkpoint",
        fix=fix or "do not restore it; checkpoint the container again",
    )


def _parse_state(source: str, text: bytes) -> PluginState:
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise _bad(source, f"{STATE_FILE} is not valid JSON: {exc}") from None
    if not isinstance(state, dict) or state.get("kind") != KIND or state.get("format") != STATE_FORMAT:
        raise _bad(
            source,
            f"{STATE_FILE} has an unknown kind/format (this npusnap reads {KIND} format {STATE_FORMAT})",
            fix="inspect it with the npusnap version whose plugin wrote it",
        )
    for key in ("processes", "files"):
        if not isinstance(state.get(key), list):
            raise _bad(source, f"{STATE_FILE} lacks {key!r}")
    try:
        return PluginState.from_json(state)
    except ShapeError as exc:
        raise _bad(source, f"{STATE_FILE} is malformed: {exc}") from None


def is_archive(path: Path) -> bool:
    return path.is_file() and any(str(path).endswith(s) for s in (".tar", ".tar.gz", ".tgz", ".tar.zst"))


# The engine's small metadata files beside checkpoint/ that inspect reads (JSON, a few KiB).
ENGINE_META = ("config.dump", "status.dump")
_META_MAX = 1 << 20


def _meta(name: str, data: bytes) -> JSONValue:
    try:
        value: JSONValue = json.loads(data)
    except ValueError:
        return {"unreadable": name}
    return value


def find(path: Path) -> Optional[PluginCheckpoint]:
    """The plugin checkpoint at ``path`` (directory or archive), or None if it is not one."""
    if path.is_dir():
        for prefix in ("", "checkpoint/"):
            state_path = path / prefix / STATE_FILE
            if state_path.is_file():
                state = _parse_state(str(path), state_path.read_bytes())
                ckpt = PluginCheckpoint(str(path), "directory", state, prefix)
                if prefix:
                    for name in ENGINE_META:
                        meta_path = path / name
                        if meta_path.is_file() and meta_path.stat().st_size < _META_MAX:
                            ckpt.engine_meta[name] = _meta(name, meta_path.read_bytes())
                    ckpt.extra_files = sorted(p.name for p in path.iterdir() if p.is_file())
                return ckpt
        return None
    if is_archive(path):
        found: Optional[PluginCheckpoint] = None
        meta: dict[str, JSONValue] = {}
        extra: list[str] = []
        with _open_archive(path) as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if name in (STATE_FILE, f"checkpoint/{STATE_FILE}") and member.isfile():
                    data = tar.extractfile(member)
                    assert data is not None
                    state = _parse_state(str(path), data.read())
                    found = PluginCheckpoint(str(path), "archive", state, name[: -len(STATE_FILE)])
                elif name in ENGINE_META and member.isfile() and member.size < _META_MAX:
                    data = tar.extractfile(member)
                    assert data is not None
                    meta[name] = _meta(name, data.read())
                if member.isfile() and "/" not in name:
                    extra.append(name)
        if found is not None:
            found.engine_meta = meta
            found.extra_files = extra if found.prefix else []
        return found
    return None


@contextmanager
def _open_archive(path: Path) -> Iterator[tarfile.TarFile]:
    """A streaming reader of a (compressed) tar archive; .zst goes through the zstd tool."""
    if str(path).endswith(".tar.zst"):
        zstd = shutil.which("zstd")
        if zstd is None:
            raise ImageError(
                f"cannot read {path}: the zstd tool is missing",
                why="podman writes .tar.zst export archives with zstd compression",
                fix="apt-get install zstd, or export with podman container checkpoint --compress=gzip",
            )
        proc = subprocess.Popen([zstd, "-q", "-d", "-c", str(path)], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                yield tar
        except tarfile.TarError as exc:
            raise _bad(str(path), f"not a readable tar archive: {exc}") from None
        finally:
            proc.stdout.close()
            proc.kill()
            proc.wait(timeout=30)
        return
    try:
        with tarfile.open(path, mode="r|*") as tar:
            yield tar
    except tarfile.TarError as exc:
        raise _bad(str(path), f"not a readable tar archive: {exc}") from None


def _sha256(f: IO[bytes]) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def verify(ckpt: PluginCheckpoint, checksums: bool = True) -> ContainerVerifyResult:
    """Check every image file the plugin recorded: present, same size, same sha256.

    Raises ImageError naming the first problem (and listing all in details)."""
    expected = {f.path: f for f in ckpt.files}
    seen: dict[str, tuple[str, int]] = {}
    problems: list[str] = []
    if ckpt.form == "directory":
        base = Path(ckpt.source) / ckpt.prefix
        for name in expected:
            p = base / name
            if not p.is_file():
                problems.append(f"{name}: missing")
                continue
            if checksums:
                with open(p, "rb") as f:
                    seen[name] = _sha256(f)
            else:
                seen[name] = ("", p.stat().st_size)
    else:
        with _open_archive(Path(ckpt.source)) as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if not name.startswith(ckpt.prefix):
                    if member.isfile() and name not in ckpt.extra_files:
                        ckpt.extra_files.append(name)
                    continue
                rel = name[len(ckpt.prefix) :]
                if rel in expected and member.isfile():
                    member_file = tar.extractfile(member)
                    assert member_file is not None
                    seen[rel] = _sha256(member_file) if checksums else ("", member.size)
        for name in expected:
            if name not in seen:
                problems.append(f"{name}: missing")
    checked_bytes = 0
    for name, (digest, size) in seen.items():
        entry = expected[name]
        if size != entry.size:
            problems.append(f"{name}: size {size} != {entry.size} recorded at the dump")
        elif checksums and digest != entry.sha256:
            problems.append(f"{name}: sha256 differs from the one recorded at the dump")
        checked_bytes += size
    if not ckpt.processes:
        problems.append(f"{STATE_FILE} lists no NPU process")
    if problems:
        raise ImageError(
            f"checkpoint {ckpt.source} failed verification: {problems[0]}",
            why="the checkpoint is truncated, was modified after the dump, or the disk is corrupt",
            fix="do not restore it; checkpoint the container again (or copy the archive again)",
            details={"problems": problems},
        )
    return ContainerVerifyResult(
        checkpoint=ckpt.source,
        form=ckpt.form,
        files_checked=len(seen),
        bytes_checked=checked_bytes,
        checksums=checksums,
        processes=len(ckpt.processes),
    )
