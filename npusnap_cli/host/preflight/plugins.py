"""The CRIU plugins for the device handles: where npusnap's CRIU loads them, whether they fit
its hook table, and what the shared plugin directories hold."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import criu, paths
from npusnap_cli.host import criuplugin
from npusnap_cli.host.preflight.items import OK, PROBLEM, WARNING, CheckItem
from npusnap_cli.jsontypes import JSONObject

# CRIU's shared plugin directories: CR_PLUGIN_DEFAULT of CRIU's build and where distributions (and
# the vendor's CRIU) put plugins. npusnap installs nothing there and does not load them: its CRIU
# gets npusnap's own directory (paths.criu_plugin_dir). NPUSNAP_CRIU_SHARED_PLUGIN_DIRS (colon-
# separated) names others for `check` to look at.
CRIU_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib64/criu", "/usr/local/lib64/criu")
NPU_PLUGIN_NAMES = ("npu_plugin.so", "ascend_plugin.so")
NPUSNAP_PLUGIN_NAMES = ("npusnap_plugin.so", "npusim_plugin.so")


def criu_plugin_dir() -> str:
    """The directory the CRIU that npusnap runs loads its plugins from (npusnap hands it over as
    CRIU_LIBS_DIR; see paths.criu_plugin_dir)."""
    return str(paths.criu_plugin_dir())


def shared_plugin_dirs() -> tuple[str, ...]:
    extra = os.environ.get("NPUSNAP_CRIU_SHARED_PLUGIN_DIRS")
    if extra:
        return tuple(d for d in extra.split(":") if d)
    return CRIU_PLUGIN_DIRS


def _plugin_dirs(simulated: bool) -> tuple[str, ...]:
    """Where a device kind's plugin must be: the directory npusnap's CRIU loads (both kinds; a
    plugin elsewhere is not loaded by npusnap's CRIU, see plugin_dirs_item)."""
    return (criu_plugin_dir(),)


def find_npu_plugin(simulated: bool = False) -> Optional[str]:
    """The CRIU plugin for the NPU's device handles: Huawei's for a real NPU, npusim_plugin.so for
    the simulated one."""
    names = criuplugin.SIMULATED.plugin_names if simulated else NPU_PLUGIN_NAMES
    for d in _plugin_dirs(simulated):
        for name in names:
            p = Path(d) / name
            if p.is_file():
                return str(p)
    return None


def check_npu_plugin(simulated: bool) -> CheckItem:
    kind = criuplugin.SIMULATED if simulated else criuplugin.ASCEND
    plugin = find_npu_plugin(simulated)
    if plugin:
        return check_npu_plugin_abi(plugin, kind)
    what = (
        "the simulated NPU keeps its device connection (a unix socket to the npusim daemon) open "
        "across Backup, as real CANN keeps /dev/davinci* open: stock CRIU cannot dump it"
        if simulated
        else "stock CRIU cannot dump /dev/davinci* file descriptors and mappings"
    )
    elsewhere = [
        str(Path(d) / n) for d in shared_plugin_dirs() for n in kind.plugin_names if (Path(d) / n).is_file()
    ]
    if elsewhere:
        what += (
            f"; {', '.join(elsewhere)} is in a shared plugin directory, which npusnap's CRIU does not "
            "load (it may be built for the vendor's CRIU)"
        )
    return CheckItem(
        "criu-npu-plugin",
        PROBLEM,
        f"no CRIU plugin for the {'simulated ' if simulated else ''}NPU's device handles "
        f"({', '.join(kind.plugin_names)}) in {', '.join(_plugin_dirs(simulated))}; {what}",
        kind.install_fix,
        data={"path": None, "kind": kind.key, "plugin_dir": criu_plugin_dir()},
    )


def check_npu_plugin_abi(plugin: str, kind: Any = None) -> CheckItem:
    """The plugin's max_hooks (its CR_PLUGIN_DESC) against the CRIU in use: a plugin built for
    another CRIU (Huawei's fork numbers the hooks differently) is called by the wrong slots."""

    kind = kind or criuplugin.ASCEND
    data: JSONObject = {"path": plugin, "kind": kind.key, "plugin_dir": criu_plugin_dir()}
    try:
        version = criu.find_criu().version
    except Exception as exc:
        return CheckItem(
            "criu-npu-plugin",
            WARNING,
            f"{plugin}: cannot check its ABI, no usable CRIU ({exc})",
            data=data,
        )
    verdict = criuplugin.check_abi(plugin, version)
    if verdict.desc is not None:
        data.update(name=verdict.desc.name, max_hooks=verdict.desc.max_hooks)
    status = OK if verdict.ok else PROBLEM if verdict.ok is False else WARNING
    fix = verdict.fix
    if verdict.ok is False and kind is criuplugin.SIMULATED:
        fix = f"rebuild this project's plugin against CRIU {version} (./scripts/setup.sh)"
    return CheckItem("criu-npu-plugin", status, f"{plugin}: {verdict.detail}", fix, data=data)


@dataclass(frozen=True)
class PluginFile:
    """A plugin of a plugin directory, by its descriptor (None: unreadable, not a plugin)."""

    path: str
    max_hooks: Optional[int]
    name: Optional[str]

    def to_json(self) -> JSONObject:
        return {"path": self.path, "max_hooks": self.max_hooks, "name": self.name}


def plugin_dirs_item() -> CheckItem:
    """The plugins of CRIU's shared directories and of npusnap's own, by their hook tables.

    A CRIU loads every plugin of its directory; Huawei's fork refuses one that declares more hooks
    than it knows ("Corrupted plugin") and then fails every run, and a plugin with fewer hooks is
    called by the wrong slots. So: npusnap's directory must hold only plugins of the CRIU npusnap
    runs (a problem otherwise); a shared directory whose plugins disagree with each other, or that
    holds npusnap's plugins (left by an older setup), breaks whichever CRIU loads it (a warning:
    npusnap's own CRIU does not load it)."""

    try:
        version = criu.find_criu().version
    except Exception as exc:
        return CheckItem(
            "criu-plugin-dirs", WARNING, f"cannot check plugin directories: no usable CRIU ({exc})"
        )
    have, source = criuplugin.criu_max_hooks(version)
    ours = criu_plugin_dir()
    found: dict[str, list[PluginFile]] = {}
    problems: list[str] = []
    warnings: list[str] = []
    for d in dict.fromkeys((ours, *shared_plugin_dirs())):
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".so"))
        except OSError:
            continue
        entries: list[PluginFile] = []
        for n in names:
            path = os.path.join(d, n)
            try:
                desc = criuplugin.read_plugin_desc(path)
            except (OSError, ValueError):  # elf.ElfError is a ValueError
                desc = None
            entries.append(PluginFile(path, desc.max_hooks if desc else None, desc.name if desc else None))
        found[d] = entries
        hooks = {e.max_hooks for e in entries if e.max_hooks is not None}
        other = [e for e in entries if have is not None and e.max_hooks not in (None, have)]
        if d == ours:
            problems += [f"{e.path} declares {e.max_hooks} hooks, CRIU {version} has {have}" for e in other]
            continue
        if len(hooks) > 1:
            warnings.append(
                f"{d} mixes plugins of different hook tables ("
                + ", ".join(f"{Path(e.path).name}: {e.max_hooks}" for e in entries)
                + "): a CRIU that loads it fails (Huawei's fork refuses one with more hooks than it knows)"
            )
        left = [e.path for e in entries if Path(e.path).name in NPUSNAP_PLUGIN_NAMES]
        if left:
            warnings.append(
                f"{', '.join(left)}: npusnap's plugins in a shared plugin directory (an older setup put "
                "them there); npusnap does not load them from there"
            )
        if other and len(hooks) == 1:
            warnings.append(
                ", ".join(f"{e.path} ({e.max_hooks} hooks)" for e in other)
                + f": built for another CRIU than {version} ({have} hooks, {source}), such as the vendor's "
                "fork; npusnap's CRIU does not load it, the vendor's CRIU may"
            )
    data: JSONObject = {
        "criu": version,
        "criu_max_hooks": have,
        "npusnap_dir": ours,
        "dirs": {d: [e.to_json() for e in entries] for d, entries in found.items()},
    }
    if problems:
        return CheckItem(
            "criu-plugin-dirs",
            PROBLEM,
            f"npusnap's plugin directory {ours} has plugins CRIU {version} cannot load: "
            + "; ".join(problems),
            f"keep only plugins built for CRIU {version} in {ours} (./scripts/setup.sh rebuilds npusnap's)",
            data=data,
        )
    if warnings:
        return CheckItem(
            "criu-plugin-dirs",
            WARNING,
            "; ".join(warnings),
            "leave the vendor's plugins where its CRIU loads them and npusnap's in "
            f"{ours}; remove npusnap_plugin.so/npusim_plugin.so from shared directories; runc, podman "
            f"and CRI runtimes that should use npusnap's plugin need `libdir {ours}` in their CRIU "
            "configuration (docs/runbooks/podman.md)",
            data=data,
        )
    return CheckItem(
        "criu-plugin-dirs",
        OK,
        f"npusnap's CRIU loads plugins from {ours}; every plugin there and in the shared directories "
        f"fits CRIU {version} ({have} hooks)",
        data=data,
    )
