"""torch.distributed collectives over HCCL on the simulated NPU, two ranks in two processes
(torch.multiprocessing), against values computed on the CPU: all_reduce (sum, product, max, min
in float32, float16, bfloat16 and int32), broadcast, all_gather (into a tensor and into a list),
reduce_scatter, send/recv, all_to_all (equal and unequal splits), reduce, scatter and
barrier. (An all_gather of unequal sizes would test HcclAllGatherV, but torch_npu flattens its
outputs with aclnnCat first.) Sizes are
multiples of 512 bytes where torch_npu would otherwise pad (byte_alignment pads all_gather
buffers with aclnnConstantPadNd). One line per check; exits non-zero on any failure."""

from __future__ import annotations

import os
import socket
import sys
import tempfile

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base(rank: int, n: int, dtype=None):
    import torch

    # distinct, exactly representable values in every dtype: small integers and halves
    v = torch.arange(n, dtype=torch.float32) % 17 * 0.5 + rank * 3 + 1
    return v.to(dtype) if dtype is not None else v


def worker(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch_npu  # noqa: F401

    torch.npu.set_device(rank)
    dev = torch.device(f"npu:{rank}")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("hccl", rank=rank, world_size=WORLD)
    results = []

    def check(name: str, got, want) -> None:
        got = got.cpu()
        ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        verdict = "ok" if ok else f"FAIL got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}"
        results.append(f"rank {rank} {name}: {verdict}")

    n = 256
    ops = {
        "sum": dist.ReduceOp.SUM,
        "product": dist.ReduceOp.PRODUCT,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        for name, op in ops.items():
            if name == "product" and dtype == torch.bfloat16:
                continue  # HCCL's prod takes no bfp16 (HcclAllReduce, Atlas A2/A3): an error there too
            t = base(rank, n, dtype).to(dev)
            dist.all_reduce(t, op=op)
            a, b = base(0, n, dtype), base(1, n, dtype)
            want = {"sum": a + b, "product": a * b, "max": torch.maximum(a, b), "min": torch.minimum(a, b)}[
                name
            ]
            check(f"all_reduce {name} {str(dtype)[6:]}", t, want)

    big = 3 * (1 << 20) // 4 + 5  # more than a 1 MiB CCL buffer (HCCL_BUFFSIZE=1), not a multiple of it
    t = base(rank, big).to(dev)
    dist.all_reduce(t)
    check("all_reduce sum of 3 MiB through a 1 MiB buffer", t, base(0, big) + base(1, big))

    t = base(rank, n).to(dev)
    dist.broadcast(t, src=1)
    check("broadcast from rank 1", t, base(1, n))

    out = torch.empty(WORLD * n, device=dev)
    dist.all_gather_into_tensor(out, base(rank, n).to(dev))
    check("all_gather_into_tensor", out, torch.cat([base(r, n) for r in range(WORLD)]))

    outs = [torch.empty(n, device=dev) for _ in range(WORLD)]
    dist.all_gather(outs, base(rank, n).to(dev))
    for r in range(WORLD):
        check(f"all_gather [{r}]", outs[r], base(r, n))

    inp = base(rank, WORLD * n).to(dev)
    out = torch.empty(n, device=dev)
    dist.reduce_scatter_tensor(out, inp)
    want = (base(0, WORLD * n) + base(1, WORLD * n))[rank * n : (rank + 1) * n]
    check("reduce_scatter_tensor sum", out, want)

    inp = base(rank, WORLD * n).to(dev)
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.MAX)
    want = torch.maximum(base(0, WORLD * n), base(1, WORLD * n))[rank * n : (rank + 1) * n]
    check("reduce_scatter_tensor max", out, want)

    if rank == 0:
        dist.send(base(7, n).to(dev), dst=1)
        t = torch.empty(n, device=dev)
        dist.recv(t, src=1)
        check("recv from rank 1", t, base(8, n))
    else:
        t = torch.empty(n, device=dev)
        dist.recv(t, src=0)
        check("recv from rank 0", t, base(7, n))
        dist.send(base(8, n).to(dev), dst=0)

    inp = base(rank, WORLD * n).to(dev)
    out = torch.empty(WORLD * n, device=dev)
    dist.all_to_all_single(out, inp)
    want = torch.cat([base(r, WORLD * n)[rank * n : (rank + 1) * n] for r in range(WORLD)])
    check("all_to_all_single equal splits", out, want)

    # unequal splits: rank r sends (r + 1) * 128 + k * 128 elements to rank k
    def split(r: int, k: int) -> int:
        return (r + 1) * 128 + k * 128

    send_sizes = [split(rank, k) for k in range(WORLD)]
    recv_sizes = [split(r, rank) for r in range(WORLD)]
    inp = base(rank, sum(send_sizes)).to(dev)
    out = torch.empty(sum(recv_sizes), device=dev)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
    parts = []
    for r in range(WORLD):
        src = base(r, sum(split(r, k) for k in range(WORLD)))
        off = sum(split(r, k) for k in range(rank))
        parts.append(src[off : off + split(r, rank)])
    check("all_to_all_single unequal splits", out, torch.cat(parts))

    t = base(rank, n).to(dev)
    dist.reduce(t, dst=1, op=dist.ReduceOp.SUM)
    if rank == 1:
        check("reduce to rank 1", t, base(0, n) + base(1, n))
    else:
        check("reduce leaves the sender's tensor", t, base(0, n))

    out = torch.empty(n, device=dev)
    chunks = [base(10 + k, n).to(dev) for k in range(WORLD)] if rank == 0 else None
    dist.scatter(out, chunks, src=0)
    check("scatter from rank 0", out, base(10 + rank, n))

    dist.barrier()
    results.append(f"rank {rank} barrier: ok")
    torch.npu.synchronize()
    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
        f.write("\n".join(results) + "\n")
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    os.environ["HCCL_BUFFSIZE"] = "1"
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(free_port(), d), nprocs=WORLD, join=True)
        lines = []
        for r in range(WORLD):
            with open(os.path.join(d, f"{r}.txt")) as f:
                lines += f.read().splitlines()
    print("\n".join(lines))
    bad = [ln for ln in lines if not ln.endswith(": ok")]
    expected = WORLD * 28
    if len(lines) != expected:
        bad.append(f"{len(lines)} checks, expected {expected}")
    print(f"FAILED: {len(bad)}" if bad else f"OK: {len(lines)} checks")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
