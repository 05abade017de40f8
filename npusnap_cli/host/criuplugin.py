"""CRIU plugins for NPU device handles: their ABI against the CRIU in use, and their marks in a dump.

Two device kinds need one. A real Ascend NPU: the runtime keeps ``/dev/davinci*`` open and mapped,
and Huawei's ``npu_plugin.so`` records and reopens them. The simulated NPU: the runtime keeps its
connection to the npusim daemon (a unix stream socket) open the same way, and this project's
``npusim_plugin.so`` (native/criu-plugin/npusim_plugin.c) records and reconnects it. Both mark a
failed dump in CRIU's log and leave image files of their own; ``DeviceKind`` says which.

Huawei's CRIU NPU plugin is built in the tree of Huawei's CRIU fork, whose ``criu-plugin.h``
numbers the hooks differently from upstream CRIU (slot 10 is UPDATE_INETSK there, PAUSE_DEVICES
upstream). CRIU loads a plugin whose ``max_hooks`` is not above its own and then calls hooks by
slot, so a plugin paired with another CRIU calls the wrong functions. Every plugin carries its
``max_hooks`` in its ``CR_PLUGIN_DESC`` (``cr_plugin_desc_t``): npusnap reads it from the ELF file
(nothing is loaded) and compares it with the CRIU in use.

After a dump that went through the plugin, Huawei's own orchestrator (GRUS) trusts it only if
CRIU's log has no ``[npu-plugin fini-dump err]`` line and the plugin's ``davinci-dev-*.img``
files exist; ``scan_dump`` does the same.

Core module (no printing); used by preflight (`npusnap check`) and the dump pipeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from npusnap_cli import elf

DESC_SYMBOL = "CR_PLUGIN_DESC"
# cr_plugin_desc_t on LP64: const char *name; init; exit; unsigned version; unsigned max_hooks; ...
_VERSION_OFFSET = 24
_MAX_HOOKS_OFFSET = 28

# Where the header of the CRIU in use may be: setup's build cache, then system include dirs.
HEADER_CANDIDATES = (
    "/var/cache/npusnap/criu-{version}/criu/include/criu-plugin.h",
    "/usr/local/include/criu/criu-plugin.h",
    "/usr/include/criu/criu-plugin.h",
)
# CR_PLUGIN_HOOK__MAX of upstream releases, read from their criu-plugin.h.
KNOWN_MAX_HOOKS = {"4.2": 13}


@dataclass(frozen=True)
class DeviceKind:
    """A kind of NPU device handle and the CRIU plugin that dumps it."""

    key: str  # "ascend" or "simulated"
    label: str  # the plugin, in messages
    plugin_names: tuple[str, ...]  # file names in CRIU's plugin directory
    fini_dump_error: str  # the line it writes into CRIU's log when a dump failed
    image_glob: str  # the image files it writes per device handle
    install_fix: str


ASCEND = DeviceKind(
    key="ascend",
    label="the NPU plugin",
    plugin_names=("npu_plugin.so", "ascend_plugin.so"),
    fini_dump_error="[npu-plugin fini-dump err]",
    image_glob="davinci-dev-*.img",
    install_fix="put an NPU plugin built for the CRIU npusnap runs (Huawei's npu_plugin.so rebuilt against "
    "its criu-plugin.h) into npusnap's plugin directory (/usr/lib/npusnap/criu-plugins, or CRIU_LIBS_DIR); "
    "stock CRIU cannot dump /dev/davinci* file descriptors and mappings, and the copy that comes with "
    "the vendor's CRIU fork does not fit stock CRIU",
)
SIMULATED = DeviceKind(
    key="simulated",
    label="the simulated NPU's plugin",
    plugin_names=("npusim_plugin.so",),
    fini_dump_error="[npusim-plugin fini-dump err]",
    image_glob="npusim-dev-*.img",
    install_fix="run ./scripts/setup.sh: it builds npusim_plugin.so and installs it into npusnap's plugin "
    "directory, /usr/lib/npusnap/criu-plugins (or set CRIU_LIBS_DIR to a directory that holds it, such "
    "as the checkout's .build/criu-plugin)",
)
KINDS = (ASCEND, SIMULATED)

FINI_DUMP_ERROR = ASCEND.fini_dump_error
PLUGIN_IMAGE_GLOB = ASCEND.image_glob


@dataclass(frozen=True)
class PluginDesc:
    path: str
    name: Optional[str]
    version: int
    max_hooks: int

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "name": self.name, "version": self.version, "max_hooks": self.max_hooks}


def read_plugin_desc(path: str) -> Optional[PluginDesc]:
    """The plugin's CR_PLUGIN_DESC (read from the file, never loaded), or None without one.
    OSError when the file cannot be read, elf.ElfError when it is not a 64-bit ELF file."""
    with elf.open_elf(path) as lib:
        sym = lib.symbol(DESC_SYMBOL, (elf.SHT_SYMTAB, elf.SHT_DYNSYM))
        if sym is None:
            return None
        off = lib.file_offset(sym.value)
        if off is None:
            return None
        version, max_hooks = lib.u32(off + _VERSION_OFFSET), lib.u32(off + _MAX_HOOKS_OFFSET)
        name: Optional[str] = None
        target = lib.relative_target(sym.value)
        if target is not None:
            name = lib.c_string(target)
    return PluginDesc(path=str(path), name=name, version=version, max_hooks=max_hooks)


def max_hooks_from_header(text: str) -> Optional[int]:
    """CR_PLUGIN_HOOK__MAX as criu-plugin.h defines it: the number of hooks before it."""
    m = re.search(r"enum\s*\{(.*?)CR_PLUGIN_HOOK__MAX", text, re.S)
    if not m:
        return None
    values = re.findall(r"CR_PLUGIN_HOOK__\w+\s*=\s*(\d+)", m.group(1))
    names = re.findall(r"(CR_PLUGIN_HOOK__\w+)", m.group(1))
    if values:
        return max(int(v) for v in values) + 1
    return len(names) or None


def criu_max_hooks(criu_version: str) -> tuple[Optional[int], str]:
    """The hook count of the CRIU in use and where it was learned; (None, why) when unknown."""
    for template in HEADER_CANDIDATES:
        header = Path(template.format(version=criu_version))
        if "{version}" not in template and not _header_matches(header, criu_version):
            continue
        try:
            value = max_hooks_from_header(header.read_text(errors="replace"))
        except OSError:
            continue
        if value is not None:
            return value, str(header)
    short = ".".join(criu_version.split(".")[:2])
    if short in KNOWN_MAX_HOOKS:
        return KNOWN_MAX_HOOKS[short], f"upstream CRIU {short}.x criu-plugin.h"
    return None, f"no criu-plugin.h of CRIU {criu_version} found"


def _header_matches(header: Path, criu_version: str) -> bool:
    """A system header belongs to the CRIU in use only if its version.h says so (when present)."""
    version_h = header.parent / "version.h"
    try:
        text = version_h.read_text(errors="replace")
    except OSError:
        return header.is_file()
    m = re.search(r'CRIU_VERSION\s+"([^"]+)"', text)
    return bool(m and m.group(1) == criu_version)


@dataclass(frozen=True)
class AbiVerdict:
    ok: Optional[bool]  # None: cannot tell
    detail: str
    fix: str = ""
    desc: Optional[PluginDesc] = None


def check_abi(plugin: str, criu_version: str) -> AbiVerdict:
    try:
        desc = read_plugin_desc(plugin)
    except (OSError, ValueError) as exc:  # elf.ElfError is a ValueError
        return AbiVerdict(False, f"cannot read {plugin}: {exc}", "reinstall the plugin")
    if desc is None:
        return AbiVerdict(
            False,
            f"{plugin} has no {DESC_SYMBOL}: it is not a CRIU plugin",
            "install the NPU plugin built for this CRIU",
        )
    have, source = criu_max_hooks(criu_version)
    label = f"{desc.name or Path(plugin).name} (max_hooks {desc.max_hooks})"
    if have is None:
        return AbiVerdict(
            None, f"{label}: cannot tell whether it fits CRIU {criu_version}: {source}", desc=desc
        )
    if desc.max_hooks != have:
        return AbiVerdict(
            False,
            f"{label} was built for a CRIU with {desc.max_hooks} plugin hooks; CRIU {criu_version} "
            f"has {have} ({source}): CRIU would call its hooks by the wrong slots",
            "use the CRIU build the plugin came with (Huawei's CRIU fork), or rebuild the plugin "
            f"against CRIU {criu_version}'s criu-plugin.h",
            desc=desc,
        )
    return AbiVerdict(True, f"{label} matches CRIU {criu_version} ({have} hooks, {source})", desc=desc)


def scan_dump(
    log: Optional[Path], images: Path, kind: DeviceKind = ASCEND, expected_images: int = 1
) -> list[str]:
    """Problems with a dump that went through a device plugin, as GRUS checks them (empty: good):
    no error line of the plugin in CRIU's log, and at least ``expected_images`` of its image files
    (one per device handle; 0 checks the log only)."""
    problems: list[str] = []
    if log is not None:
        try:
            text = log.read_text(errors="replace")
        except OSError as exc:
            problems.append(f"cannot read CRIU's log {log}: {exc.strerror}")
        else:
            bad = [ln.strip() for ln in text.splitlines() if kind.fini_dump_error in ln]
            if bad:
                problems.append(f"CRIU's log has {kind.label}'s error line: {bad[0]}")
    found = len(list(images.glob(kind.image_glob)))
    if expected_images > 0 and found == 0:
        problems.append(f"{kind.label} wrote no {kind.image_glob} into {images}")
    elif found < expected_images:
        problems.append(
            f"{kind.label} wrote {found} {kind.image_glob} into {images}, "
            f"for {expected_images} device handles"
        )
    return problems
