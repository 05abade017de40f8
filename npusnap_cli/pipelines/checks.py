"""Check tables: what a command verifies before it touches anything, one table per command.

A check has a name, a one-line description, and a function of the command's context that returns
what it found (a short text) or raises the NpusnapError the command would raise; ``skip`` gives
the reason it does not apply, if any. The command runs its table in order and stops at the first
problem (``run_in_order``); its ``--dry-run`` runs every check, also after a problem, so that one
run lists everything to fix, and exits with the first problem's code (``run_all``).

Core module: never prints.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

from npusnap_cli.errors import NpusnapError, settle_no_space
from npusnap_cli.jsontypes import JSONObject

C = TypeVar("C")


@dataclass(frozen=True)
class Check(Generic[C]):
    name: str
    what: str
    run: Callable[[C], str]  # what it found (a short text); raises the command's error
    skip: Optional[Callable[[C], Optional[str]]] = None  # the reason it does not apply


@dataclass(frozen=True)
class CheckResult:
    name: str
    what: str
    status: str  # "ok", "problem", "skipped"
    detail: str
    error: Optional[JSONObject] = None  # the problem's NpusnapError.to_dict()
    exit_code: int = 0

    def to_dict(self) -> JSONObject:
        return {
            "name": self.name,
            "what": self.what,
            "status": self.status,
            "detail": self.detail,
            "error": self.error,
            "exit_code": self.exit_code,
        }


def run_in_order(checks: Iterable[Check[C]], ctx: C) -> None:
    """Every check that applies, in order; the first problem's NpusnapError is raised."""
    for check in checks:
        if check.skip is None or not check.skip(ctx):
            check.run(ctx)


def run_all(checks: Iterable[Check[C]], ctx: C) -> list[CheckResult]:
    """Every check, also after a problem: what each found, or its problem and exit code."""
    results = []
    for check in checks:
        reason = check.skip(ctx) if check.skip is not None else None
        if reason:
            results.append(CheckResult(check.name, check.what, "skipped", reason))
            continue
        try:
            detail = check.run(ctx)
        except NpusnapError as err:
            err = settle_no_space(err) or err  # a full disk is 3 here too, as the command reports it
            results.append(
                CheckResult(check.name, check.what, "problem", err.message, err.to_dict(), int(err.exit_code))
            )
            continue
        results.append(CheckResult(check.name, check.what, "ok", detail))
    return results


def first_problem(results: Iterable[CheckResult]) -> int:
    """The exit code of the first problem, 0 if there is none."""
    return next((r.exit_code for r in results if r.status == "problem"), 0)
