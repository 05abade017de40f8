"""Wire format between the simulated runtime (native/npusim) and the device daemon.

Mirror of native/npusim/npusim_wire.h: a 32-byte request header (op, dev, a, b, n), answered by a
24-byte header (status, pad, value, payload_len) and a small payload. Status is 0 or a negative
errno. Device memory never crosses the socket: every allocation is a memfd the daemon owns, and
OP_MAP hands it to the runtime (SCM_RIGHTS on the answer's header), which copies to and from a
mapping of it at memory speed.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Dict, Optional, Tuple

REQ = struct.Struct("<IiQQQ")
RESP = struct.Struct("<iIQQ")

OP_CLAIM = 1
OP_RELEASE = 2
OP_ALLOC = 3
OP_ALLOC_AT = 4
OP_FREE = 5
# 6, 7, 8: the byte-streaming WRITE, READ and COPY of earlier versions; answered EOPNOTSUPP.
OP_STATUS = 9
OP_SHUTDOWN = 10
OP_HAS = 11
OP_CONFIG = 12  # -> value = CONFIG_* bits
OP_MAP = 13  # a, n -> the allocation's memfd (SCM_RIGHTS) and a MAP payload
# Remap device ids for every process of one pid namespace (the simulator's stand-in for a
# container that exposes physical device b as its device dev): a = the namespace's inode, n = the
# host pid of its init (the map ends with it); dev = -1 clears the namespace's map.
OP_NSMAP = 14
MAP = struct.Struct("<QQd")  # OP_MAP's payload: allocation base address, its size, link MB/s (0: none)

CLAIM_EXCLUSIVE = 1  # OP_CLAIM's b: no other live process may have the device open (Restore)
CONFIG_KEEP_CONTENTS = 1  # Restore brings back allocation contents (not what CANN does)
CONFIG_DRIVER_SNAPSHOT = 2  # the driver feature of the driver-backed flow; driver version << 16
ALLOC_POISON = 1  # OP_ALLOC_AT's b: fill the allocation with the poison pattern
POISON = b"\xef\xbe\xad\xde"  # 0xDEADBEEF as little-endian 32-bit words

# Device addresses: device d owns [BASE + d * SPAN, BASE + (d + 1) * SPAN). Never host addresses.
ADDR_BASE = 0x1000_0000_0000
ADDR_SPAN = 0x0100_0000_0000  # 1 TiB of address space per device
ALIGN = 512


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


# Set in npusnap's environment by the strict tests: npusnap itself must work with what a real
# node offers, so any attempt of it to reach the simulator's daemon is a bug, and fails loudly.
NO_DAEMON_ENV = "NPUSNAP_NO_SIM_DAEMON"


def connect(path: str, timeout: Optional[float] = 5.0) -> socket.socket:
    if os.environ.get(NO_DAEMON_ENV) == "1":
        raise PermissionError(f"{NO_DAEMON_ENV}=1: npusnap may not talk to the simulator's daemon ({path})")
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
