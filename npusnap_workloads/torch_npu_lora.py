"""A LoRA-shaped torch_npu fine-tuning job: a frozen base (a stack of Linear layers, ``--base-mib``
of float32 weights on the device) with a rank-``--rank`` adapter on each layer, trained with
AdamW. Between two snapshots such a job changes its adapter, the adapter's gradients and
optimizer state and its activations: a small share of its device memory, which is what an
incremental snapshot (docs/image-format.md, "Device-memory chunks") must not write again::

    eval "$(npusnap sim env)"
    npusnap run -- .build/torch-npu/bin/python npusnap_workloads/torch_npu_lora.py --steps 40

Each step prints ``step N loss L adapter H`` (H: a hash of every adapter parameter's bytes); the
base's hash is printed once at the start and once at the end (``base H``), so a restore that lost
or shifted any of it shows. ``--device cpu`` runs the same numbers on the CPU; ``--times FILE``
appends each step's end time there (bench/copyconcurrent.py reads the job's gaps from it).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

# torch is the torch_npu venv's (scripts/setup-torch-npu.sh), not npusnap's.
import torch  # type: ignore[import-not-found]
import torch.nn as nn  # type: ignore[import-not-found]


class LoRALinear(nn.Module):  # type: ignore[misc]
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(dim, rank) / dim**0.5)
        self.b = nn.Parameter(torch.zeros(rank, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + (x @ self.a) @ self.b)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--base-mib", type=int, default=64, help="MiB of frozen float32 base weights")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--interval", type=float, default=0.0, help="seconds to sleep after each step")
    ap.add_argument("--device", default="npu")
    ap.add_argument("--times", help="append each step's end (time.monotonic()) to this file")
    args = ap.parse_args()
    if args.device == "npu":
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401

    dim = int((args.base_mib * (1 << 20) / 4 / args.layers) ** 0.5)
    dim -= dim % 8
    torch.manual_seed(0)
    model = nn.Sequential(*[LoRALinear(dim, args.rank) for _ in range(args.layers)]).to(args.device)
    adapter = [p for p in model.parameters() if p.requires_grad]
    base = [p for p in model.parameters() if not p.requires_grad]
    opt = torch.optim.AdamW(adapter, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    print(f"base {digest(base)} dim {dim}", flush=True)
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, dim, generator=gen).to(args.device)
        y = torch.randn(args.batch, dim, generator=gen).to(args.device)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f} adapter {digest(adapter)}", flush=True)
        if args.times:
            with open(args.times, "a") as f:
                f.write(f"{time.monotonic():.6f}\n")
        if args.interval:
            time.sleep(args.interval)
    print(f"base {digest(base)} dim {dim}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
