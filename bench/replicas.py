"""Fast replicas: N copies of a warmed-up inference server restored from one image, against N
cold starts of the same server.

The server (npusnap_cli/workloads/infer.py) imports its framework (torch), reads its weights
(``--layers`` fp32 matrices of ``--hidden`` squared: 256 MiB by default) from disk, uploads them to
its device, warms up with the simulator's aclnn operators (one forward pass per batch size 1, 2,
4, 8, 16), and serves on one TCP port shared by every copy (SO_REUSEPORT); a request is a forward
pass through every layer. For each N the figure is the time from the start until each copy has
answered its first request (the client connects every few milliseconds; the kernel spreads the
connections over the copies, and each answer names its copy's pid):

* **cold**: N `npusnap run --pid-ns` servers started at once, one per device;
* **replicas**: one `npusnap restore IMAGE --replicas N --device-map 0=K ...` of an image dumped
  once from a warmed-up server (the default restore: the image is verified first).

A private simulated NPU with enough devices. Before each measurement the weights file and the
image's files leave the page cache (``posix_fadvise(DONTNEED)``): both sides read from disk once,
and N copies share what the first read brought in.

    scripts/setup-torch.sh     # the server's interpreter: torch's CPU build in a venv of its own
    python -m bench.replicas --counts 1,2,4,8 --out docs/benchmarks-replicas.md
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
    """Host pid -> seconds from ``start`` to its first answer to an inference, until ``n`` copies
    answered. Each connection first asks which copy the kernel gave it (``hello``, no device
    work); only a copy not yet heard from gets the inference: the copies already up are not kept
    busy (a request is a forward pass, on the host's CPU in the simulator) while the others start."""
    seen: dict[int, float] = {}
    answers: set[str] = set()
    k = 0
    deadline = start + timeout_s
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {n} copies answered within {timeout_s:g}s")
        k += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                f = c.makefile("rw")
                f.write("hello\n")
                f.flush()
                hello = f.readline().split()
                if len(hello) != 2 or hello[0] != "pid" or int(hello[1]) in seen:
                    time.sleep(0.002)
                    continue
                f.write("infer 7\n")  # the same input for every copy: the same answer
                f.flush()
                line = f.readline().split()
        except OSError:
            time.sleep(0.002)
            continue
        if len(line) == 4 and line[0] == "pid" and line[1] == hello[1]:
            seen[int(line[1])] = time.monotonic() - start
            answers.add(line[3])
    if len(answers) != 1:
        raise AssertionError(f"the copies computed different results: {sorted(answers)}")
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


def drop_cache(*paths: Path) -> None:
    """Take the files (directories: every file under them) out of the page cache, so that the
    next reader reads them from disk."""
    for top in paths:
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file() and not p.is_symlink()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


SERVER: list[str] = []  # the server's own options (main)
PYTHON = [sys.executable]  # the server's interpreter (main: the torch venv's with --framework torch)


def server_argv(weights: Path, device: int, out: Path) -> list[str]:
    return [
        str(NPUSNAP),
        "run",
        "--pid-ns",
        "--detach",
        "--output",
        str(out),
        "--",
        PYTHON[0],
        INFER,
        "--weights",
        str(weights),
        "--device",
        str(device),
        "--port",
        str(PORT),
        *SERVER,
    ]


def cold(n: int, weights: Path, work: Path, env: dict[str, str]) -> list[float]:
    drop_cache(weights)
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
        seen = first_answers(PORT, n, start, 300)
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
        first_answers(PORT, 1, time.monotonic(), 300)
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
    drop_cache(img)
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
        seen = first_answers(PORT, n, start, 300)
        _out, err = p.communicate(timeout=300)
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


def _med_all(runs: list[list[float]]) -> float:
    """The median over runs of the time until every copy had answered."""
    return statistics.median(max(r) for r in runs)


def _all(runs: list[list[float]]) -> str:
    lasts = [max(r) for r in runs]
    return f"{statistics.median(lasts):.2f} s ({min(lasts):.2f}-{max(lasts):.2f})"


def _first(runs: list[list[float]]) -> str:
    return f"{statistics.median(statistics.median(r) for r in runs):.2f} s"


def render(rows: list[dict[str, Any]], setup: dict[str, Any]) -> str:
    fw = "imports torch (CPU build), " if setup["framework"] == "torch" else ""
    L = [
        "# Benchmark: fast replicas",
        "",
        "Generated by `python -m bench.replicas` (bench/replicas.py): time from the start until each of N",
        "copies of an inference server answered its first request. The server",
        f"(npusnap_cli/workloads/infer.py) {fw}reads {setup['weights_mib']} MiB of weights",
        f"({setup['layers']} fp32 matrices of {setup['hidden']}x{setup['hidden']}) from disk, uploads",
        "them into device memory of an expandable-segments allocator, warms up with one forward pass",
        f"(`aclnnMatmul` + `aclnnRelu` per layer) per batch size 1, 2, 4 ... {setup['warmup_batch']}, "
        "and serves; a request is",
        "a forward pass of a batch of one. *cold*: N servers started at once (`npusnap run --pid-ns`).",
        "*replicas*: `npusnap restore IMAGE --replicas N` (one `--device-map` per copy) of an image dumped",
        f"once from a warmed-up server ({setup['image_mib']} MiB: process memory and device memory), "
        "verified first.",
        "Before each measurement the weights file and the image leave the page cache: each side reads",
        "its files from disk once, and N copies share the page cache. Simulated NPU (its operators run",
        f"on the host's CPU), {setup['repeat']} runs per N (each side first in turn; medians, and the",
        "range of *all answered*), on a 2-core VM shared with other work: read them as orders of magnitude.",
        "",
        "| N | cold: all answered | cold: median first answer "
        "| replicas: all answered | replicas: median first answer |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        L.append(
            f"| {r['n']} | {_all(r['cold'])} | {_first(r['cold'])} "
            f"| {_all(r['replicas'])} | {_first(r['replicas'])} |"
        )
    one_cold = next((_med_all(r["cold"]) for r in rows if r["n"] == 1), None)
    biggest = rows[-1] if rows else None
    if one_cold is not None and biggest is not None and biggest["n"] > 1:
        met = _med_all(biggest["replicas"]) < one_cold
        L += [
            "",
            f"Goal (all of {biggest['n']} replicas answered before one cold start did): "
            f"**{'met' if met else 'not met'}** in this run "
            f"(medians of {len(biggest['replicas'])} runs: {_med_all(biggest['replicas']):.2f} s against "
            f"{one_cold:.2f} s).",
        ]
    L += [
        "",
        "What a cold start's time holds: an interpreter, the framework's import, CANN's start, reading",
        "the weights from disk, the upload, and the warm-up's compute; N cold starts share the page",
        "cache (the weights are read from disk once) and nothing else. What a replica's time holds: the",
        "CLI starting and the image's checksums (once for all copies); then, per copy, in a process",
        "forked from that CLI (no interpreter start, no imports): CRIU's restore of the process memory",
        "(read once from disk, then from the page cache), the device restore and npusnap writing the",
        "device memory back (the image's device-memory file, mapped read-only, so that every copy copies",
        "from the same page-cache pages), and the first request. Neither the framework's import nor the",
        "warm-up runs again. On a 2-core VM the N copies still share two cores: the per-copy work (CRIU,",
        "the device-memory copy: one device's worth per copy, as each NPU's memory must be written) adds",
        "up, where cold starts add up their whole start-up.",
        "",
    ]
    return "\n".join(L)


PAGE = REPO / "docs" / "benchmarks-replicas.md"
NOTES = "<!-- notes: written by hand, kept when the bench rewrites this page -->"


def kept_notes(page: Path) -> str:
    """The hand-written part of ``page`` (from the NOTES line on), kept across runs."""
    try:
        text = page.read_text()
    except OSError:
        return ""
    at = text.find(NOTES)
    return "\n" + text[at:] if at >= 0 else ""


def section() -> list[str]:
    """The lines docs/benchmarks.md shows of the replicas page (bench/report.py), or none."""
    if not PAGE.exists():
        return []
    lines = PAGE.read_text().split(NOTES)[0].splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    goal = [ln for ln in lines if ln.startswith("Goal")]
    return [
        "## Fast replicas",
        "",
        "Time until each of N copies of an inference server (torch imported, 256 MiB of weights on its",
        "device, warmed up with the simulator's operators) answered its first request: restored from one",
        "image (`restore --replicas N`) or cold-started. Details and how it was measured:",
        "[benchmarks-replicas.md](benchmarks-replicas.md) (`python -m bench.replicas`).",
        "",
        *table,
        *(["", *goal] if goal else []),
        "",
        "What each side's time holds, and where a replica's CPU goes: "
        "[benchmarks-replicas.md](benchmarks-replicas.md).",
        "",
    ]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=16, help="weight matrices (default 16)")
    ap.add_argument(
        "--hidden", type=int, default=2048, help="their size: hidden x hidden fp32 (default 2048)"
    )
    ap.add_argument("--warmup-batch", type=int, default=16, help="the server warms up batch sizes 1 .. this")
    ap.add_argument(
        "--framework",
        choices=("torch", "none"),
        default="torch",
        help="what the server imports first (torch: scripts/setup-torch.sh's venv; none for a quick run)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per N and side (default 3)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks-replicas.md")
    ns = ap.parse_args(argv)
    counts = [int(x) for x in ns.counts.split(",")]
    if ns.framework == "torch":
        # torch lives in a venv of its own (scripts/setup-torch.sh), never in npusnap's
        torch_py = Path(os.environ.get("NPUSNAP_BUILD_DIR") or REPO / ".build") / "torch" / "bin" / "python"
        if not torch_py.exists():
            raise SystemExit(f"bench.replicas: no {torch_py}: scripts/setup-torch.sh makes it")
        PYTHON[0] = str(torch_py)
    SERVER[:] = ["--warmup-batch", str(ns.warmup_batch), "--framework", ns.framework]
    from npusnap_cli.sim import manager
    from npusnap_cli.workloads.infer import write_weights

    work = Path(tempfile.mkdtemp(prefix="npusnap-bench-replicas-"))
    os.environ["NPUSIM_SOCKET"] = str(work / "npusim.sock")
    weights_bytes = ns.layers * ns.hidden * ns.hidden * 4
    manager.start(devices=max(counts), capacity_bytes=max(256 << 20, 2 * weights_bytes))
    env = dict(os.environ)
    env.update(manager.env())
    env["NPUSNAP_RUNTIME_DIR"] = str(work / "npusnap")
    try:
        weights = work / "weights.bin"
        write_weights(str(weights), ns.layers, ns.hidden)
        img = make_image(weights, work, env)
        rows = []
        for n in counts:
            row: dict[str, Any] = {"n": n, "cold": [], "replicas": []}
            for k in range(ns.repeat):
                # Each side goes first in turn: whatever the machine is doing meanwhile hits both.
                for side in ("cold", "replicas") if k % 2 == 0 else ("replicas", "cold"):
                    fn = cold if side == "cold" else replicas
                    row[side].append(fn(n, weights if side == "cold" else img, work, env))
            print(json.dumps(row), flush=True)
            rows.append(row)
        setup = {
            "weights_mib": weights_bytes >> 20,
            "layers": ns.layers,
            "hidden": ns.hidden,
            "warmup_batch": ns.warmup_batch,
            "framework": ns.framework,
            "repeat": ns.repeat,
            "image_mib": sum(p.stat().st_size for p in img.rglob("*") if p.is_file()) >> 20,
        }
        ns.out.write_text(render(rows, setup) + kept_notes(ns.out))
        print(f"wrote {ns.out}")
    finally:
        manager.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
