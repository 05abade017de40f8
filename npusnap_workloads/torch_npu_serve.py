"""A real torch_npu inference server: a small GPT-style model (the attention block of
torch_npu_block.py, stacked) built in the process, uploaded to its NPU, warmed up, and serving
greedy generation over HTTP (the replicas benchmark and test)::

    eval "$(npusnap sim env)"
    npusnap run -- .build/torch-npu/bin/python npusnap_workloads/torch_npu_serve.py --port 7100

It listens on 127.0.0.1:PORT with SO_REUSEPORT, as multi-process servers do, so that any number
of copies (cold-started ones, or replicas restored from one image) share the port and the kernel
spreads connections over them. ``GET /hello`` answers ``pid HOSTPID`` (which copy the kernel
chose: its host pid, read from /proc/self; no device work); ``GET /infer?n=N`` answers ``pid
HOSTPID tokens T1,T2,...``: ``--tokens`` tokens generated greedily on the device from a prompt
made from N, so every copy answers the same N with the same tokens (the weights are checked).
The model is made from ``torch.manual_seed(0)``: no download, no file. Once serving it prints
``serving on 127.0.0.1:PORT``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

# torch is the torch_npu venv's (scripts/setup-torch-npu.sh), not npusnap's: no stubs for mypy here.
import torch  # type: ignore[import-not-found]
import torch.nn as nn  # type: ignore[import-not-found]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_npu_block import Block  # type: ignore[import-not-found]


def host_pid() -> int:
    """Our pid as the host sees it (/proc/self), also inside a pid namespace of our own."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


class Model(nn.Module):  # type: ignore[misc]
    """``layers`` attention blocks; each block already ends in a vocabulary head, so a block's
    logits feed the next one through its embedding of their argmax (a toy, but every operator
    of a transformer's forward runs on the device)."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(vocab, dim, 4) for _ in range(layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.blocks[0](idx)
        for block in self.blocks[1:]:
            logits = block(logits.argmax(-1)) + logits
        return logits


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401

        self.device = torch.device(f"npu:{args.device}")
        self.args = args
        torch.npu.set_device(self.device)
        torch.manual_seed(0)
        self.model = Model(args.vocab, args.dim, args.layers).to(self.device).eval()
        self.lock = threading.Lock()  # one generation at a time on the device

    def generate(self, n: int) -> list[int]:
        torch.npu.set_device(self.device)  # a handler thread's current device
        prompt = [(n * 7 + k * 13) % self.args.vocab for k in range(4)]
        with self.lock, torch.no_grad():
            idx = torch.tensor([prompt], device=self.device)
            for _ in range(self.args.tokens):
                nxt = self.model(idx)[:, -1].argmax(-1, keepdim=True)
                idx = torch.cat([idx, nxt], dim=1)
            return [int(t) for t in idx[0, len(prompt) :].cpu()]


class ReusePortServer(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def handler_for(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive in a dump

        def do_GET(self) -> None:
            url = urlparse(self.path)
            pid = host_pid()  # asked each time: a replica is another process with the same memory
            if url.path == "/hello":
                body = f"pid {pid}\n"
            elif url.path == "/infer":
                n = int(parse_qs(url.query).get("n", ["0"])[0])
                tokens = server.generate(n)
                body = f"pid {pid} tokens {','.join(map(str, tokens))}\n"
            else:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the output file is the job's

    return Handler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--port", type=int, default=7100)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8, help="tokens generated per request")
    args = ap.parse_args()
    start = time.monotonic()
    server = Server(args)
    server.generate(0)  # warm-up: every operator once, the allocator's pools made
    httpd = ReusePortServer(("127.0.0.1", args.port), handler_for(server))
    print(f"serving on 127.0.0.1:{args.port} (ready after {time.monotonic() - start:.2f} s)", flush=True)
    httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
