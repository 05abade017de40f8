#!/usr/bin/env python3
"""Build npusnap's node wheels: the CLI and its native parts, nothing of the simulator.

One wheel per machine architecture, from the same sources (the native parts cross-compiled for
the architecture that is not this machine's), each tagged for its platform::

    dist/npusnap-<v>-py3-none-linux_x86_64.whl
    dist/npusnap-<v>-py3-none-linux_aarch64.whl
    dist/pycriu-<criu version>-py3-none-any.whl    (from the CRIU source scripts/setup.sh built)

A node wheel holds the package ``npusnap_cli`` only (not ``npusnap_sim`` nor
``npusnap_workloads``) with, as package data, what ``make -C native node`` builds: the agent
(``agent/lib/libnpusnap_agent.so``), the attach payload (``device/attach/lib/``) and npusnap's
CRIU plugin (``criu/plugin/npusnap_plugin.so``; never the simulated NPU's ``npusim_plugin.so``),
plus ``node-build.json`` (architecture, the newest glibc the libraries need, the CRIU whose
``criu-plugin.h`` the plugin was built against), which scripts/install-node.sh checks first.

    scripts/build_node_wheels.py [--arch x86_64] [--arch aarch64] [--out dist] [--deps 3.11 ...]
                                 [--version V]

A cross build needs ``gcc-aarch64-linux-gnu libc6-dev-arm64-cross`` (or the x86_64 pair) and the
target's libffi, which is unpacked from the target's ``libffi-dev`` package, downloaded through
this machine's own apt mirror with a private apt state (the machine's apt configuration is not
changed), or given with ``--ffi-dir``. ``--deps PYVER...`` also downloads the wheels the CLI
depends on for each architecture and Python version, with pip, so that the directory installs
offline. Run with the development virtualenv's Python (it needs setuptools).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, Optional

from npusnap_cli import elf

REPO = Path(__file__).resolve().parent.parent
ARCHES = {"x86_64": "amd64", "aarch64": "arm64"}  # machine -> Debian architecture
ELF_MACHINES = {"x86_64": elf.EM_X86_64, "aarch64": elf.EM_AARCH64}  # machine -> ELF e_machine
CRIU_VERSION = os.environ.get("NPUSNAP_CRIU_VERSION", "4.2.1")


def cache_dir() -> Path:
    if os.environ.get("NPUSNAP_CACHE"):
        return Path(os.environ["NPUSNAP_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/cache/npusnap")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "npusnap"


def say(text: str) -> None:
    print(f"[node-wheels] {text}", file=sys.stderr, flush=True)


def die(text: str, fix: str = "") -> None:
    say(f"ERROR: {text}")
    if fix:
        say(f"  fix: {fix}")
    raise SystemExit(1)


def compiler(arch: str) -> str:
    if arch == platform.machine():
        return os.environ.get("CC") or "gcc"
    cc = f"{arch}-linux-gnu-gcc"
    if shutil.which(cc) is None:
        deb = ARCHES[arch]
        die(
            f"no cross compiler for {arch} ({cc})",
            f"apt-get install -y --no-install-recommends gcc-{arch.replace('_', '-')}-linux-gnu "
            f"libc6-dev-{deb}-cross",
        )
    return cc


def apt_mirror() -> Optional[tuple[str, str]]:
    """(URI, suite) of this machine's first Debian source that is not the security one."""
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", f.read_text(errors="replace")):
            fields = dict(
                (k.strip(), v.strip())
                for k, _, v in (ln.partition(":") for ln in stanza.splitlines() if not ln.startswith("#"))
                if v
            )
            uris, suites = fields.get("URIs", "").split(), fields.get("Suites", "").split()
            if uris and suites and "deb" in fields.get("Types", "").split() and "-security" not in suites[0]:
                return uris[0], suites[0]
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]:
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            words = [w for w in line.split() if not w.startswith("[")]
            if len(words) >= 3 and words[0] == "deb" and "security" not in line:
                return words[1], words[2]
    return None


def target_ffi(arch: str) -> Path:
    """The target's libffi (its ``usr/``), from its libffi-dev package; cached."""
    deb_arch = ARCHES[arch]
    root = cache_dir() / f"libffi-{deb_arch}"
    if (root / "usr" / "include").is_dir():
        return root / "usr"
    mirror = apt_mirror()
    if mirror is None:
        die(
            "cannot find this machine's Debian mirror in its apt configuration",
            f"unpack libffi-dev:{deb_arch} somewhere (dpkg-deb -x) and pass --ffi-dir <that>/usr",
        )
    assert mirror is not None
    uri, suite = mirror
    work = Path(tempfile.mkdtemp(prefix=f"npusnap-apt-{deb_arch}-"))
    try:
        for sub in ("lists/partial", "archives/partial", "deb"):
            (work / sub).mkdir(parents=True)
        (work / "sources.list").write_text(f"deb [arch={deb_arch}] {uri} {suite} main\n")
        opts = [
            *("-o", f"Dir::Etc::SourceList={work / 'sources.list'}", "-o", "Dir::Etc::SourceParts=-"),
            *("-o", f"Dir::State::Lists={work / 'lists'}", "-o", f"Dir::Cache::Archives={work / 'archives'}"),
            *("-o", f"APT::Architecture={deb_arch}", "-o", f"APT::Architectures::={deb_arch}", "-qq"),
        ]
        say(f"fetching libffi-dev:{deb_arch} ({suite}, through this machine's apt mirror)")
        for cmd in (["apt-get", *opts, "update"], ["apt-get", *opts, "download", f"libffi-dev:{deb_arch}"]):
            r = subprocess.run(cmd, cwd=work / "deb", capture_output=True, text=True)
            if r.returncode != 0:
                die(f"{' '.join(cmd[:1] + cmd[-2:])} failed: {r.stderr.strip()[-400:]}",
                    "pass --ffi-dir with the target's libffi-dev unpacked")  # fmt: skip
        debs = list((work / "deb").glob("libffi-dev_*.deb"))
        if not debs:
            die(f"apt downloaded no libffi-dev:{deb_arch}", "pass --ffi-dir")
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(tmp)], check=True)
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root / "usr"


def build_native(arch: str, build: Path, ffi_dir: Optional[Path]) -> None:
    cc = compiler(arch)
    cmd = ["make", "-s", "-C", str(REPO / "native"), "node", f"BUILD={build}", f"CC={cc}",
           f"NPUSNAP_CACHE={cache_dir()}", f"CRIU_VERSION={CRIU_VERSION}"]  # fmt: skip
    if arch != platform.machine():
        cmd.append(f"FFI_DIR={ffi_dir or target_ffi(arch)}")
    elif ffi_dir:
        cmd.append(f"FFI_DIR={ffi_dir}")
    say(f"building the native parts for {arch} with {cc} into {build}")
    if subprocess.run(cmd).returncode != 0:
        die(f"the native build for {arch} failed", f"run: {' '.join(cmd)}")


def glibc_needed(paths: List[Path]) -> str:
    """The newest GLIBC_x.y symbol version the libraries need (their version references)."""
    found = {
        tuple(int(x) for x in m)
        for p in paths
        for m in re.findall(rb"GLIBC_(\d+)\.(\d+)(?![.\d])", p.read_bytes())
    }
    return ".".join(str(x) for x in max(found)) if found else "0"


def elf_machine(path: Path) -> Optional[int]:
    """The e_machine of ``path``, or None if it is not a 64-bit ELF file."""
    try:
        with elf.open_elf(path) as f:
            return f.machine
    except (OSError, elf.ElfError):
        return None


def check_machine(arch: str, paths: List[Path]) -> None:
    """Every native part is built for ``arch``: a cross build that fell back to the host's
    compiler must not be packed into the other architecture's wheel."""
    for p in paths:
        got = elf_machine(p)
        if got != ELF_MACHINES[arch]:
            die(f"{p} is not an {arch} ELF (e_machine {got}, want {ELF_MACHINES[arch]})",
                f"rebuild with the {arch} compiler: rm -rf {p.parent.parent}")  # fmt: skip


def version() -> str:
    m = re.search(r'^__version__ = "([^"]+)"', (REPO / "npusnap_cli" / "__init__.py").read_text(), re.M)
    if not m:
        die("no __version__ in npusnap_cli/__init__.py")
    assert m is not None
    return m.group(1)


NATIVE = {  # built file (under BUILD) -> its place in the package
    "agent/libnpusnap_agent.so": "npusnap_cli/agent/lib/libnpusnap_agent.so",
    "attach/libnpusnap_attach.so": "npusnap_cli/device/attach/lib/libnpusnap_attach.so",
    "attach/gdb_inject.py": "npusnap_cli/device/attach/lib/gdb_inject.py",
    "criu-plugin/npusnap_plugin.so": "npusnap_cli/criu/plugin/npusnap_plugin.so",
}


def stage(arch: str, build: Path, where: Path, stamp: str) -> None:
    """A copy of the product alone (no stand-ins, no stray build output) with the native parts,
    as version ``stamp``."""
    shutil.copy2(REPO / "README.md", where / "README.md")
    text = (REPO / "pyproject.toml").read_text()
    only = re.sub(r"(?m)^include = \[.*\]$", 'include = ["npusnap_cli*"]', text)
    if only == text:
        die("pyproject.toml has no [tool.setuptools.packages.find] include line to narrow")
    (where / "pyproject.toml").write_text(only)
    shutil.copytree(
        REPO / "npusnap_cli",
        where / "npusnap_cli",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"),
    )
    for built, dest in NATIVE.items():
        src = build / built
        if not src.is_file():
            die(f"{src} was not built", f"make -C native node BUILD={build}")
        (where / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, where / dest)
    check_machine(arch, [build / b for b in NATIVE if b.endswith(".so")])
    init = where / "npusnap_cli" / "__init__.py"
    text = init.read_text()
    init.write_text(re.sub(r'(?m)^__version__ = "[^"]+"$', f'__version__ = "{stamp}"', text))
    info = {
        "arch": arch,
        "glibc": glibc_needed([build / b for b in NATIVE if b.endswith(".so")]),
        "criu_plugin_header": CRIU_VERSION,
        "version": stamp,
    }
    (where / "npusnap_cli" / "node-build.json").write_text(json.dumps(info, indent=1) + "\n")


def build_wheel(arch: str, build: Path, out: Path, stamp: str) -> Path:
    with tempfile.TemporaryDirectory(prefix="npusnap-wheel-") as tmp:
        where = Path(tmp)
        stage(arch, build, where, stamp)
        code = (
            "import sys, setuptools.build_meta as b; "
            "print(b.build_wheel(sys.argv[1], {'--build-option': ['--plat-name', sys.argv[2]]}))"
        )
        r = subprocess.run(
            [sys.executable, "-c", code, str(where / "dist"), f"linux_{arch}"],
            cwd=where,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            sys.stderr.write(r.stderr[-3000:])
            die("setuptools could not build the wheel", f"{sys.executable} -m pip install 'setuptools>=77'")
        name = r.stdout.strip().splitlines()[-1]
        out.mkdir(parents=True, exist_ok=True)
        dest = out / name
        shutil.copy2(where / "dist" / name, dest)
    with zipfile.ZipFile(dest) as z:
        names = z.namelist()
    bad = [n for n in names if n.startswith(("npusnap_sim", "npusnap_workloads")) or "npusim" in n]
    if bad or f"{NATIVE['criu-plugin/npusnap_plugin.so']}" not in names:
        die(f"{dest} holds the wrong things: {bad or 'no CRIU plugin'}")
    return dest


def build_pycriu(src: Path, out: Path) -> Optional[Path]:
    """pycriu from the CRIU source (not on the package index), built from a copy of the source."""
    if not (src / "pycriu" / "rpc_pb2.py").is_file():
        say(f"no built pycriu source at {src}: no pycriu wheel (scripts/setup.sh builds CRIU there)")
        return None
    with tempfile.TemporaryDirectory(prefix="npusnap-pycriu-") as tmp:
        copy = Path(tmp) / "lib"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        r = subprocess.run(
            [*pip, "-w", str(out), str(copy)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            say(f"pycriu wheel not built: {r.stderr.strip()[-300:]}")
            return None
    return max(out.glob("pycriu-*.whl"), key=lambda p: p.stat().st_mtime)


def download_deps(wheel: Path, arch: str, pythons: List[str], out: Path) -> None:
    """The wheels of the CLI's dependencies for ``arch`` and each Python version (pip download)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [
            ln.split(":", 1)[1].strip()
            for ln in z.read(meta).decode().splitlines()
            if ln.startswith("Requires-Dist:") and "extra ==" not in ln
        ]
    plats = [f"manylinux_2_{v}_{arch}" for v in (17, 28, 31, 34)] + [f"manylinux2014_{arch}"]
    for py in pythons:
        say(f"downloading the dependencies' wheels for {arch}, Python {py}")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(out),
               "--python-version", py, "--implementation", "cp"]  # fmt: skip
        for p in plats:
            cmd += ["--platform", p]
        if subprocess.run(cmd + reqs).returncode != 0:
            die(f"pip could not download the dependencies for {arch}, Python {py}", "check pip's index")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--arch", action="append", choices=sorted(ARCHES), help="default: this machine's")
    parser.add_argument("--out", default=str(REPO / "dist"), help="where the wheels go (default dist/)")
    parser.add_argument("--ffi-dir", help="the target's libffi (a dir with include/ and lib/)")
    parser.add_argument(
        "--pycriu-src",
        default=str(cache_dir() / f"criu-{CRIU_VERSION}" / "lib"),
        help="CRIU's lib/ source directory to build pycriu from ('' for none)",
    )
    parser.add_argument("--deps", nargs="*", metavar="PYVER", help="also download the dependencies' wheels")
    parser.add_argument(
        "--version",
        default=version(),
        help="the version the wheel carries (default: npusnap_cli/__init__.py's; another one, such as "
        "a local build's X.Y.Z.post1, to try an upgrade)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    arches = args.arch or [platform.machine()]
    for arch in arches:
        if arch not in ARCHES:
            die(f"unsupported architecture {arch}", "--arch x86_64 or --arch aarch64")
        build = REPO / ".build" / f"node-{arch}"
        build_native(arch, build, Path(args.ffi_dir) if args.ffi_dir else None)
        wheel = build_wheel(arch, build, out, args.version)
        print(wheel)
        if args.deps:
            download_deps(wheel, arch, args.deps, out)
    if args.pycriu_src:
        pycriu = build_pycriu(Path(args.pycriu_src), out)
        if pycriu:
            print(pycriu)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
