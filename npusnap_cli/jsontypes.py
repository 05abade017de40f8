"""The JSON types: what ``json.loads`` returns and ``json.dumps`` takes, precisely.

For values that are truly free-form JSON (the ``--json`` envelope's payload, an error's
``details``, a third party's document we only forward). A record with known keys is a dataclass
or a TypedDict of its own module, parsed in one place; these types are not a way around that.

``Sequence`` and ``Mapping`` (not ``list`` and ``dict``) so that a ``list[int]`` or a
``dict[str, str]`` is a JSON value too: a reader narrows with ``isinstance(v, dict)`` /
``isinstance(v, list)`` (or the helpers below), and never mutates a value it did not build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional, Union

JSONScalar = Union[str, int, float, bool, None]
JSONValue = Union[JSONScalar, Sequence["JSONValue"], Mapping[str, "JSONValue"]]
# A JSON object built or read here (mutable): its values are any JSON.
JSONObject = dict[str, JSONValue]


def obj(value: JSONValue) -> Mapping[str, JSONValue]:
    """``value`` if it is a JSON object, else an empty one (an optional section of a reply)."""
    return value if isinstance(value, Mapping) else {}


def array(value: JSONValue) -> Sequence[JSONValue]:
    """``value`` if it is a JSON array, else an empty one (a string is not an array here)."""
    return value if isinstance(value, Sequence) and not isinstance(value, str) else ()


def as_int(value: JSONValue) -> Optional[int]:
    """``value`` if it is a JSON integer (not a boolean), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_str(value: JSONValue) -> Optional[str]:
    """``value`` if it is a JSON string, else None."""
    return value if isinstance(value, str) else None
