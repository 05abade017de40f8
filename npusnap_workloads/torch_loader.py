"""A PyTorch DataLoader feeding train.py's device loop: worker processes read a real Dataset.

The dataset is a file of fixed-size records written once (``--data``, made if missing); a
map-style ``Dataset`` reads record ``i`` from it with ``os.pread`` and returns it as a tensor.
A ``DataLoader`` with ``--workers`` worker processes (``--context spawn`` or ``fork``, as
``multiprocessing_context``) batches the shuffled records (a seeded ``torch.Generator``), and
every batch is folded into the parameters on the NPU: the step's update adds the batch's
checksum, so each printed line depends on every batch before it and on the device memory::

    epoch E batch B sum S step N loss X checksum Y

An uninterrupted run's output is a pure function of the options, so a run dumped mid-epoch and
restored (or copied) must print exactly the same lines::

    npusnap run --pid-ns -- python torch_loader.py --epochs 3 --workers 2 --context spawn

Needs torch (any CPU build); the device is the simulated NPU's (or a real one's) ACL.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback
import zlib
from typing import Any, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train import AclFailure, Trainer, load_acl  # type: ignore[import-not-found]
else:
    from npusnap_workloads.train import AclFailure, Trainer, load_acl

RECORD = 256  # bytes per sample


def make_data(path: str, records: int) -> None:
    """The records, deterministic, written once (atomically: several runs may share the file)."""
    if os.path.exists(path) and os.path.getsize(path) == records * RECORD:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        for i in range(records):
            f.write(hashlib.shake_256(f"record-{i}".encode()).digest(RECORD))
    os.replace(tmp, path)


class Records:
    """A map-style Dataset over the records file; each worker opens it for itself."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = os.path.getsize(path) // RECORD
        self.fd = -1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch  # type: ignore[import-not-found]

        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY)
        raw = os.pread(self.fd, RECORD, i * RECORD)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "n": self.n, "fd": -1}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="records.bin", help="records file (made if missing)")
    ap.add_argument("--records", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--context", choices=("spawn", "fork", "forkserver"), default="spawn")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds to wait after each batch")
    ap.add_argument("--param-bytes", type=int, default=65536)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    from torch.utils.data import DataLoader  # type: ignore[import-not-found]

    try:
        make_data(args.data, args.records)
        trainer = Trainer(load_acl(), args.device, args.param_bytes, args.seed)
        gen = torch.Generator()
        gen.manual_seed(args.seed)
        loader = DataLoader(
            Records(args.data),
            batch_size=args.batch,
            shuffle=True,
            generator=gen,
            num_workers=args.workers,
            multiprocessing_context=args.context if args.workers else None,
        )
        n = 0
        for epoch in range(args.epochs):
            for b, batch in enumerate(loader):
                n += 1
                s = zlib.crc32(bytes(batch.to(torch.uint8).flatten().tolist()))
                # The batch enters the device update: a wrong or repeated batch changes every line after.
                rest = trainer.step((n << 32) | s).split(" ", 2)[2]
                sys.stdout.write(f"epoch {epoch} batch {b} sum {s:08x} step {n} {rest}\n")
                sys.stdout.flush()
                if args.interval > 0:
                    time.sleep(args.interval)
        trainer.close()
    except (AclFailure, OSError, ValueError) as exc:
        print(f"torch_loader: {exc}", file=sys.stderr, flush=True)
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
