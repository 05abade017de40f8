"""A real torch_npu DDP job: two ranks train a small MLP over the ``hccl`` backend, with every
torch_npu setting at its default (task queue, watchdog, caching allocator)::

    eval "$(npusnap sim env)"
    npusnap run -- .build/torch-npu/bin/python npusnap_workloads/torch_npu_ddp.py --steps 30

``--launcher spawn`` (the default) starts the ranks with torch.multiprocessing: one process tree.
``--launcher none`` is one rank as torchrun starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
environment). Each rank prints ``rank R step N loss L params H`` (H: a hash of every parameter's
bytes, equal on all ranks since DDP keeps them in step), so that a run dumped and restored midway
can be compared line for line with an uninterrupted one. ``--device cpu`` runs the same job over
gloo on the CPU. ``--pg-timeout S`` sets the process group's timeout (the watchdog's work
timeout). ``--phase DIR`` makes each rank keep ``DIR/rank-R`` saying where it is (``forward``,
``backward`` with the gradient all-reduce in flight, ``optimizer``), as torch_npu_block.py does.
``--stall S`` makes rank 0 sleep S seconds inside its backward of step ``--stall-step`` (its
phase then says ``backward N stalled``), before its gradient all-reduce, while rank 1's is
already launched and waits for it on rank 1's device. No number changes.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import socket
import sys
import time

# torch is the torch_npu venv's (scripts/setup-torch-npu.sh), not npusnap's: no stubs for mypy here.
import torch  # type: ignore[import-not-found]
import torch.distributed as dist  # type: ignore[import-not-found]

DIM, HIDDEN, OUT, BATCH = 32, 64, 8, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def param_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def set_phase(path: str | None, text: str) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP  # type: ignore[import-not-found]

    npu = args.device == "npu"
    if npu:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401

        torch.npu.set_device(rank)
        dev = torch.device(f"npu:{rank}")
    else:
        dev = torch.device("cpu")
    timeout = datetime.timedelta(seconds=args.pg_timeout) if args.pg_timeout else None
    extra = {"timeout": timeout} if timeout is not None else {}
    backend = "hccl" if npu else "gloo"
    if args.port:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world, **extra
        )
    else:  # torchrun's rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group(backend, **extra)
    phase = os.path.join(args.phase, f"rank-{rank}") if args.phase else None
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT)).to(
        dev
    )
    model = DDP(net, device_ids=[rank] if npu else None, bucket_cap_mb=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    data = [
        (torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, OUT, generator=gen))
        for _ in range(args.steps)
    ]
    for step in range(args.steps):
        x, t = (z.to(dev) for z in data[step])
        set_phase(phase, f"forward {step}")
        loss = torch.nn.functional.mse_loss(model(x), t)
        opt.zero_grad()
        set_phase(phase, f"backward {step}")
        if rank == 0 and args.stall and step == args.stall_step:
            # Rank 0 stops inside its backward, before its gradient all-reduce: rank 1's is
            # launched and waits for it on rank 1's device.
            def stall(grad: torch.Tensor, step: int = step) -> torch.Tensor:
                set_phase(phase, f"backward {step} stalled")
                time.sleep(args.stall)
                return grad

            loss.register_hook(stall)
        loss.backward()
        set_phase(phase, f"optimizer {step}")
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.8f} params {param_hash(net)}", flush=True)
        set_phase(phase, f"idle {step}")
        if args.interval:
            time.sleep(args.interval)
    dist.destroy_process_group()


def spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    rank_main(rank, world, args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--launcher", choices=("spawn", "none"), default="spawn")
    ap.add_argument("--device", choices=("npu", "cpu"), default="npu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=float, default=0.0, help="seconds to sleep after each step")
    ap.add_argument("--pg-timeout", type=float, default=0.0, help="the process group's timeout, seconds")
    ap.add_argument("--phase", default=None, help="a directory for each rank's phase file")
    ap.add_argument("--stall", type=float, default=0.0, help="seconds rank 0 sleeps inside a backward")
    ap.add_argument("--stall-step", type=int, default=3, help="the step of --stall")
    args = ap.parse_args()
    if args.launcher == "none":
        args.port = 0
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    import torch.multiprocessing as mp  # type: ignore[import-not-found]

    args.port = free_port()
    mp.spawn(spawned, args=(2, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
