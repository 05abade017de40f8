"""`npusnap restore IMAGE --replicas N`: N copies of one image, restored side by side.

Only an image of a job in its own pid namespace (`npusnap run --pid-ns`) can be restored more
than once at a time: CRIU gives each copy a new pid namespace, so no host pid is needed, and
each copy's agent listens under a name of its own (host/pidns.py). CANN's Restore needs its
device free of every other process, so each copy needs a device of its own: ``--device-map`` once
per replica (the simulated NPU remaps device ids per pid namespace, as a container's device
mapping does on a node).

The image is verified once, here; then every copy is restored at the same time by its own
`npusnap restore --no-verify` (one process each: CRIU's restore, the device restore and the
settle watch run in parallel), each with its own CRIU log directory and pidfile. The copies read
the same image files, so the page cache holds the image's memory and device-memory files once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import image as img
from npusnap_cli.errors import NpusnapError, PreflightError, UsageError
from npusnap_cli.host import hostres


@dataclass(frozen=True)
class ReplicaResult:
    index: int
    ok: bool
    root_pid: Optional[int]
    result: dict[str, Any]
    error: Optional[dict[str, Any]]
    wall_s: float


def pidfile_for(pidfile: Optional[Path], index: int) -> Optional[Path]:
    """Replica ``index``'s pidfile (or output file): ``{n}`` in the name is replaced, else ``.N``
    is appended."""
    if pidfile is None:
        return None
    text = str(pidfile)
    return Path(text.replace("{n}", str(index)) if "{n}" in text else f"{text}.{index}")


def check(directory: Path, replicas: int, device_maps: list[tuple[tuple[int, int], ...]]) -> img.Manifest:
    manifest = img.load_manifest(directory)
    if not manifest.pid_ns:
        raise UsageError(
            f"--replicas {replicas} needs an image of a job in its own pid namespace",
            why="CRIU restores every other job with its original host pids, which only one copy can have",
            fix="start the job with `npusnap run --pid-ns`, dump it, and restore that image",
        )
    if manifest.npu_processes and len(device_maps) != replicas:
        raise UsageError(
            f"--replicas {replicas} needs --device-map once per replica ({len(device_maps)} given)",
            why="CANN's Restore needs its device free of every other process: each copy needs a "
            "device of its own",
            fix="e.g. --replicas 2 --device-map 0=1 --device-map 0=2",
        )
    agents = [p.agent_socket for p in manifest.processes if p.agent_socket]
    listeners = hostres.image_listeners(img.criu_dir(directory), agents)
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
    targets = [tuple(sorted(dict(m).values())) for m in device_maps]
    flat = [d for t in targets for d in t]
    if len(set(flat)) != len(flat):
        raise UsageError(
            "two replicas are mapped onto the same device", fix="give each replica other devices"
        )
    return manifest


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
    timeout_s: float = 600.0,
) -> list[ReplicaResult]:
    """Restore ``replicas`` copies at once; one result per copy (failed ones included)."""
    check(directory, replicas, device_maps)
    if verify:
        img.verify(directory)
    procs = []
    base_logs = logs or (directory / img.LOGS_SUBDIR)
    for i in range(replicas):
        argv = [sys.executable, "-m", "npusnap_cli", "restore", str(directory), "--json", "--no-verify"]
        argv += ["--settle", str(settle_s), "--logs", str(base_logs / f"replica-{i}")]
        if i < len(device_maps):
            argv += ["--device-map", ",".join(f"{a}={b}" for a, b in device_maps[i])]
        pf = pidfile_for(pidfile, i)
        if pf is not None:
            argv += ["--pidfile", str(pf)]
        of = pidfile_for(output, i)
        if of is not None:
            argv += ["--output", str(of)]
        procs.append(
            (
                time.monotonic(),
                subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            )
        )
    results = []
    for i, (started, p) in enumerate(procs):
        try:
            out, _err = p.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _err = p.communicate()
        wall = time.monotonic() - started
        try:
            env = json.loads(out) if out.strip() else {}
        except ValueError:
            env = {}
        ok = p.returncode == 0 and bool(env.get("ok"))
        res = env.get("result") or {}
        err = env.get("error") or (None if ok else {"message": f"exit {p.returncode}: {_err.strip()[-400:]}"})
        results.append(ReplicaResult(i, ok, res.get("root_pid") if ok else None, res, err, wall))
    return results


def failure(results: list[ReplicaResult]) -> Optional[NpusnapError]:
    bad = [r for r in results if not r.ok]
    if not bad:
        return None
    first = bad[0]
    err = NpusnapError(
        f"{len(bad)} of {len(results)} replicas failed; replica {first.index}: "
        f"{(first.error or {}).get('message', '?')}",
        why="each replica is restored on its own; the others are running",
        fix=(first.error or {}).get("fix") or "see each replica's error in the JSON result",
        details={"replicas": [r.__dict__ for r in results]},
    )
    err.exit_code = (first.error or {}).get("exit_code") or err.exit_code
    return err
