"""Build the agent's own wheel: ``npusnap-agent``, the Python face plus the native core.

Standard library only, any Python 3.9+, no network, no build backend: it writes the wheel (a
zip laid out as PEP 427 says) straight from this checkout. The wheel holds

* ``npusnap_cli/__init__.py`` (the version), ``npusnap_cli/contract.py`` (the hook stages),
  ``npusnap_cli/paths.py`` (where the agent log goes; standard library, contract and procfs
  only), ``npusnap_cli/host/{__init__,procfs}.py`` (one pid's /proc entries, standard library
  only) and ``npusnap_cli/agent/{__init__,hooks,native}.py``
  (``start()``, ``register_hook()``, ...; standard library only, Python 3.9+);
* ``npusnap_cli/agent/lib/libnpusnap_agent.so`` (the native core; build it first with
  ``make -C native`` or ``scripts/setup.sh``).

It depends on nothing, so it installs into the application's own environment (another
virtualenv, conda, Python 3.9) without the CLI's typer/rich/psutil/protobuf. Install either
this wheel or the full ``npusnap`` CLI in one environment, not both: they share the
``npusnap_cli`` package (the CLI includes the agent).

    python agent-dist/build_wheel.py [--out DIR]      -> DIR/npusnap_agent-<v>-py3-none-<plat>.whl
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import platform
import re
import sys
import zipfile
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "npusnap_cli"
FILES = [
    "npusnap_cli/__init__.py",
    "npusnap_cli/contract.py",
    "npusnap_cli/paths.py",
    "npusnap_cli/host/__init__.py",
    "npusnap_cli/host/procfs.py",
    "npusnap_cli/agent/__init__.py",
    "npusnap_cli/agent/hooks.py",
    "npusnap_cli/agent/native.py",
]
LIBRARY = "npusnap_cli/agent/lib/libnpusnap_agent.so"
BUILT_LIBRARY = REPO / ".build" / "agent" / "libnpusnap_agent.so"


def version() -> str:
    text = (PACKAGE / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if not m:
        raise SystemExit("no __version__ in npusnap_cli/__init__.py")
    return m.group(1)


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build(out_dir: Path) -> Path:
    lib = REPO / LIBRARY
    if not lib.is_file():
        lib = BUILT_LIBRARY
    if not lib.is_file():
        raise SystemExit(f"{LIBRARY} is not built: run `make -C {REPO / 'native'}` first")
    v = version()
    plat = f"linux_{platform.machine()}"
    dist = "npusnap_agent"
    info = f"{dist}-{v}.dist-info"
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: npusnap-agent\n"
        f"Version: {v}\n"
        "Summary: The npusnap agent for applications: start() and hooks, with its native core\n"
        "Requires-Python: >=3.9\n"
        "License: Apache-2.0\n"
    )
    wheel = (
        "Wheel-Version: 1.0\nGenerator: npusnap build_wheel.py\nRoot-Is-Purelib: false\n"
        f"Tag: py3-none-{plat}\n"
    )
    entries: List[Tuple[str, bytes, int]] = []
    for name in FILES:
        entries.append((name, (REPO / name).read_bytes(), 0o644))
    entries.append((LIBRARY, lib.read_bytes(), 0o755))
    entries.append((f"{info}/METADATA", metadata.encode(), 0o644))
    entries.append((f"{info}/WHEEL", wheel.encode(), 0o644))
    records = [record_line(n, d) for n, d, _ in entries] + [f"{info}/RECORD,,"]
    entries.append((f"{info}/RECORD", ("\n".join(records) + "\n").encode(), 0o644))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{dist}-{v}-py3-none-{plat}.whl"
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, mode in entries:
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = (0o100000 | mode) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    os.replace(tmp, path)
    return path


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / ".build" / "dist"), help="where to write the wheel")
    args = parser.parse_args(argv)
    print(build(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
