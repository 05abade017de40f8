"""Descriptors CRIU cannot dump, found before anything is locked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from npusnap_cli.errors import PreflightError

# CRIU 4.2.1 dumps an anon-inode descriptor only of the kinds dump_one_file() knows
# (criu/files.c: eventfd, eventpoll, inotify, fanotify, signalfd, timerfd, pidfd; bpf-map only
# when CRIU was built with libbpf); anything else goes to dump_unsupp_fd(), which fails the dump
# unless a plugin claims it (none does for anon inodes). Found only by CRIU, that failure comes
# after the NPU lock (then rolled back); /proc/PID/fd shows it before anything is touched.

CRIU_ANON_KINDS = ("[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]")
IO_URING_ENTER = 426  # the same number on x86_64 and aarch64 (the unified syscall table)

_ANON_FIX = {
    "[io_uring]": (
        "an io_uring instance: CRIU cannot save its rings or in-flight requests",
        "start the job again under `npusnap run --no-io-uring -- CMD...`: io_uring_setup then fails "
        "in the whole tree (ENOSYS, as on a kernel without io_uring) and libuv, like most programs, "
        "falls back to epoll; or make the program close its ring before the dump",
    ),
    "[perf_event]": (
        "a perf event (a profiler or `perf` attached from inside)",
        "stop the profiler in the job before the dump (perf_event fds cannot be saved)",
    ),
    "[userfaultfd]": (
        "a userfaultfd (a user-space pager, a live-migration or GC runtime)",
        "make the program close it before the dump",
    ),
}


# PyTorch's TCPStore server on libuv (the default since torch 2.4) names its loop thread so
# (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp); libuv 1.50 and later always set up a
# ring for that loop (src/unix/linux.c, the epoll_ctl batching ring), whatever UV_USE_IO_URING
# says. torchrun's elastic agent runs as "pt_elastic" (torch/distributed/run.py).
TORCH_STORE_THREAD = "pt_tcpstore_uv"
TORCHRUN_COMM = "pt_elastic"
TORCHRUN_MODULES = ("torchrun", "torch.distributed.run", "torch.distributed.launch")

_TORCHRUN_FIX = (
    "this is torchrun's elastic agent: its rendezvous stores hold the ring, and torch (2.13) has no "
    "setting for them (USE_LIBUV reaches only stores that ranks host themselves, and "
    "UV_USE_IO_URING=0 does not remove this ring). Start the job again as `npusnap run "
    "--no-io-uring -- torchrun ...`: io_uring_setup then fails in the agent and its workers and "
    "libuv uses epoll (docs/distributed.md, PyTorch)"
)
_TORCH_RANK_FIX = (
    "this process hosts PyTorch's rendezvous store (rank 0 of ranks started without torchrun): "
    "start every rank with USE_LIBUV=0 in its environment (torch/distributed/rendezvous.py reads "
    "it for env:// and tcp://; or `?use_libuv=0` in a tcp:// init_method URL), or start the job "
    "under `npusnap run --no-io-uring` (docs/distributed.md, PyTorch)"
)


@dataclass(frozen=True)
class UndumpableFd:
    pid: int
    fd: int
    kind: str  # the anon-inode name: "[io_uring]", "bpf-prog", ...
    comm: str
    threads: tuple[tuple[int, str], ...]  # (tid, name) of threads in a system call on it
    # (tid, name) of PyTorch's libuv TCPStore threads in the process (for a ring: its user)
    store_threads: tuple[tuple[int, str], ...] = ()
    torchrun: bool = False  # the process is torchrun's elastic agent

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "fd": self.fd,
            "kind": self.kind,
            "comm": self.comm,
            "threads": [{"tid": t, "name": n} for t, n in self.threads],
            "torch_store_threads": [{"tid": t, "name": n} for t, n in self.store_threads],
            "torchrun": self.torchrun,
        }

    def fix(self) -> tuple[str, str]:
        """What the descriptor is, and the exact way out."""
        what, fix = _ANON_FIX.get(
            self.kind,
            (f"an anon inode of kind {self.kind}", "make the program close it before the dump"),
        )
        if self.kind == "[io_uring]" and self.store_threads:
            what = f"{what} (PyTorch's TCPStore, on libuv)"
            fix = _TORCHRUN_FIX if self.torchrun else _TORCH_RANK_FIX
        return what, fix


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _threads_on(pid: int, fd: int, kind: str) -> tuple[tuple[int, str], ...]:
    """Threads of ``pid`` blocked in a system call whose first argument is ``fd`` (io_uring_enter
    for a ring), and the kernel's io_uring workers (iou-wrk-*, iou-sqp-*) of a ring."""
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return ()
    for tid in tids:
        name = _read(f"/proc/{pid}/task/{tid}/comm")
        fields = _read(f"/proc/{pid}/task/{tid}/syscall").split()
        try:
            on_fd = len(fields) > 1 and int(fields[1], 16) == fd
        except ValueError:
            on_fd = False
        if on_fd or (kind == "[io_uring]" and name.startswith(("iou-wrk-", "iou-sqp-"))):
            out.append((tid, name))
    return tuple(out)


def _torch_store_threads(pid: int) -> tuple[tuple[int, str], ...]:
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return ()
    named = ((tid, _read(f"/proc/{pid}/task/{tid}/comm")) for tid in tids)
    return tuple((tid, name) for tid, name in named if name == TORCH_STORE_THREAD)


def _is_torchrun(pid: int, comm: str) -> bool:
    if comm == TORCHRUN_COMM:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:4]
    except OSError:
        return False
    words = [os.path.basename(a.decode(errors="replace")) for a in argv]
    return any(w in TORCHRUN_MODULES for w in words)


def find_undumpable_fds(pids: list[int], bpf_maps: bool = False) -> list[UndumpableFd]:
    """Descriptors of the processes that CRIU 4.2.1 refuses to dump (anon inodes of kinds it
    does not know), with the threads that are using them."""
    known = CRIU_ANON_KINDS + (("bpf-map",) if bpf_maps else ())
    found = []
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in sorted(names, key=lambda n: int(n) if n.isdigit() else -1):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if not link.startswith("anon_inode:"):
                continue
            kind = link[len("anon_inode:") :]
            if kind in known:
                continue
            fd = int(name)
            comm = _read(f"/proc/{pid}/comm") or "?"
            threads = _threads_on(pid, fd, kind)
            store = _torch_store_threads(pid) if kind == "[io_uring]" else ()
            found.append(
                UndumpableFd(
                    pid=pid,
                    fd=fd,
                    kind=kind,
                    comm=comm,
                    threads=threads,
                    store_threads=store,
                    torchrun=bool(store) and _is_torchrun(pid, comm),
                )
            )
    return found


def undumpable_fds_error(found: list[UndumpableFd]) -> Optional[Any]:
    """The preflight refusal naming the first such descriptor and its fix, or None."""
    if not found:
        return None

    e = found[0]
    what, fix = e.fix()
    threads = ", ".join(f"{tid} ({name})" for tid, name in e.threads)
    store = ", ".join(f"{tid} ({name})" for tid, name in e.store_threads)
    others = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return PreflightError(
        f"pid {e.pid} ({e.comm}) holds anon_inode:{e.kind} on fd {e.fd}{others}"
        + (f", used by thread(s) {threads}" if threads else "")
        + (f"; PyTorch's TCPStore runs on libuv in thread(s) {store}" if store else ""),
        why=f"it is {what}; CRIU dumps only the anon-inode kinds it knows ({', '.join(CRIU_ANON_KINDS)}) "
        "and would fail after the job was locked",
        fix=fix,
        details={"undumpable_fds": [x.to_dict() for x in found]},
    )


def criu_has_libbpf(binary_path: str) -> bool:
    """Whether this CRIU was linked with libbpf (then it dumps bpf maps)."""
    try:
        with open(binary_path, "rb") as f:
            return b"libbpf.so" in f.read()
    except OSError:
        return False
