"""A 2-rank DDP job over HCCL on the simulated NPU matches the same job over gloo on the CPU.

Run with the torch_npu python under the simulated CANN tree's environment. Both jobs are spawned
with torch.multiprocessing (mp.spawn), one process tree each; `--launcher torchrun` runs the NPU
job under torchrun instead. The model is one matmul, y = x @ W, with the loss ((y - t)^2).mean()
and SGD (foreach=False): only operators the simulator has (one parameter also keeps DDP from
concatenating tensors into its broadcast and bucket buffers). Each rank prints one line per
step: its loss and a hash of all parameters; the NPU lines must match the CPU's within 1e-4
relative, and two NPU runs must be bit-identical. Exits non-zero on any mismatch.

Needs aclnnConstantPadNd: DDP's constructor checks the parameters' shapes across ranks
(torch_npu's _verify_params_across_processes), and torch_npu pads that exchange with
constant_pad_nd; without the operator it falls back to aclop and the job fails there."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile

STEPS = 6
DIM, OUT, BATCH = 8, 4, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, backend: str, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if backend == "hccl":
        import torch_npu  # noqa: F401

        torch.npu.set_device(rank)
        dev = torch.device(f"npu:{rank}")
    else:
        dev = torch.device("cpu")
    if "MASTER_ADDR" in os.environ:  # torchrun's rendezvous
        dist.init_process_group(backend, rank=rank, world_size=world)
    else:
        # A file store: no TCP store thread in rank 0 that the other rank may still be talking to
        # when rank 0 exits (torch then aborts the other one at exit, now and then, under load).
        store = os.path.join(out_dir, f"store-{backend}")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(1234)  # same weights on every rank before the broadcast
            self.w = torch.nn.Parameter(torch.randn(DIM, OUT, generator=g) * 0.3)

        def forward(self, x):
            return x @ self.w

    torch.manual_seed(rank)  # rank 1 starts from other weights: DDP's broadcast must fix that
    net = Net()
    if rank:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    net = net.to(dev)
    model = DDP(net, device_ids=[rank] if backend == "hccl" else None, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    lines = []
    for step in range(1, STEPS + 1):
        x = torch.randn(BATCH, DIM, generator=g).to(dev)
        t = torch.randn(BATCH, OUT, generator=g).to(dev)
        opt.zero_grad(set_to_none=False)
        y = model(x)
        d = y - t
        loss = (d * d).mean()
        loss.backward()
        opt.step()
        params = [p.detach().cpu().contiguous() for p in model.parameters()]
        h = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()[:16]
        lines.append(
            {
                "step": step,
                "loss": float(loss.item()),
                "hash": h,
                "params": [p.flatten().tolist() for p in params],
            }
        )
        print(f"rank {rank} step {step} loss {loss.item():.8f} params {h}", flush=True)
    with open(os.path.join(out_dir, f"{backend}-{rank}.json"), "w") as f:
        json.dump(lines, f)
    if backend == "gloo":
        # The reference has written its lines. torch's teardown of a gloo process aborts now and
        # then on a loaded machine ("terminate called without an active exception"), which is
        # not what this script checks: leave without it.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


def run_spawn(backend: str, out_dir: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, backend, free_port(), out_dir), nprocs=2, join=True)


def run_cpu_reference(out_dir: str) -> None:
    """The gloo job in a process tree of its own that never sees the NPU: no CANN or simulator
    variables, no preloaded libraries, and torch told not to import torch_npu through its
    device-backend entry point."""
    drop = ("ASCEND", "NPUSIM", "LD_PRELOAD", "LD_LIBRARY_PATH", "HCCL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    cmd = [sys.executable, os.path.abspath(__file__), "--cpu-reference", out_dir]
    subprocess.run(cmd, env=env, check=True, timeout=80)


def torchrun_entry() -> None:  # the script run by torchrun: one rank
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[2], 0, sys.argv[3])


def run_torchrun(backend: str, out_dir: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        os.path.abspath(__file__),
        "--rank-entry",
        backend,
        out_dir,
    ]
    subprocess.run(cmd, check=True, timeout=80)


def load(out_dir: str, backend: str) -> list[list[dict]]:
    out = []
    for r in range(2):
        with open(os.path.join(out_dir, f"{backend}-{r}.json")) as f:
            out.append(json.load(f))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-entry":
        torchrun_entry()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--cpu-reference":
        run_spawn("gloo", sys.argv[2])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", choices=["spawn", "torchrun"], default="spawn")
    ap.add_argument("--reruns", type=int, default=2, help="NPU runs that must be bit-identical")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cpu_dir:
        run_cpu_reference(cpu_dir)
        cpu = load(cpu_dir, "gloo")
        npu_runs = []
        for _ in range(args.reruns):
            with tempfile.TemporaryDirectory() as d:
                (run_torchrun if args.launcher == "torchrun" else run_spawn)("hccl", d)
                npu_runs.append(load(d, "hccl"))
    bad = []
    npu = npu_runs[0]
    for r in range(2):
        for c, n in zip(cpu[r], npu[r]):
            if rel(n["loss"], c["loss"]) > 1e-4:
                bad.append(f"rank {r} step {c['step']}: loss {n['loss']} vs cpu {c['loss']}")
            worst = max(
                rel(x, y) if abs(y) > 1e-6 else abs(x - y)
                for pn, pc in zip(n["params"], c["params"])
                for x, y in zip(pn, pc)
            )
            if worst > 1e-4:
                bad.append(f"rank {r} step {c['step']}: parameters differ from cpu by {worst:.3g} relative")
        if [s["hash"] for s in npu[r]] != [s["hash"] for s in npu[1 - r]]:
            bad.append(f"rank {r}: parameters differ between the ranks")
    for k, other in enumerate(npu_runs[1:], 2):
        if [[(s["loss"], s["hash"]) for s in x] for x in other] != [
            [(s["loss"], s["hash"]) for s in x] for x in npu
        ]:
            bad.append(f"npu run {k} is not bit-identical to run 1")
    for r in range(2):
        for c, n in zip(cpu[r], npu[r]):
            print(
                f"rank {r} step {c['step']} loss npu {n['loss']:.8f} cpu {c['loss']:.8f} params {n['hash']}"
            )
    if len(npu[0]) != STEPS or len(cpu[0]) != STEPS:
        bad.append("missing steps")
    print(
        "\n".join(bad)
        if bad
        else f"OK: hccl ({args.launcher}) matches gloo on the CPU, {args.reruns} NPU runs identical"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
