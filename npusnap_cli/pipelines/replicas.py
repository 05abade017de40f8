"""`npusnap restore IMAGE --replicas N`: N copies of one image, restored side by side.

Only an image of a job in its own pid namespace (`npusnap run --pid-ns`) can be restored more
than once at a time: CRIU gives each copy a new pid namespace, so no host pid is needed, and
each copy's agent listens under a name of its own (host/pidns.py). CANN's Restore needs its
device free of every other process, so each copy needs a device of its own: ``--device-map`` once
per replica (each copy restored in a container of the simulated NPU that holds its devices only,
as a container's device mounts do on a node: host/pidns.py ``enter_device_view``).

The image is verified once, here; then every copy is restored at the same time by its own
`npusnap restore --no-verify` (one process each: CRIU's restore, the device restore and the
settle watch run in parallel), each with its own CRIU log directory and pidfile. Those processes
are forked from this one once it has imported the restore's modules: a copy starts no
interpreter and imports nothing (the CLI's start is a large part of a small restore, and N of
them share the host's cores). The copies read the same image files, so the page cache holds the
image's memory and device-memory files once, and each copy's agent copies its device memory
from a read-only mapping of that one file (native/agent/devmem_save.c): every copy reads the same
page-cache pages. An image with CRIU ghost files (small deleted files the job held open) is the
exception: CRIU recreates each under one name of the image's, so the copies' CRIU restores take
turns on a lock per ghost name (host/ghostlock.py); their device restores still overlap.
(Lazy pages are not used: a `criu lazy-pages` daemon serves the tasks of one restore,
criu/uffd.c, so N copies would need N daemons reading the same files.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import selectors
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from npusnap_cli.errors import NpusnapError, PreflightError, UsageError
from npusnap_cli.host import hostres, pidns, proctree
from npusnap_cli.image import integrity, layout
from npusnap_cli.image.manifest import Manifest, load_manifest
from npusnap_cli.pipelines import restore


@dataclass(frozen=True)
class ReplicaResult:
    index: int
    ok: bool
    root_pid: Optional[int]
    result: dict[str, Any]
    error: Optional[dict[str, Any]]
    wall_s: float
    warnings: tuple[str, ...] = ()  # what the copy's restore told (e.g. the ghost files it waited for)
    stopped: bool = False  # restored, then stopped again because another copy failed
    name: str = ""  # the copy's name (--replica-name): its logs directory and output suffix
    output: Optional[str] = None  # where the copy writes what the original wrote to its file


DEFAULT_NAME = "replica-{n}"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def names_for(template: str, replicas: int) -> list[str]:
    """Each copy's name: ``{n}`` in ``template`` is its number (else ``-N`` is appended). A name
    becomes a directory and a file suffix, so it is a plain word."""
    names = [
        template.replace("{n}", str(i)) if "{n}" in template else f"{template}-{i}" for i in range(replicas)
    ]
    bad = [n for n in names if not _NAME.fullmatch(n)]
    if bad:
        raise UsageError(
            f"--replica-name {template!r} makes the name {bad[0]!r}",
            why="a copy's name is a directory of its logs and a suffix of its output file: letters, "
            "digits, '.', '_' and '-' only, up to 64 characters",
            fix="for example --replica-name 'trainer-{n}'",
        )
    return names


def pidfile_for(pidfile: Optional[Path], index: int) -> Optional[Path]:
    """Replica ``index``'s pidfile (or output file): ``{n}`` in the name is replaced, else ``.N``
    is appended."""
    if pidfile is None:
        return None
    text = str(pidfile)
    return Path(text.replace("{n}", str(index)) if "{n}" in text else f"{text}.{index}")


def check(directory: Path, replicas: int, device_maps: list[tuple[tuple[int, int], ...]]) -> Manifest:
    manifest = load_manifest(directory)
    if not manifest.pid_ns:
        raise UsageError(
            f"--replicas {replicas} needs an image of a job in its own pid namespace",
            why="CRIU restores every other job with its original host pids, which only one copy can have",
            fix="start the job with `npusnap run --pid-ns`, dump it, and restore that image",
        )
    if manifest.npu_processes and replicas > 1:
        # Before asking for --device-map: on a real CANN it would only be refused in turn.
        pidns.refuse_on_real_cann(manifest, f"--replicas {replicas}")
    if manifest.npu_processes and len(device_maps) != replicas:
        raise UsageError(
            f"--replicas {replicas} needs --device-map once per replica ({len(device_maps)} given)",
            why="CANN's Restore needs its device free of every other process: each copy needs a "
            "device of its own",
            fix="e.g. --replicas 2 --device-map 0=1 --device-map 0=2",
        )
    agents = [p.agent_socket for p in manifest.processes if p.agent_socket]
    listeners = hostres.image_listeners(layout.criu_dir(directory), agents)
    if replicas > 1 and listeners:
        raise PreflightError(
            f"--replicas {replicas}: the job listens on unix socket path {listeners[0]}, which only "
            "one copy can bind",
            why="CRIU binds each restored unix socket at its dumped path, replacing the socket file, "
            "and the path is in the job's memory too: the copies' clients would reach one another "
            "(a DataLoader worker's multiprocessing listener under /tmp/pymp-*, usually)",
            fix="restore one copy per host (or per container with a /tmp of its own), or run the "
            "job so that nothing listens on a unix socket path when it is dumped (DataLoader: "
            "num_workers=0)",
            details={"listeners": listeners},
        )
    # every device each copy's container holds (unmapped ids below a mapped one included)
    for m in device_maps:
        pidns.check_device_map(manifest, m)
    targets = [tuple(pidns.container_devices(manifest, m)) for m in device_maps]
    flat = [d for t in targets for d in t]
    if len(set(flat)) != len(flat):
        raise UsageError(
            "two replicas are mapped onto the same device", fix="give each replica other devices"
        )
    # Every copy's devices free before any copy starts: a copy refused after another one started
    # would leave the command half done.
    users = restore.device_users(manifest) if device_maps else []
    for i, m in enumerate(device_maps):
        try:
            restore.check_devices_free(manifest, m, users)
        except NpusnapError as exc:
            exc.message = f"replica {i}: {exc.message}"
            exc.why = (exc.why or "") + "; no replica was started"
            raise
    return manifest


@dataclass
class _Child:
    pid: int
    started: float
    out: bytearray
    err: bytearray
    status: Optional[int] = None
    ended: float = 0.0


def _fork_restore(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, int, int]:
    """Run ``main(argv)`` (the CLI's entry point: ``npusnap <argv>``) in a child forked from this
    process: (pid, stdout fd, stderr fd)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's lines run in the child
        rc = 70
        try:
            os.close(out_r)
            os.close(err_r)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
            # Fresh file objects: a thread of the parent may have held the old ones' locks.
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            rc = main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # nothing may unwind into the parent's code
            rc = 70
        os._exit(rc)
    os.close(out_w)
    os.close(err_w)
    return pid, out_r, err_r


def restore_all(
    directory: Path,
    replicas: int,
    device_maps: list[tuple[tuple[int, int], ...]],
    *,
    verify: bool,
    pidfile: Optional[Path],
    logs: Optional[Path],
    output: Optional[Path] = None,
    settle_s: float,
    extra: list[str],
    main: Callable[[list[str]], int],
    timeout_s: float = 600.0,
    name: str = DEFAULT_NAME,
) -> list[ReplicaResult]:
    """Restore ``replicas`` copies at once; one result per copy (failed ones included). ``main`` is
    the CLI's entry point, run in each child as ``npusnap restore ... --no-verify``; the caller has
    imported what a restore imports, so that the children fork with it.

    Each copy has a name (``name``, ``{n}`` its number): its CRIU logs go under ``LOGS/NAME``
    and, without ``output``, what the original wrote to its output file goes to that file's path
    with ``.NAME`` appended: copies never append to the original's log, nor to each other's."""
    names = names_for(name, replicas)
    check(directory, replicas, device_maps)
    if verify:
        integrity.verify(directory)
    base_logs = logs or (directory / layout.LOGS_SUBDIR)
    original_output = None
    if output is None:
        original_output = pidns.output_file_of(layout.criu_dir(directory), load_manifest(directory))
    outputs: list[Optional[Path]] = [
        pidfile_for(output, i)
        if output is not None
        else (Path(f"{original_output}.{names[i]}") if original_output else None)
        for i in range(replicas)
    ]
    children: list[_Child] = []
    sel = selectors.DefaultSelector()
    try:
        for i in range(replicas):
            argv = ["restore", str(directory), "--json", "--no-verify"]
            argv += ["--settle", str(settle_s), "--logs", str(base_logs / names[i])]
            if i < len(device_maps):
                argv += ["--device-map", ",".join(f"{a}={b}" for a, b in device_maps[i])]
            pf = pidfile_for(pidfile, i)
            if pf is not None:
                argv += ["--pidfile", str(pf)]
            of = outputs[i]
            if of is not None:
                argv += ["--output", str(of)]
            pid, out_fd, err_fd = _fork_restore(main, [*argv, *extra])
            child = _Child(pid, time.monotonic(), bytearray(), bytearray())
            children.append(child)
            sel.register(out_fd, selectors.EVENT_READ, child.out)
            sel.register(err_fd, selectors.EVENT_READ, child.err)
        deadline = time.monotonic() + timeout_s
        while (sel.get_map() or any(c.status is None for c in children)) and time.monotonic() < deadline:
            if not sel.get_map():
                time.sleep(0.02)
            for key, _ in sel.select(timeout=max(0.02, min(0.2, deadline - time.monotonic()))):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    key.data.extend(chunk)
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
            for c in children:
                if c.status is None:
                    done, status = os.waitpid(c.pid, os.WNOHANG)
                    if done:
                        c.status, c.ended = os.waitstatus_to_exitcode(status), time.monotonic()
    finally:
        for key in list(sel.get_map().values()):
            os.close(key.fd)
        sel.close()
        for c in children:  # past the deadline (or interrupted): a copy's restore is killed
            if c.status is None:
                try:
                    os.kill(c.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.status, c.ended = os.waitstatus_to_exitcode(os.waitpid(c.pid, 0)[1]), time.monotonic()
    results = []
    for i, c in enumerate(children):
        wall = c.ended - c.started
        out = c.out.decode(errors="replace")
        try:
            env = json.loads(out) if out.strip() else {}
        except ValueError:
            env = {}
        ok = c.status == 0 and bool(env.get("ok"))
        res = env.get("result") or {}
        err = env.get("error") or (
            None if ok else {"message": f"exit {c.status}: {c.err.decode(errors='replace').strip()[-400:]}"}
        )
        warned = tuple(str(w) for w in env.get("warnings") or ())
        of = outputs[i]
        results.append(
            ReplicaResult(
                i,
                ok,
                res.get("root_pid") if ok else None,
                res,
                err,
                wall,
                warned,
                name=names[i],
                output=str(of) if of is not None else None,
            )
        )
    if any(not r.ok for r in results):
        results = [_stop(r, pidfile_for(pidfile, r.index)) if r.ok else r for r in results]
    return results


def _stop(r: ReplicaResult, pidfile: Optional[Path]) -> ReplicaResult:
    """All or nothing: a copy that was restored while another failed is stopped again, so that
    the command's failure means that none of its copies runs. The copy is init of its own pid
    namespace: its SIGKILL ends every process in it."""
    root = int(r.root_pid or 0)
    if root <= 0:
        return r
    with contextlib.suppress(ProcessLookupError):
        os.kill(root, signal.SIGKILL)
    left = proctree.wait_gone([root], timeout=10.0)
    if left:
        return r  # still there: reported as running, as it is
    if pidfile is not None:
        with contextlib.suppress(OSError):
            if pidfile.read_text().strip() == str(root):
                pidfile.unlink()
    return dataclasses.replace(
        r, ok=False, root_pid=None, stopped=True, result={**r.result, "stopped_pid": root}
    )


def failure(results: list[ReplicaResult]) -> Optional[NpusnapError]:
    bad = [r for r in results if not r.ok and not r.stopped]
    if not bad:
        return None
    first = bad[0]
    stopped = [r for r in results if r.stopped]
    running = [r for r in results if r.ok]
    if running:
        now = "still running (could not be stopped): " + ", ".join(
            f"replica {r.index} pid {r.root_pid}" for r in running
        )
    elif stopped:
        now = (
            "the replicas restored meanwhile were stopped again (pids "
            + ", ".join(str(r.result.get("stopped_pid")) for r in stopped)
            + "): no replica runs"
        )
    else:
        now = "no replica runs"
    err = NpusnapError(
        f"{len(bad)} of {len(results)} replicas failed; replica {first.index}: "
        f"{(first.error or {}).get('message', '?')}",
        why="the replicas are restored together, all or none; " + now,
        fix=(first.error or {}).get("fix") or "see each replica's error in the JSON result",
        details={"replicas": [r.__dict__ for r in results], "running": [r.root_pid for r in running]},
    )
    err.exit_code = (first.error or {}).get("exit_code") or err.exit_code
    return err
