"""Agent replies for tests: the JSON a native agent sends, decoded as the contract's records.

Each builder takes the members a test cares about (nested objects merged into the rest), fills the
others as an idle agent of a process without device memory would, and decodes the whole through
the generated ``from_json``: a fake reply is checked like a real one."""

from __future__ import annotations

import copy
from typing import Any

from npusnap_cli import contract
from npusnap_cli import replies as agent_replies

OWNER: dict[str, Any] = {"command": "dump", "pid": 4242, "since": "2026-01-31T12:00:00Z"}
LEASE: dict[str, Any] = {
    "active": False,
    "lease_s": None,
    "remaining_s": None,
    "voided_reason": None,
    "frozen_gaps": 0,
}
DEVICE_MEMORY: dict[str, Any] = {"available": True, "mode": None, "saved": False, "flow": None}
HELLO: dict[str, Any] = {
    "agent_version": "0.0.0",
    "agent": "native",
    "protocol_version": contract.PROTOCOL_VERSION,
    "pid": 4242,
    "start_time_ticks": 1000,
    "log": None,
    "started_at": None,
    "restored": False,
    "socket": "/run/npusnap/4242.sock",
    "python": None,
    "acl": {
        "loaded": True,
        "library": None,
        "cann_version": None,
        "visible_devices": None,
        "devices": [],
        "devices_source": None,
        "callback_devices": [],
    },
    "hooks": {"pre_lock": [], "post_backup": [], "post_restore": [], "post_unlock": []},
    "owner": None,
    "device_memory": DEVICE_MEMORY,
}
STATUS: dict[str, Any] = {
    "state": "RUNNING",
    "lease": LEASE,
    "owner": None,
    "pid": 4242,
    "acl_loaded": True,
    "restored": False,
    "restore_pending": False,
    "device_memory": DEVICE_MEMORY,
    "hccl": [],
    "events": [],
}


def merged(base: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``parts`` in it, objects merged member by member."""
    out = copy.deepcopy(base)
    for key, value in parts.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def hello(parts: dict[str, Any] | None = None, **members: Any) -> agent_replies.HelloReply:
    return agent_replies.HelloReply.from_json(merged(HELLO, {**(parts or {}), **members}))


def status(parts: dict[str, Any] | None = None, **members: Any) -> agent_replies.StatusReply:
    return agent_replies.StatusReply.from_json(merged(STATUS, {**(parts or {}), **members}))


def error(type: str, name: str, message: str = "x", code: int = 0, **extra: Any) -> agent_replies.ErrorReply:
    obj = {"code": code, "message": message, "name": name, "type": type, **extra}
    return agent_replies.ErrorReply.from_json(obj)
