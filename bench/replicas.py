"""Fast replicas: N copies of a warmed-up inference server restored from one image, against N
cold starts of the same server.

The server (npusnap_cli/workloads/infer.py) reads its weights from disk, uploads them to its
device, warms up, and serves on one TCP port shared by every copy (SO_REUSEPORT). For each N the
figure is the time from the start until each copy has answered its first request (the client
connects every few milliseconds; the kernel spreads the connections over the copies, and each
answer names its copy's pid):

* **cold**: N `npusnap run --pid-ns` servers started at once, one per device;
* **replicas**: one `npusnap restore IMAGE --replicas N --device-map 0=K ...` of an image dumped
  once from a warmed-up server (the default restore: the image is verified first).

A private simulated NPU with enough devices; the weights file is read from the page cache after
the first run (cold starts here are the best case for reading weights).

    python -m bench.replicas --counts 1,2,4,8 --weights-mib 32 --out docs/benchmarks-replicas.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import NPUSNAP, REPO

INFER = str(REPO / "npusnap_cli" / "workloads" / "infer.py")
PORT = 7931


def first_answers(port: int, n: int, start: float, timeout_s: float) -> dict[int, float]:
    """Host pid -> seconds from ``start`` to its first answer, until ``n`` copies answered."""
    seen: dict[int, float] = {}
    k = 0
    deadline = start + timeout_s
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {n} copies answered within {timeout_s:g}s")
        k += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(f"infer {k}\n".encode())
                line = c.makefile("r").readline().split()
        except OSError:
            time.sleep(0.002)
            continue
        if len(line) == 4 and line[0] == "pid":
            seen.setdefault(int(line[1]), time.monotonic() - start)
    return seen


def kill_all(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)  # a pid-namespace init ignores SIGTERM it does not handle
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def server_argv(weights: Path, device: int, out: Path) -> list[str]:
    return [
        str(NPUSNAP),
        "run",
        "--pid-ns",
        "--detach",
        "--output",
        str(out),
        "--",
        sys.executable,
        INFER,
        "--weights",
        str(weights),
        "--device",
        str(device),
        "--port",
        str(PORT),
    ]


def cold(n: int, weights: Path, work: Path, env: dict[str, str]) -> list[float]:
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            server_argv(weights, k, work / f"cold-{n}-{k}.log"), env=env, stdout=subprocess.PIPE, text=True
        )
        for k in range(n)
    ]
    pids = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=60)
            if p.returncode != 0:
                raise RuntimeError(f"npusnap run failed ({p.returncode})")
            pids.append(int(out.strip()))
        seen = first_answers(PORT, n, start, 120)
        assert set(seen) == set(pids), (seen, pids)
        return sorted(seen.values())
    finally:
        kill_all(pids)


def make_image(weights: Path, work: Path, env: dict[str, str]) -> Path:
    out = subprocess.run(
        server_argv(weights, 0, work / "original.log"), env=env, capture_output=True, text=True, check=True
    )
    pid = int(out.stdout.strip())
    try:
        first_answers(PORT, 1, time.monotonic(), 120)
        img = work / "img"
        # The first answer's connection may still be closing in the server: CRIU refuses a
        # socket in flight, and npusnap rolls the dump back; the next try finds it closed.
        for attempt in range(3):
            time.sleep(0.2)
            d = subprocess.run(
                [str(NPUSNAP), "dump", str(pid), str(img)], env=env, capture_output=True, text=True
            )
            if d.returncode == 0:
                break
            print(
                f"dump try {attempt + 1} failed ({d.returncode}): {d.stderr.strip().splitlines()[-3:]}",
                flush=True,
            )
        else:
            raise RuntimeError("the dump failed three times")
        return img
    finally:
        kill_all([pid])


def replicas(n: int, img: Path, work: Path, env: dict[str, str]) -> list[float]:
    maps = [a for k in range(n) for a in ("--device-map", f"0={k}")]
    pidfile = work / f"rep-{n}-{{n}}.pid"
    start = time.monotonic()
    p = subprocess.Popen(
        [
            str(NPUSNAP),
            "restore",
            str(img),
            "--replicas",
            str(n),
            *maps,
            "--pidfile",
            str(pidfile),
            "--logs",
            str(work / f"logs-{n}"),
        ]
        if n > 1
        else [
            str(NPUSNAP),
            "restore",
            str(img),
            "--device-map",
            "0=0",
            "--pidfile",
            str(work / f"rep-{n}-0.pid"),
            "--logs",
            str(work / f"logs-{n}"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        seen = first_answers(PORT, n, start, 120)
        _out, err = p.communicate(timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"restore failed: {err[-600:]}")
        pids = [int((work / f"rep-{n}-{k}.pid").read_text()) for k in range(n)]
        assert set(seen) == set(pids), (seen, pids)
        return sorted(seen.values())
    finally:
        if p.poll() is None:
            p.kill()
        kill_all(pids or list(seen_pids(work, n)))


def seen_pids(work: Path, n: int) -> list[int]:
    out = []
    for k in range(n):
        f = work / f"rep-{n}-{k}.pid"
        if f.exists():
            out.append(int(f.read_text()))
    return out


def render(rows: list[dict[str, Any]], weights_mib: int) -> str:
    L = [
        "# Benchmark: fast replicas",
        "",
        "Generated by `python -m bench.replicas` (bench/replicas.py): time from the start until each of N",
        f"copies of an inference server ({weights_mib} MiB of weights resident on its device, two warm-up",
        "passes) answered its first request. *cold*: N servers started at once (`npusnap run --pid-ns`:",
        "read the weights, upload, warm up, listen). *replicas*: `npusnap restore IMAGE --replicas N`",
        "(one `--device-map` per copy) of an image dumped once from a warmed-up server, verified first.",
        "Simulated NPU, one run per N, on a shared 2-core VM: read the figures as orders of magnitude.",
        "",
        "| N | cold: all answered | cold: median first answer "
        "| replicas: all answered | replicas: median first answer |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        L.append(
            f"| {r['n']} | {max(r['cold']):.2f} s | {statistics.median(r['cold']):.2f} s | "
            f"{max(r['replicas']):.2f} s | {statistics.median(r['replicas']):.2f} s |"
        )
    L += [
        "",
        "On this simulator a copy is not faster than a cold start: the sample server's start-up",
        "(a Python interpreter, a few ACL calls, a memory-speed upload) costs what a restore costs,",
        "and N copies contend for the same two cores either way.",
        "What a replica's time holds: the CLI starting, the image's checksums (once for all copies),",
        "N restores at once (CRIU, the device restore, npusnap writing the device memory back), and",
        "the first request. What a cold start's holds: the interpreter and CANN starting, reading",
        "the weights (page cache here), the upload and the warm-up. On this simulator the device",
        "copy runs at memory speed and a warm-up is two passes: a real model's graph compilation",
        "and weight loading from remote storage would weigh on the cold side only.",
        "",
    ]
    return "\n".join(L)


PAGE = REPO / "docs" / "benchmarks-replicas.md"


def section() -> list[str]:
    """The lines docs/benchmarks.md shows of the replicas page (bench/report.py), or none."""
    if not PAGE.exists():
        return []
    table = [ln for ln in PAGE.read_text().splitlines() if ln.startswith("|")]
    return [
        "## Fast replicas",
        "",
        "Time until each of N copies of an inference server answered its first request: restored from",
        "one image (`restore --replicas N`) or cold-started. Details and how it was measured:",
        "[benchmarks-replicas.md](benchmarks-replicas.md) (`python -m bench.replicas`).",
        "",
        *table,
        "",
    ]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--weights-mib", type=int, default=32)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-replicas.md")
    ns = ap.parse_args(argv)
    counts = [int(x) for x in ns.counts.split(",")]
    from npusnap_cli.sim import manager

    work = Path(tempfile.mkdtemp(prefix="npusnap-bench-replicas-"))
    os.environ["NPUSIM_SOCKET"] = str(work / "npusim.sock")
    manager.start(devices=max(counts), capacity_bytes=max(256, 4 * ns.weights_mib) << 20)
    env = dict(os.environ)
    env.update(manager.env())
    env["NPUSNAP_RUNTIME_DIR"] = str(work / "npusnap")
    try:
        weights = work / "weights.bin"
        weights.write_bytes(os.urandom(ns.weights_mib << 20))
        img = make_image(weights, work, env)
        rows = []
        for n in counts:
            row = {"n": n, "cold": cold(n, weights, work, env), "replicas": replicas(n, img, work, env)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        ns.out.write_text(render(rows, ns.weights_mib))
        print(f"wrote {ns.out}")
    finally:
        manager.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
