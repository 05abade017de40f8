"""One rank of a PyTorch job: train.py's device loop plus a torch.distributed all-reduce per step.

Started by ``torchrun`` (or by hand with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``),
it joins a gloo process group through the rendezvous store (torchrun's elastic agent's, or rank
0's), keeps its parameters on device ``LOCAL_RANK`` and, every step, all-reduces its checksum
with a CPU tensor. The line printed for step ``n`` holds both, so every rank's output depends on
every other rank's device state at the same step, and an uninterrupted run's output is a pure
function of the options::

    npusnap run --no-io-uring -- torchrun --standalone --nproc-per-node 2 torch_ranks.py --steps 40

Needs torch (any CPU build with gloo); the device is the simulated NPU's (or a real one's) ACL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train import AclFailure, Trainer, load_acl  # type: ignore[import-not-found]
else:
    from npusnap_workloads.train import AclFailure, Trainer, load_acl


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--param-bytes", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch  # type: ignore[import-not-found]
    import torch.distributed as dist  # type: ignore[import-not-found]

    rank = int(os.environ["RANK"])
    device = int(os.environ.get("LOCAL_RANK", rank))
    try:
        trainer = Trainer(load_acl(), device, args.param_bytes, args.seed + rank)
        dist.init_process_group("gloo")
        for n in range(1, args.steps + 1):
            line = trainer.step(n)
            # The checksum's low 24 bits: a float64 holds them, and their sum, exactly.
            mine = torch.tensor([float(int(line.rsplit(" ", 1)[1], 16) & 0xFFFFFF)], dtype=torch.float64)
            dist.all_reduce(mine)
            sys.stdout.write(f"[rank {rank}] {line} | allreduce {int(mine.item()):08x}\n")
            sys.stdout.flush()
            if args.interval > 0 and n < args.steps:
                time.sleep(args.interval)
        dist.destroy_process_group()
        trainer.close()
    except (AclFailure, OSError, ValueError) as exc:
        print(f"[rank {rank}] torch_ranks: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
