"""The one exception hierarchy of npusnap, and the stable exit code of each kind of failure.

Core modules raise these; only the CLI layer (``ui.py``) turns them into messages and exit
codes. ``docs/exit-codes.md`` documents ``ExitCode`` (defined in native/contract/npusnap.toml) and a
test freezes it: changing a number breaks every runbook that tests ``$?``, so never renumber, only
add.

Every error carries three parts, rendered in this order:

* ``message`` — one line: what failed;
* ``why`` — the likely cause;
* ``fix`` — the exact next step (a command where there is one);

plus optional ``details`` (for example a CRIU log path and its relevant lines).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Optional

from npusnap_cli import contract
from npusnap_cli.jsontypes import JSONObject, JSONValue, obj

# Process exit codes: generated from native/contract/npusnap.toml (as is the C plugin's), documented
# in docs/exit-codes.md and frozen by a test.
ExitCode = contract.ExitCode


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
        details: Optional[Mapping[str, JSONValue]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.why = why
        self.fix = fix
        # Free-form JSON: a map keyed by a pid or a device goes in with string keys (as json.dumps
        # would write it).
        self.details: JSONObject = dict(details or {})

    def to_dict(self) -> JSONObject:
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


class NoSpaceError(PreflightError):
    """A full disk or an exhausted quota (ENOSPC, EDQUOT), in whatever command and stage it
    happens: always exit 3, the host's problem (docs/exit-codes.md), never the stage's code (a
    CRIU write, an agent's copy, an archive's compressor): a runbook tests one code for it."""


NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def no_space_cause(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC/EDQUOT OSError that ``exc`` is or was raised from (its cause or context): a
    library may wrap it (zstandard's compressor reports a failed write as its own ZstdError)."""
    seen: set[int] = set()
    cur: Optional[BaseException] = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in NO_SPACE_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def no_space(
    what: str,
    where: object,
    *,
    cause: Optional[str] = None,
    why: str = "",
    fix: str = "",
    details: Optional[Mapping[str, JSONValue]] = None,
) -> NoSpaceError:
    """The one report of a full disk: what failed, the filesystem to free, the next step."""
    return NoSpaceError(
        f"{what} failed: no space left on the filesystem of {where}" + (f" ({cause})" if cause else ""),
        why=why or f"the filesystem of {where} has no space (or quota) left",
        fix=fix or f"free space there (see `df -h {where}`), or write elsewhere; then run the command again",
        details={"where": str(where), **(details or {})},
    )


def settle_no_space(err: BaseException) -> Optional[NpusnapError]:
    """``err`` as the error to report when a full disk caused it (a NoSpaceError that keeps its
    message, fix and details), else None. An error that says more than "no space" keeps its own
    code: a rollback that failed (9), an interruption (130), something busy (11)."""
    if isinstance(err, (NoSpaceError, StateUnknownError, InterruptedError_, BusyError, ContinuityError)):
        return None
    cause = no_space_cause(err)
    if cause is None:
        return None
    if not isinstance(err, NpusnapError):
        where = os.path.dirname(cause.filename) if isinstance(cause.filename, str) else "the disk written to"
        return no_space("writing", where or "/", cause=cause.strerror, details={"errno": cause.errno})
    settled = NoSpaceError(
        err.message,
        why=f"{cause.strerror}: the filesystem written to has no space (or quota) left",
        fix=err.fix
        or "free space where npusnap writes (see `df -h`), or write elsewhere; then run the command again",
        details={**err.details, "errno": cause.errno},
    )
    if cause.filename is not None:
        settled.details.setdefault("path", str(cause.filename))
    return settled


def settle_permission(err: BaseException) -> Optional[NpusnapError]:
    """A PermissionError (EACCES, EPERM) or a read-only filesystem (EROFS) that reached the top as
    exit 3 naming the path and the cause, else None: as a user it is the host's answer (this uid may not read
    root's image or write where root writes), not a bug in npusnap."""
    if isinstance(err, OSError) and err.errno == errno.EROFS:
        where = f" {err.filename}" if err.filename else ""
        return PreflightError(
            f"cannot write{where}: read-only filesystem (EROFS)",
            why="the filesystem (or its mount) is read-only, whatever space it has",
            fix="write to a directory on a writable filesystem, or remount it read-write; then run the "
            "command again",
            details={"errno": err.errno, "path": str(err.filename or "")},
        )
    if not isinstance(err, PermissionError):
        return None
    euid = os.geteuid()
    where = f" on {err.filename}" if err.filename else ""
    if euid != 0:
        return PreflightError(
            f"permission denied{where}: this needs root (npusnap runs as uid {euid})",
            why=f"{err.strerror or err}: uid {euid} may not read or write it (images, agents' sockets "
            "and CRIU's work are root's)",
            fix="run the same command as root (`sudo npusnap ...`), or as the user who owns the path",
            details={"errno": err.errno, "path": str(err.filename or ""), "euid": euid},
        )
    return PreflightError(
        f"permission denied{where}, even as root",
        why=f"{err.strerror or err}: a mount option (nosuid, a foreign filesystem), an LSM policy or "
        "a container without the capability refused root",
        fix="check the path's mount (`findmnt -T PATH`) and the host's security policy, then run the "
        "command again",
        details={"errno": err.errno, "path": str(err.filename or "")},
    )


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
    """Rollback failed: the message says what each process is in now (as its agent answered, gone, or
    no answer) and lists the recovery commands."""

    exit_code = ExitCode.STATE_UNKNOWN
    kind = "state-unknown"


class ContinuityError(NpusnapError):
    exit_code = ExitCode.CONTINUITY
    kind = "continuity"


class InterruptedError_(NpusnapError):
    """The user interrupted the command; everything was rolled back."""

    exit_code = ExitCode.INTERRUPTED
    kind = "interrupted"


def from_dict(data: Mapping[str, JSONValue], *, prefix: str = "") -> NpusnapError:
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
        details=dict(obj(data.get("details"))),
    )
