"""Wire format between the simulated runtime (native/npusim) and the device daemon.

Defined in native/contract/npusnap.toml (generated into npusnap_cli/contract.py and
native/include/npusnap/contract.h): a 32-byte request header (op, dev, a, b, n), answered by a
24-byte header (status, pad, value, payload_len) and a small payload. Status is 0 or a negative
errno. Device memory never crosses the socket: every allocation is a memfd the daemon owns, and
OP_MAP hands it to the runtime (SCM_RIGHTS on the answer's header), which copies to and from a
mapping of it at memory speed.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Dict, Optional, Tuple

from npusnap_cli import contract

# The format itself is the contract's (native/contract/npusnap.toml; the C side is
# native/include/npusnap/contract.h).
REQ = contract.SIM_REQ
RESP = contract.SIM_RESP
MAP = contract.SIM_MAP  # OP_MAP's payload: allocation base address, its size, link MB/s (0: none)

OP_CLAIM = contract.SIM_OP_CLAIM
OP_RELEASE = contract.SIM_OP_RELEASE
OP_ALLOC = contract.SIM_OP_ALLOC
OP_ALLOC_AT = contract.SIM_OP_ALLOC_AT
OP_FREE = contract.SIM_OP_FREE
# 6, 7, 8: not offered (the bytes go through the OP_MAP mapping, never the socket): EOPNOTSUPP.
OP_STATUS = contract.SIM_OP_STATUS
OP_SHUTDOWN = contract.SIM_OP_SHUTDOWN
OP_HAS = contract.SIM_OP_HAS
OP_CONFIG = contract.SIM_OP_CONFIG  # -> value = CONFIG_* bits
OP_MAP = contract.SIM_OP_MAP  # a, n -> the allocation's memfd (SCM_RIGHTS) and a MAP payload
# 14: not offered (a process's devices are its mount namespace's device nodes): EOPNOTSUPP.

CLAIM_EXCLUSIVE = contract.SIM_CLAIM_EXCLUSIVE  # OP_CLAIM's b: no other live process on the device
CONFIG_KEEP_CONTENTS = contract.SIM_CONFIG_KEEP_CONTENTS  # Restore brings back contents (not CANN's)
CONFIG_DRIVER_SNAPSHOT = contract.SIM_CONFIG_DRIVER_SNAPSHOT  # driver-backed flow; version << 16
# Faults of the simulated node: NPUSIM_NODE_FAULT=name[,name...] in the daemon's environment (read
# at its start, by nothing else), passed to each process's libraries in OP_CONFIG's value. Each
# makes the node behave as a real node that breaks one assumption of npusnap might
# (docs/simulator.md, "Faults of the node"); `npusnap qualify` must then fail that check.
NODE_FAULT_ENV = "NPUSIM_NODE_FAULT"
FAULTS = {
    "mapname": contract.SIM_CONFIG_FAULT_MAPNAME,  # device memory mapped under another name
    "dropcopy": contract.SIM_CONFIG_FAULT_DROPCOPY,  # a copy to the host while locked drops bytes
    "movevmm": contract.SIM_CONFIG_FAULT_MOVEVMM,  # Restore puts a VMM range at another address
    "untracked": contract.SIM_CONFIG_FAULT_UNTRACKED,  # huge-page allocations bypass halMemAlloc
}
CONFIG_FAULT_MAPNAME = contract.SIM_CONFIG_FAULT_MAPNAME


def node_faults(value: str) -> int:
    """The bits of an NPUSIM_NODE_FAULT value (names separated by commas); ValueError on an
    unknown name."""
    bits = 0
    for name in (n.strip() for n in value.split(",")):
        if not name:
            continue
        if name not in FAULTS:
            raise ValueError(f"{NODE_FAULT_ENV}: unknown fault {name!r} (known: {', '.join(FAULTS)})")
        bits |= FAULTS[name]
    return bits


ALLOC_POISON = contract.SIM_ALLOC_POISON  # OP_ALLOC_AT's b: fill the allocation with the poison
POISON = struct.pack("<I", contract.SIM_POISON_WORD)  # as little-endian 32-bit words

# Device addresses: device d owns [BASE + d * SPAN, BASE + (d + 1) * SPAN). Never host addresses.
ADDR_BASE = contract.SIM_ADDR_BASE
ADDR_SPAN = contract.SIM_ADDR_SPAN  # 1 TiB of address space per device
ALIGN = contract.SIM_ALIGN


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r
    return bytes(buf)


def request(
    sock: socket.socket, op: int, dev: int = -1, a: int = 0, b: int = 0, n: int = 0
) -> Tuple[int, int, bytes]:
    """Send one request without payload; return (status, value, payload)."""
    sock.sendall(REQ.pack(op, dev, a, b, n))
    status, _pad, value, plen = RESP.unpack(recv_exact(sock, RESP.size))
    payload = recv_exact(sock, plen) if plen else b""
    return status, value, payload


def connect(path: str, timeout: Optional[float] = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    return s


def query_status(path: str, timeout: float = 5.0) -> Dict[str, Any]:
    """The daemon's status document; raises OSError/ConnectionError when it is not reachable."""
    with connect(path, timeout) as s:
        status, _value, payload = request(s, OP_STATUS)
    if status != 0:
        raise ConnectionError(f"npusim daemon answered status {status}")
    result: Dict[str, Any] = json.loads(payload.decode("utf-8"))
    return result
