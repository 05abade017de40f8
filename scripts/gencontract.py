#!/usr/bin/env python3
"""Write the C header and the Python modules of npusnap's shared contracts from one spec.

    native/contract/npusnap.toml  ->  native/include/npusnap/contract.h
                                  ->  npusnap_cli/contract.py
                                  ->  npusnap_cli/replies.py (the agent's replies as records)

All outputs are committed, so building the native code needs no Python; ``--check`` (run by
``make lint`` and scripts/test.sh) fails when one is not what the spec gives. The model is
CRIU's lib/pycriu/images/magic.py, generated from criu/include/magic.h: constants that two
languages share are written once and generated into both.

Struct layouts are computed here (natural alignment, or none for packed structs) and checked
against the spec's ``size``; the header checks every size and offset again with _Static_assert,
the Python module with struct.calcsize and ctypes when it is imported.

Runs with the project's virtualenv (tomllib: Python 3.11+).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "native" / "contract" / "npusnap.toml"
HEADER = ROOT / "native" / "include" / "npusnap" / "contract.h"
MODULE = ROOT / "npusnap_cli" / "contract.py"

# field type -> (C type, struct format char, ctypes name, size, alignment)
SCALARS = {
    "u8": ("uint8_t", "B", "c_uint8", 1, 1),
    "i32": ("int32_t", "i", "c_int32", 4, 4),
    "u32": ("uint32_t", "I", "c_uint32", 4, 4),
    "i64": ("int64_t", "q", "c_int64", 8, 8),
    "u64": ("uint64_t", "Q", "c_uint64", 8, 8),
    "f64": ("double", "d", "c_double", 8, 8),
}
CHAR_ARRAY = re.compile(r"^char\[(\d+)\]$")


class SpecError(Exception):
    pass


# -- layouts ---------------------------------------------------------------------------------------


def layout(key: str, st: dict[str, Any]) -> dict[str, Any]:
    """Offsets, size and the little-endian struct format (explicit padding) of one struct."""
    packed = bool(st.get("packed", False))
    off = 0
    max_align = 1
    fields = []
    fmt = "<"
    for row in st["fields"]:
        name, ftype = row[0], row[1]
        doc = row[2] if len(row) > 2 else ""
        m = CHAR_ARRAY.match(ftype)
        if m:
            n = int(m.group(1))
            ctype, char, ct, size, align = "char", f"{n}s", f"c_char * {n}", n, 1
        elif ftype in SCALARS:
            ctype, char, ct, size, align = SCALARS[ftype]
        else:
            raise SpecError(f"struct {key}: field {name} has unknown type {ftype!r}")
        if packed:
            align = 1
        pad = (-off) % align
        if pad:
            fmt += f"{pad}x"
        off += pad
        fields.append({"name": name, "type": ftype, "ctype": ctype, "array": int(m.group(1)) if m else 0,
                       "ctypes": ct, "offset": off, "doc": doc})  # fmt: skip
        fmt += char
        off += size
        max_align = max(max_align, align)
    tail = (-off) % max_align
    if tail:
        fmt += f"{tail}x"
    size = off + tail
    if size != st["size"]:
        raise SpecError(f"struct {key}: fields add up to {size} bytes, the spec says {st['size']}")
    return {**st, "key": key, "size": size, "fields": fields, "fmt": fmt, "packed": packed}


# -- C ---------------------------------------------------------------------------------------------


def c_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def c_pattern(p: str) -> str:
    """'{uid}' / '{pid}' placeholders as printf conversions."""
    return p.replace("{uid}", "%u").replace("{pid}", "%d")


def upper(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def pairs(spec: dict[str, Any]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(C name, Python expression) of every integer and every string constant of the contract, for
    the test that compares what the C compiler sees with what Python has."""
    ints: list[tuple[str, str]] = []
    strs: list[tuple[str, str]] = []
    for section in ("snapshot_state", "callback_stage"):
        s = spec[section]
        ints += [(f"{s['c_prefix']}{n}", f"{s['python']}.{n}") for n in s["values"]]
    ints += [("NPUSNAP_DRIVER_FLOW_MIN_MAJOR", "DRIVER_FLOW_MIN_VERSION[0]")]
    ints += [("NPUSNAP_DRIVER_FLOW_MIN_MINOR", "DRIVER_FLOW_MIN_VERSION[1]")]
    ints += [("NPUSNAP_DRIVER_FLOW_FLAGS", "DRIVER_FLOW_FLAGS")]
    ints += [(e["name"], e["name"]) for e in spec["acl_errors"]]
    hs, dm = spec["hook_stages"], spec["device_memory_modes"]
    strs += [(f"{hs['c_prefix']}{upper(n)}", f"HOOK_STAGES[{i}]") for i, n in enumerate(hs["names"])]
    strs += [(f"{dm['c_prefix']}{upper(n)}", f"DEVICE_MEMORY_MODES[{i}]") for i, n in enumerate(dm["names"])]
    strs += [("NPUSNAP_DEVMEM_MODE_DEFAULT", "DEFAULT_DEVICE_MEMORY_MODE")]
    strs += [
        ("NPUSNAP_DEVMEM_FILE_MAGIC", "DEVMEM_FILE_MAGIC.decode()"),
        ("NPUSNAP_DEVMEM_FILE_SUBDIR", "DEVMEM_FILE_SUBDIR"),
    ]
    strs += [
        ("NPUSNAP_AGENT_SOCKET_ENV_DIR", "AGENT_SOCKET_ENV_DIR"),
        ("NPUSNAP_AGENT_SOCKET_ROOT_DIR", "AGENT_SOCKET_ROOT_DIR"),
    ]
    strs += [("NPUSNAP_AGENT_SOCKET_XDG_SUBDIR", "AGENT_SOCKET_XDG_SUBDIR")]
    strs += [("NPUSNAP_AGENT_SOCKET_DIR_PREFIX", "AGENT_SOCKET_DIR_PREFIX")]
    strs += [("NPUSNAP_AGENT_LOG_ENV", "AGENT_LOG_ENV"), ("NPUSNAP_AGENT_STDERR_ENV", "AGENT_STDERR_ENV")]
    strs += [("NPUSNAP_AGENT_LIBRARY", "AGENT_LIBRARY")]
    strs += [("NPUSNAP_AGENT_SHOW_PRELOAD_ENV", "AGENT_SHOW_PRELOAD_ENV")]
    p = spec["protocol"]
    ints += [("NPUSNAP_PROTOCOL_VERSION", "PROTOCOL_VERSION")]
    ints += [(f"NPUSNAP_PROTOCOL_{k.upper()}", k.upper()) for k in ("max_line", "token_hex_chars")]
    ints += [
        (f"NPUSNAP_PROTOCOL_{k.upper()}", k.upper())
        for k in ("max_owner_command", "max_lease_s", "max_path", "hccl_root_bytes")
    ]
    strs += [(f"NPUSNAP_ERRTYPE_{upper(t)}", f"ERR_{upper(t)}") for t in p["error_types"]]
    strs += [(f"NPUSNAP_ERR_{n}", f"E_{n}") for n in p["errors"]]
    strs += [
        (f"NPUSNAP_PLUGIN_{k.upper()}", f"PLUGIN_{k.upper()}") for k in ("name", "state_file", "state_kind")
    ]
    strs += [("NPUSNAP_PLUGIN_OWNER_COMMAND", "PLUGIN_OWNER_COMMAND")]
    ints += [("NPUSNAP_PLUGIN_STATE_FORMAT", "PLUGIN_STATE_FORMAT")]
    ints += [(f"NPUSNAP_EXIT_{e['name']}", f"ExitCode.{e['name']}") for e in spec["exit_codes"]]
    sw = spec["sim_wire"]
    ints += [(f"NPUSIM_OP_{n}", f"SIM_OP_{n}") for n in sw["ops"]]
    for k in (
        "claim_exclusive",
        "config_keep_contents",
        "config_driver_snapshot",
        "alloc_poison",
        "poison_word",
    ):
        ints.append((f"NPUSIM_{k.upper()}", f"SIM_{k.upper()}"))
    ints += [(f"NPUSIM_CONFIG_FAULT_{n}", f"SIM_CONFIG_FAULT_{n}") for n in sw["config_faults"]]
    ints += [(f"NPUSIM_{k.upper()}", f"SIM_{k.upper()}") for k in ("addr_base", "addr_span", "align")]
    strs += [
        (f"NPUSIM_SOCKET_{k.upper()}", f"SIM_SOCKET_{k.upper()}")
        for k in ("env", "root_path", "xdg_subdir", "name")
    ]
    return ints, strs


def gen_c(spec: dict[str, Any], structs: list[dict[str, Any]]) -> str:
    out: list[str] = []
    w = out.append
    w("/* npusnap's shared contracts: GENERATED by scripts/gencontract.py from")
    w(" * native/contract/npusnap.toml -- do not edit; edit the spec and regenerate.")
    w(" * npusnap_cli/contract.py is generated from the same spec for the Python side. */")
    w("#ifndef NPUSNAP_CONTRACT_H")
    w("#define NPUSNAP_CONTRACT_H")
    w("")
    w("#include <stddef.h>")
    w("#include <stdint.h>")
    w("#include <string.h>")
    w("")
    w("#ifdef __cplusplus")
    w("#define NPUSNAP_STATIC_ASSERT static_assert")
    w("#else")
    w("#define NPUSNAP_STATIC_ASSERT _Static_assert")
    w("#endif")
    w("")

    def enum(section: str, c_type: str) -> None:
        s = spec[section]
        pre = s["c_prefix"]
        w(f"/* {s['doc']} */")
        w(f"enum {c_type} {{")
        for name, value in s["values"].items():
            w(f"    {pre}{name} = {value},")
        w("};")
        w(f"#define {pre}COUNT {len(s['values'])}")
        w(f"static inline const char *{c_type}_name(int v) {{")
        w("    switch (v) {")
        for name, value in s["values"].items():
            w(f"    case {value}: return {c_str(name)};")
        w("    default: return NULL;")
        w("    }")
        w("}")
        w("")

    w("/* ---- the CANN runtime's snapshot API ---- */")
    enum("snapshot_state", "npusnap_snapshot_state")
    enum("callback_stage", "npusnap_callback_stage")
    df = spec["driver_flow"]
    w("/* The first CANN version npusnap tries the driver-backed flow on, and the flags it passes. */")
    w(f"#define NPUSNAP_DRIVER_FLOW_MIN_MAJOR {df['min_major']}")
    w(f"#define NPUSNAP_DRIVER_FLOW_MIN_MINOR {df['min_minor']}")
    w(f"#define NPUSNAP_DRIVER_FLOW_FLAGS {df['flags']}")
    w("")
    w("/* ACL return codes npusnap explains. X(code, name, meaning, hint); in a hint, {pid} stands")
    w(" * for the calling process's pid. CANN's own names for them (ACL_ERROR_...) are at the end. */")
    w("#define NPUSNAP_ACL_ERRORS(X) \\")
    rows = spec["acl_errors"]
    for i, e in enumerate(rows):
        end = " \\" if i < len(rows) - 1 else ""
        w(f"    X({e['code']}, {c_str(e['name'])}, {c_str(e['meaning'])}, {c_str(e['hint'])}){end}")
    unk = spec["acl_unknown"]
    w(f"#define NPUSNAP_ACL_ERROR_UNKNOWN_NAME {c_str(unk['name'])}")
    w("static inline const char *npusnap_acl_error_name(int code) {")
    w("    switch (code) {")
    for e in rows:
        w(f"    case {e['code']}: return {c_str(e['name'])};")
    w("    default: return NPUSNAP_ACL_ERROR_UNKNOWN_NAME;")
    w("    }")
    w("}")
    w("")

    w("/* ---- the agent ---- */")
    hs = spec["hook_stages"]
    w(f"/* {hs['doc']}. */")
    for n in hs["names"]:
        w(f"#define {hs['c_prefix']}{upper(n)} {c_str(n)}")
    w(f"#define NPUSNAP_HOOK_STAGE_COUNT {len(hs['names'])}")
    w(f"#define NPUSNAP_HOOK_STAGES_INIT {', '.join(c_str(n) for n in hs['names'])}")
    w("")
    dm = spec["device_memory_modes"]
    w(f"/* {dm['doc']}. */")
    for n in dm["names"]:
        w(f"#define {dm['c_prefix']}{upper(n)} {c_str(n)}")
    w(f"#define NPUSNAP_DEVMEM_MODE_DEFAULT {c_str(dm['default'])}")
    w(f"#define NPUSNAP_DEVMEM_MODES_TEXT {c_str(', '.join(repr(n) for n in dm['names']))}")
    w("static inline int npusnap_devmem_mode_valid(const char *mode) {")
    w("    return " + " || ".join(f"strcmp(mode, {c_str(n)}) == 0" for n in dm["names"]) + ";")
    w("}")
    w("")
    df = spec["devmem_file"]
    w("/* The image's device-memory file: a header, one record per copied allocation, their bytes. */")
    w(f"#define NPUSNAP_DEVMEM_FILE_MAGIC {c_str(df['magic'])}")
    w(f"#define NPUSNAP_DEVMEM_FILE_SUBDIR {c_str(df['subdir'])}")
    w(f"#define NPUSNAP_DEVMEM_FILE_PATTERN {c_str(c_pattern(df['name_pattern']))}")
    w(f"#define NPUSNAP_DEVMEM_PIECE_BYTES {int(df['piece_bytes'])}ull")
    w("")
    ar = spec["agent_record"]
    w("/* The agent's device record, read from outside through /proc/PID/mem. */")
    w(f"#define NPUSNAP_AGENT_RECORD_SYMBOL {ar['symbol']}")
    w(f"#define NPUSNAP_AGENT_RECORD_MAGIC {c_str(ar['magic'])}")
    w("")
    dp = spec["device_paths"]
    w("/* What /proc shows of NPU device state: path prefixes of device mappings and device files. */")
    w("#define NPUSNAP_DEVICE_MAPPING_PREFIXES " + ", ".join(c_str(x) for x in dp["mapping_prefixes"]))
    w("#define NPUSNAP_DEVICE_FILE_PREFIXES " + ", ".join(c_str(x) for x in dp["file_prefixes"]))
    w("")
    sk = spec["agent_socket"]
    w("/* Agent control sockets: printf patterns (%u: uid, %d: pid). */")
    w(f"#define NPUSNAP_AGENT_SOCKET_ENV_DIR {c_str(sk['env_dir'])}")
    w(f"#define NPUSNAP_AGENT_SOCKET_ROOT_DIR {c_str(sk['root_dir'])}")
    w(f"#define NPUSNAP_AGENT_SOCKET_XDG_SUBDIR {c_str(sk['xdg_subdir'])}")
    w(f"#define NPUSNAP_AGENT_SOCKET_TMP_DIR {c_str(c_pattern(sk['tmp_dir']))}")
    w(f"#define NPUSNAP_AGENT_SOCKET_DIR_PREFIX {c_str(sk['dir_prefix'])}")
    w(f"#define NPUSNAP_AGENT_SOCKET_NAME {c_str(c_pattern(sk['name']))}")
    w(f"#define NPUSNAP_AGENT_LOG_NAME {c_str(c_pattern(sk['log_name']))}")
    w(f"#define NPUSNAP_AGENT_LOG_ENV {c_str(sk['log_env'])}")
    w(f"#define NPUSNAP_AGENT_STDERR_ENV {c_str(sk['stderr_env'])}")
    w(f"#define NPUSNAP_AGENT_LIBRARY {c_str(sk['library'])}")
    w(f"#define NPUSNAP_AGENT_SHOW_PRELOAD_ENV {c_str(sk['show_preload_env'])}")
    w("")

    p = spec["protocol"]
    w("/* ---- the agent's line protocol ---- */")
    w(f"#define NPUSNAP_PROTOCOL_VERSION {p['version']}")
    w(f"#define NPUSNAP_PROTOCOL_MAX_LINE ({p['max_line']})")
    w(f"#define NPUSNAP_PROTOCOL_TOKEN_HEX_CHARS {p['token_hex_chars']}")
    w(f"#define NPUSNAP_PROTOCOL_MAX_OWNER_COMMAND {p['max_owner_command']}")
    w(f"#define NPUSNAP_PROTOCOL_MAX_LEASE_S {p['max_lease_s']}")
    w(f"#define NPUSNAP_PROTOCOL_MAX_PATH {p['max_path']}")
    w(f"#define NPUSNAP_PROTOCOL_HCCL_ROOT_BYTES {p['hccl_root_bytes']}")
    w("/* error.type */")
    for t, doc in p["error_types"].items():
        w(f"#define NPUSNAP_ERRTYPE_{upper(t)} {c_str(t)} /* {doc} */")
    w("/* error.name of the agent's own errors (ACL errors carry the ACL's name). */")
    for n, (t, doc) in p["errors"].items():
        w(f"#define NPUSNAP_ERR_{n} {c_str(n)} /* {t}: {doc} */")
    w("/* Argument kinds: what JSON values an argument takes. */")
    w("enum npusnap_arg_kind {")
    for k, doc in p["arg_kinds"].items():
        w(f"    NPUSNAP_ARG_{upper(k)}, /* {doc} */")
    w("};")
    w("static inline const char *npusnap_arg_kind_name(int kind) {")
    w("    switch (kind) {")
    for k in p["arg_kinds"]:
        w(f"    case NPUSNAP_ARG_{upper(k)}: return {c_str(k)};")
    w("    default: return NULL;")
    w("    }")
    w("}")
    ops = p["ops"]
    max_args = max(len(a) for a in ops.values())
    w("/* The operations (sorted) and their arguments, as initialisers of")
    w(" * struct { const char *op;")
    w(" *          struct { const char *name; int kind; } args[NPUSNAP_PROTOCOL_MAX_ARGS]; }. */")
    w(f"#define NPUSNAP_PROTOCOL_OP_COUNT {len(ops)}")
    w(f"#define NPUSNAP_PROTOCOL_MAX_ARGS {max_args}")
    w(f"#define NPUSNAP_PROTOCOL_OP_NAMES {c_str(', '.join(sorted(ops)))}")
    w("#define NPUSNAP_PROTOCOL_OPS_INIT \\")
    names = sorted(ops)
    for i, op in enumerate(names):
        args = ops[op]
        inner = ", ".join(f"{{{c_str(a)}, NPUSNAP_ARG_{upper(k)}}}" for a, k in args.items()) or "{0, 0}"
        end = ", \\" if i < len(names) - 1 else ""
        w(f"    {{{c_str(op)}, {{{inner}}}}}{end}")
    w("")

    cp = spec["criu_plugin"]
    w("/* ---- the CRIU plugin ---- */")
    w(f"#define NPUSNAP_PLUGIN_NAME {c_str(cp['name'])}")
    w(f"#define NPUSNAP_PLUGIN_STATE_FILE {c_str(cp['state_file'])}")
    w(f"#define NPUSNAP_PLUGIN_STATE_KIND {c_str(cp['state_kind'])}")
    w(f"#define NPUSNAP_PLUGIN_STATE_FORMAT {cp['state_format']}")
    w(f"#define NPUSNAP_PLUGIN_OWNER_COMMAND {c_str(cp['owner_command'])}")
    w("")

    w("/* ---- npusnap's exit codes (docs/exit-codes.md) ---- */")
    w("enum npusnap_exit_code {")
    for e in spec["exit_codes"]:
        w(f"    NPUSNAP_EXIT_{e['name']} = {e['code']},")
    w("};")
    w("static inline const char *npusnap_exit_summary(int code) {")
    w("    switch (code) {")
    for e in spec["exit_codes"]:
        w(f"    case {e['code']}: return {c_str(e['summary'])};")
    w("    default: return NULL;")
    w("    }")
    w("}")
    w("")

    sw = spec["sim_wire"]
    w("/* ---- the simulated NPU's wire format (runtime <-> daemon), little-endian ---- */")
    w("enum npusim_op {")
    for n, v in sw["ops"].items():
        w(f"    NPUSIM_OP_{n} = {v},")
    w("};")
    w(f"#define NPUSIM_CLAIM_EXCLUSIVE {sw['claim_exclusive']}u")
    w(f"#define NPUSIM_CONFIG_KEEP_CONTENTS {sw['config_keep_contents']}u")
    w(f"#define NPUSIM_CONFIG_DRIVER_SNAPSHOT {sw['config_driver_snapshot']}u")
    for n, v in sw["config_faults"].items():
        w(f"#define NPUSIM_CONFIG_FAULT_{n} {v:#x}u")
    w(f"#define NPUSIM_ALLOC_POISON {sw['alloc_poison']}u")
    w(f"#define NPUSIM_POISON_WORD {sw['poison_word']:#X}u".replace("0X", "0x"))
    w(f"#define NPUSIM_ADDR_BASE ((uint64_t){sw['addr_base']:#x})")
    w(f"#define NPUSIM_ADDR_SPAN ((uint64_t){sw['addr_span']:#x})")
    w(f"#define NPUSIM_ALIGN {sw['align']}")
    ss = spec["sim_socket"]
    w(f"#define NPUSIM_SOCKET_ENV {c_str(ss['env'])}")
    w(f"#define NPUSIM_SOCKET_ROOT_PATH {c_str(ss['root_path'])}")
    w(f"#define NPUSIM_SOCKET_XDG_SUBDIR {c_str(ss['xdg_subdir'])}")
    w(f"#define NPUSIM_SOCKET_TMP_DIR {c_str(c_pattern(ss['tmp_dir']))}")
    w(f"#define NPUSIM_SOCKET_NAME {c_str(ss['name'])}")
    w("")

    w("/* ---- struct layouts (sizes and offsets checked below) ---- */")
    for st in structs:
        w(f"/* {st['doc']} ({st['size']} bytes{', packed' if st['packed'] else ''}) */")
        if st["packed"]:
            w("#pragma pack(push, 1)")
        head = "typedef struct" if st.get("c_typedef") else "struct"
        w(f"{head} {st['c_name']} {{")
        for f in st["fields"]:
            dim = f"[{f['array']}]" if f["array"] else ""
            doc = f" /* {f['doc']} */" if f["doc"] else ""
            w(f"    {f['ctype']} {f['name']}{dim};{doc}")
        w(f"}}{' ' + st['c_name'] if st.get('c_typedef') else ''};")
        if st["packed"]:
            w("#pragma pack(pop)")
        w(f'NPUSNAP_STATIC_ASSERT(sizeof(struct {st["c_name"]}) == {st["size"]}, "{st["c_name"]} size");')
        for f in st["fields"]:
            w(f"NPUSNAP_STATIC_ASSERT(offsetof(struct {st['c_name']}, {f['name']}) == {f['offset']}, "
              f"\"{st['c_name']}.{f['name']} offset\");")  # fmt: skip
        w("")
    ints, strs = pairs(spec)
    w("/* ---- for native/contract/layout.c, which prints what the compiler sees for a unit test ---- */")
    w("#define NPUSNAP_CONTRACT_STRUCTS(S, F) \\")
    rows = []
    for st in structs:
        rows.append(f"S({st['c_name']})")
        rows += [f"F({st['c_name']}, {f['name']})" for f in st["fields"]]
    w(" \\\n".join(f"    {r}" for r in rows))
    w("#define NPUSNAP_CONTRACT_INTS(X) \\")
    w(" \\\n".join(f"    X({c})" for c, _ in ints))
    w("#define NPUSNAP_CONTRACT_STRINGS(X) \\")
    w(" \\\n".join(f"    X({c})" for c, _ in strs))
    w("")
    w("#endif")
    w("")
    w("/* CANN's own names for the ACL codes above, for npusnap's C code, which includes no CANN header:")
    w(" * define NPUSNAP_CONTRACT_CANN_NAMES before including this file. Code that includes CANN's acl")
    w(" * headers must not (they declare the same names as constants). */")
    w("#if defined(NPUSNAP_CONTRACT_CANN_NAMES) && !defined(NPUSNAP_CONTRACT_CANN_NAMES_DONE)")
    w("#define NPUSNAP_CONTRACT_CANN_NAMES_DONE")
    for e in spec["acl_errors"]:
        w(f"#define {e['name']} {e['code']}")
    w("#endif")
    return "\n".join(out) + "\n"


# -- Python ----------------------------------------------------------------------------------------


def py_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def camel(key: str) -> str:
    return "".join(part.capitalize() for part in key.split("_"))


def gen_py(spec: dict[str, Any], structs: list[dict[str, Any]]) -> str:
    out: list[str] = []
    w = out.append
    w("# ruff: noqa: E501")
    w('"""npusnap\'s shared contracts: GENERATED by scripts/gencontract.py from')
    w("native/contract/npusnap.toml.")
    w("")
    w("Do not edit: edit the spec and regenerate. native/include/npusnap/contract.h is generated from the")
    w("same spec for the C side, npusnap_cli/replies.py (the agent's replies as records) for Python.")
    w("Standard library only, Python 3.9+ (the agent imports it inside targets).")
    w('"""')
    w("")
    w("from __future__ import annotations")
    w("")
    w("import ctypes")
    w("import struct")
    w("from enum import IntEnum")
    w("from typing import Dict, Tuple")
    w("")

    def enum(section: str) -> None:
        s = spec[section]
        w("")
        w(f"class {s['python']}(IntEnum):")
        w(f'    """{s["doc"]}."""')
        w("")
        for name, value in s["values"].items():
            w(f"    {name} = {value}")
        w("")

    w("# -- the CANN runtime's snapshot API " + "-" * 62)
    enum("snapshot_state")
    enum("callback_stage")
    w("")
    df = spec["driver_flow"]
    w("# The first CANN version npusnap tries the driver-backed flow on, and the flags it passes.")
    w(f"DRIVER_FLOW_MIN_VERSION = ({df['min_major']}, {df['min_minor']})")
    w(f"DRIVER_FLOW_FLAGS = {df['flags']}")
    w("")
    w("# ACL return codes npusnap explains.")
    for e in spec["acl_errors"]:
        w(f"{e['name']} = {e['code']}")
    w("")
    w('# code -> (name, meaning, hint); "{pid}" in a hint stands for the calling process\'s pid.')
    w("ACL_ERRORS: Dict[int, Tuple[str, str, str]] = {")
    for e in spec["acl_errors"]:
        w(f"    {e['name']}: ({py_str(e['name'])}, {py_str(e['meaning'])}, {py_str(e['hint'])}),")
    w("}")
    unk = spec["acl_unknown"]
    w(f"ACL_ERROR_UNKNOWN = ({py_str(unk['name'])}, {py_str(unk['meaning'])}, {py_str(unk['hint'])})")
    w("")

    w("# -- the agent " + "-" * 84)
    hs = spec["hook_stages"]
    w(f"# {hs['doc']}.")
    w(f"HOOK_STAGES = ({', '.join(py_str(n) for n in hs['names'])})")
    dm = spec["device_memory_modes"]
    w(f"# {dm['doc']}.")
    w(f"DEVICE_MEMORY_MODES = ({', '.join(py_str(n) for n in dm['names'])})")
    w(f"DEFAULT_DEVICE_MEMORY_MODE = {py_str(dm['default'])}")
    d = spec["devmem_file"]
    w("# The image's device-memory file: a header, one record per copied allocation, their bytes.")
    w(f"DEVMEM_FILE_MAGIC = b{py_str(d['magic'])}")
    w(f"DEVMEM_FILE_SUBDIR = {py_str(d['subdir'])}")
    w(f"DEVMEM_FILE_PATTERN = {py_str(d['name_pattern'])}")
    w(f"DEVMEM_PIECE_BYTES = {int(d['piece_bytes'])}")
    ar = spec["agent_record"]
    w("# The agent's device record, read from outside through /proc/PID/mem.")
    w(f"AGENT_RECORD_SYMBOL = {py_str(ar['symbol'])}")
    w(f"AGENT_RECORD_MAGIC = b{py_str(ar['magic'])}")
    dp = spec["device_paths"]
    w("# What /proc shows of NPU device state: path prefixes of device mappings and device files.")
    w(f"DEVICE_MAPPING_PREFIXES = ({', '.join(py_str(x) for x in dp['mapping_prefixes'])})")
    w(f"DEVICE_FILE_PREFIXES = ({', '.join(py_str(x) for x in dp['file_prefixes'])})")
    sk = spec["agent_socket"]
    w("# Agent control sockets ({uid}, {pid}: str.format fields).")
    w(f"AGENT_SOCKET_ENV_DIR = {py_str(sk['env_dir'])}")
    w(f"AGENT_SOCKET_ROOT_DIR = {py_str(sk['root_dir'])}")
    w(f"AGENT_SOCKET_XDG_SUBDIR = {py_str(sk['xdg_subdir'])}")
    w(f"AGENT_SOCKET_TMP_DIR = {py_str(sk['tmp_dir'])}")
    w(f"AGENT_SOCKET_DIR_PREFIX = {py_str(sk['dir_prefix'])}")
    w(f"AGENT_SOCKET_NAME = {py_str(sk['name'])}")
    w(f"AGENT_LOG_NAME = {py_str(sk['log_name'])}")
    w(f"AGENT_LOG_ENV = {py_str(sk['log_env'])}")
    w(f"AGENT_STDERR_ENV = {py_str(sk['stderr_env'])}")
    w(f"AGENT_LIBRARY = {py_str(sk['library'])}")
    w(f"AGENT_SHOW_PRELOAD_ENV = {py_str(sk['show_preload_env'])}")
    w("")

    p = spec["protocol"]
    w("# -- the agent's line protocol " + "-" * 68)
    w(f"PROTOCOL_VERSION = {p['version']}")
    w(f"MAX_LINE = {p['max_line']}")
    w(f"TOKEN_HEX_CHARS = {p['token_hex_chars']}")
    w(f"MAX_OWNER_COMMAND = {p['max_owner_command']}")
    w(f"MAX_LEASE_S = {p['max_lease_s']}")
    w(f"MAX_PATH = {p['max_path']}")
    w(f"HCCL_ROOT_BYTES = {p['hccl_root_bytes']}")
    w("# error.type")
    for t, doc in p["error_types"].items():
        w(f"ERR_{upper(t)} = {py_str(t)}  # {doc}")
    w("ERROR_TYPES: Dict[str, str] = {")
    for t, doc in p["error_types"].items():
        w(f"    ERR_{upper(t)}: {py_str(doc)},")
    w("}")
    w("# error.name of the agent's own errors (ACL errors carry the ACL's name).")
    for n, (t, doc) in p["errors"].items():
        w(f"E_{n} = {py_str(n)}  # {t}: {doc}")
    w("# name -> (type, meaning)")
    w("PROTOCOL_ERRORS: Dict[str, Tuple[str, str]] = {")
    for n, (t, doc) in p["errors"].items():
        w(f"    E_{n}: ({py_str(t)}, {py_str(doc)}),")
    w("}")
    w("# Argument kinds: what JSON values an argument takes (each codec implements the check).")
    w("ARG_KINDS: Dict[str, str] = {")
    for k, doc in p["arg_kinds"].items():
        w(f"    {py_str(k)}: {py_str(doc)},")
    w("}")
    w("# op -> {argument: kind}")
    w("PROTOCOL_OPS: Dict[str, Dict[str, str]] = {")
    for op in sorted(p["ops"]):
        args = ", ".join(f"{py_str(a)}: {py_str(k)}" for a, k in p["ops"][op].items())
        w(f"    {py_str(op)}: {{{args}}},")
    w("}")
    w("")
    w("")
    w(PY_PROTOCOL_ERROR)
    w("")
    w("")

    cp = spec["criu_plugin"]
    w("# -- the CRIU plugin " + "-" * 78)
    w(f"PLUGIN_NAME = {py_str(cp['name'])}")
    w(f"PLUGIN_STATE_FILE = {py_str(cp['state_file'])}")
    w(f"PLUGIN_STATE_KIND = {py_str(cp['state_kind'])}")
    w(f"PLUGIN_STATE_FORMAT = {cp['state_format']}")
    w(f"PLUGIN_OWNER_COMMAND = {py_str(cp['owner_command'])}")
    w("")

    w("# -- npusnap's exit codes (docs/exit-codes.md; stable: never renumber, only add) " + "-" * 18)
    w("")
    w("")
    w("class ExitCode(IntEnum):")
    w('    """Process exit codes. Stable: documented in docs/exit-codes.md and frozen by a test."""')
    w("")
    for e in spec["exit_codes"]:
        w(f"    {e['name']} = {e['code']}  # {e['summary']}")
    w("")
    w("")
    w("EXIT_SUMMARIES: Dict[int, str] = {")
    for e in spec["exit_codes"]:
        w(f"    ExitCode.{e['name']}: {py_str(e['summary'])},")
    w("}")
    w("")

    sw = spec["sim_wire"]
    w("# -- the simulated NPU's wire format (runtime <-> daemon), little-endian " + "-" * 26)
    for n, v in sw["ops"].items():
        w(f"SIM_OP_{n} = {v}")
    w(f"SIM_CLAIM_EXCLUSIVE = {sw['claim_exclusive']}")
    w(f"SIM_CONFIG_KEEP_CONTENTS = {sw['config_keep_contents']}")
    w(f"SIM_CONFIG_DRIVER_SNAPSHOT = {sw['config_driver_snapshot']}")
    for n, v in sw["config_faults"].items():
        w(f"SIM_CONFIG_FAULT_{n} = {v:#x}")
    w(f"SIM_ALLOC_POISON = {sw['alloc_poison']}")
    w(f"SIM_POISON_WORD = {sw['poison_word']:#X}".replace("0X", "0x"))
    w(f"SIM_ADDR_BASE = {sw['addr_base']:#x}")
    w(f"SIM_ADDR_SPAN = {sw['addr_span']:#x}")
    w(f"SIM_ALIGN = {sw['align']}")
    ss = spec["sim_socket"]
    w(f"SIM_SOCKET_ENV = {py_str(ss['env'])}")
    w(f"SIM_SOCKET_ROOT_PATH = {py_str(ss['root_path'])}")
    w(f"SIM_SOCKET_XDG_SUBDIR = {py_str(ss['xdg_subdir'])}")
    w(f"SIM_SOCKET_TMP_DIR = {py_str(ss['tmp_dir'])}")
    w(f"SIM_SOCKET_NAME = {py_str(ss['name'])}")
    w("")

    w("# -- struct layouts " + "-" * 79)
    w("# For each: NAME (a little-endian struct.Struct with explicit padding), NAME_SIZE,")
    w("# NAME_OFFSETS {field: offset}, and a ctypes Structure of the same layout.")
    layouts = []
    for st in structs:
        key = upper(st["key"])
        w(f"# {st['doc']} (C: struct {st['c_name']})")
        w(f"{key} = struct.Struct({py_str(st['fmt'])})")
        w(f"{key}_SIZE = {st['size']}")
        offs = ", ".join(f"{py_str(f['name'])}: {f['offset']}" for f in st["fields"])
        w(f"{key}_OFFSETS: Dict[str, int] = {{{offs}}}")
        w("")
        w("")
        cls = camel(st["key"])
        w(f"class {cls}(ctypes.Structure):")
        w(f'    """{st["doc"]} (C: struct {st["c_name"]})."""')
        w("")
        if st["packed"]:
            w("    _pack_ = 1")
        w("    _fields_ = [")
        for f in st["fields"]:
            ct = f"ctypes.c_char * {f['array']}" if f["array"] else f"ctypes.{f['ctypes']}"
            w(f"        ({py_str(f['name'])}, {ct}),")
        w("    ]")
        w("")
        w("")
        layouts.append((key, cls))
    w("# name -> (struct.Struct, size, offsets, ctypes class): what tests compare with the C compiler's.")
    w("LAYOUTS: Dict[str, Tuple[struct.Struct, int, Dict[str, int], type]] = {")
    for st, (key, cls) in zip(structs, layouts):
        w(f"    {py_str(st['c_name'])}: ({key}, {key}_SIZE, {key}_OFFSETS, {cls}),")
    w("}")
    ints, strs = pairs(spec)
    w("# C name -> value, of every integer and string constant (compared with the compiler's by a test).")
    w("C_INTS: Dict[str, int] = {")
    for c, py in ints:
        w(f"    {py_str(c)}: {py},")
    w("}")
    w("C_STRINGS: Dict[str, str] = {")
    for c, py in strs:
        w(f"    {py_str(c)}: {py},")
    w("}")
    w("")
    w("")
    w("def _check_layouts() -> None:")
    w('    """The generator\'s sizes against struct.calcsize and ctypes on this interpreter."""')
    w("    for c_name, (packed, size, offsets, cls) in LAYOUTS.items():")
    w("        got = {name: getattr(cls, name).offset for name in offsets}")
    w("        if struct.calcsize(packed.format) != size or ctypes.sizeof(cls) != size or got != offsets:")
    w('            raise ImportError(f"npusnap_cli.contract: {c_name} is not laid out as its contract says")')
    w("")
    w("")
    w("_check_layouts()")
    return "\n".join(out) + "\n"


# -- the agent's replies ---------------------------------------------------------------------------

SCALAR_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str"}
TUPLE_TYPE = re.compile(r"^\((.*)\)$")


def replies_module() -> Path:
    """npusnap_cli/replies.py: beside MODULE (a test points MODULE elsewhere)."""
    return MODULE.with_name("replies.py")


# contract.py's error of the protocol: its codec's (device/protocol.py) and the replies' decoders'.
PY_PROTOCOL_ERROR = '''class ProtocolError(Exception):
    """A line that does not follow the protocol, or a reply not of its op's shape (raised on either
    side); ``name`` is one of PROTOCOL_ERRORS."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message'''


# The generated module's head: its imports, its decoders and the one base of its records, which
# does from each class's field table what @dataclass would write (standard library only).
PY_REPLIES_HEAD = '''# ruff: noqa: E501
"""The agent's replies as records: GENERATED by scripts/gencontract.py from
native/contract/npusnap.toml ([protocol.objects.*], [protocol.replies.*], [protocol.error_object]).

Do not edit: edit the spec and regenerate. Standard library only, Python 3.9+, like contract.py
(the agent may import it inside targets). Each record is a frozen dataclass to the type checker; at
run time one base, _Record, gives them what @dataclass would write (by exec, costing milliseconds a
class at import), from each class's field table: (member, decoder, flags), in the agent's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ClassVar, Dict, List, Optional, Tuple, Type, TypeVar, cast

from npusnap_cli.contract import E_BAD_MESSAGE, ProtocolError

_T = TypeVar("_T")
_R = TypeVar("_R", bound="_Record")
_Decode = Callable[[object, str], object]

if TYPE_CHECKING:
    from dataclasses import dataclass

    from npusnap_cli.jsontypes import JSONValue
else:

    def dataclass(*, frozen: bool) -> Callable[[_T], _T]:
        """The records are frozen dataclasses to the type checker; at run time _Record is."""
        return lambda cls: cls


_NULL = 1  # a field's flags: the member may be null
_OPT = 2  # the member may be left out (None then)
_OPT_NULL = 3  # both: <name>_sent tells a null member from a left-out one
_JSON_NAMES = {
    bool: "a boolean", int: "an integer", float: "a number",
    str: "a string", list: "a list", dict: "an object",
}


def _bad(where: str, expected: str, value: object) -> ProtocolError:
    got = "null" if value is None else _JSON_NAMES.get(type(value), type(value).__name__)
    return ProtocolError(E_BAD_MESSAGE, f"{where}: expected {expected}, got {got}")


def _object(value: object, where: str) -> Dict[str, object]:
    if not isinstance(value, dict):
        raise _bad(where, "an object", value)
    return value


def _list(value: object, where: str) -> List[object]:
    if not isinstance(value, list):
        raise _bad(where, "a list", value)
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(where, "a boolean", value)
    return value


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(where, "an integer", value)
    return value


def _float(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(where, "a number", value)
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, "a string", value)
    return value


def _list_of(decode: Callable[[object, str], _T]) -> Callable[[object, str], Tuple[_T, ...]]:
    """The decoder of a JSON list of ``decode``'s values, as a tuple."""

    def list_of(value: object, where: str) -> Tuple[_T, ...]:
        return tuple(decode(x, f"{where}[{i}]") for i, x in enumerate(_list(value, where)))

    return list_of


def _fixed(*decode: _Decode) -> Callable[[object, str], Tuple[object, ...]]:
    """The decoder of a JSON list of len(decode) values, one decoder each, as a tuple."""

    def fixed(value: object, where: str) -> Tuple[object, ...]:
        v = _list(value, where)
        if len(v) != len(decode):
            raise _bad(where, f"a list of {len(decode)}", value)
        return tuple(d(x, f"{where}[{i}]") for i, (d, x) in enumerate(zip(decode, v)))

    return fixed


class _Record:
    """A reply record: frozen, compared and hashed by value, decoded and encoded by its field table."""

    __slots__ = ()
    _where: ClassVar[str]  # how from_json's errors name the record by default (the class's where=)
    _fields: ClassVar[Tuple[Tuple[str, _Decode, int], ...]]  # (member, decoder, flags), the agent's order
    _names: ClassVar[Tuple[str, ...]]  # __init__'s: the members always there, then the others
    _defaults: ClassVar[Dict[str, object]]  # of the others: None (<name>_sent: False)

    def __init_subclass__(cls, where: str) -> None:
        cls._where = where
        later: Dict[str, object] = {}
        for name, _, flags in cls._fields:
            if flags & _OPT:
                later[name] = None
                if flags & _NULL:
                    later[f"{name}_sent"] = False
        cls._names = (*(n for n, _, f in cls._fields if not f & _OPT), *later)
        cls._defaults = later

    def __init__(self, *args: object, **kwargs: object) -> None:
        cls, names = type(self), self._names
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes {len(names)} positional arguments, not {len(args)}")
        for name, value in zip(names, args):
            object.__setattr__(self, name, value)
        for name in names[len(args) :]:
            if name not in kwargs and name not in self._defaults:
                raise TypeError(f"{cls.__name__}() missing required argument: {name!r}")
            object.__setattr__(self, name, kwargs.pop(name) if name in kwargs else self._defaults[name])
        if kwargs:
            name = next(iter(kwargs))
            why = "multiple values for" if name in names else "an unexpected keyword"
            raise TypeError(f"{cls.__name__}() got {why} argument {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}")

    def _values(self) -> Tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._names)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, self.__class__):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    @classmethod
    def from_json(cls: Type[_R], value: object, where: Optional[str] = None) -> _R:
        """Decode and check the JSON value; ProtocolError names the member that does not fit
        (``where``: the record's name in the message, by default its class's)."""
        where = cls._where if where is None else where
        obj = _object(value, where)
        record = object.__new__(cls)
        for name, decode, flags in cls._fields:
            if name in obj:
                member = obj[name]
                out = None if member is None and flags & _NULL else decode(member, f"{where}.{name}")
            elif flags & _OPT:
                out = None
            else:
                raise ProtocolError(E_BAD_MESSAGE, f"{where}: no member {name!r}")
            object.__setattr__(record, name, out)
            if flags == _OPT_NULL:
                object.__setattr__(record, f"{name}_sent", name in obj)
        return record

    def to_json(self) -> Dict[str, JSONValue]:
        """The JSON object the agent sent, its members in its order."""
        out: Dict[str, JSONValue] = {}
        for name, _, flags in self._fields:
            value = getattr(self, name)
            if flags & _OPT and not (getattr(self, f"{name}_sent") if flags & _NULL else value is not None):
                continue
            out[name] = _json(value)
        return out


def _json(value: object) -> JSONValue:
    """A field's value as JSON: a record's object, a tuple's list, a scalar as it is."""
    if isinstance(value, _Record):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [_json(x) for x in value]
    return cast("JSONValue", value)'''


def parse_type(text: str, objects: dict[str, Any], where: str) -> dict[str, Any]:
    """A member's type: {"optional", "nullable", "base"}; base is ("scalar", name), ("object",
    name), ("list", base) or ("tuple", [scalar names])."""
    t = text.strip()
    optional = t.startswith("optional ")
    if optional:
        t = t[len("optional ") :].strip()
    nullable = t.endswith("?")
    if nullable:
        t = t[:-1].strip()
    return {"optional": optional, "nullable": nullable, "base": parse_base(t, objects, where)}


def parse_base(t: str, objects: dict[str, Any], where: str) -> tuple[Any, ...]:
    if t in SCALAR_TYPES:
        return ("scalar", t)
    if t.startswith("[") and t.endswith("]"):
        return ("list", parse_base(t[1:-1].strip(), objects, where))
    m = TUPLE_TYPE.match(t)
    if m:
        items = [x.strip() for x in m.group(1).split(",")]
        if not items or any(x not in SCALAR_TYPES for x in items):
            raise SpecError(f"{where}: a fixed-length list holds scalars only: {t!r}")
        return ("tuple", items)
    if t in objects:
        return ("object", t)
    raise SpecError(f"{where}: unknown type {t!r}")


def py_annotation(base: tuple[Any, ...]) -> str:
    kind = base[0]
    if kind == "scalar":
        return SCALAR_TYPES[base[1]]
    if kind == "object":
        return camel(base[1])
    if kind == "list":
        return f"Tuple[{py_annotation(base[1])}, ...]"
    return "Tuple[" + ", ".join(SCALAR_TYPES[x] for x in base[1]) + "]"


def py_decoder(base: tuple[Any, ...]) -> str:
    """An expression of a function (value, where) -> the decoded value."""
    kind = base[0]
    if kind == "scalar":
        return f"_{base[1]}"
    if kind == "object":
        return f"{camel(base[1])}.from_json"
    if kind == "tuple":
        return "_fixed(" + ", ".join(f"_{x}" for x in base[1]) + ")"
    return f"_list_of({py_decoder(base[1])})"


def reply_records(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every record of the replies, nested objects first: {"key", "cls", "doc", "where", "fields"}."""
    p = spec["protocol"]
    objects = p.get("objects", {})
    records = []
    tables = [(f"protocol.objects.{k}", k, camel(k), v, k) for k, v in objects.items()]
    tables += [
        (f"protocol.replies.{op}", op, camel(op) + "Reply", v, f"{op} reply")
        for op, v in p["replies"].items()
    ]
    tables.append(("protocol.error_object", "error", "ErrorReply", p["error_object"], "error"))
    for section, key, cls, table, where in tables:
        fields = []
        for row in table["fields"]:
            name, ftype = row[0], row[1]
            doc = row[2] if len(row) > 2 else ""
            fields.append({"name": name, "doc": doc, **parse_type(ftype, objects, f"{section}.{name}")})
        records.append({"key": key, "cls": cls, "doc": table["doc"], "where": where, "fields": fields})
    return records


def wrapped(items: list[str], indent: str, width: int = 110) -> list[str]:
    """``items``, each followed by ",", in lines of at most ``width`` columns."""
    lines: list[str] = []
    line = ""
    for item in items:
        cell = item + ","
        if line and len(indent) + len(line) + 1 + len(cell) > width:
            lines.append(indent + line)
            line = ""
        line = f"{line} {cell}" if line else cell
    return [*lines, indent + line] if line else lines


def gen_py_replies(spec: dict[str, Any]) -> str:
    """npusnap_cli/replies.py: a record class per reply, error and nested object of the spec."""
    out: list[str] = [PY_REPLIES_HEAD]
    w = out.append
    flags = {(False, False): "0", (False, True): "_NULL", (True, False): "_OPT", (True, True): "_OPT_NULL"}
    for r in reply_records(spec):
        fields = r["fields"]
        # (name, annotation, comment) in __init__'s order: the members always there, then the others
        always: list[tuple[str, str, str]] = []
        later: list[tuple[str, str, str]] = []
        for f in fields:
            ann = py_annotation(f["base"])
            if not f["optional"]:
                always.append((f["name"], f"Optional[{ann}]" if f["nullable"] else ann, f["doc"]))
                continue
            later.append((f["name"], f"Optional[{ann}] = None", f["doc"]))
            if f["nullable"]:
                later.append((f"{f['name']}_sent", "bool = False", f"{f['name']} was there (it may be null)"))
        names = [n for n, _, _ in always + later]
        w("")
        w("")
        w("@dataclass(frozen=True)")
        w(f"class {r['cls']}(_Record, where={py_str(r['where'])}):")
        w(f'    """{r["doc"]}."""')
        w("")
        w(f"    __slots__ = ({', '.join(py_str(n) for n in sorted(names))}{',' if len(names) == 1 else ''})")
        for n, ann, doc in always:
            w(f"    {n}: {ann}{f'  # {doc}' if doc else ''}")
        if later:
            w("    if TYPE_CHECKING:  # may be left out: None then (_Record.__init__ too)")
            for n, ann, doc in later:
                w(f"        {n}: {ann}{f'  # {doc}' if doc else ''}")
        rows = [
            f"({py_str(f['name'])}, {py_decoder(f['base'])}, {flags[f['optional'], f['nullable']]})"
            for f in fields
        ]
        one = f"    _fields = ({', '.join(rows)}{',' if len(rows) == 1 else ''})"
        if len(one) <= 110:
            w(one)
        else:
            w("    _fields = (")
            out.extend(wrapped(rows, " " * 8))
            w("    )")
    w("")
    w("")
    w("# op -> the record of its result")
    w("REPLIES: Dict[str, type] = {")
    for r in reply_records(spec):
        if r["where"].endswith(" reply"):
            w(f"    {py_str(r['key'])}: {r['cls']},")
    w("}")
    return "\n".join(out) + "\n"


def validate(spec: dict[str, Any]) -> None:
    """Refuse a spec whose tables repeat a number or a name (a copy-paste slip would otherwise be
    generated into both languages)."""
    tables = {
        "snapshot_state": list(spec["snapshot_state"]["values"].items()),
        "callback_stage": list(spec["callback_stage"]["values"].items()),
        "acl_errors": [(e["name"], e["code"]) for e in spec["acl_errors"]],
        "exit_codes": [(e["name"], e["code"]) for e in spec["exit_codes"]],
        "sim_wire.ops": list(spec["sim_wire"]["ops"].items()),
    }
    for table, rows in tables.items():
        for what, col in (("name", 0), ("value", 1)):
            seen = [row[col] for row in rows]
            dups = sorted({str(v) for v in seen if seen.count(v) > 1})
            if dups:
                raise SpecError(f"{table}: {what} repeated: {', '.join(dups)}")
    for op, args in spec["protocol"]["ops"].items():
        for arg, kind in args.items():
            if kind not in spec["protocol"]["arg_kinds"]:
                raise SpecError(f"protocol.ops.{op}.{arg}: unknown argument kind {kind!r}")
    for name, (etype, _doc) in spec["protocol"]["errors"].items():
        if etype not in spec["protocol"]["error_types"]:
            raise SpecError(f"protocol.errors.{name}: unknown error type {etype!r}")
    replies = spec["protocol"].get("replies", {})
    if set(replies) != set(spec["protocol"]["ops"]):
        raise SpecError(
            "protocol.replies: every op has one reply shape, and only the ops do "
            f"(ops without: {sorted(set(spec['protocol']['ops']) - set(replies))}, "
            f"not ops: {sorted(set(replies) - set(spec['protocol']['ops']))})"
        )
    reply_records(spec)  # every type known
    if spec["device_memory_modes"]["default"] not in spec["device_memory_modes"]["names"]:
        raise SpecError("device_memory_modes.default is not one of its names")


def generate() -> dict[Path, str]:
    spec = tomllib.loads(SPEC.read_text(encoding="utf-8"))
    validate(spec)
    structs = [layout(k, v) for k, v in spec["structs"].items()]
    return {
        HEADER: gen_c(spec, structs),
        MODULE: gen_py(spec, structs),
        replies_module(): gen_py_replies(spec),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a generated file is not up to date")
    args = ap.parse_args(argv)
    try:
        outputs = generate()
    except (SpecError, KeyError, tomllib.TOMLDecodeError) as exc:
        print(f"gencontract: {SPEC.relative_to(ROOT)}: {exc}", file=sys.stderr)
        return 2
    stale = []
    for path, text in outputs.items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"gencontract: wrote {path.relative_to(ROOT)}")
    if stale:
        print(
            f"gencontract: stale: {', '.join(stale)} "
            "(run .venv/bin/python scripts/gencontract.py and commit)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
