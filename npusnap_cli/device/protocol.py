"""The wire protocol between the npusnap CLI and the agent inside a target process.

Standard library only, Python 3.9+: the agent imports this module inside the target.

Line-delimited JSON over a filesystem AF_UNIX stream socket, one request and one response per
line, in order::

    request   {"v": 1, "id": 7, "op": "lock", "args": {"lease_s": 30}}
    response  {"v": 1, "id": 7, "ok": true, "result": {...}}
              {"v": 1, "id": 7, "ok": false,
               "error": {"type": "acl", "code": 507906, "name": "ACL_ERROR_SNAPSHOT_LOCK_FAILED",
                         "message": "..."}}

Only the operations in ``OPS`` exist; arguments are checked against a small schema per op. There is
no operation that evaluates code: the agent is a code-execution surface and must stay an
allow-list. Lines longer than ``MAX_LINE`` bytes are refused (a peer cannot make the agent buffer
without bound inside the application's memory).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple

from npusnap_cli import contract

PROTOCOL_VERSION = contract.PROTOCOL_VERSION
MAX_LINE = contract.MAX_LINE

# The operations, their arguments and the argument kinds are the contract's
# (native/contract/npusnap.toml), which native/agent/proto.c compiles in too. Lock ownership
# (docs/internals.md, "Lock ownership"): ``lock`` takes ``owner`` and answers a ``token``; every op
# that changes or keeps a lock takes that ``token``; ``unlock`` and ``rollback`` accept
# ``force: true`` instead (``npusnap thaw --force``). ``lock``'s ``device_memory_file`` is the
# image's device-memory file: its descriptor comes with the line (SCM_RIGHTS).
#
# What JSON values each argument kind takes, in Python types (proto.c checks the same kinds).
KIND_TYPES: Dict[str, Tuple[type, ...]] = {
    "lease": (int, float, type(None)),
    "owner": (dict, type(None)),
    "device_memory": (str, type(None)),
    "token": (str, type(None)),
    "bool": (bool,),
    "path": (str,),
    "hex": (str,),
}
# op -> {argument name: (allowed JSON types, required)}
OP_ARGS: Dict[str, Dict[str, Tuple[Tuple[type, ...], bool]]] = {
    op: {name: (KIND_TYPES[kind], False) for name, kind in args.items()}
    for op, args in contract.PROTOCOL_OPS.items()
}
OPS = frozenset(OP_ARGS)

# Error names of lock ownership (``type: "state"``); the error object also carries ``owner``.
ALREADY_LOCKED = contract.E_ALREADY_LOCKED
NOT_OWNER = contract.E_NOT_OWNER
# ``type: "state"`` of a lock whose copy of the device memory failed (``code``: -errno); nothing
# was locked.
DEVICE_MEMORY_SAVE_FAILED = contract.E_DEVICE_MEMORY_SAVE_FAILED
# ``type: "state"`` of a lock whose devices did not drain in time after Lock (a kernel or a
# collective still running: another rank not yet at its half of an all-reduce); the agent
# unlocked again, the job runs on.
DEVICE_BUSY = contract.E_DEVICE_BUSY
TOKEN_HEX_CHARS = contract.TOKEN_HEX_CHARS
MAX_OWNER_COMMAND = contract.MAX_OWNER_COMMAND
# What the agent does with the job's device memory around Lock (native/include/npusnap/devmem.h).
DEVICE_MEMORY_MODES = contract.DEVICE_MEMORY_MODES

# The kinds of error an agent reports (``error.type``).
ERR_ACL = contract.ERR_ACL  # a CANN call returned non-zero (code/name are the ACL's)
ERR_HOOK = contract.ERR_HOOK  # an application hook raised; the op was rolled back
ERR_PROTOCOL = contract.ERR_PROTOCOL  # malformed request, unknown op, refused peer, busy
ERR_STATE = contract.ERR_STATE  # the op is not legal now (no ACL runtime, restore required, ...)
ERR_INTERNAL = contract.ERR_INTERNAL  # a bug in the agent; the application was not touched further
ERROR_TYPES = frozenset(contract.ERROR_TYPES)


# A line that does not follow the protocol, or a reply not of its op's shape (raised on either
# side): the contract's, which its reply decoders raise too.
ProtocolError = contract.ProtocolError


def _dumps(obj: Dict[str, Any]) -> bytes:
    data = (json.dumps(obj, separators=(",", ":"), sort_keys=True, default=str) + "\n").encode("utf-8")
    if len(data) > MAX_LINE:
        raise ProtocolError("LINE_TOO_LONG", f"message of {len(data)} bytes exceeds {MAX_LINE}")
    return data


def _loads(line: bytes) -> Dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ProtocolError("LINE_TOO_LONG", f"line of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError("BAD_JSON", f"not a JSON line: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("BAD_MESSAGE", "a message must be a JSON object")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            "VERSION_MISMATCH",
            f"protocol version {obj.get('v')!r} is not supported (speaks {PROTOCOL_VERSION})",
        )
    msg_id = obj.get("id")
    if not isinstance(msg_id, int) or isinstance(msg_id, bool):
        raise ProtocolError("BAD_MESSAGE", "message id must be an integer")
    return obj


def encode_request(msg_id: int, op: str, args: Optional[Dict[str, Any]] = None) -> bytes:
    """One request line. Validates the op and its arguments on the sending side too."""
    args = dict(args or {})
    validate_args(op, args)
    return _dumps({"v": PROTOCOL_VERSION, "id": msg_id, "op": op, "args": args})


def validate_args(op: str, args: Dict[str, Any]) -> None:
    """Raise ProtocolError unless ``op`` is allowed and ``args`` fit its schema."""
    if op not in OP_ARGS:
        raise ProtocolError("UNKNOWN_OP", f"unknown operation {op!r} (allowed: {', '.join(sorted(OPS))})")
    schema = OP_ARGS[op]
    for key, value in args.items():
        if key not in schema:
            raise ProtocolError("BAD_ARGS", f"operation {op!r} takes no argument {key!r}")
        types, _required = schema[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise ProtocolError("BAD_ARGS", f"argument {key!r} of {op!r} has the wrong type")
    for key, (_types, required) in schema.items():
        if required and key not in args:
            raise ProtocolError("BAD_ARGS", f"operation {op!r} needs argument {key!r}")
    lease = args.get("lease_s")
    if lease is not None and not (0 < float(lease) <= contract.MAX_LEASE_S):
        raise ProtocolError("BAD_ARGS", "lease_s must be > 0 and at most a week")
    drain = args.get("drain_timeout_s")
    if drain is not None and not (0 < float(drain) <= 600):
        raise ProtocolError("BAD_ARGS", "drain_timeout_s must be > 0 and at most 600")
    token = args.get("token")
    if token is not None and len(token) > 2 * TOKEN_HEX_CHARS:
        raise ProtocolError("BAD_ARGS", "token is too long")
    owner = args.get("owner")
    if owner is not None:
        command, pid = owner.get("command"), owner.get("pid")
        if (
            set(owner) - {"command", "pid"}
            or not isinstance(command, str)
            or not 0 < len(command) <= MAX_OWNER_COMMAND
            or not isinstance(pid, int)
            or isinstance(pid, bool)
            or pid <= 0
        ):
            raise ProtocolError("BAD_ARGS", 'owner must be {"command": str (1-64 chars), "pid": int > 0}')
    path = args.get("device_memory_file")
    if path is not None and (
        not path.startswith("/") or len(path.encode()) >= contract.MAX_PATH or "\0" in path
    ):
        raise ProtocolError("BAD_ARGS", "device_memory_file must be an absolute path")
    mode = args.get("device_memory")
    if mode is not None and mode not in DEVICE_MEMORY_MODES:
        raise ProtocolError(
            "BAD_ARGS", f"device_memory must be one of 'preserve', 'app', 'discard' (got {mode!r})"
        )
    for name, kind in contract.PROTOCOL_OPS[op].items():
        value = args.get(name)
        if (
            kind == "hex"
            and value is not None
            and (len(value) > 2 * contract.HCCL_ROOT_BYTES or value.strip("0123456789abcdef"))
        ):
            raise ProtocolError("BAD_ARGS", f"{name} must be lowercase hex digits")


def decode_request(line: bytes) -> Tuple[int, str, Dict[str, Any]]:
    """Parse and validate one request line: ``(id, op, args)``."""
    obj = _loads(line)
    op = obj.get("op")
    args = obj.get("args", {})
    if not isinstance(op, str):
        raise ProtocolError("BAD_MESSAGE", "request has no op")
    if not isinstance(args, dict):
        raise ProtocolError("BAD_ARGS", "args must be a JSON object")
    validate_args(op, args)
    return int(obj["id"]), op, args


def encode_result(msg_id: int, result: Dict[str, Any]) -> bytes:
    return _dumps({"v": PROTOCOL_VERSION, "id": msg_id, "ok": True, "result": result})


def make_error(err_type: str, name: str, message: str, code: int = 0, **extra: Any) -> Dict[str, Any]:
    """The ``error`` object of a failed response."""
    if err_type not in ERROR_TYPES:
        err_type = ERR_INTERNAL
    error: Dict[str, Any] = {"type": err_type, "code": int(code), "name": name, "message": message}
    error.update(extra)
    return error


def encode_error(msg_id: int, error: Dict[str, Any]) -> bytes:
    return _dumps({"v": PROTOCOL_VERSION, "id": msg_id, "ok": False, "error": error})


def decode_response(line: bytes) -> Tuple[int, bool, Dict[str, Any]]:
    """Parse one response line: ``(id, ok, result-or-error)``."""
    obj = _loads(line)
    ok = obj.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError("BAD_MESSAGE", "response has no ok flag")
    body = obj.get("result" if ok else "error")
    if not isinstance(body, dict):
        raise ProtocolError("BAD_MESSAGE", "response has no result/error object")
    if not ok:
        for key in ("type", "name", "message"):
            if not isinstance(body.get(key), str):
                raise ProtocolError("BAD_MESSAGE", f"error object lacks {key!r}")
    return int(obj["id"]), ok, body


class LineBuffer:
    """Splits a byte stream into lines, refusing any line longer than ``MAX_LINE``."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = b""
        self._max = max_line

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_line(self) -> Optional[bytes]:
        """The next complete line (without the newline), or None; ProtocolError if too long."""
        idx = self._buf.find(b"\n")
        if idx < 0:
            if len(self._buf) > self._max:
                raise ProtocolError("LINE_TOO_LONG", f"line exceeds {self._max} bytes")
            return None
        if idx > self._max:
            raise ProtocolError("LINE_TOO_LONG", f"line exceeds {self._max} bytes")
        line, self._buf = self._buf[:idx], self._buf[idx + 1 :]
        return line
