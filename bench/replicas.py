"""Fast replicas: N copies of a warmed-up inference server restored from one image, against N
cold starts of the same server.

The server (npusnap_workloads/infer.py) imports its framework (torch), reads its weights
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

from bench.common import NOTES, NPUSNAP, REPO, kept_notes

INFER = str(REPO / "npusnap_workloads" / "infer.py")
SERVE = str(REPO / "npusnap_workloads" / "torch_npu_serve.py")
PORT = 7931
# The goal: all of N replicas answer within this share of one cold start's time, in every run.
GOAL_SHARE = 0.6


def _ask_lines(port: int, seen: dict[int, float]) -> Optional[tuple[int, str]]:
    """infer.py's line protocol: (copy's host pid, its answer), or None for a copy already heard."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        f = c.makefile("rw")
        f.write("hello\n")
        f.flush()
        hello = f.readline().split()
        if len(hello) != 2 or hello[0] != "pid" or int(hello[1]) in seen:
            return None
        f.write("infer 7\n")  # the same input for every copy: the same answer
        f.flush()
        line = f.readline().split()
    if len(line) == 4 and line[0] == "pid" and line[1] == hello[1]:
        return int(line[1]), line[3]
    return None


def _http_get(port: int, path: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        while chunk := c.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.0 200") and not head.startswith(b"HTTP/1.1 200"):
        raise OSError(f"HTTP {head[:40]!r}")
    return body.decode()


def _ask_http(port: int, seen: dict[int, float]) -> Optional[tuple[int, str]]:
    """torch_npu_serve.py over HTTP: /hello, then /infer?n=7 (generated tokens)."""
    hello = _http_get(port, "/hello").split()
    if len(hello) != 2 or int(hello[1]) in seen:
        return None
    line = _http_get(port, "/infer?n=7").split()
    if len(line) == 4 and line[1] == hello[1]:
        return int(line[1]), line[3]
    return None


ASK = [_ask_lines]  # main: _ask_http for --framework torch_npu


def first_answers(port: int, n: int, start: float, timeout_s: float) -> dict[int, float]:
    """Host pid -> seconds from ``start`` to its first answer to an inference, until ``n`` copies
    answered. Each connection first asks which copy the kernel gave it (no device work); only a
    copy not yet heard from gets the inference: the copies already up are not kept busy (a
    request is computed on the host's CPU in the simulator) while the others start."""
    seen: dict[int, float] = {}
    answers: set[str] = set()
    deadline = start + timeout_s
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {n} copies answered within {timeout_s:g}s")
        try:
            got = ASK[0](port, seen)
        except OSError:
            got = None
        if got is None:
            time.sleep(0.002)
            continue
        seen[got[0]] = time.monotonic() - start
        answers.add(got[1])
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
# Files that leave the page cache before every measurement, on both sides: the framework's and the
# node's (main_torch_npu's cold-node rows). A restored copy maps the same shared libraries as a
# cold start, from the same files, and faults in what it touches: neither side gets them free.
NODE_FILES: list[Path] = []
PYTHON = [sys.executable]  # the server's interpreter (main: the torch venv's with --framework torch)


def server_argv(weights: Path, device: int, out: Path) -> list[str]:
    run = [str(NPUSNAP), "run", "--pid-ns", "--detach", "--output", str(out), "--", PYTHON[0]]
    if ASK[0] is _ask_http:  # the torch_npu server builds its model in the process: no weights file
        return [*run, SERVE, "--device", str(device), "--port", str(PORT), *SERVER]
    return [*run, INFER, "--weights", str(weights), "--device", str(device), "--port", str(PORT), *SERVER]


def cold(n: int, weights: Path, work: Path, env: dict[str, str]) -> list[float]:
    drop_cache(weights, *NODE_FILES)
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
    drop_cache(img, *NODE_FILES)
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


def _table(rows: list[dict[str, Any]]) -> list[str]:
    """One row per N: each side's time until all answered and its median first answer."""
    return [
        "| N | cold: all answered | cold: median first answer "
        "| replicas: all answered | replicas: median first answer |",
        "|---|---|---|---|---|",
        *(
            f"| {r['n']} | {_all(r['cold'])} | {_first(r['cold'])} "
            f"| {_all(r['replicas'])} | {_first(r['replicas'])} |"
            for r in rows
        ),
    ]


def render(rows: list[dict[str, Any]], setup: dict[str, Any]) -> str:
    fw = "imports torch (CPU build), " if setup["framework"] == "torch" else ""
    L = [
        "# Benchmark: fast replicas",
        "",
        "Generated by `python -m bench.replicas` (bench/replicas.py): time from the start until each of N",
        "copies of an inference server answered its first request. The server",
        f"(npusnap_workloads/infer.py) {fw}reads {setup['weights_mib']} MiB of weights",
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
        *_table(rows),
    ]
    one_cold = next((_med_all(r["cold"]) for r in rows if r["n"] == 1), None)
    biggest = rows[-1] if rows else None
    if one_cold is not None and biggest is not None and biggest["n"] > 1:
        runs = [max(r) for r in biggest["replicas"]]
        ratio = _med_all(biggest["replicas"]) / one_cold
        met = all(t <= GOAL_SHARE * one_cold for t in runs)
        L += [
            "",
            f"Goal (all of {biggest['n']} replicas answered within {GOAL_SHARE}x one cold start, in every "
            f"run): **{'met' if met else 'not met'}** in this run ({len(runs)} runs: "
            f"{', '.join(f'{t:.2f}' for t in runs)} s against a median cold start of {one_cold:.2f} s; "
            f"median {ratio:.2f}x).",
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


def _table_and_goal(page: Path) -> tuple[list[str], list[str]]:
    """A page's generated table and goal lines (the part before its notes)."""
    lines = page.read_text().split(NOTES)[0].splitlines()
    return [ln for ln in lines if ln.startswith("|")], [ln for ln in lines if ln.startswith("Goal")]


def section() -> list[str]:
    """The lines docs/benchmarks.md shows of the replicas page (bench/report.py), or none."""
    if not PAGE.exists():
        return []
    table, goal = _table_and_goal(PAGE)
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


def npu_section() -> list[str]:
    """The lines docs/benchmarks.md shows of the torch_npu replicas page, or none: its tables and
    goal lines, under a heading per page-cache state."""
    if not NPU_PAGE.exists():
        return []
    shown: list[str] = []
    for ln in NPU_PAGE.read_text().split(NOTES)[0].splitlines():
        if ln.startswith("## "):
            shown += ["", "#" + ln, ""]
        elif ln.startswith("Goal"):
            shown += ["", ln]
        elif ln.startswith(("|", "**Page cache**")):
            shown += [ln, ""] if ln.startswith("**") else [ln]
    return [
        "## torch_npu inference replicas",
        "",
        "The same with a real torch_npu server (a GPT-style model built in the process, greedy",
        "generation over HTTP): N replicas of one image against N cold starts, the image cold for the",
        "replicas, the framework's files warm or cold for both sides. Details:",
        "[benchmarks-replicas-torch-npu.md](benchmarks-replicas-torch-npu.md)",
        "(`python -m bench.replicas --framework torch_npu`).",
        *shown,
        "",
    ]


def measure(
    counts: list[int], repeat: int, weights: Path, img: Path, work: Path, env: dict[str, str]
) -> list[dict[str, Any]]:
    """For each N, ``repeat`` runs of each side: N cold starts (from ``weights``) and N replicas
    (of ``img``); one row per N, printed as it is done."""
    rows = []
    for n in counts:
        row: dict[str, Any] = {"n": n, "cold": [], "replicas": []}
        for k in range(repeat):
            # Each side goes first in turn: whatever the machine is doing meanwhile hits both.
            for side in ("cold", "replicas") if k % 2 == 0 else ("replicas", "cold"):
                fn = cold if side == "cold" else replicas
                row[side].append(fn(n, weights if side == "cold" else img, work, env))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def image_mib(img: Path) -> int:
    return sum(p.stat().st_size for p in img.rglob("*") if p.is_file()) >> 20


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
        choices=("torch", "none", "torch_npu"),
        default="torch",
        help="what the server imports first (torch: scripts/setup-torch.sh's venv; none for a quick "
        "run); torch_npu: the real torch_npu server instead (torch_npu_serve.py, scripts/setup-torch-"
        "npu.sh's venv), written to docs/benchmarks-replicas-torch-npu.md",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per N and side (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="the page (default: by --framework)")
    ns = ap.parse_args(argv)
    counts = [int(x) for x in ns.counts.split(",")]
    if ns.out is None:
        ns.out = NPU_PAGE if ns.framework == "torch_npu" else PAGE
    if ns.framework == "torch_npu":
        return main_torch_npu(counts, ns.repeat, ns.out)
    if ns.framework == "torch":
        # torch lives in a venv of its own (scripts/setup-torch.sh), never in npusnap's
        torch_py = Path(os.environ.get("NPUSNAP_BUILD_DIR") or REPO / ".build") / "torch" / "bin" / "python"
        if not torch_py.exists():
            raise SystemExit(f"bench.replicas: no {torch_py}: scripts/setup-torch.sh makes it")
        PYTHON[0] = str(torch_py)
    SERVER[:] = ["--warmup-batch", str(ns.warmup_batch), "--framework", ns.framework]
    from npusnap_sim import manager
    from npusnap_workloads.infer import write_weights

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
        rows = measure(counts, ns.repeat, weights, img, work, env)
        setup = {
            "weights_mib": weights_bytes >> 20,
            "layers": ns.layers,
            "hidden": ns.hidden,
            "warmup_batch": ns.warmup_batch,
            "framework": ns.framework,
            "repeat": ns.repeat,
            "image_mib": image_mib(img),
        }
        ns.out.write_text(render(rows, setup) + kept_notes(ns.out))
        print(f"wrote {ns.out}")
    finally:
        manager.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


NPU_PAGE = REPO / "docs" / "benchmarks-replicas-torch-npu.md"


def main_torch_npu(counts: list[int], repeat: int, out: Path) -> int:
    """The torch_npu server (torch_npu_serve.py): N cold starts against N replicas."""
    npu_py = Path(os.environ.get("NPUSNAP_BUILD_DIR") or REPO / ".build") / "torch-npu" / "bin" / "python"
    if not npu_py.exists():
        raise SystemExit(f"bench.replicas: no {npu_py}: scripts/setup-torch-npu.sh makes it")
    PYTHON[0] = str(npu_py)
    ASK[0] = _ask_http
    SERVER[:] = []
    from npusnap_sim import manager

    work = Path(tempfile.mkdtemp(prefix="npusnap-bench-replicas-npu-"))
    os.environ["NPUSIM_SOCKET"] = str(work / "npusim.sock")
    manager.start(devices=max(counts), capacity_bytes=1 << 30)
    env = dict(os.environ)
    env.update(manager.env())
    env["NPUSNAP_RUNTIME_DIR"] = str(work / "npusnap")
    env["NPUSIM_KERNEL_BLOCK_US"] = "0"
    nothing = work / "none"  # the server reads no file: its model is built in the process
    nothing.write_bytes(b"")
    try:
        img = make_image(nothing, work, env)
        warm = measure(counts, repeat, nothing, img, work, env)
        # A node that has not run the job: torch's and torch_npu's files (the server's venv) and
        # CANN's leave the page cache too, before each side.
        NODE_FILES[:] = [npu_py.parent.parent, Path(env["ASCEND_HOME_PATH"]).resolve()]
        node_cold = measure(counts, repeat, nothing, img, work, env)
        NODE_FILES[:] = []
        out.write_text(render_torch_npu(warm, node_cold, image_mib(img), repeat) + kept_notes(out))
        print(f"wrote {out}")
    finally:
        manager.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


def render_torch_npu(
    warm: list[dict[str, Any]], node_cold: list[dict[str, Any]], image_mib: int, repeat: int
) -> str:
    L = [
        "# Benchmark: torch_npu inference replicas",
        "",
        "Generated by `python -m bench.replicas --framework torch_npu` (bench/replicas.py): time from the",
        "start until each of N copies of a real torch_npu inference server answered its first request.",
        "The server (npusnap_workloads/torch_npu_serve.py): the torch 2.13 CPU wheel with torch_npu",
        "2.13 on the simulated NPU, a GPT-style model of 4 attention blocks built in the process",
        "(`torch.manual_seed(0)`, no download), uploaded to its device, warmed up with one generation, then",
        "greedy generation of 8 tokens per HTTP request (`GET /infer?n=7`; every copy must answer the",
        "same tokens). *cold*: N servers started at once (`npusnap run --pid-ns`, one device each): an",
        "interpreter, `import torch` (which loads torch_npu), CANN's start, the model's build and upload,",
        "the warm-up, the first answer. *replicas*: `npusnap restore IMAGE --replicas N` (one",
        f"`--device-map` per copy) of an image dumped once from a warm server ({image_mib} MiB), verified",
        "first. The image leaves the page cache before every replicas measurement (read from disk once).",
        "Simulated NPU, 2-core VM shared with other work,",
        f"{repeat} runs per N (each side first in turn; medians, and the range of *all answered*).",
        "The Python interpreter and npusnap stay in the page cache throughout: tools every node has run.",
    ]
    for title, rows, how in (
        (
            "Framework warm",
            warm,
            "the torch and torch_npu files and CANN's stay in the page cache (a node that ran the job"
            " before: the most favourable case for a cold start).",
        ),
        (
            "Node cold",
            node_cold,
            "before each side, the server's venv (torch, torch_npu and their dependencies) and the CANN"
            " tree leave the page cache too (a node that has not run the job, where a replica is most"
            " wanted). A restored copy maps the same libraries from the same files and reads from disk"
            " what it touches, so neither side gets them for free.",
        ),
    ):
        L += ["", f"## {title}", "", f"**Page cache**: {how}", "", *_table(rows)]
        one = next((r for r in rows if r["n"] == 1), None)
        if one is not None:
            c, rep = _med_all(one["cold"]), _med_all(one["replicas"])
            L += [
                "",
                f"Goal (one replica answers at least 10x sooner than one cold start), {title.lower()}: "
                f"**{'met' if c >= 10 * rep else 'not met'}** in this run ({rep:.2f} s against {c:.2f} s:"
                f" {c / rep:.1f}x).",
            ]
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    raise SystemExit(main())
