"""Keeping io_uring out of a job (`npusnap run --no-io-uring`): a seccomp filter on io_uring_setup.

CRIU cannot dump an io_uring instance (docs/distributed.md), and some libraries open one that no
setting of theirs removes: libuv 1.50 and later always set up a ring to batch its epoll_ctl calls
(src/unix/linux.c, ``uv__iou_init(..., &lfields->ctl, 256, 0)``; ``UV_USE_IO_URING`` only governs
the SQPOLL ring for file operations), and PyTorch's TCPStore runs its server on that libuv, in
torchrun's elastic agent too, where torch 2.13 offers no switch (``USE_LIBUV`` reaches only the
stores that ranks host themselves).

The filter makes ``io_uring_setup`` fail with ENOSYS in the process and everything it starts,
exactly as on a kernel built without io_uring: libuv (and any program that runs on kernels
without io_uring) then falls back to plain epoll and system calls, and no ring ever exists.
Nothing else is filtered. A seccomp filter is inherited across fork and exec, and CRIU saves and
restores it with the process, so a restored job stays without rings.

Installing a filter needs CAP_SYS_ADMIN or the no_new_privs bit (seccomp(2)); without the
capability the bit is set, and set-uid programs in the job then run without their privileges.
"""

from __future__ import annotations

import ctypes
import os

# seccomp(2), include/uapi/linux/{prctl,seccomp,filter,bpf_common}.h
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K
SECCOMP_DATA_NR = 0  # offsetof(struct seccomp_data, nr)
# io_uring_setup has number 425 on every architecture of the unified table (x86_64, aarch64,
# i386 and arm compat tasks alike); x32 tasks on x86_64 add __X32_SYSCALL_BIT.
IO_URING_SETUP = 425
X32_SYSCALL_BIT = 0x40000000
ENOSYS = 38
CAP_SYS_ADMIN = 21


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


PROGRAM: tuple[tuple[int, int, int, int], ...] = (
    (BPF_LD_W_ABS, 0, 0, SECCOMP_DATA_NR),
    (BPF_JEQ_K, 2, 0, IO_URING_SETUP),  # -> ENOSYS
    (BPF_JEQ_K, 1, 0, X32_SYSCALL_BIT | IO_URING_SETUP),  # -> ENOSYS
    (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
)


def needs_no_new_privs() -> bool:
    """True when this process lacks CAP_SYS_ADMIN, so the filter needs the no_new_privs bit."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return not (int(line.split()[1], 16) >> CAP_SYS_ADMIN) & 1
    except (OSError, ValueError, IndexError):
        pass
    return True


def deny_io_uring() -> None:
    """Install the filter in this process (then inherited by everything it execs and forks).
    Raises OSError with the kernel's errno if it cannot be installed."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    if needs_no_new_privs() and libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    insns = (_SockFilter * len(PROGRAM))(*(_SockFilter(*i) for i in PROGRAM))
    prog = _SockFprog(len(PROGRAM), insns)
    addr = ctypes.cast(ctypes.byref(prog), ctypes.c_void_p)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, addr, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")
