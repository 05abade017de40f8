"""Which aclnn operators the installed torch_npu wheel looks up, and which the simulator implements.

torch_npu imports no ``aclnn*`` name at link time: op-plugin (compiled into ``libtorch_npu.so``)
finds every operator with ``dlsym`` by the name written in the library's read-only data, and
checks ``aclnnX`` and ``aclnnXGetWorkspaceSize`` together. So the names the wheel can ask for are
the ``aclnn*`` strings of ``libtorch_npu.so`` (without the ``GetWorkspaceSize`` halves), and an
operator is implemented when the simulator's ``libopapi.so`` exports it. Both files are read as
bytes, never loaded: loading torch_npu needs a device, loading the simulator runs its
constructors.

Used by ``npusnap sim ops`` and scripts/gensimops.py (docs/simulator-ops.md). Core module: returns
an ``OpsCoverage``, never prints.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli import elf, paths
from npusnap_cli.errors import PreflightError
from npusnap_cli.jsontypes import JSONObject

WHEEL_LIBRARY = Path("torch_npu") / "lib" / "libtorch_npu.so"
OPAPI = Path("lib64") / "libopapi.so"
WORKSPACE_SUFFIX = "GetWorkspaceSize"

# A whole C string of the read-only data: not preceded by a printable byte, ended by NUL (a name
# inside a longer message, e.g. in an error text, is no lookup).
_NAME = re.compile(rb"(?<![\x21-\x7e])(aclnn[A-Za-z0-9_]+)\x00")


@dataclass(frozen=True)
class OpsCoverage:
    wheel_library: str  # libtorch_npu.so read
    opapi: str  # the simulator's libopapi.so read
    looked_up: tuple[str, ...]  # sorted, without ...GetWorkspaceSize
    implemented: tuple[str, ...]  # looked up and exported by libopapi.so
    missing: tuple[str, ...]  # looked up, not exported
    extra: tuple[str, ...]  # exported, never looked up by this wheel

    def to_dict(self) -> JSONObject:
        return {
            "wheel_library": self.wheel_library,
            "opapi": self.opapi,
            "looked_up_count": len(self.looked_up),
            "implemented_count": len(self.implemented),
            "missing_count": len(self.missing),
            "implemented": list(self.implemented),
            "missing": list(self.missing),
            "extra": list(self.extra),
        }


def default_site_packages() -> Optional[Path]:
    """The site-packages of the torch_npu venv scripts/setup-torch-npu.sh links at
    ``.build/torch-npu`` (None when there is none)."""
    venv = paths.build_dir() / "torch-npu"
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[-1] if found else None


def wheel_library(where: Optional[Path]) -> Path:
    """``libtorch_npu.so`` from a site-packages directory, the ``torch_npu`` package directory, a
    venv, or the library itself; ``None``: the default venv. PreflightError when it is not there."""
    setup_fix = "build the venv: ./scripts/setup-torch-npu.sh, or name an install: --torch-npu PATH"
    if where is None:
        where = default_site_packages()
        if where is None:
            raise PreflightError(
                "no torch_npu wheel to read",
                why=f"{paths.build_dir() / 'torch-npu'} holds no lib/python3*/site-packages",
                fix=setup_fix,
            )
    candidates = [
        where,
        where / WHEEL_LIBRARY,
        where / "lib" / "libtorch_npu.so",  # the torch_npu package directory
        *sorted(where.glob("lib/python3*/site-packages/" + str(WHEEL_LIBRARY))),  # a venv
    ]
    for c in candidates:
        if c.is_file() and c.name == "libtorch_npu.so":
            return c
    raise PreflightError(
        f"no torch_npu wheel at {where}",
        why=f"none of {where}/{WHEEL_LIBRARY}, {where}/lib/libtorch_npu.so or a venv's site-packages "
        "holds libtorch_npu.so",
        fix=setup_fix,
    )


def opapi_library() -> Path:
    """The simulator's ``libopapi.so`` (the tree ``npusnap sim env`` points at)."""
    lib = paths.sim_cann_home() / OPAPI
    if not lib.is_file():
        raise PreflightError(
            "the simulated NPU is not built",
            why=f"{lib} is missing",
            fix="run ./scripts/setup.sh (or npusnap sim start, which builds it)",
        )
    return lib


def looked_up_names(library: Path) -> set[str]:
    """The aclnn operator names a torch_npu library can look up (``...GetWorkspaceSize`` folded)."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        names = {m.group(1).decode() for m in _NAME.finditer(data)}
    return {n for n in names if not n.endswith(WORKSPACE_SUFFIX)}


def exported_names(library: Path) -> set[str]:
    """The aclnn operators a library exports (its defined dynamic symbols), without the
    ``...GetWorkspaceSize`` halves."""
    try:
        with elf.open_elf(library) as image:
            names = {s.name for s in image.symbols() if s.name.startswith("aclnn")}
    except (OSError, elf.ElfError) as exc:
        raise PreflightError(
            f"cannot read {library}", why=str(exc), fix="rebuild it: make -C native"
        ) from None
    return {n for n in names if not n.endswith(WORKSPACE_SUFFIX)}


def coverage(torch_npu: Optional[Path] = None) -> OpsCoverage:
    """Compare the wheel's lookups (``torch_npu``: see :func:`wheel_library`) with the simulator."""
    wheel = wheel_library(torch_npu)
    opapi = opapi_library()
    wanted = looked_up_names(wheel)
    have = exported_names(opapi)
    return OpsCoverage(
        wheel_library=str(wheel),
        opapi=str(opapi),
        looked_up=tuple(sorted(wanted)),
        implemented=tuple(sorted(wanted & have)),
        missing=tuple(sorted(wanted - have)),
        extra=tuple(sorted(have - wanted)),
    )
