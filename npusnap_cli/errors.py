"""The one exception hierarchy of npusnap, and the stable exit code of each kind of failure.

Core modules raise these; only the CLI layer (``ui.py``) turns them into messages and exit
codes. ``docs/exit-codes.md`` documents the table below and a test freezes it: changing a
number breaks every runbook that tests ``$?``, so never renumber, only add.

Every error carries three parts, rendered in this order:

* ``message`` — one line: what failed;
* ``why`` — the likely cause;
* ``fix`` — the exact next step (a command where there is one);

plus optional ``details`` (for example a CRIU log path and its relevant lines).
"""

from __future__ import annotations

import enum
from typing import Any, Optional


class ExitCode(enum.IntEnum):
    """Process exit codes. Stable: documented in docs/exit-codes.md and frozen by a test."""

    OK = 0
    INTERNAL = 1  # a bug in npusnap: unexpected exception
    USAGE = 2  # bad command line or bad input value
    PREFLIGHT = 3  # the host cannot do this: CRIU missing/too old, privileges, disk space, CANN
    TARGET = 4  # the target process: no such pid, not an NPU process, no agent and cannot attach
    AGENT = 5  # talking to the in-target agent failed: attach, socket, protocol, hook failure
    CRIU = 6  # CRIU refused or failed (dump or restore); the job was rolled back
    DEVICE = 7  # a CANN snapshot call failed (lock/backup/restore/unlock); rolled back
    IMAGE = 8  # the image directory is missing, incomplete, tampered with or incompatible
    STATE_UNKNOWN = 9  # rollback itself failed: a human must look (the message says how)
    CONTINUITY = 10  # demo: the restored workload did not continue identically
    BUSY = 11  # something the command needs is in use (a lock held by another command): wait, retry
    IMAGE_INCOMPATIBLE = 12  # image from another CRIU/CANN/schema: an older image will not help either
    INTERRUPTED = 130  # Ctrl-C / SIGTERM; everything was rolled back


class NpusnapError(Exception):
    """Base of every error npusnap reports to the user."""

    exit_code: ExitCode = ExitCode.INTERNAL
    kind: str = "internal"

    def __init__(
        self,
        message: str,
        *,
        why: str = "",
        fix: str = "",
        details: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.why = why
        self.fix = fix
        self.details: dict[str, Any] = dict(details or {})

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "exit_code": int(self.exit_code),
            "message": self.message,
            "why": self.why,
            "fix": self.fix,
            "details": self.details,
        }


class UsageError(NpusnapError):
    exit_code = ExitCode.USAGE
    kind = "usage"


class PreflightError(NpusnapError):
    exit_code = ExitCode.PREFLIGHT
    kind = "preflight"


class TargetError(NpusnapError):
    exit_code = ExitCode.TARGET
    kind = "target"


class AgentError(NpusnapError):
    exit_code = ExitCode.AGENT
    kind = "agent"


class CriuError(NpusnapError):
    exit_code = ExitCode.CRIU
    kind = "criu"


class DeviceError(NpusnapError):
    exit_code = ExitCode.DEVICE
    kind = "device"


class BusyError(PreflightError):
    """A resource is taken for now (a lock another command holds, the image's pids or devices):
    the same command can succeed later.

    A PreflightError (nothing was touched) with its own code, so that a runbook can wait and
    retry on 11 but go and fix the host on 3.
    """

    exit_code = ExitCode.BUSY
    kind = "busy"


class ImageError(NpusnapError):
    exit_code = ExitCode.IMAGE
    kind = "image"


class IncompatibleImageError(ImageError):
    """The image is intact but was made by another CRIU, CANN or image schema than this host has.

    Its own code, apart from IMAGE (corrupt or incomplete: an older image may do), because every
    image of that host has the same versions: fix the host, or restore where the versions match.
    """

    exit_code = ExitCode.IMAGE_INCOMPATIBLE
    kind = "image-incompatible"


class StateUnknownError(NpusnapError):
    """Rollback failed: processes may be locked or gone. The message lists recovery commands."""

    exit_code = ExitCode.STATE_UNKNOWN
    kind = "state-unknown"


class ContinuityError(NpusnapError):
    exit_code = ExitCode.CONTINUITY
    kind = "continuity"


class InterruptedError_(NpusnapError):
    """The user interrupted the command; everything was rolled back."""

    exit_code = ExitCode.INTERRUPTED
    kind = "interrupted"


def from_dict(data: dict[str, Any], *, prefix: str = "") -> NpusnapError:
    """Rebuild an error from its ``to_dict()`` form (e.g. another npusnap's JSON envelope).

    The class is chosen by ``kind`` so that the exit code is preserved.
    """
    classes: list[type[NpusnapError]] = [NpusnapError]
    while classes[-1:]:
        found = [sub for cls in classes for sub in cls.__subclasses__() if sub not in classes]
        if not found:
            break
        classes.extend(found)
    cls = next((c for c in classes if c.kind == data.get("kind")), NpusnapError)
    return cls(
        prefix + str(data.get("message", "unknown error")),
        why=str(data.get("why", "")),
        fix=str(data.get("fix", "")),
        details=dict(data.get("details") or {}),
    )
