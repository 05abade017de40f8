"""A real torch_npu training job: a small attention block (embedding, LayerNorm, causal attention,
GELU MLP, cross-entropy) trained with a default-settings optimizer. The demo runs it (when the
torch_npu venv of scripts/setup-torch-npu.sh exists), so do the snapshot and compute tests and
the torch_npu benchmark (bench/torchnpu.py)::

    eval "$(npusnap sim env)"
    npusnap run -- .build/torch-npu/bin/python npusnap_workloads/torch_npu_block.py --steps 30

Each step prints ``step N loss L params H`` (H: a hash of every parameter's bytes), so that a run
dumped and restored midway can be compared line for line with an uninterrupted one. The job
records where it is in a phase file (``--phase FILE``, a small shared mapping it rewrites as it
goes): after a dump that killed it, the file holds the phase the dump caught. Phases: ``h2d``
(a batch copied from pinned memory with non_blocking=True), ``forward``, ``backward``,
``optimizer`` (inside the foreach step), ``burst`` (hundreds of tiny launches queued at once:
the task queue's ring fills), ``sync`` (waiting for the device at loss.item()).

``--stall PHASE:SECONDS`` sleeps that long inside PHASE once, in step 2 (after the next batch's
copy was queued; in a backward hook; between the two halves of the optimizer step), the phase
file saying ``PHASE 2 stalled`` meanwhile, so that a dump taken then lands there with the work
queued before it (and 300 launches on a scratch tensor) still in flight. Neither changes a number.

Runs on the CPU as well (``--device cpu``), which the tests use as the oracle for the numbers.
``--times FILE`` writes each step's wall-clock seconds there, one a line (never to stdout or
stderr, which must read the same with and without npusnap); ``--threads N`` sets
torch.set_num_threads (the benchmark compares the device with the CPU at the same count).
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import sys
import time

# torch is the torch_npu venv's (scripts/setup-torch-npu.sh), not npusnap's: no stubs for mypy here.
import torch  # type: ignore[import-not-found]
import torch.nn as nn  # type: ignore[import-not-found]
import torch.nn.functional as F  # type: ignore[import-not-found]

PHASES = ("idle", "h2d", "forward", "backward", "optimizer", "burst", "sync")


class Phase:
    """The current phase and step, in a shared file mapping that survives the process's death."""

    def __init__(self, path: str | None) -> None:
        self.map = None
        if path:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, 64)
            self.map = mmap.mmap(fd, 64)
            os.close(fd)

    def set(self, name: str, step: int) -> None:
        if self.map is not None:
            text = name if " " in name else f"{name} {step}"
            self.map[:64] = text.encode().ljust(64)


class Block(nn.Module):  # type: ignore[misc]
    def __init__(self, vocab: int, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.emb(idx)
        d = x.shape[-1]
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.tril(torch.ones(t, t, device=idx.device)).bool()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


def param_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def infer_half(model: nn.Module, dev: torch.device, args: argparse.Namespace) -> int:
    """The model in float16, forward only: one loss line per batch."""
    model = model.half().eval()
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq + 1), generator=gen)
    with torch.no_grad():
        for step in range(args.steps):
            batch = data[step].to(dev)
            logits = model(batch[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="npu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--interval", type=float, default=0.0, help="seconds to sleep after each step")
    ap.add_argument("--burst", type=int, default=0, help="tiny launches queued each step (ring pressure)")
    ap.add_argument("--phase", default=None, help="phase file (see the module docstring)")
    ap.add_argument("--stall", default="", help="PHASE:SECONDS: sleep inside PHASE every step")
    ap.add_argument("--empty-cache", action="store_true", help="torch.npu.empty_cache() after every step")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers (pin_memory=True)")
    ap.add_argument(
        "--autocast", choices=("bfloat16", "float16"), default=None, help="forward under torch.autocast"
    )
    ap.add_argument("--half", action="store_true", help="the whole model in float16 (inference only)")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--times", default=None, help="file for each step's wall-clock seconds")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    times = open(args.times, "w") if args.times else None  # noqa: SIM115  (open for the whole run)
    if args.device.startswith("npu"):
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (torch 2.13 autoloads it; explicit for older ones)
    dev = torch.device(args.device)
    phase = Phase(args.phase)
    scratch = torch.zeros(8, device=dev)
    stall_phase, _, stall_s = args.stall.partition(":")
    stall = float(stall_s or 0)

    def pause(name: str) -> None:
        # once, in step 2: the phase file says "stalled" while the step's earlier work still runs
        if stall and stall_phase == name and stall_step[0] == 2:
            for _ in range(300):  # device work queued behind this point (scratch: no number changes)
                scratch.add_(1.0)
            phase.set(f"{name} 2 stalled", 2)
            time.sleep(stall)
            stall_step[0] = -1

    stall_step = [0]

    def stall_in_backward(grad: torch.Tensor) -> torch.Tensor:
        pause("backward")
        return grad

    torch.manual_seed(0)
    model = Block(args.vocab, args.dim, 4).to(dev)
    if args.half:
        return infer_half(model, dev, args)
    # Two optimizers over the two halves of the parameters (the same numbers as one): a stall
    # between their steps lands inside the model's optimizer step, the first half's foreach
    # kernels queued.
    params = list(model.parameters())
    halves = [params[: len(params) // 2], params[len(params) // 2 :]]
    if args.optimizer == "adamw":
        opts = [torch.optim.AdamW(h, lr=3e-3) for h in halves]
    else:
        opts = [torch.optim.SGD(h, lr=0.1, momentum=0.9) for h in halves]
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq + 1), generator=gen)
    batches: list[torch.Tensor] | torch.utils.data.DataLoader[torch.Tensor]
    if args.workers:
        batches = torch.utils.data.DataLoader(
            data, batch_size=None, num_workers=args.workers, pin_memory=dev.type != "cpu"
        )
    else:
        batches = [d.pin_memory() if dev.type != "cpu" else d for d in data]
    source = iter(batches)
    # The next batch is copied ahead (non_blocking, from pinned memory), behind the current step's
    # optimizer kernels: a copy in flight while the step finishes.
    batch = next(source).to(dev, non_blocking=True)
    for step in range(args.steps):
        started = time.perf_counter()
        stall_step[0] = step if stall_step[0] >= 0 else -1
        phase.set("forward", step)
        if args.autocast:
            with torch.autocast(dev.type, dtype=getattr(torch, args.autocast)):
                logits = model(batch[:, :-1]).float()
        else:
            logits = model(batch[:, :-1])
        if stall and stall_phase == "backward":
            logits.register_hook(stall_in_backward)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        for o in opts:
            o.zero_grad()
        phase.set("backward", step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        phase.set("optimizer", step)
        opts[0].step()
        pause("optimizer")
        opts[1].step()
        if step + 1 < args.steps:
            phase.set("h2d", step)
            batch = next(source).to(dev, non_blocking=True)
            pause("h2d")
        if args.burst:
            phase.set("burst", step)
            for i in range(args.burst):
                scratch.add_(1.0)
                if i % 512 == 0:
                    phase.set(f"burst {step} {i}", step)
            scratch.zero_()
        phase.set("sync", step)
        line = f"step {step} loss {loss.item():.6f} params {param_hash(model)}"
        if args.empty_cache and dev.type == "npu":
            torch.npu.empty_cache()
        phase.set("idle", step)
        if times is not None:
            times.write(f"{time.perf_counter() - started:.6f}\n")
            times.flush()
        print(line, flush=True)
        if args.interval:
            time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
