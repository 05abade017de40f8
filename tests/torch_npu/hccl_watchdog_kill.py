"""A rank killed mid-run: the surviving rank's ProcessGroupHCCL watchdog takes its process down,
as on a device.

Two ranks in two processes (plain subprocesses: mp.spawn would itself kill the survivor when a
rank dies), both on the simulated NPU over HCCL. Rank 1 runs a few all_reduces and SIGKILLs
itself; rank 0 goes on calling all_reduce, which no peer answers. What happens then is
torch_npu's own code (ProcessGroupHCCL.cpp, the watchdog's workCleanupLoop): every second it
checks its works for a timeout (the process group's `timeout`) and the communicators for an
async error (HcclGetCommAsyncError); with TORCH_HCCL_ASYNC_ERROR_HANDLING at its default
(tear down) the first one makes WorkHCCL::handleException rethrow on the watchdog thread, and
the process ends in std::terminate (SIGABRT).

Two cases: `timeout` (the process group's timeout, 5 s, runs out first: "Watchdog caught
collective operation timeout") and `exec` (HCCL_EXEC_TIMEOUT, 4 s, runs out first: the
collective fails on the stream and HcclGetCommAsyncError reports HCCL_E_TIMEOUT). Each must end
rank 0 by SIGABRT within 60 s with torch_npu's tear-down message. Exits non-zero otherwise."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, pg_timeout: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch_npu  # noqa: F401

    torch.npu.set_device(rank)
    dist.init_process_group(
        "hccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    t = torch.ones(1024, device=f"npu:{rank}")
    for step in range(1, 1000):
        dist.all_reduce(t)
        t.div_(2.0)
        torch.npu.synchronize()
        print(f"rank {rank} step {step} ok", flush=True)
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.1)


def run_case(case: str) -> list[str]:
    port = free_port()
    env = dict(os.environ)
    if case == "exec":
        env["HCCL_EXEC_TIMEOUT"] = "4"
        pg_timeout = 120.0
    else:
        env.pop("HCCL_EXEC_TIMEOUT", None)
        pg_timeout = 5.0
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--rank", str(r), str(port), str(pg_timeout)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    t0 = time.monotonic()
    bad = []
    try:
        _, err1 = procs[1].communicate(timeout=60)
        killed_at = time.monotonic()
        out0, err0 = procs[0].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return [f"{case}: a rank did not end within 60 s"]
    took = time.monotonic() - killed_at
    print(
        f"{case}: rank 1 ended by signal {-procs[1].returncode} after {killed_at - t0:.1f} s; "
        f"rank 0 ended with {procs[0].returncode} {took:.1f} s later"
    )
    if procs[1].returncode != -signal.SIGKILL:
        bad.append(f"{case}: rank 1 did not die of SIGKILL: {procs[1].returncode}\n{err1[-2000:]}")
    if "rank 0 step 3 ok" not in out0:
        bad.append(f"{case}: rank 0 did not run three steps:\n{out0}\n{err0[-3000:]}")
    if procs[0].returncode != -signal.SIGABRT:
        bad.append(f"{case}: rank 0 did not end by SIGABRT: {procs[0].returncode}\n{err0[-3000:]}")
    want = "Watchdog caught collective operation timeout" if case == "timeout" else "HcclGetCommAsyncError"
    tear = "we are taking the entire process down"
    for w in (want, tear):
        if w not in err0:
            bad.append(f"{case}: rank 0's stderr lacks {w!r}:\n{err0[-3000:]}")
    for line in err0.splitlines():
        if any(k in line for k in (want, tear, "HCCL_E_TIMEOUT", "error code")):
            print(f"  rank 0: {line.strip()[:200]}")
    return bad


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return 0
    bad = []
    for case in sys.argv[1:] or ["timeout", "exec"]:
        bad += run_case(case)
    print("\n".join(bad) if bad else "OK: the watchdog took the surviving rank down")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
