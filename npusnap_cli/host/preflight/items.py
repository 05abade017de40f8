"""What a check of `npusnap check` yields (``CheckItem``) and the report of them all."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from npusnap_cli.jsontypes import JSONObject

OK = "ok"
PROBLEM = "problem"  # blocks dump/restore
WARNING = "warning"  # works, but something is worth knowing
INFO = "info"


@dataclass(frozen=True)
class CheckItem:
    name: str
    status: str
    detail: str
    fix: str = ""
    data: JSONObject = field(default_factory=dict)  # what the check found, for --json


@dataclass(frozen=True)
class CheckReport:
    items: tuple[CheckItem, ...]

    @property
    def ready(self) -> bool:
        return all(item.status != PROBLEM for item in self.items)

    def item(self, name: str) -> Optional[CheckItem]:
        return next((i for i in self.items if i.name == name), None)

    def to_dict(self) -> JSONObject:
        return {"ready": self.ready, "checks": [asdict(i) for i in self.items]}
