"""The native agent library against the Python sources it must agree with (one source of truth).

protocol.py's OP_ARGS and the native proto.c table name the same operations and arguments;
the ACL error names the agent reports are those of acl.ERRORS.
"""

from __future__ import annotations

import json

import pytest

from npusnap_cli import acl
from npusnap_cli.agent import native
from npusnap_cli.device import protocol

# The native table's value kinds, as the Python types protocol.OP_ARGS accepts for them.
KINDS = {
    "lease": (int, float, type(None)),
    "token": (str, type(None)),
    "bool": (bool,),
    "owner": (dict, type(None)),
    "device_memory": (str, type(None)),
    "path": (str,),
}


@pytest.fixture(scope="module")
def lib():  # type: ignore[no-untyped-def]
    if native.library_path() is None:
        pytest.fail("libnpusnap_agent.so is not built: run scripts/setup.sh")
    return native.load()


def test_protocol_tables_agree(lib) -> None:  # type: ignore[no-untyped-def]
    table = json.loads(lib.npusnap_agent_protocol_table())
    assert set(table) == set(protocol.OP_ARGS)
    for op, args in table.items():
        assert set(args) == set(protocol.OP_ARGS[op]), op
        for name, kind in args.items():
            assert KINDS[kind] == protocol.OP_ARGS[op][name][0], (op, name, kind)


def test_acl_error_names_agree(lib) -> None:  # type: ignore[no-untyped-def]
    for code, (name, _meaning, _hint) in acl.ERRORS.items():
        assert lib.npusnap_agent_acl_error_name(code).decode() == name
    assert lib.npusnap_agent_acl_error_name(12345).decode() == acl.describe(12345)[0]


def test_library_is_found_by_package_path() -> None:
    path = native.library_path(include_mapped=False)
    assert path is not None and path.name == native.LIBRARY_NAME
