"""A two-rank "distributed" job: one launcher process and two train.py workers on devices 0 and 1.

Exercises process trees with several NPU processes (like torchrun with two ranks). Each worker's
lines are prefixed with ``[rank R] ``; with ``--out-dir`` every worker writes its own file
(``rank0.log``, ``rank1.log``), otherwise both share the launcher's stdout. The launcher itself
does not use the NPU; it waits for the workers and exits with the first non-zero status. With
``--load-acl`` it loads the CANN runtime and calls aclInit without opening a device, as a
launcher that imports torch_npu does.

    eval "$(npusnap sim env)"
    python3 launcher.py --steps 100 --interval 0.5 --out-dir /tmp/job
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="steps per worker, 0 = forever (default 100)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between steps (default 0.5)")
    ap.add_argument("--param-bytes", type=int, default=1 << 20, help="parameter bytes per worker")
    ap.add_argument("--seed", type=int, default=0, help="base seed; rank R uses seed + R")
    ap.add_argument(
        "--devices", default="0,1", help="comma-separated device ids, one worker each (default 0,1)"
    )
    ap.add_argument("--out-dir", default=None, help="write rank<R>.log files here instead of stdout")
    ap.add_argument("--load-acl", action="store_true", help="load the CANN runtime (aclInit, no device)")
    args = ap.parse_args(argv)
    if args.load_acl:
        import ctypes

        home = os.environ.get("ASCEND_HOME_PATH", "")
        acl = ctypes.CDLL(os.path.join(home, "lib64", "libacl_rt.so"))
        acl.aclInit.argtypes = [ctypes.c_char_p]
        rc = acl.aclInit(None)
        if rc not in (0, 100002):  # ACL_ERROR_REPEAT_INITIALIZE
            print(f"launcher: aclInit failed with {rc}", file=sys.stderr)
            return 2

    devices = [int(d) for d in args.devices.split(",") if d.strip()]
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    workers: List[subprocess.Popen[bytes]] = []
    for rank, device in enumerate(devices):
        cmd = [sys.executable, os.path.join(HERE, "train.py"), "--device", str(device)]
        cmd += ["--steps", str(args.steps), "--interval", str(args.interval)]
        cmd += ["--param-bytes", str(args.param_bytes), "--seed", str(args.seed + rank)]
        cmd += ["--prefix", f"[rank {rank}] "]
        if args.out_dir:
            with open(os.path.join(args.out_dir, f"rank{rank}.log"), "ab") as out:
                workers.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out))
        else:
            workers.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))

    def forward(signum: int, _frame: object) -> None:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    rc = 0
    for w in workers:
        code = w.wait()
        if code != 0 and rc == 0:
            rc = code if code > 0 else 128 - code
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
