"""`npusnap restore --dry-run`: every check a restore makes and everything it needs, with nothing
touched — no file created, no process started, no agent contacted.

The checks are a list (``CHECKS``) that other modules extend with ``register``: each has a name,
a one-line description, and a function that returns what it found (a short text) or raises the
NpusnapError the real restore would raise. All checks run, also after a problem, so that one
run lists everything to fix; the result's exit code is the first problem's (the order is the
real restore's, the image's own integrity first: a corrupt image is exit 8 even while its
original still runs).

Core module: never prints.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criu
from npusnap_cli import image as img
from npusnap_cli.errors import NpusnapError, PreflightError, UsageError
from npusnap_cli.host import hostres, lazypages, pidfile, pidns
from npusnap_cli.pipelines import restore


@dataclass
class DryRunContext:
    """What a check may read: the image, its manifest and the restore's options."""

    image: Path
    manifest: img.Manifest
    options: Any  # restore.RestoreOptions
    cache: dict[str, Any] = field(default_factory=dict)

    def criu_binary(self) -> Any:
        if "criu" not in self.cache:
            self.cache["criu"] = criu.find_criu()
        return self.cache["criu"]


@dataclass(frozen=True)
class Check:
    name: str
    what: str
    run: Callable[[DryRunContext], str]
    # Skipped (not applicable) when this returns a reason.
    skip: Optional[Callable[[DryRunContext], Optional[str]]] = None


CHECKS: list[Check] = []


def register(check: Check, *, before: Optional[str] = None) -> None:
    """Add a check (e.g. a host resource the image needs); ``before``: the name it must precede."""
    if any(c.name == check.name for c in CHECKS):
        raise ValueError(f"a dry-run check named {check.name!r} exists")
    if before is None:
        CHECKS.append(check)
        return
    index = next(i for i, c in enumerate(CHECKS) if c.name == before)
    CHECKS.insert(index, check)


@dataclass(frozen=True)
class CheckResult:
    name: str
    what: str
    status: str  # "ok", "problem", "skipped"
    detail: str
    error: Optional[dict[str, Any]] = None
    exit_code: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_checks(image: Path, options: Any) -> list[CheckResult]:
    final = img.follow_pointer(image)
    manifest = img.load_manifest(final)  # no manifest: nothing to check, the error says why
    ctx = DryRunContext(final, manifest, options)
    results = []
    for check in CHECKS:
        reason = check.skip(ctx) if check.skip is not None else None
        if reason:
            results.append(CheckResult(check.name, check.what, "skipped", reason))
            continue
        try:
            detail = check.run(ctx)
        except NpusnapError as err:
            results.append(
                CheckResult(check.name, check.what, "problem", err.message, err.to_dict(), int(err.exit_code))
            )
            continue
        results.append(CheckResult(check.name, check.what, "ok", detail))
    return results


# --------------------------------------------------------------------------------------------
# The restore's own checks, in its order
# --------------------------------------------------------------------------------------------


def _structure(ctx: DryRunContext) -> str:
    img.verify(ctx.image, checksums=False, require_signature=ctx.options.require_signature)
    m = ctx.manifest
    signed = ", signature good" if ctx.options.require_signature else ""
    return f"{len(m.files)} files, sizes as listed{signed}"


def _checksums(ctx: DryRunContext) -> str:
    img.verify(ctx.image, checksums=True)
    return f"{len(ctx.manifest.files)} files, {sum(f.size for f in ctx.manifest.files)} bytes match"


def _versions(ctx: DryRunContext) -> str:
    binary = ctx.criu_binary()
    restore.check_versions(ctx.manifest, binary)
    v = ctx.manifest.versions
    return f"CRIU {binary.version}" + (f", CANN {v.cann}" if ctx.manifest.npu_processes else "")


def _lazy(ctx: DryRunContext) -> str:
    lazypages.check_lazy(ctx.image, ctx.manifest, ctx.criu_binary())
    return "CRIU can serve the pages lazily"


def _device_memory(ctx: DryRunContext) -> str:
    kept = restore.check_device_memory(ctx.manifest, ctx.options.accept_lost_device_memory)
    return f"kept by {kept or '-'}"


def _pids(ctx: DryRunContext) -> str:
    ids = restore.image_thread_ids(ctx.image, ctx.manifest)
    if ctx.manifest.pid_ns:
        return "a pid namespace of its own (`run --pid-ns`): no host pid needed"
    restore.check_pids_free(ctx.manifest, ids)
    return f"{len(ids)} pid(s) and thread id(s) free"


def _devices(ctx: DryRunContext) -> str:
    device_map = getattr(ctx.options, "device_map", ())
    pidns.check_device_map(ctx.manifest, device_map)
    notes = restore.check_devices_free(ctx.manifest, device_map)
    moved = dict(device_map)
    devices = sorted({moved.get(d, d) for p in ctx.manifest.npu_processes for d in (p.devices or ())})
    return f"device(s) {', '.join(map(str, devices)) or '-'} free" + "".join(f"; {n}" for n in notes)


def _socket_dirs(ctx: DryRunContext) -> str:
    """prepare_sockets' checks without creating anything."""
    made = []
    for p in ctx.manifest.processes:
        if not p.agent_socket:
            continue
        sock = Path(p.agent_socket)
        parent = sock.parent
        try:
            st = parent.lstat()
        except FileNotFoundError:
            if not os.access(parent.parent, os.W_OK | os.X_OK):
                raise PreflightError(
                    f"cannot create the agent socket directory {parent}",
                    fix=f"create it (mode 0700, owned by uid {p.uid}) or run as the image's user/root",
                ) from None
            made.append(str(parent))
            continue
        restore.check_socket_dir(sock, p.uid, st)
    return f"would create {', '.join(made)}" if made else "present and private"


def _host_files(ctx: DryRunContext) -> str:
    todo = hostres.check_put_back(ctx.manifest.host_files, replace=ctx.options.replace_tmpfs_files)
    return f"would put back {len(todo)} file(s)" if todo else "nothing to put back"


def _pipes(ctx: DryRunContext) -> str:
    pipes = [e for e in ctx.manifest.external_stdio if e.kind == "pipe"]
    target = ctx.options.pipe_to
    if not pipes:
        return "none recorded" + (" (--pipe-to is not needed)" if target is not None else "")
    if target is None:
        e = pipes[0]
        raise PreflightError(
            f"the image's pid {e.pid} wrote to a pipe to a process outside the tree (fd {e.fd})",
            fix="rerun restore with --pipe-to FILE: the job then writes there",
        )
    parent = Path(target).parent
    if Path(target).is_symlink() or not os.access(parent if str(parent) else ".", os.W_OK):
        raise PreflightError(f"cannot open --pipe-to {target}", fix="name a writable file (not a symlink)")
    return f"{len(pipes)} pipe(s) -> {target}"


def _logs(ctx: DryRunContext) -> str:
    wanted = ctx.options.logs
    if wanted is not None:
        if not restore._writable_dir(wanted, parents=True):
            raise UsageError(f"cannot write CRIU's restore log into {wanted}", fix="pass a writable --logs")
        return f"CRIU's log -> {wanted}"
    inside = img.logs_dir(ctx.image)
    if restore._writable_dir(inside, parents=False):
        return f"CRIU's log -> {inside / img.RESTORE_LOG}"
    return "the image is not writable: CRIU's log would go under $TMPDIR/npusnap-logs"


def _pidfile(ctx: DryRunContext) -> str:
    pidfile.check(ctx.options.pidfile)
    return f"-> {ctx.options.pidfile}"


for _check in (
    Check("structure", "manifest, file list, sizes, signature", _structure),
    Check(
        "checksums",
        "every file's sha256",
        _checksums,
        skip=lambda c: None if c.options.verify else "--no-verify",
    ),
    Check("versions", "same CRIU and CANN as at dump time", _versions),
    Check("lazy-pages", "CRIU's lazy pages", _lazy, skip=lambda c: None if c.options.lazy else "not --lazy"),
    Check("device-memory", "who keeps the device memory", _device_memory),
    Check("pids", "the image's pids and thread ids are free", _pids),
    Check("devices", "the image's NPU devices are free", _devices),
    Check("agent-sockets", "the agents' socket directories", _socket_dirs),
    Check("host-files", "tmpfs and deleted files to put back", _host_files),
    Check("pipes", "pipes to outside the tree (--pipe-to)", _pipes),
    Check("logs", "where CRIU's restore log goes", _logs),
    Check(
        "pidfile",
        "--pidfile can be written",
        _pidfile,
        skip=lambda c: None if c.options.pidfile is not None else "no --pidfile",
    ),
):
    register(_check)
