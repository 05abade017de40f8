"""This node's qualification report (`npusnap qualify`, pipelines/qualify.py): where it is, and
what `npusnap check` makes of it.

The report is the node's own evidence for the assumptions npusnap makes of an Ascend node. It
names the CANN installation and the driver it was made for (the driver's ``version.info`` and
the sha256 of the ``libascend_hal.so`` the probe loaded): after an upgrade of either it no longer
speaks for the node, and `check` asks for a new one. A report whose checks failed makes `check`
refuse the node (a problem row), and `dump` and `restore` refuse to run there (``gate``); a report
out of date, or a node without one on real hardware (nothing there was shown), is a warning of
each; on the simulator a missing report is a note of `check` only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from npusnap_cli import acl, paths
from npusnap_cli.errors import PreflightError
from npusnap_cli.host.preflight.items import INFO, OK, PROBLEM, WARNING, CheckItem
from npusnap_cli.jsontypes import JSONObject

REPORT_FORMAT = "npusnap-qualify"
REPORT_VERSION = 1
REPORT_NAME = "qualify-report.json"  # in paths.state_dir()
DRIVER_VERSION_INFO = "/usr/local/Ascend/driver/version.info"
RUN = "run `npusnap qualify` as root on an idle device"


class NodeCann(Protocol):
    """What a report is matched against: acl.CannInstall, or the lighter ``SeenCann``."""

    @property
    def home(self) -> str: ...

    @property
    def version(self) -> Optional[str]: ...

    @property
    def simulated(self) -> bool: ...


@dataclass(frozen=True)
class SeenCann:
    """The CANN a job runs on, from its home's version file alone (no library is read)."""

    home: str
    version: Optional[str]
    simulated: bool

    @classmethod
    def at(cls, home: str) -> SeenCann:
        version, simulated = acl.read_version_info(home)
        return cls(os.path.abspath(home), version, simulated)


def report_path() -> Path:
    """Where `npusnap qualify` (root's) writes the report, and where this user reads it first."""
    return paths.state_dir() / REPORT_NAME


def report_for_node() -> Path:
    """The report that speaks for this node: this user's own (root's, or one a test made with
    NPUSNAP_STATE_DIR), else root's, which qualify (run as root) wrote; a user reads it where root
    made it readable (its directory is root's own, 0700, by default)."""
    own = report_path()
    if own.exists() or os.geteuid() == 0 or os.environ.get("NPUSNAP_STATE_DIR"):
        return own
    return paths.ROOT_STATE_DIR / REPORT_NAME


def driver_version(version_info: str = DRIVER_VERSION_INFO) -> Optional[str]:
    """The driver's ``Version=`` from its version.info, None without one."""
    with contextlib.suppress(OSError):
        for line in Path(version_info).read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip().lower() == "version":
                return value.strip() or None
    return None


def file_sha256(path: str) -> Optional[str]:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
    return None


def load(path: Optional[Path] = None) -> Optional[dict[str, Any]]:
    """The report, if there is one of this user's or root's (a file of another owner, or not a
    report, is none)."""
    path = path or report_for_node()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_uid not in (os.geteuid(), 0):
            return None
        try:
            doc = json.loads(f.read(1 << 22))
        except ValueError:
            return None
    if not isinstance(doc, dict) or doc.get("format") != REPORT_FORMAT:
        return None
    return doc


def stale(report: dict[str, Any], install: NodeCann) -> Optional[str]:
    """Why the report no longer speaks for this node (another CANN, another driver), or None."""
    cann = report.get("cann") if isinstance(report.get("cann"), dict) else {}
    driver = report.get("driver") if isinstance(report.get("driver"), dict) else {}
    assert isinstance(cann, dict) and isinstance(driver, dict)
    if cann.get("home") != install.home or cann.get("version") != install.version:
        return (
            f"it was made for CANN {cann.get('version')} at {cann.get('home')}; this is CANN "
            f"{install.version} at {install.home}"
        )
    have = driver_version()
    if driver.get("version") != have:
        return f"it was made for driver {driver.get('version')}; this is driver {have}"
    hal = driver.get("hal_library")
    if isinstance(hal, str) and driver.get("hal_sha256") != file_sha256(hal):
        return f"the driver's library {hal} changed since (another driver)"
    return None


def check_item(install: NodeCann, path: Optional[Path] = None) -> CheckItem:
    """`npusnap check`'s ``qualify`` row."""
    path = path or report_for_node()
    report = load(path)
    data: JSONObject = {"report": str(path)}
    if report is None:
        if install.simulated:
            return CheckItem(
                "qualify", INFO, f"no qualification report ({path}); the simulated NPU needs none", RUN, data
            )
        if os.geteuid() != 0:
            # Root's report sits in root's private state directory: a user cannot tell.
            return CheckItem(
                "qualify",
                WARNING,
                f"no qualification report this user can read ({path}): root's, if there is one, "
                "is private to root",
                "`sudo npusnap check` shows the node's report; " + RUN,
                data,
            )
        return CheckItem(
            "qualify",
            WARNING,
            f"this node was never qualified (no {path}): what npusnap assumes of it is unproven here",
            RUN,
            data,
        )
    data.update(created_at=report.get("created_at"), passed=report.get("passed"), failed=report.get("failed"))
    why = stale(report, install)
    if why:
        return CheckItem(
            "qualify", WARNING, f"the qualification report is out of date: {why}", RUN + " again", data
        )
    if report.get("passed") is not True:
        failed = report.get("failed") or []
        return CheckItem(
            "qualify",
            PROBLEM,
            f"the qualification report of {report.get('created_at')} failed: "
            f"{', '.join(str(f) for f in failed) or 'no check passed'}: npusnap's snapshots cannot be "
            "trusted on this node",
            f"attach {path} to a bug report; {RUN} again after a fix",
            data,
        )
    return CheckItem("qualify", OK, f"qualified on {report.get('created_at')} ({path})", data=data)


def gate(install: NodeCann, tell: Callable[[str], None], path: Optional[Path] = None) -> str:
    """What a dump or a restore makes of the report for the CANN its job runs on: a failed report
    refuses (PreflightError, before anything is touched), an out-of-date one, or none on real
    hardware, is told through ``tell``; the line for the check table otherwise."""
    item = check_item(install, path)
    if item.status == PROBLEM:
        raise PreflightError(
            item.detail,
            why="`npusnap qualify` found an assumption npusnap's snapshots rest on to be false on this "
            "node: a snapshot could lose device memory without a word",
            fix=item.fix,
            details=dict(item.data),
        )
    if item.status == WARNING:
        tell(f"{item.detail} ({item.fix})")
    return item.detail
