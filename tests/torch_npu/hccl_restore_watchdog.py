"""A snapshot Restore invalidates HCCL communicators; torch_npu sees it as it would on a device.

Two ranks (plain subprocesses) all-reduce over HCCL on the simulated NPU, then each takes its own
process through the runtime's snapshot calls (aclrtSnapShotProcessLock, Backup, Restore, Unlock,
with (pid, NULL) as CANN 9.1 takes them). Each rank sees only its own device
(ASCEND_RT_VISIBLE_DEVICES): a Restore needs its devices free of other processes, and torch_npu
opens device 0 in every process that can see it. HCCL's RESTORE_POST callback marks every communicator
invalid: from then on each call on it answers HCCL_E_UNAVAIL and HcclGetCommAsyncError reports
HCCL_E_UNAVAIL.

- `watchdog`: TORCH_HCCL_ASYNC_ERROR_HANDLING at its default (tear down). The watchdog's next
  poll (ProcessGroupHCCL::checkHcclComms, every second) finds the error and takes the process
  down: each rank must end by SIGABRT within 30 s, saying "got ERROR via HcclGetCommAsyncError".
- `rebuild`: TORCH_HCCL_ASYNC_ERROR_HANDLING=0 (no watchdog action). The ranks call
  torch_npu.distributed.reinit_process_group(rebuild_link=True) (one at a time, meeting through
  the store before and after), which destroys the communicators
  and makes new ones through root info and HcclCommInitRootInfoConfig; the next all_reduce gives
  the right sum (device memory contents do not survive a Restore, so the tensor is uploaded anew).
Exits non-zero on any mismatch."""

from __future__ import annotations

import ctypes
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


def snapshot_cycle() -> list[int]:
    lib = os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so")
    rt = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD)  # the runtime this process already uses
    codes = []
    for name in ("Lock", "Backup", "Restore", "Unlock"):
        fn = getattr(rt, f"aclrtSnapShotProcess{name}")
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
        codes.append(fn(os.getpid(), None))
    return codes


def rank_main(rank: int, port: int, case: str) -> None:
    import torch
    import torch.distributed as dist
    import torch_npu  # noqa: F401

    torch.npu.set_device(0)  # its one visible device (ASCEND_RT_VISIBLE_DEVICES)
    dev = "npu:0"
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.full((256,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    print(f"rank {rank} before {t[0].item()}", flush=True)
    torch.npu.synchronize()
    print(f"rank {rank} snapshot {snapshot_cycle()}", flush=True)
    if case == "watchdog":
        time.sleep(20)  # the watchdog must end the process before this does
        print(f"rank {rank} still alive", flush=True)
        return
    import torch_npu.distributed as tnd

    # reinit_process_group resets the group's root-info counter and deletes its store keys: the
    # ranks must not overlap in it (one rank's delete could take the other's new root info), so
    # they meet before and after it, through the store (no collective works yet).
    store = dist.distributed_c10d._get_default_store()

    def store_barrier(name: str) -> None:
        store.add(name, 1)
        deadline = time.monotonic() + 30
        while int(store.add(name, 0)) < 2:
            assert time.monotonic() < deadline, f"no peer at {name}"
            time.sleep(0.05)

    store_barrier("before_reinit")
    tnd.reinit_process_group(rebuild_link=True)
    store_barrier("after_reinit")
    t = torch.full((256,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    print(f"rank {rank} after rebuild {t[0].item()}", flush=True)
    dist.destroy_process_group()


def run_case(case: str) -> list[str]:
    port = free_port()
    env = dict(os.environ)
    if case == "rebuild":
        env["TORCH_HCCL_ASYNC_ERROR_HANDLING"] = "0"
    else:
        env.pop("TORCH_HCCL_ASYNC_ERROR_HANDLING", None)
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--rank", str(r), str(port), case],
            env=dict(env, ASCEND_RT_VISIBLE_DEVICES=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    bad = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=75)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            bad.append(f"{case}: rank {r} did not end within 75 s")
        print(f"{case}: rank {r} exit {p.returncode}: " + " | ".join(out.split("\n")).strip(" |"))
        if f"rank {r} before 3.0" not in out or f"rank {r} snapshot [0, 0, 0, 0]" not in out:
            bad.append(f"{case}: rank {r}: no all_reduce or snapshot cycle before:\n{out}\n{err[-3000:]}")
        if case == "watchdog":
            if p.returncode != -signal.SIGABRT or "still alive" in out:
                bad.append(
                    f"{case}: rank {r} was not taken down by the watchdog: {p.returncode}\n{err[-3000:]}"
                )
            if "got ERROR via HcclGetCommAsyncError" not in err:
                bad.append(f"{case}: rank {r}: the watchdog did not report the async error:\n{err[-3000:]}")
            for line in err.splitlines():
                if "HcclGetCommAsyncError" in line or "entire process down" in line:
                    print(f"  rank {r}: {line.strip()[:200]}")
        else:
            if p.returncode != 0 or f"rank {r} after rebuild 3.0" not in out:
                bad.append(f"{case}: rank {r}: the rebuilt group did not all-reduce:\n{out}\n{err[-3000:]}")
    return bad


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return 0
    bad = []
    for case in sys.argv[1:] or ["watchdog", "rebuild"]:
        bad += run_case(case)
    print("\n".join(bad) if bad else "OK: a restored communicator fails as HCCL's, and rebuilds")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
