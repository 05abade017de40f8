"""An inference server with its weights resident in device memory (the replicas benchmark).

Start-up is what a real server does, on the simulated NPU: read the weights file from disk, upload
it to the device (aclrtMalloc + aclrtMemcpy), warm up (``--warmup`` full passes over the
weights on the device), then serve. It listens on 127.0.0.1:PORT with SO_REUSEPORT, as
multi-process servers do, so that any number of copies (cold-started ones, or replicas restored
from one image) share the port and the kernel spreads connections over them. A request is one
line, ``infer N``, and a connection may carry any number of them (keep-alive); the answer is
``pid HOSTPID result CRC``: a checksum over a slice of the
weights read back from the device, so that the copy answering is known (its host pid, read from
/proc/self) and its weights are checked.

    python3 infer.py --weights w.bin --device 0 --port 7100 --warmup 2

Runs on any Python 3.9+, standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import threading
import zlib
from typing import List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train import ACL_ERROR_REPEAT_INITIALIZE, AclFailure, check, load_acl  # type: ignore[import-not-found]
else:
    from npusnap_cli.workloads.train import ACL_ERROR_REPEAT_INITIALIZE, AclFailure, check, load_acl

H2D, D2H = 1, 2
SLICE = 1 << 20  # bytes of the weights one request reads back


def host_pid() -> int:
    """Our pid as the host sees it (/proc/self), also inside a pid namespace of our own."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


class Server:
    def __init__(self, weights: str, device: int) -> None:
        self.lib = load_acl()
        rc = self.lib.aclInit(None)
        if rc not in (0, ACL_ERROR_REPEAT_INITIALIZE):
            check(rc, "aclInit")
        check(self.lib.aclrtSetDevice(device), f"aclrtSetDevice({device})")
        with open(weights, "rb") as f:
            data = f.read()
        self.size = len(data)
        self.dev = ctypes.c_void_p()
        check(self.lib.aclrtMalloc(ctypes.byref(self.dev), self.size, 0), "aclrtMalloc")
        host = ctypes.create_string_buffer(data, self.size)
        check(self.lib.aclrtMemcpy(self.dev, self.size, host, self.size, H2D), "aclrtMemcpy(upload)")
        self.expect = zlib.crc32(data)
        self.buf = ctypes.create_string_buffer(self.size)

    def warm_up(self, passes: int) -> None:
        for _ in range(passes):
            check(self.lib.aclrtMemcpy(self.buf, self.size, self.dev, self.size, D2H), "aclrtMemcpy(warm-up)")
            if zlib.crc32(self.buf.raw) != self.expect:
                raise AclFailure("the weights on the device are not the ones uploaded")

    def infer(self, n: int) -> int:
        off = (n * SLICE) % max(1, self.size - SLICE) if self.size > SLICE else 0
        length = min(SLICE, self.size)
        src = ctypes.c_void_p(self.dev.value + off)  # type: ignore[operator]
        check(self.lib.aclrtMemcpy(self.buf, length, src, length, D2H), "aclrtMemcpy(infer)")
        return zlib.crc32(self.buf.raw[:length]) ^ n


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=2, help="full passes over the weights before serving")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        server = Server(args.weights, args.device)
        server.warm_up(args.warmup)
    except (AclFailure, OSError) as exc:
        print(f"infer: {exc}", file=sys.stderr, flush=True)
        return 1
    sk = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sk.bind(("127.0.0.1", args.port))
    sk.listen(64)
    print(
        f"serving on 127.0.0.1:{args.port} ({server.size} bytes of weights on device {args.device})",
        flush=True,
    )
    lock = threading.Lock()  # one device copy at a time: the answers share the host buffer
    while True:
        conn, _ = sk.accept()
        threading.Thread(target=serve, args=(server, lock, conn), daemon=True).start()


def serve(server: Server, lock: threading.Lock, conn: socket.socket) -> None:
    """Answer requests on one connection until the client closes it (keep-alive clients send
    many; a one-shot client sends one and closes)."""
    with conn, conn.makefile("r") as lines:
        try:
            for raw in lines:
                line = raw.split()
                n = int(line[1]) if len(line) == 2 and line[0] == "infer" else 0
                with lock:
                    result = server.infer(n)
                conn.sendall(f"pid {host_pid()} result {result:08x}\n".encode())
        except (OSError, ValueError, AclFailure) as exc:
            print(f"infer: request failed: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
