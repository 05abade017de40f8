"""Sample NPU workloads shipped with npusnap (used by the demo, the docs and the tests).

Each is a standalone script for plain ``python3`` (3.9+) that talks to the CANN runtime through
ctypes on ``$ASCEND_HOME_PATH/lib64/libacl_rt.so``, exactly as a user program would — run
``eval "$(npusnap sim env)"`` first to use the simulated NPU. ``script_path(name)`` gives their
paths to the demo and the tests.

Here too: the demo (``demo.py``) and its command, `npusnap demo` (``cli.py``, named by its full
name in the CLI's command table). Like the simulator, this package stands beside the product: it
imports npusnap_cli, which never imports it.
"""

from __future__ import annotations

from pathlib import Path

WORKLOADS_DIR = Path(__file__).resolve().parent


def script_path(name: str) -> Path:
    """Path of a workload script: ``script_path("train")`` -> .../workloads/train.py."""
    path = WORKLOADS_DIR / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no workload named {name!r} in {WORKLOADS_DIR}")
    return path
