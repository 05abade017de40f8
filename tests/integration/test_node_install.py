"""The node install path: scripts/build_node_wheels.py and scripts/install-node.sh.

The node wheel is built from this checkout, installed offline into a temporary prefix (with a
temporary plugin and bin directory), run from there, upgraded in place and uninstalled; nothing of
the simulator may come along, and npusnap's state directory survives. The dependencies' wheels
are repacked from this virtualenv's installed distributions (the test needs no network); on a
node they come from ``build_node_wheels.py --deps``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install-node.sh"
BUILD = REPO / "scripts" / "build_node_wheels.py"

pytestmark = [pytest.mark.integration, pytest.mark.serial]

# The simulator's packages, its CRIU plugin and its CANN tree's stand-in libraries.
SIMULATOR_NAMES = re.compile(
    r"^(npusnap_sim|npusnap_workloads|npusim_plugin\.so|libnpusim.*|libascendcl\.so|"
    r"libacl_rt\.so|libascend_hal\.so|libruntime\.so|libhccl\.so|set_env\.sh)$"
)


def _wheel_of(dist: md.Distribution, out: Path) -> Path:
    """An installed distribution packed back into a wheel (its files, its own WHEEL tags)."""
    assert dist.files is not None
    info = next(f for f in dist.files if f.name == "WHEEL" and f.parent.name.endswith(".dist-info"))
    tags = [
        ln.split(":", 1)[1].strip().split("-")
        for ln in info.read_text().splitlines()
        if ln.startswith("Tag:")
    ]
    tag = "-".join(".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3))  # py2.py3-none-any
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    path = out / f"{name}-{dist.version}-{tag}.whl"
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files:
            rel = f.as_posix()
            if rel.startswith("..") or "__pycache__" in rel or f.name in ("RECORD", "INSTALLER", "REQUESTED"):
                continue
            if f.name == "direct_url.json":
                continue
            src = Path(str(dist.locate_file(f)))
            if not src.is_file():
                continue
            data = src.read_bytes()
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{rel},sha256={digest},{len(data)}")
        record = f"{info.parent.as_posix()}/RECORD"
        z.writestr(record, "\n".join([*records, f"{record},,"]) + "\n")
    return path


def _requirement_names(dist: md.Distribution) -> list[str]:
    from packaging.requirements import Requirement  # a dev dependency: only the test needs it

    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _wheelhouse(wheel: Path, out: Path) -> None:
    """The wheels of ``wheel``'s dependencies (and theirs), from this virtualenv."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    todo = [
        re.split(r"[\s<>=!~;\[(]", ln.split(":", 1)[1].strip())[0]
        for ln in text.splitlines()
        if ln.startswith("Requires-Dist:") and "extra ==" not in ln
    ]
    seen: set[str] = set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        dist = md.distribution(name)
        _wheel_of(dist, out)
        todo += _requirement_names(dist)


def _run(args: list[str], env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    # Not from the checkout, which `python -c` would put on sys.path as the current directory.
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240, cwd="/")
    if check and r.returncode != 0:
        pytest.fail(f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def _files(root: Path) -> list[Path]:
    return [Path(d) / n for d, dirs, files in os.walk(root) for n in [*dirs, *files]]


def test_node_install_upgrade_uninstall(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    env = dict(os.environ)
    for var in ("NPUSNAP_CRIU_PLUGIN_DIR", "CRIU_LIBS_DIR", "NPUSNAP_BUILD_DIR", "PYTHONPATH"):
        env.pop(var, None)
    state = tmp_path / "state"
    state.mkdir()
    (state / "history.jsonl").write_text('{"kept": true}\n')
    env["NPUSNAP_STATE_DIR"] = str(state)

    built = _run([sys.executable, str(BUILD), "--out", str(dist)], env)
    wheel = next(dist.glob(f"npusnap-*-py3-none-linux_{os.uname().machine}.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "npusnap_cli/criu/plugin/npusnap_plugin.so" in names
    assert "npusnap_cli/agent/lib/libnpusnap_agent.so" in names
    assert not [n for n in names if n.startswith(("npusnap_sim/", "npusnap_workloads/")) or "npusim" in n]
    if not list(dist.glob("pycriu-*.whl")):  # no CRIU source built here: this virtualenv's pycriu
        _wheel_of(md.distribution("pycriu"), dist)
    _wheelhouse(wheel, dist)
    assert built.stdout.strip()

    prefix, plugins, bindir = tmp_path / "opt" / "npusnap", tmp_path / "criu-plugins", tmp_path / "bin"
    args = ["bash", str(INSTALL), "--wheels", str(dist), "--prefix", str(prefix),
            "--plugin-dir", str(plugins), "--bin-dir", str(bindir)]  # fmt: skip
    _run(args, env)

    # Runs from the prefix, with its own plugin directory and nothing of this checkout.
    clean = {k: v for k, v in env.items() if not k.startswith("NPUSNAP_") or k == "NPUSNAP_STATE_DIR"}
    version = _run([str(bindir / "npusnap"), "--version"], clean)
    assert version.stdout.startswith("npusnap ")
    assert "dump" in _run([str(prefix / "bin" / "npusnap"), "--help"], clean).stdout
    probe = _run([str(prefix / "bin" / "npusnap"), "--json", "check"], clean, check=False)
    assert str(plugins) in probe.stdout  # npusnap's CRIU gets the directory the plugin went to
    site = _run(
        [str(prefix / "current" / "bin" / "python"), "-c",
         "import npusnap_cli.paths as p, npusnap_cli.agent.native as n; "
         "print(p.PACKAGE_DIR); print(p.attach_payload_path()); print(n.library_path(False))"],
        clean,
    ).stdout.split()  # fmt: skip
    assert site[0].startswith(str(prefix)) and Path(site[1]).is_file() and site[2].startswith(str(prefix))
    assert sorted(p.name for p in plugins.iterdir()) == ["npusnap_plugin.so"]
    assert not [p for p in _files(prefix) if SIMULATOR_NAMES.match(p.name)]
    assert os.readlink(bindir / "npusnap") == str(prefix / "bin" / "npusnap")

    # The same version again: in place, state untouched.
    again = _run(args, env)
    assert "ok: npusnap" in again.stderr
    assert (prefix / "current").resolve().parent == prefix / "versions"

    # An upgrade: a newer wheel beside the old one. The new version gets a virtualenv of its own and
    # `current`; the old one stays (an image it dumped names its agent library), state untouched.
    old = version.stdout.split()[1]
    new = f"{old}.post1"
    _run([sys.executable, str(BUILD), "--out", str(dist), "--version", new, "--pycriu-src", ""], env)
    upgraded = _run(args, env)
    assert f"upgraded from {old}" in upgraded.stderr
    assert (prefix / "current").resolve() == prefix / "versions" / new
    assert (prefix / "versions" / old / "bin" / "npusnap").is_file()
    assert _run([str(bindir / "npusnap"), "--version"], clean).stdout.split()[1] == new
    assert (state / "history.jsonl").read_text().startswith('{"kept": true}\n')
    assert sorted(p.name for p in plugins.iterdir()) == ["npusnap_plugin.so"]

    out = _run(["bash", str(INSTALL), "--uninstall", "--prefix", str(prefix)], env)
    assert not prefix.exists() and not plugins.exists() and not (bindir / "npusnap").is_symlink()
    assert (state / "history.jsonl").read_text().startswith('{"kept": true}\n')
    assert str(state) in out.stderr


def test_a_wheel_is_built_only_of_its_architecture_s_binaries(tmp_path: Path) -> None:
    """A native part of another architecture (a cross build that fell back to the host's
    compiler) stops the build instead of going into the wheel."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import build_node_wheels as b; "
        "from pathlib import Path; print(b.elf_machine(Path(sys.argv[2]))); "
        "b.check_machine(sys.argv[3], [Path(sys.argv[2])])"
    )
    host = os.uname().machine
    other = "aarch64" if host == "x86_64" else "x86_64"
    lib = REPO / ".build" / "agent" / "libnpusnap_agent.so"
    ok = _run([sys.executable, "-c", code, str(REPO / "scripts"), str(lib), host], dict(os.environ))
    assert ok.stdout.strip() == {"x86_64": "62", "aarch64": "183"}[host]
    bad = _run(
        [sys.executable, "-c", code, str(REPO / "scripts"), str(lib), other], dict(os.environ), check=False
    )
    assert bad.returncode == 1 and f"is not an {other} ELF" in bad.stderr and "fix:" in bad.stderr


def test_node_install_refuses_old_criu_and_python(tmp_path: Path) -> None:
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17'\n")
    old.chmod(0o755)
    env = dict(os.environ, NPUSNAP_CRIU=str(old))
    args = ["bash", str(INSTALL), "--prefix", str(tmp_path / "p"), "--plugin-dir", str(tmp_path / "pl")]
    r = _run(args, env, check=False)
    assert r.returncode == 1 and "CRIU is too old" in r.stderr and "fix:" in r.stderr
    py = tmp_path / "python3.8"
    py.write_text("#!/bin/sh\necho 3.8\n")
    py.chmod(0o755)
    r = _run([*args, "--python", str(py)], env, check=False)
    assert r.returncode == 1 and "needs Python 3.10 or newer" in r.stderr and "fix:" in r.stderr
    for shared in ("/usr/lib/criu", "/usr/lib/criu/"):
        r = _run(
            ["bash", str(INSTALL), "--prefix", str(tmp_path / "p"), "--plugin-dir", shared],
            dict(os.environ),
            check=False,
        )
        assert r.returncode == 1 and "CRIU's shared plugin directory" in r.stderr
    assert not (tmp_path / "p").exists()
