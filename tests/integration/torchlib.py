"""Where the torch tests find PyTorch: the virtualenv scripts/setup-torch.sh links at .build/torch
(scripts/test.sh runs it), apart from npusnap's own .venv."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from tests.integration.dumplib import REPO

TORCH = Path(os.environ.get("NPUSNAP_BUILD_DIR") or REPO / ".build") / "torch"
TORCH_BIN = TORCH / "bin"
TORCHRUN = str(TORCH_BIN / "torchrun")


def skip_reason() -> Optional[str]:
    if os.environ.get("NPUSNAP_NO_TORCH") == "1":
        return "NPUSNAP_NO_TORCH=1"
    if not os.access(TORCHRUN, os.X_OK):
        return f"{TORCHRUN} is missing: run scripts/setup-torch.sh (scripts/test.sh does)"
    return None
