"""`npusnap restore --dry-run`: every check a restore makes and everything it needs, with nothing
touched — no file created, no process started, no agent contacted.

The checks are a list (``CHECKS``) that other modules extend with ``register``: the image's
structure and checksums, then the restore's own preflight (``restore.CHECKS``, the list that
``restore.preflight`` runs). Each has a name, a one-line description, and a function that returns
what it found (a short text) or raises the NpusnapError the real restore would raise. All checks
run, also after a problem, so that one run lists everything to fix; the result's exit code is the
first problem's (the order is the real restore's, the image's own integrity first: a corrupt image
is exit 8 even while its original still runs).

Core module: never prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from npusnap_cli.image import integrity, layout
from npusnap_cli.image.manifest import load_manifest
from npusnap_cli.pipelines import checks
from npusnap_cli.pipelines.checks import CheckResult
from npusnap_cli.pipelines.restore import CHECKS as RESTORE_CHECKS
from npusnap_cli.pipelines.restore import Check, Preflight, RestoreOptions

# What a check reads: the image, its manifest and the restore's options (restore.Preflight).
DryRunContext = Preflight


def _structure(ctx: Preflight) -> str:
    integrity.verify(ctx.image, checksums=False, require_signature=ctx.options.require_signature)
    m = ctx.manifest
    signed = ", signature good" if ctx.options.require_signature else ""
    return f"{len(m.files)} files, sizes as listed{signed}"


def _checksums(ctx: Preflight) -> str:
    integrity.verify(ctx.image, checksums=True)
    return f"{len(ctx.manifest.files)} files, {sum(f.size for f in ctx.manifest.files)} bytes match"


# The image's own integrity first (a corrupt image is exit 8 even while its original still
# runs), then the restore's own preflight, in its order.
CHECKS: list[Check] = [
    Check("structure", "manifest, file list, sizes, signature", _structure),
    Check(
        "checksums",
        "every file's sha256",
        _checksums,
        skip=lambda c: None if c.options.verify else "--no-verify",
    ),
    *RESTORE_CHECKS,
]


def register(check: Check, *, before: Optional[str] = None) -> None:
    """Add a check (e.g. a host resource the image needs); ``before``: the name it must precede."""
    if any(c.name == check.name for c in CHECKS):
        raise ValueError(f"a dry-run check named {check.name!r} exists")
    if before is None:
        CHECKS.append(check)
        return
    index = next(i for i, c in enumerate(CHECKS) if c.name == before)
    CHECKS.insert(index, check)


def run_checks(image: Path, options: RestoreOptions) -> list[CheckResult]:
    final = layout.follow_pointer(image)
    manifest = load_manifest(final)  # no manifest: nothing to check, the error says why
    ctx = Preflight(final, manifest, options, dry_run=True)
    return checks.run_all(CHECKS, ctx)
