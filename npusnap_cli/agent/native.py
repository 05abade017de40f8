"""The ctypes face of the native agent core (``libnpusnap_agent.so``, built from native/agent/).

Standard library only, Python 3.9+ (runs inside target processes). One table of symbols and
their signatures, applied once; everything else in ``npusnap_cli.agent`` goes through here.

Where the library is found, first match wins:

* the copy already mapped into this process (``npusnap run`` preloads it): a second copy would
  be a second agent;
* ``$NPUSNAP_BUILD_DIR/agent/libnpusnap_agent.so`` (a developer's build directory);
* ``npusnap_cli/agent/lib/libnpusnap_agent.so`` (the copy shipped inside the package);
* ``<repo>/.build/agent/libnpusnap_agent.so`` (a source checkout after ``scripts/setup.sh``).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from npusnap_cli import contract

LIBRARY_NAME = contract.AGENT_LIBRARY
PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "lib"
REPO_BUILD_DIR = Path(__file__).resolve().parent.parent.parent / ".build"

# int hook_callback(void *handle, const char *stage, char *out, size_t outlen)
HOOK_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t
)

_SIGNATURES: Dict[str, Tuple[Any, List[Any]]] = {
    "npusnap_agent_start": (ctypes.c_char_p, []),
    "npusnap_agent_stop": (None, []),
    "npusnap_agent_running": (ctypes.c_int, []),
    "npusnap_agent_socket_path": (ctypes.c_char_p, []),
    "npusnap_agent_last_error": (ctypes.c_char_p, []),
    "npusnap_agent_set_hook_callback": (None, [HOOK_CALLBACK, ctypes.c_double]),
    "npusnap_agent_set_hooks": (None, [ctypes.c_uint, ctypes.c_char_p]),
    "npusnap_agent_hook_claim": (ctypes.c_int, [ctypes.c_void_p]),
    "npusnap_agent_set_python_info": (None, [ctypes.c_char_p]),
    "npusnap_agent_log": (None, [ctypes.c_char_p]),
    "npusnap_agent_log_file": (ctypes.c_char_p, []),
}


class NativeAgentMissing(OSError):
    """The library is not built / not shipped, or cannot be loaded."""


def candidates() -> List[Path]:
    out: List[Path] = []
    env = os.environ.get("NPUSNAP_BUILD_DIR")
    if env:
        out.append(Path(env) / "agent" / LIBRARY_NAME)
    out.append(PACKAGE_LIB_DIR / LIBRARY_NAME)
    out.append(REPO_BUILD_DIR / "agent" / LIBRARY_NAME)
    return out


def mapped_library() -> Optional[Path]:
    """The agent library already loaded into this process (preloaded), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip()
                if path.startswith("/") and os.path.basename(path) == LIBRARY_NAME:
                    return Path(path)
    except OSError:
        pass
    return None


def library_path(include_mapped: bool = True) -> Optional[Path]:
    """The agent library this copy of npusnap_cli would load, or None if there is none."""
    mapped = mapped_library() if include_mapped else None
    return mapped or next((p for p in candidates() if p.is_file()), None)


def load() -> ctypes.CDLL:
    """Load (or reuse, when preloaded by `npusnap run`) the agent library and type its symbols."""
    path = library_path()
    if path is None:
        raise NativeAgentMissing(
            f"the native agent library {LIBRARY_NAME} is not built: looked at "
            + ", ".join(str(p) for p in candidates())
            + " (fix: run scripts/setup.sh, or `make -C native`)"
        )
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn: Callable[..., Any] = getattr(lib, name)
        fn.restype = restype  # type: ignore[attr-defined]
        fn.argtypes = argtypes  # type: ignore[attr-defined]
    return lib
