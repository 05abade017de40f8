"""A ZeRO/FSDP-style sharded data-parallel job over HCCL on the simulated NPU: each of two ranks
keeps half of the flattened weight, all-gathers the whole weight before the forward
(all_gather_into_tensor: HcclAllGather), and reduce-scatters the gradient after the backward
(reduce_scatter_tensor: HcclReduceScatter) so that it updates only its half — the collectives
FSDP's sharding strategy is made of. torch's own FSDP wrappers flatten and pad parameters with
aclnnCat / aclnnConstantPadNd, which the simulator does not have yet; this job does the same
communication with tensors already laid out.

Oracle: the same model trained in one CPU process on both ranks' batches together (the mean of
the two ranks' mean losses is the mean loss over the joined batch, so the averaged gradient is
the full-batch gradient). Per-step losses and the gathered weight must match within 1e-4
relative, both ranks must hold the same weight, and a second NPU run must be bit-identical.
Exits non-zero on any mismatch."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import tempfile

STEPS = 6
DIM, OUT, BATCH, LR = 16, 32, 8, 0.05  # 512 weights: each rank's half is 1 KiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_weight():
    import torch

    g = torch.Generator().manual_seed(4321)
    return torch.randn(DIM * OUT, generator=g) * 0.2


def batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, OUT, generator=g)


def worker(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch_npu  # noqa: F401

    torch.npu.set_device(rank)
    dev = torch.device(f"npu:{rank}")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("hccl", rank=rank, world_size=2)
    n = DIM * OUT // 2
    shard = init_weight()[rank * n : (rank + 1) * n].clone().to(dev)
    lines = []
    for step in range(1, STEPS + 1):
        full = torch.empty(2 * n, device=dev)
        dist.all_gather_into_tensor(full, shard)
        w = full.view(DIM, OUT).detach().requires_grad_(True)
        x, t = (a.to(dev) for a in batch(rank, step))
        d = x @ w - t
        loss = (d * d).mean()
        loss.backward()
        gshard = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(gshard, w.grad.reshape(-1).contiguous())
        with torch.no_grad():
            shard.sub_(gshard / 2.0 * LR)  # the average of the two ranks' gradients
        losses = torch.zeros(2, device=dev)
        losses[rank] = loss.detach()
        dist.all_reduce(losses)
        full = torch.empty(2 * n, device=dev)
        dist.all_gather_into_tensor(full, shard)
        wc = full.cpu()
        h = hashlib.sha256(wc.numpy().tobytes()).hexdigest()[:16]
        mean_loss = float(losses.cpu().mean())
        lines.append({"step": step, "loss": mean_loss, "hash": h, "w": wc.tolist()})
        print(f"rank {rank} step {step} loss {mean_loss:.8f} weight {h}", flush=True)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(lines, f)
    dist.destroy_process_group()


def cpu_reference() -> list[dict]:
    import torch

    w = init_weight().view(DIM, OUT).clone()
    out = []
    for step in range(1, STEPS + 1):
        w.requires_grad_(True)
        xs, ts = zip(*(batch(r, step) for r in range(2)))
        d = torch.cat(xs) @ w - torch.cat(ts)
        loss = (d * d).mean()
        loss.backward()
        with torch.no_grad():
            w = (w - w.grad * LR).detach()
        out.append({"step": step, "loss": float(loss.detach()), "w": w.reshape(-1).tolist()})
    return out


def main() -> int:
    import torch.multiprocessing as mp

    runs = []
    for _ in range(2):
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(worker, args=(free_port(), d), nprocs=2, join=True)
            ranks = []
            for r in range(2):
                with open(os.path.join(d, f"{r}.json")) as f:
                    ranks.append(json.load(f))
            runs.append(ranks)
    ref = cpu_reference()
    bad = []
    npu = runs[0]
    for s, (a, b, c) in enumerate(zip(npu[0], npu[1], ref), 1):
        if a["hash"] != b["hash"]:
            bad.append(f"step {s}: the ranks hold different weights")
        rel = abs(a["loss"] - c["loss"]) / abs(c["loss"])
        worst = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(a["w"], c["w"]))
        print(
            f"step {s} loss npu {a['loss']:.8f} cpu {c['loss']:.8f} (rel {rel:.1e}) weight {a['hash']} "
            f"(worst rel {worst:.1e})"
        )
        if rel > 1e-4 or worst > 1e-4:
            bad.append(f"step {s}: npu differs from the cpu reference (loss {rel:.2e}, weight {worst:.2e})")
    if [[x["hash"] for x in r] for r in runs[1]] != [[x["hash"] for x in r] for r in runs[0]]:
        bad.append("the second npu run is not bit-identical")
    if len(npu[0]) != STEPS:
        bad.append("missing steps")
    print("\n".join(bad) if bad else "OK: sharded training over HCCL matches the CPU; reruns identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
