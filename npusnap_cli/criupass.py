"""CRIU options npusnap passes through as they are (``--criu-opt``), from an allow-list.

npusnap names the CRIU options it has an opinion about itself (``--tcp-established``,
``--file-locks``, ``--external``...). A few more are ones users of raw CRIU need and that change
nothing npusnap relies on: they go to CRIU unchanged, as podman's checkpoint does with its own
list. Each is checked here (name, value, dump or restore), then handed to CRIU as a
configuration file of its RPC (``criu_opts.config_file``, read by CRIU after the RPC settings:
criu/cr-service.c), written by npusnap in CRIU's work directory and named through npusnap's own
descriptor of it, so no other user can swap it.

Anything else (``--root``, ``--action-script``, ``--libdir``, ``--exec-cmd``...) would change
where CRIU reads or writes as root, or what it runs, and is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from npusnap_cli.errors import UsageError


def _size(value: str) -> Optional[str]:
    # CRIU's parse_size: a number with an optional K, M or G (criu/config.c).
    return None if re.fullmatch(r"[0-9]{1,12}[KMG]?", value) else "a size such as 1048576, 64K, 8M or 1G"


def _cgroup_mode(value: str) -> Optional[str]:
    modes = ("none", "props", "soft", "full", "strict", "ignore")
    return None if value in modes else "one of " + ", ".join(modes)


def _abs_path(value: str) -> Optional[str]:
    ok = value.startswith("/") and re.fullmatch(r"[A-Za-z0-9_./@+:=,-]+", value) is not None
    return None if ok else "an absolute path of letters, digits and _./@+:=,-"


def _join_ns(value: str) -> Optional[str]:
    # CRIU's --join-ns NS:{PID|NS_FILE} (criu/namespaces.c, join_ns_add), for the namespaces
    # whose joining changes no credential: not user (it takes ids), not mnt or pid.
    ok = re.fullmatch(r"(net|uts|ipc):([0-9]{1,10}|/[A-Za-z0-9_./@+:=-]+)", value) is not None
    return None if ok else "net, uts or ipc, a colon, and a pid or an absolute path (net:/var/run/netns/NAME)"


@dataclass(frozen=True)
class Passed:
    """One option of the allow-list: when it applies and what its value must be."""

    name: str
    commands: tuple[str, ...]  # "dump", "restore"
    summary: str
    value: Optional[Callable[[str], Optional[str]]] = None  # None: a flag; else what is wrong
    value_optional: bool = False


ALLOWED: dict[str, Passed] = {
    p.name: p
    for p in (
        Passed("ghost-limit", ("dump",), "largest deleted file kept in the image", _size),
        Passed("ghost-fiemap", ("dump",), "save a deleted file's holes with FIEMAP"),
        Passed("no-ghost-fiemap", ("dump",), "save a deleted file's holes with SEEK_DATA/SEEK_HOLE"),
        Passed("manage-cgroups", ("dump", "restore"), "dump/restore the tree's cgroups", _cgroup_mode, True),
        Passed("skip-in-flight", ("dump",), "drop TCP connections still being accepted"),
        Passed("tcp-close", ("dump",), "close established TCP connections instead of dumping them"),
        Passed("force-irmap", ("dump",), "resolve inotify/fanotify watches by path"),
        Passed("irmap-scan-path", ("dump",), "where to look for watched files", _abs_path),
        Passed("join-ns", ("restore",), "restore into an existing namespace", _join_ns),
    )
}


def parse(items: list[str], command: str) -> tuple[str, ...]:
    """``--criu-opt`` values (``NAME`` or ``NAME=VALUE``, with or without the leading dashes) as
    the lines of a CRIU configuration file; UsageError for anything not on the allow-list."""
    lines = []
    for item in items:
        name, eq, value = item.lstrip("-").partition("=")
        spec = ALLOWED.get(name)
        if spec is None:
            raise UsageError(
                f"--criu-opt {item}: not an option npusnap passes to CRIU",
                why="only options that change nothing npusnap relies on, nor where CRIU reads or "
                "writes as root, are passed through",
                fix="one of: " + ", ".join(sorted(ALLOWED)) + " (see `npusnap " + command + " --help`)",
            )
        if command not in spec.commands:
            raise UsageError(
                f"--criu-opt {name} is an option of {' and '.join(spec.commands)}, not of {command}",
                fix=f"pass it to `npusnap {spec.commands[0]}`",
            )
        if spec.value is None and eq:
            raise UsageError(f"--criu-opt {name} takes no value", fix=f"--criu-opt {name}")
        if spec.value is not None and not eq and not spec.value_optional:
            raise UsageError(f"--criu-opt {name} needs a value", fix=f"--criu-opt {name}=VALUE")
        if eq:
            assert spec.value is not None
            problem = spec.value(value)
            if problem:
                raise UsageError(f"--criu-opt {name}={value}: the value must be {problem}")
        lines.append(f"{name}={value}" if eq else name)
    return tuple(lines)


def help_text(command: str) -> str:
    names = [p.name + ("[=V]" if p.value_optional else "=V" if p.value else "") for p in ALLOWED.values()]
    names = [n for n, p in zip(names, ALLOWED.values()) if command in p.commands]
    return "A CRIU option passed through unchanged (repeatable; allow-list: " + ", ".join(names) + ")."
