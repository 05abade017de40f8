"""Every command's `--json` envelope keeps its shape and its exit code.

A fixed set of scenarios (a job dumped, verified, inspected, listed, exported, restored, and the
failures a user meets first) runs real commands on the simulated NPU. Each envelope is reduced to
its shape: the keys of every object, the type of every value (``number`` for int and float,
``null`` matching any type, a list by the shapes of its elements, numbers and paths as object keys
written ``<n>`` and ``<path>``). The shapes and exit codes are compared with
tests/integration/golden/envelopes.json, and every difference is reported at once.

A change to an envelope is a change for every script that reads it: when one is meant, run
``NPUSNAP_GOLDEN_UPDATE=1 pytest tests/integration/test_envelopes.py`` and commit the new file with
the change (docs/reference/ says what the fields mean).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.conftest import requires_root
from tests.integration.dumplib import PY, TRAIN, TRAIN_ARGS, Job, cli, job_env, kill, wait_until

pytestmark = [pytest.mark.integration, requires_root]

GOLDEN = Path(__file__).parent / "golden" / "envelopes.json"

Shape = Any  # a JSON value: "str", "number", "bool", "null", [shapes...] or {key: shape}


def shape(value: Any) -> Shape:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return _merge([shape(v) for v in value])
    return {_key(k): shape(v) for k, v in sorted(value.items())}


def _merge(shapes: list[Shape]) -> list[Shape]:
    """The elements of a list as one shape: objects by the union of their keys (rows differ in
    their optional members), null taken by any other type."""
    out: Shape = "null"
    for s in shapes:
        if out == "null":
            out = s
        elif isinstance(out, dict) and isinstance(s, dict):
            out = {k: _merge([out.get(k, "null"), s.get(k, "null")])[0] for k in sorted({*out, *s})}
        elif isinstance(out, list) and isinstance(s, list):
            out = _merge(out + s)
    return [] if out == "null" and not shapes else [out]


def _key(k: str) -> str:
    """Keys that are data (pids, device ids, paths) are one key of the shape."""
    if re.fullmatch(r"-?\d+", k):
        return "<n>"
    if k.startswith("/"):
        return "<path>"
    return k


def differences(want: Shape, got: Shape, where: str = "$") -> list[str]:
    if want == "null" or got == "null" or want == got:
        return []
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}.{k}: gone" for k in want if k not in got]
        out += [f"{where}.{k}: new" for k in got if k not in want]
        for k in want:
            if k in got:
                out += differences(want[k], got[k], f"{where}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if not want or not got:
            return []  # an empty list says nothing of its elements
        w, g = want[0], got[0]
        if isinstance(w, dict) and isinstance(g, dict):
            # Rows differ in their optional members: only a member no row had before is news.
            return [f"{where}[].{k}: new" for k in g if k not in w] + [
                d for k in g if k in w for d in differences(w[k], g[k], f"{where}[].{k}")
            ]
        return differences(w, g, f"{where}[]")
    return [f"{where}: was {json.dumps(want)}, now {json.dumps(got)}"]


class Scenarios:
    """Run each command once and keep (exit code, shape of the envelope) by scenario name."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.seen: dict[str, dict[str, Shape]] = {}

    def run(self, name: str, *args: str, timeout: float = 180) -> Optional[dict[str, Any]]:
        rc, envelope, err = cli(self.env, *args, timeout=timeout)
        assert envelope is not None, f"{name}: `npusnap {' '.join(args)} --json` printed no envelope: {err}"
        self.seen[name] = {"exit": rc, "envelope": shape(envelope)}
        return envelope


@pytest.fixture(scope="module")
def scenarios(
    sim_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, dict[str, Shape]]]:
    tmp = tmp_path_factory.mktemp("envelopes")
    runtime = tmp / "rt"
    runtime.mkdir(mode=0o700)
    env = job_env(sim_env, runtime)
    s = Scenarios(env)
    job = Job(tmp, env, [PY, TRAIN, "--steps", "4000", *TRAIN_ARGS, "--device", "0", "--seed", "5"])
    store = tmp / "store"
    store.mkdir(mode=0o700)
    img = store / "img"
    restored = 0
    try:
        job.wait_lines(3)
        s.run("status", "status", str(job.pid))
        s.run("ps", "ps")
        s.run("dump --dry-run", "dump", "--dry-run", str(job.pid), str(store / "dry"))
        s.run("dump --leave-running", "dump", "--leave-running", str(job.pid), str(img))
        s.run("verify", "verify", str(img))
        s.run("verify --no-checksums", "verify", "--no-checksums", str(img))
        s.run("inspect", "inspect", str(img))
        s.run("list", "list", str(store))
        s.run("export", "export", str(img), str(tmp / "img.tar.zst"))
        s.run("verify (archive)", "verify", str(tmp / "img.tar.zst"))
        s.run("inspect (archive)", "inspect", str(tmp / "img.tar.zst"))
        s.run("restore (archive)", "restore", str(tmp / "img.tar.zst"))
        s.run("restore --dry-run (device busy)", "restore", "--dry-run", str(img))
        s.run("verify (no image)", "verify", str(tmp / "missing"))
        s.run("dump (no process)", "dump", "4194000", str(tmp / "none"))
        s.run("status (no process)", "status", "4194000")
        s.run("import", "import", str(tmp / "img.tar.zst"), str(store / "imported"))
        s.run("freeze", "freeze", str(job.pid))
        s.run("thaw", "thaw", str(job.pid))
        s.run("check", "check")
        kill(job.pid)
        job.reap()
        res = s.run("restore", "restore", str(img))
        restored = int(res["result"]["root_pid"]) if res and res.get("ok") else 0
        job.restored_pid = restored
        if restored:
            wait_until(lambda: Path(f"/proc/{restored}").exists(), 10, "the restored job")
            s.run("status (restored)", "status", str(restored))
        yield s.seen
    finally:
        job.cleanup()


def test_every_envelope_keeps_its_shape_and_exit_code(scenarios: dict[str, dict[str, Shape]]) -> None:
    if os.environ.get("NPUSNAP_GOLDEN_UPDATE") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(scenarios, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    problems = [f"{name}: no longer run" for name in golden if name not in scenarios]
    problems += [
        f"{name}: not in {GOLDEN.name} (NPUSNAP_GOLDEN_UPDATE=1)" for name in scenarios if name not in golden
    ]
    for name in golden:
        if name not in scenarios:
            continue
        want, got = golden[name], scenarios[name]
        if want["exit"] != got["exit"]:
            problems.append(f"{name}: exit code was {want['exit']}, now {got['exit']}")
        problems += [f"{name}: {d}" for d in differences(want["envelope"], got["envelope"])]
    assert not problems, "envelopes changed:\n" + "\n".join(problems)
