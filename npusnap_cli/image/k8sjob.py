"""A Kubernetes job checkpoint (``npusnap k8s checkpoint``): its manifest, and the check of
every member archive it names.

The directory holds ``npusnap-k8s-job.json`` and one container checkpoint archive per member
(containers.py reads each). k8s/jobcheckpoint.py writes it and restores from it; ``npusnap
inspect``/``verify`` reach it through image/opened.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from npusnap_cli.errors import ImageError
from npusnap_cli.image import containers
from npusnap_cli.image.layout import K8S_JOB_MANIFEST
from npusnap_cli.jsontypes import JSONObject

MANIFEST = K8S_JOB_MANIFEST  # image.open tells such a directory apart by this name
MANIFEST_KIND = "npusnap-k8s-job"
MANIFEST_FORMAT = 1


def sha256_of(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def read_manifest(directory: Path) -> dict[str, Any]:
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ImageError(
            f"{directory}: no readable {MANIFEST}: {exc}", fix="checkpoint the job again"
        ) from None
    if (
        not isinstance(data, dict)
        or data.get("kind") != MANIFEST_KIND
        or data.get("format") != MANIFEST_FORMAT
    ):
        raise ImageError(f"{directory}/{MANIFEST} is not a {MANIFEST_KIND} format {MANIFEST_FORMAT} manifest")
    return data


def verify_job(directory: Path) -> JSONObject:
    """Every archive the manifest names: same size and sha256, and the plugin's record intact."""
    manifest = read_manifest(directory)
    problems = []
    for m in manifest["members"]:
        if m.get("sha256") is None:
            problems.append(f"member {m['member']}: its archive is on node {m['node']} ({m['archive']})")
            continue
        path = directory / str(m["archive"])
        if not path.is_file():
            problems.append(f"member {m['member']}: {path.name} is missing")
            continue
        digest, size = sha256_of(path)
        if (digest, size) != (m["sha256"], m["size"]):
            problems.append(f"member {m['member']}: {path.name} differs from the manifest's sha256/size")
            continue
        ckpt = containers.find(path)
        if ckpt is None:
            problems.append(f"member {m['member']}: {path.name} has no plugin record")
            continue
        containers.verify(ckpt)
    if problems:
        raise ImageError(
            f"job checkpoint {directory} failed verification: {problems[0]}",
            why="an archive is missing, truncated or was modified",
            fix="do not restore the job from it; checkpoint the job again",
            details={"problems": problems},
        )
    return {"directory": str(directory), "ok": True, "members": len(manifest["members"])}
