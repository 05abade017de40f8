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


# -- reading a record's fields -------------------------------------------------------------------
# A module that parses a JSON record (a dataclass's ``from_json``) reads each field through these,
# and turns the ShapeError into its own error (an ImageError for a file of an image, say).


class ShapeError(ValueError):
    """A JSON document that is not the record it should be; the message names the field."""


def _wrong(data: Mapping[str, JSONValue], key: str, what: str) -> ShapeError:
    if key not in data:
        return ShapeError(f"{key!r} is missing")
    return ShapeError(f"{key!r} is a {type(data[key]).__name__}, not {what}")


def as_record(value: JSONValue, what: str = "the record") -> Mapping[str, JSONValue]:
    """``value`` as a JSON object, or ShapeError."""
    if not isinstance(value, Mapping):
        raise ShapeError(f"{what} is a {type(value).__name__}, not a JSON object")
    return value


def req_str(data: Mapping[str, JSONValue], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise _wrong(data, key, "a string")
    return value


def opt_str(data: Mapping[str, JSONValue], key: str) -> Optional[str]:
    """``data[key]``: a string, or None when it is absent or null."""
    return None if data.get(key) is None else req_str(data, key)


def req_int(data: Mapping[str, JSONValue], key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):  # a bool is no number here
        raise _wrong(data, key, "an integer")
    return value


def opt_int(data: Mapping[str, JSONValue], key: str) -> Optional[int]:
    return None if data.get(key) is None else req_int(data, key)


def req_bool(data: Mapping[str, JSONValue], key: str) -> bool:
    value = data.get(key)
    if not isinstance(value, bool):
        raise _wrong(data, key, "a boolean")
    return value


def opt_bool(data: Mapping[str, JSONValue], key: str) -> Optional[bool]:
    return None if data.get(key) is None else req_bool(data, key)


def req_float(data: Mapping[str, JSONValue], key: str) -> float:
    """A JSON number (an integer too), as a float."""
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong(data, key, "a number")
    return float(value)


def opt_float(data: Mapping[str, JSONValue], key: str) -> Optional[float]:
    return None if data.get(key) is None else req_float(data, key)


def req_obj(data: Mapping[str, JSONValue], key: str) -> Mapping[str, JSONValue]:
    value = data.get(key)
    if not isinstance(value, Mapping):
        raise _wrong(data, key, "an object")
    return value


def req_list(data: Mapping[str, JSONValue], key: str) -> Sequence[JSONValue]:
    value = data.get(key)
    if not isinstance(value, list):
        raise _wrong(data, key, "an array")
    return value


def int_list(data: Mapping[str, JSONValue], key: str, *, optional: bool = False) -> tuple[int, ...]:
    """``data[key]``: an array of integers (with ``optional``, absent or null is empty)."""
    if optional and data.get(key) is None:
        return ()
    out = []
    for item in req_list(data, key):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ShapeError(f"{key!r} holds a {type(item).__name__}, not an integer")
        out.append(item)
    return tuple(out)
