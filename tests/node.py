"""A node of its own for a part of the test suite (a pytest worker, which runs beside the others;
the zdtm run): on the simulator each CANN tree is a node, so the devices one part's jobs hold are
never "occupied" for another's restores (npusnap_cli/device/occupancy.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from npusnap_cli import contract, paths


def isolate_node(name: str) -> Path:
    """Copies of the simulator's CANN trees, the default simulator socket (`npusnap sim start`
    in a runbook) and npusnap's state directory, all under a new directory, set in this
    process's environment (and so in every child's). Returns the directory: remove it at the end."""
    base = Path(tempfile.mkdtemp(prefix=f"npusnap-{name}-"))
    # Readable by all, as /usr/local/Ascend is: permissions.md runs a job as another user, with
    # this node's CANN tree. What must stay private below it (the state directory, the
    # simulator's socket) is created with its own modes.
    os.chmod(base, 0o755)
    built = paths.build_dir()
    # Every tree the build made (paths.sim_cann_home names them cann and cann-VERSION).
    for src in sorted(p for p in built.glob("cann*") if p.is_dir()):
        dst = base / src.name
        shutil.copytree(src, dst, symlinks=True)
        env_sh = dst / "set_env.sh"
        if env_sh.is_file():
            env_sh.write_text(env_sh.read_text().replace(str(src), str(dst)))
    os.environ[paths.SIM_CANN_DIR_ENV] = str(base)
    os.environ[contract.SIM_SOCKET_ENV] = str(base / "npusim.sock")
    os.environ["NPUSNAP_STATE_DIR"] = str(base / "state")
    return base
