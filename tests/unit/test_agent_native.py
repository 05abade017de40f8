"""The native agent library as the Python side finds and loads it.

What the library and the Python modules must agree on (operations, error names, states, layouts)
is generated into both from native/contract/npusnap.toml; tests/unit/test_contract.py checks that.
"""

from __future__ import annotations

from npusnap_cli.agent import native


def test_library_is_found_by_package_path() -> None:
    path = native.library_path(include_mapped=False)
    assert path is not None and path.name == native.LIBRARY_NAME


def test_library_loads_and_types_its_symbols() -> None:
    lib = native.load()
    assert lib.npusnap_agent_running() == 0
