"""An inference server with its weights resident in device memory (the replicas benchmark).

Start-up is what a real server does, on the simulated NPU: import its framework (``--framework
torch``: torch, whose CPU build stands in for torch + torch_npu), read the weights file from disk
(a model of ``--layers`` fp32 matrices of ``hidden x hidden``, written by ``write_weights``),
upload every layer into device memory taken from an expandable-segments caching allocator (as
torch_npu allocates), drop the host copy, and warm up: one forward pass per batch size 1, 2, 4 ...
``--warmup-batch`` through the ``aclnnMatmul`` and ``aclnnRelu`` operators of ``libopapi.so`` on a
stream, as a server captures a graph per batch size before it serves. Then it serves: it listens
on 127.0.0.1:PORT with SO_REUSEPORT, as multi-process servers do, so that any number of copies
(cold-started ones, or replicas restored from one image) share the port and the kernel spreads
connections over them. A connection carries lines (each connection is served by a thread of its
own, so a keep-alive client holds up no one): ``hello`` is answered ``pid HOSTPID`` (which copy
the kernel chose: its host pid, read from /proc/self; no device work), ``infer N`` is
answered ``pid HOSTPID result CRC``: one forward pass of a batch of one (an input made from N)
through every layer on the device, CRC-32 of the output, so that the weights are checked (every
copy gives the same CRC for the same N).

    python3 infer.py --weights w.bin --device 0 --port 7100 --warmup-batch 16

Runs on any Python 3.9+, standard library only (torch only with ``--framework torch``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import socket
import struct
import sys
import threading
import zlib
from typing import List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from npu_train import (  # type: ignore[import-not-found]
        ACL_ERROR_REPEAT_INITIALIZE,
        CachingAllocator,
        ExpandableSegment,
        JobError,
        Libs,
        Ops,
        Tensor,
        check,
    )
else:
    from npusnap_workloads.npu_train import (
        ACL_ERROR_REPEAT_INITIALIZE,
        CachingAllocator,
        ExpandableSegment,
        JobError,
        Libs,
        Ops,
        Tensor,
        check,
    )

H2D, D2H = 1, 2
HEADER = 4096  # the weights file: a JSON header padded to this many bytes, then the layers
ALIGN = 512


def write_weights(path: str, layers: int, hidden: int, seed: int = 1) -> int:
    """A weights file of ``layers`` fp32 ``hidden x hidden`` matrices, values of magnitude about
    1/128 with random signs (so that activations stay finite through every layer). Returns its size."""
    head = json.dumps({"layers": layers, "hidden": hidden, "dtype": "float32"}).encode()
    rng = random.Random(seed)
    # Little-endian fp32: byte 3 holds the sign and the exponent's high bits. 0x3C: 2^-7 or 2^-6.
    exponent = bytes((0x3C | (b & 0x80)) for b in range(256))
    n = hidden * hidden * 4
    with open(path, "wb") as f:
        f.write(head.ljust(HEADER, b" "))
        for _ in range(layers):
            layer = bytearray(rng.randbytes(n))
            layer[3::4] = bytes(layer[3::4]).translate(exponent)
            f.write(layer)
    return HEADER + layers * n


def host_pid() -> int:
    """Our pid as the host sees it (/proc/self), also inside a pid namespace of our own."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


class Server:
    def __init__(self, weights: str, device: int, max_batch: int, framework: str) -> None:
        if framework == "torch":
            # What a real server imports first; its cost is the point. Not in npusnap's venv: the
            # bench runs this server with the interpreter of scripts/setup-torch.sh's venv.
            import torch  # type: ignore[import-not-found]  # noqa: F401

        libs = Libs(hccl=False)
        self.rt, op = libs.rt, libs.op
        rc = self.rt.aclInit(None)
        if rc not in (0, ACL_ERROR_REPEAT_INITIALIZE):
            check(rc, "aclInit")
        check(self.rt.aclrtSetDevice(device), f"aclrtSetDevice({device})")
        self.stream = ctypes.c_void_p()
        check(
            self.rt.aclrtCreateStreamWithConfig(ctypes.byref(self.stream), 0, 0),
            "aclrtCreateStreamWithConfig",
        )
        with open(weights, "rb") as f:
            head = json.loads(f.read(HEADER))
            self.layers, self.hidden = int(head["layers"]), int(head["hidden"])
            h, layer_bytes = self.hidden, self.hidden * self.hidden * 4
            act_bytes = 2 * max_batch * h * 4
            segment = ExpandableSegment(self.rt, device, self.layers * layer_bytes + act_bytes + (8 << 20))
            self.alloc = CachingAllocator(segment)
            self.ops = Ops(libs, self.alloc, self.stream)
            self.w: List[Tensor] = []
            host = ctypes.create_string_buffer(layer_bytes)
            for i in range(self.layers):  # one layer at a time: the host never holds the model
                if f.readinto(host) != layer_bytes:
                    raise JobError(f"{weights}: layer {i} is short")
                addr = self.alloc.malloc(layer_bytes)
                check(self.rt.aclrtMemcpy(addr, layer_bytes, host, layer_bytes, H2D), "aclrtMemcpy(upload)")
                self.w.append(Tensor(op, addr, [h, h]))
            del host
        # Activations for every batch size up to max_batch: two ping-pong buffers per size.
        self.acts = {}
        b = 1
        while b <= max_batch:
            self.acts[b] = [Tensor(op, self.alloc.malloc(b * h * 4), [b, h]) for _ in range(2)]
            b *= 2
        self.max_batch = b // 2

    def forward(self, x: bytes, batch: int) -> bytes:
        """One pass of a ``batch x hidden`` fp32 input through every layer (matmul, relu)."""
        a, b = self.acts[batch]
        n = batch * self.hidden * 4
        buf = ctypes.create_string_buffer(x, n)
        check(self.rt.aclrtMemcpy(a.data, n, buf, n, H2D), "aclrtMemcpy(input)")
        for w in self.w:
            self.ops.matmul(a, w, b)
            self.ops.relu(b, a)
        check(self.rt.aclrtSynchronizeStream(self.stream), "aclrtSynchronizeStream")
        out = ctypes.create_string_buffer(n)
        check(self.rt.aclrtMemcpy(out, n, a.data, n, D2H), "aclrtMemcpy(output)")
        return out.raw

    def input(self, n: int, batch: int) -> bytes:
        rng = random.Random(n)
        return struct.pack(f"<{batch * self.hidden}f", *(rng.random() for _ in range(batch * self.hidden)))

    def warm_up(self) -> None:
        b = 1
        while b <= self.max_batch:
            out = self.forward(self.input(b, b), b)
            if any(v != v for v in struct.unpack(f"<{len(out) // 4}f", out)):  # NaN
                raise JobError("the warm-up pass gave NaN: the weights on the device are not the model's")
            b *= 2

    def infer(self, n: int) -> int:
        return zlib.crc32(self.forward(self.input(n, 1), 1)) ^ n


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument(
        "--warmup-batch", type=int, default=16, help="warm up batch sizes 1, 2, 4 ... up to this (default 16)"
    )
    ap.add_argument("--framework", choices=("none", "torch"), default="none", help="import torch first")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        server = Server(args.weights, args.device, max(1, args.warmup_batch), args.framework)
        server.warm_up()
    except (JobError, OSError, ImportError, ValueError, KeyError) as exc:
        print(f"infer: {exc}", file=sys.stderr, flush=True)
        return 1
    sk = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sk.bind(("127.0.0.1", args.port))
    sk.listen(64)
    print(
        f"serving on 127.0.0.1:{args.port} ({server.layers} layers of {server.hidden}x{server.hidden} "
        f"on device {args.device})",
        flush=True,
    )
    lock = threading.Lock()  # one forward pass at a time on the device
    while True:
        conn, _ = sk.accept()
        threading.Thread(target=serve, args=(server, lock, conn), daemon=True).start()


def serve(server: Server, lock: threading.Lock, conn: socket.socket) -> None:
    """Answer the lines of one connection until the client closes it, in a thread of its own: a
    keep-alive client holding a connection does not keep the others waiting."""
    with conn:
        try:
            conn.settimeout(30)
            for raw in conn.makefile("r"):
                line = raw.split()
                if line == ["hello"]:
                    conn.sendall(f"pid {host_pid()}\n".encode())
                    continue
                n = int(line[1]) if len(line) == 2 and line[0] == "infer" else 0
                with lock:
                    result = server.infer(n)
                conn.sendall(f"pid {host_pid()} result {result:08x}\n".encode())
        except (OSError, ValueError, JobError) as exc:
            print(f"infer: request failed: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
