"""A torch_npu-shaped training job: an MLP trained by aclnn operators on the NPU (ctypes only).

What a PyTorch job on Ascend does underneath, without a framework: parameters, gradients and
optimizer state live in an *expandable-segments* caching allocator (a reserved device address range
backed chunk by chunk with ``aclrtMallocPhysical`` + ``aclrtMapMem``, tensors sub-allocated from
it); every step uploads its batch with ``aclrtMemcpyAsync`` on a copy stream, the compute stream
waits for it on an event, and forward, backward and the optimizer step run as asynchronous
two-phase ``aclnn*`` operators (``libopapi.so``) on the compute stream; with ``--ranks 2`` the
gradients are all-reduced by HCCL (``libhccl.so``) on that stream. After a synchronize the loss
and the parameters are read back with ``aclrtMemcpy`` and one line is printed per step::

    step N loss X checksum Y

(``Y``: CRC-32 of the parameters' bytes). The output is a pure function of the options: an
uninterrupted run and a run that was dumped and restored midway print the same lines.

    eval "$(npusnap sim env)"
    python3 npu_train.py --steps 50 --interval 0.2                  # one process, device 0
    python3 npu_train.py --steps 50 --ranks 2                       # a launcher and two ranks
    python3 npu_train.py --rank 0 --world 2 --device 0 --rendezvous /tmp/rdv &   # or by hand
    python3 npu_train.py --rank 1 --world 2 --device 1 --rendezvous /tmp/rdv

Ranks find each other through files in ``--rendezvous`` (rank 0 writes HCCL's root info there, as
a launcher's store would carry it). An HCCL communicator does not survive a snapshot restore (HCCL
marks it invalid); the job then destroys it and builds a new one, as vllm-ascend rebuilds its
groups. Runs on any Python 3.9+, standard library only.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

c_void_p = ctypes.c_void_p
c_size_t = ctypes.c_size_t
c_int = ctypes.c_int
c_int32 = ctypes.c_int32
c_uint32 = ctypes.c_uint32
c_int64 = ctypes.c_int64
c_uint64 = ctypes.c_uint64
byref = ctypes.byref

ACL_FLOAT = 0  # aclDataType
ACL_FORMAT_ND = 2  # aclFormat
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_HBM_MEM_HUGE = 4
HCCL_DATA_TYPE_FP32 = 4
HCCL_REDUCE_SUM = 0
HCCL_E_UNAVAIL = 7  # a communicator a snapshot restore invalidated
HCCL_ROOT_INFO_BYTES = 4108

IN_DIM = 16
OUT_DIM = 4
BATCH = 32
NBATCHES = 8  # the data set: this many batches per rank, cycled
LR = 0.05
MOMENTUM = 0.9
SEGMENT_BYTES = 64 << 20  # the allocator's reserved address range
ALIGN = 512
RENDEZVOUS_S = 120.0


class JobError(RuntimeError):
    pass


def check(code: int, what: str) -> None:
    if code != 0:
        raise JobError(f"{what} failed with error {code}")


class PhysicalMemProp(ctypes.Structure):
    """aclrtPhysicalMemProp (include/external/acl/acl_rt.h)."""

    _fields_ = [
        ("handleType", c_int),
        ("allocationType", c_int),
        ("memAttr", c_int),
        ("locationId", c_uint32),
        ("locationType", c_int),
        ("reserve", c_uint64),
    ]


P = ctypes.POINTER
_RT: Dict[str, Tuple[Any, List[Any]]] = {
    "aclInit": (c_int, [ctypes.c_char_p]),
    "aclrtSetDevice": (c_int, [c_int32]),
    "aclrtResetDevice": (c_int, [c_int32]),
    "aclrtCreateStreamWithConfig": (c_int, [P(c_void_p), c_uint32, c_uint32]),
    "aclrtDestroyStream": (c_int, [c_void_p]),
    "aclrtSynchronizeStream": (c_int, [c_void_p]),
    "aclrtCreateEvent": (c_int, [P(c_void_p)]),
    "aclrtDestroyEvent": (c_int, [c_void_p]),
    "aclrtRecordEvent": (c_int, [c_void_p, c_void_p]),
    "aclrtStreamWaitEvent": (c_int, [c_void_p, c_void_p]),
    "aclrtMemcpy": (c_int, [c_void_p, c_size_t, c_void_p, c_size_t, c_int]),
    "aclrtMemcpyAsync": (c_int, [c_void_p, c_size_t, c_void_p, c_size_t, c_int, c_void_p]),
    "aclrtReserveMemAddress": (c_int, [P(c_void_p), c_size_t, c_size_t, c_void_p, c_uint64]),
    "aclrtReleaseMemAddress": (c_int, [c_void_p]),
    "aclrtMallocPhysical": (c_int, [P(c_void_p), c_size_t, P(PhysicalMemProp), c_uint64]),
    "aclrtFreePhysical": (c_int, [c_void_p]),
    "aclrtMapMem": (c_int, [c_void_p, c_size_t, c_size_t, c_void_p, c_uint64]),
    "aclrtUnmapMem": (c_int, [c_void_p]),
}
_OPAPI: Dict[str, Tuple[Any, List[Any]]] = {
    "aclCreateTensor": (
        c_void_p,
        [P(c_int64), c_uint64, c_int, P(c_int64), c_int64, c_int, P(c_int64), c_uint64, c_void_p],
    ),
    "aclDestroyTensor": (c_int, [c_void_p]),
    "aclCreateScalar": (c_void_p, [c_void_p, c_int]),
    "aclDestroyScalar": (c_int, [c_void_p]),
    "aclCreateIntArray": (c_void_p, [P(c_int64), c_uint64]),
    "aclDestroyIntArray": (c_int, [c_void_p]),
}
_HCCL: Dict[str, Tuple[Any, List[Any]]] = {
    "HcclGetRootInfo": (c_int, [c_void_p]),
    "HcclCommInitRootInfo": (c_int, [c_uint32, c_void_p, c_uint32, P(c_void_p)]),
    "HcclAllReduce": (c_int, [c_void_p, c_void_p, c_uint64, c_int, c_int, c_void_p, c_void_p]),
    "HcclBroadcast": (c_int, [c_void_p, c_uint64, c_int, c_uint32, c_void_p, c_void_p]),
    "HcclCommDestroy": (c_int, [c_void_p]),
    "HcclGetCommAsyncError": (c_int, [c_void_p, P(c_int)]),
}


def _load(path: str, table: Dict[str, Tuple[Any, List[Any]]]) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in table.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


class Libs:
    """The CANN libraries of $ASCEND_HOME_PATH (as set_env.sh sets it), as torch_npu loads them."""

    def __init__(self, hccl: bool) -> None:
        home = os.environ.get("ASCEND_HOME_PATH")
        if not home:
            raise JobError(
                'ASCEND_HOME_PATH is not set: source your CANN set_env.sh, or eval "$(npusnap sim env)"'
            )
        lib64 = os.path.join(home, "lib64")
        self.rt = _load(os.path.join(lib64, "libacl_rt.so"), _RT)
        self.op = _load(os.path.join(lib64, "libopapi.so"), _OPAPI)
        self.hccl = _load(os.path.join(lib64, "libhccl.so"), _HCCL) if hccl else None


class ExpandableSegment:
    """torch_npu's expandable segment: one reserved address range, mapped a chunk at a time."""

    def __init__(self, rt: ctypes.CDLL, device: int, size: int) -> None:
        self.rt = rt
        self.prop = PhysicalMemProp(0, 0, ACL_HBM_MEM_HUGE, device, ACL_MEM_LOCATION_TYPE_DEVICE, 0)
        self.chunk = self._granularity(rt)
        self.size = (size + self.chunk - 1) // self.chunk * self.chunk
        va = c_void_p()
        check(rt.aclrtReserveMemAddress(byref(va), self.size, 0, None, 0), "aclrtReserveMemAddress")
        self.base = int(va.value or 0)
        self.handles: List[c_void_p] = []

    def _granularity(self, rt: ctypes.CDLL) -> int:
        """The size of a physical chunk: the runtime's recommended granularity, as torch_npu asks
        for it; a runtime without that query gets the 2 MiB of a huge page of device memory."""
        try:
            fn = rt.aclrtMemGetAllocationGranularity
        except AttributeError:
            return 2 << 20
        fn.restype = c_int
        fn.argtypes = [P(PhysicalMemProp), c_int, P(c_size_t)]
        gran = c_size_t(0)
        check(fn(byref(self.prop), 1, byref(gran)), "aclrtMemGetAllocationGranularity")
        return max(int(gran.value), 1 << 20)

    @property
    def mapped(self) -> int:
        return len(self.handles) * self.chunk

    def grow_to(self, nbytes: int) -> None:
        if nbytes > self.size:
            raise JobError(f"the expandable segment is full ({self.size} bytes reserved)")
        while self.mapped < nbytes:
            h = c_void_p()
            check(
                self.rt.aclrtMallocPhysical(byref(h), self.chunk, byref(self.prop), 0), "aclrtMallocPhysical"
            )
            check(self.rt.aclrtMapMem(self.base + self.mapped, self.chunk, 0, h, 0), "aclrtMapMem")
            self.handles.append(h)

    def release(self) -> None:
        for i, h in enumerate(self.handles):
            self.rt.aclrtUnmapMem(self.base + i * self.chunk)
            self.rt.aclrtFreePhysical(h)
        self.handles = []
        self.rt.aclrtReleaseMemAddress(self.base)


class CachingAllocator:
    """Blocks sub-allocated from an expandable segment; freed blocks are cached by size."""

    def __init__(self, segment: ExpandableSegment) -> None:
        self.seg = segment
        self.top = 0
        self.free_blocks: Dict[int, List[int]] = {}

    def malloc(self, nbytes: int) -> int:
        size = (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN
        cached = self.free_blocks.get(size)
        if cached:
            return cached.pop()
        self.seg.grow_to(self.top + size)
        addr = self.seg.base + self.top
        self.top += size
        return addr

    def free(self, addr: int, nbytes: int) -> None:
        size = (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN
        self.free_blocks.setdefault(size, []).append(addr)


class Tensor:
    """An fp32 view of device memory: shape, strides and offset in elements, as aclCreateTensor takes."""

    def __init__(
        self,
        op: ctypes.CDLL,
        data: int,
        shape: Sequence[int],
        strides: Optional[Sequence[int]] = None,
        offset: int = 0,
    ) -> None:
        self.data = data
        self.shape = tuple(shape)
        if strides is None:
            strides, acc = [], 1
            for d in reversed(self.shape):
                strides.insert(0, acc)
                acc *= d
        self.strides = tuple(strides)
        self.offset = offset
        nd = len(self.shape)
        dims = (c_int64 * max(nd, 1))(*self.shape)
        st = (c_int64 * max(nd, 1))(*self.strides)
        span = offset + sum((d - 1) * s for d, s in zip(self.shape, self.strides)) + 1
        storage = (c_int64 * 1)(span)
        self.handle = op.aclCreateTensor(dims, nd, ACL_FLOAT, st, offset, ACL_FORMAT_ND, storage, 1, data)
        if not self.handle:
            raise JobError(f"aclCreateTensor{self.shape} failed")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def t(self, op: ctypes.CDLL) -> Tensor:
        """The transposed view of a 2-D tensor (no copy: the strides swap)."""
        return Tensor(op, self.data, self.shape[::-1], self.strides[::-1], self.offset)


class Ops:
    """aclnn operators launched on one stream: GetWorkspaceSize, then the launch."""

    def __init__(self, libs: Libs, alloc: CachingAllocator, stream: c_void_p) -> None:
        self.op = libs.op
        self.alloc = alloc
        self.stream = stream
        self.scalars: Dict[float, int] = {}
        self.dims0 = libs.op.aclCreateIntArray((c_int64 * 1)(0), 1)

    def scalar(self, v: float) -> int:
        if v not in self.scalars:
            f = ctypes.c_float(v)
            self.scalars[v] = self.op.aclCreateScalar(ctypes.addressof(f), ACL_FLOAT)
        return self.scalars[v]

    def run(self, name: str, *args: Any) -> None:
        ws = c_uint64(0)
        ex = c_void_p()
        prepare = getattr(self.op, name + "GetWorkspaceSize")
        prepare.restype = c_int
        check(prepare(*args, byref(ws), byref(ex)), name + "GetWorkspaceSize")
        workspace = self.alloc.malloc(ws.value) if ws.value else 0
        launch = getattr(self.op, name)
        launch.restype = c_int
        launch.argtypes = [c_void_p, c_uint64, c_void_p, c_void_p]
        check(launch(workspace or None, ws.value, ex, self.stream), name)
        if workspace:
            self.alloc.free(workspace, ws.value)  # stream-ordered: the next user runs after this kernel

    def matmul(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        self.run(
            "aclnnMatmul", c_void_p(a.handle), c_void_p(b.handle), c_void_p(out.handle), ctypes.c_int8(0)
        )

    def add_(self, out: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> None:
        self.run(
            "aclnnAdd",
            c_void_p(a.handle),
            c_void_p(b.handle),
            c_void_p(self.scalar(alpha)),
            c_void_p(out.handle),
        )

    def inplace_add(self, self_ref: Tensor, other: Tensor, alpha: float) -> None:
        self.run(
            "aclnnInplaceAdd", c_void_p(self_ref.handle), c_void_p(other.handle), c_void_p(self.scalar(alpha))
        )

    def inplace_muls(self, self_ref: Tensor, v: float) -> None:
        self.run("aclnnInplaceMuls", c_void_p(self_ref.handle), c_void_p(self.scalar(v)))

    def relu(self, a: Tensor, out: Tensor) -> None:
        self.run("aclnnRelu", c_void_p(a.handle), c_void_p(out.handle))

    def threshold_backward(self, grad: Tensor, x: Tensor, out: Tensor) -> None:
        self.run(
            "aclnnThresholdBackward",
            c_void_p(grad.handle),
            c_void_p(x.handle),
            c_void_p(self.scalar(0.0)),
            c_void_p(out.handle),
        )

    def sum0(self, a: Tensor, out: Tensor) -> None:
        self.run(
            "aclnnReduceSum",
            c_void_p(a.handle),
            c_void_p(self.dims0),
            ctypes.c_bool(False),
            c_int(ACL_FLOAT),
            c_void_p(out.handle),
        )

    def mse_loss(self, y: Tensor, target: Tensor, out: Tensor) -> None:
        self.run(
            "aclnnMseLoss", c_void_p(y.handle), c_void_p(target.handle), c_int64(1), c_void_p(out.handle)
        )

    def mse_loss_backward(self, grad: Tensor, y: Tensor, target: Tensor, out: Tensor) -> None:
        self.run(
            "aclnnMseLossBackward",
            c_void_p(grad.handle),
            c_void_p(y.handle),
            c_void_p(target.handle),
            c_int64(1),
            c_void_p(out.handle),
        )


def floats(values: Sequence[float]) -> bytes:
    return array.array("f", values).tobytes()


def make_data(seed: int, rank: int, hidden: int) -> Tuple[List[bytes], List[bytes], bytes]:
    """Batches (inputs, targets) of one rank and the initial parameters, all from the seed."""
    teacher = random.Random(f"npu-train-teacher-{seed}")
    wt = [[teacher.uniform(-1, 1) for _ in range(OUT_DIM)] for _ in range(IN_DIM)]
    rng = random.Random(f"npu-train-data-{seed}-{rank}")
    xs, ts = [], []
    for _ in range(NBATCHES):
        x = [[rng.gauss(0.0, 1.0) for _ in range(IN_DIM)] for _ in range(BATCH)]
        t = [
            [math.tanh(sum(x[b][i] * wt[i][o] for i in range(IN_DIM))) for o in range(OUT_DIM)]
            for b in range(BATCH)
        ]
        xs.append(floats([v for row in x for v in row]))
        ts.append(floats([v for row in t for v in row]))
    init = random.Random(f"npu-train-init-{seed}")
    params: List[float] = []
    for fan_in, n in (
        (IN_DIM, IN_DIM * hidden),
        (IN_DIM, hidden),
        (hidden, hidden * OUT_DIM),
        (hidden, OUT_DIM),
    ):
        bound = 1.0 / math.sqrt(fan_in)
        params += [init.uniform(-bound, bound) for _ in range(n)]
    return xs, ts, floats(params)


class Trainer:
    def __init__(self, libs: Libs, args: argparse.Namespace) -> None:
        self.libs = libs
        self.args = args
        self.rank, self.world = args.rank, args.world
        self.device = args.device
        rt = libs.rt
        rc = rt.aclInit(None)
        if rc not in (0, ACL_ERROR_REPEAT_INITIALIZE):
            check(rc, "aclInit")
        check(rt.aclrtSetDevice(self.device), f"aclrtSetDevice({self.device})")
        self.compute, self.copy = c_void_p(), c_void_p()
        check(rt.aclrtCreateStreamWithConfig(byref(self.compute), 0, 0), "aclrtCreateStreamWithConfig")
        check(rt.aclrtCreateStreamWithConfig(byref(self.copy), 0, 0), "aclrtCreateStreamWithConfig")
        self.uploaded, self.consumed = c_void_p(), c_void_p()
        check(rt.aclrtCreateEvent(byref(self.uploaded)), "aclrtCreateEvent")
        check(rt.aclrtCreateEvent(byref(self.consumed)), "aclrtCreateEvent")
        self.segment = ExpandableSegment(rt, self.device, SEGMENT_BYTES)
        self.alloc = CachingAllocator(self.segment)
        self.ops = Ops(libs, self.alloc, self.compute)
        op = libs.op
        h = args.hidden
        self.xs, self.ts, init = make_data(args.seed, self.rank, h)
        sizes = [IN_DIM * h, h, h * OUT_DIM, OUT_DIM]
        self.nparams = sum(sizes)
        nbytes = 4 * self.nparams
        # Flat buffers (as DDP buckets gradients): one all-reduce and one optimizer pass each.
        self.p_addr = self.alloc.malloc(nbytes)
        self.g_addr = self.alloc.malloc(nbytes)
        self.m_addr = self.alloc.malloc(nbytes)
        self.flat_p = Tensor(op, self.p_addr, [self.nparams])
        self.flat_g = Tensor(op, self.g_addr, [self.nparams])
        self.flat_m = Tensor(op, self.m_addr, [self.nparams])
        shapes = [[IN_DIM, h], [h], [h, OUT_DIM], [OUT_DIM]]
        offs = [0, sizes[0], sizes[0] + sizes[1], sizes[0] + sizes[1] + sizes[2]]
        self.w1, self.b1, self.w2, self.b2 = (
            Tensor(op, self.p_addr, s, offset=o) for s, o in zip(shapes, offs)
        )
        self.gw1, self.gb1, self.gw2, self.gb2 = (
            Tensor(op, self.g_addr, s, offset=o) for s, o in zip(shapes, offs)
        )

        def act(*shape: int) -> Tensor:
            n = 1
            for d in shape:
                n *= d
            return Tensor(op, self.alloc.malloc(4 * n), shape)

        self.x, self.t = act(BATCH, IN_DIM), act(BATCH, OUT_DIM)
        self.h1, self.a1, self.y = act(BATCH, h), act(BATCH, h), act(BATCH, OUT_DIM)
        self.loss = act()
        self.one = act()
        self.dy, self.da1, self.dh1 = act(BATCH, OUT_DIM), act(BATCH, h), act(BATCH, h)
        self.a1_t, self.w2_t, self.x_t = self.a1.t(op), self.w2.t(op), self.x.t(op)
        self.h2d(self.p_addr, init)
        self.h2d(self.m_addr, bytes(nbytes))
        self.h2d(self.one.data, floats([1.0]))
        self.comm = c_void_p()
        self.comm_gen = 0
        if self.world > 1:
            self.build_comm()
            # As DDP does at start: every rank takes rank 0's parameters.
            hccl = libs.hccl
            assert hccl is not None
            p, n = self.p_addr, self.nparams
            check(hccl.HcclBroadcast(p, n, HCCL_DATA_TYPE_FP32, 0, self.comm, self.compute), "HcclBroadcast")
            check(rt.aclrtSynchronizeStream(self.compute), "aclrtSynchronizeStream")

    def h2d(self, addr: int, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        check(
            self.libs.rt.aclrtMemcpy(addr, len(data), buf, len(data), ACL_MEMCPY_HOST_TO_DEVICE),
            "aclrtMemcpy",
        )

    def d2h(self, addr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        check(self.libs.rt.aclrtMemcpy(buf, n, addr, n, ACL_MEMCPY_DEVICE_TO_HOST), "aclrtMemcpy")
        return buf.raw

    # ------------------------------------------------------------------ HCCL

    def _root_file(self) -> str:
        return os.path.join(self.args.rendezvous, f"hccl-root-{self.comm_gen}")

    def build_comm(self) -> None:
        """A communicator of all ranks: rank 0 publishes HCCL's root info, the others read it."""
        hccl = self.libs.hccl
        assert hccl is not None
        info = ctypes.create_string_buffer(HCCL_ROOT_INFO_BYTES)
        path = self._root_file()
        if self.rank == 0:
            check(hccl.HcclGetRootInfo(info), "HcclGetRootInfo")
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(info.raw)
            os.replace(tmp, path)
        else:
            deadline = time.monotonic() + RENDEZVOUS_S
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise JobError(
                        f"rank 0 published no HCCL root info at {path} within {RENDEZVOUS_S:.0f} s"
                    )
                time.sleep(0.05)
            with open(path, "rb") as f:
                ctypes.memmove(info, f.read(HCCL_ROOT_INFO_BYTES), HCCL_ROOT_INFO_BYTES)
        comm = c_void_p()
        check(hccl.HcclCommInitRootInfo(self.world, info, self.rank, byref(comm)), "HcclCommInitRootInfo")
        self.comm = comm

    def rebuild_comm(self) -> None:
        """A snapshot restore invalidated the communicator: destroy it, build a new one."""
        assert self.libs.hccl is not None
        self.libs.hccl.HcclCommDestroy(self.comm)
        self.comm_gen += 1
        self.build_comm()

    def all_reduce_grads(self) -> None:
        hccl = self.libs.hccl
        assert hccl is not None
        g, n = self.g_addr, self.nparams
        for attempt in (0, 1):
            rc = hccl.HcclAllReduce(g, g, n, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, self.comm, self.compute)
            if rc != HCCL_E_UNAVAIL or attempt:
                break
            self.rebuild_comm()
        check(rc, "HcclAllReduce")
        self.ops.inplace_muls(self.flat_g, 1.0 / self.world)

    def optimizer_step(self) -> None:
        """SGD with momentum: m = mu * m + g; p = p - lr * m."""
        self.ops.inplace_muls(self.flat_m, MOMENTUM)
        self.ops.inplace_add(self.flat_m, self.flat_g, 1.0)
        self.ops.inplace_add(self.flat_p, self.flat_m, -LR)

    def sync_collective_step(self) -> None:
        """Wait for the step's all-reduce and optimizer. An all-reduce launched just before a
        snapshot lock reaches its stream after the restore, on the invalidated communicator: it
        fails there without touching the gradients and the stream skips what followed it (the
        optimizer), so both are run again on a new communicator."""
        rt, hccl = self.libs.rt, self.libs.hccl
        assert hccl is not None
        rc = rt.aclrtSynchronizeStream(self.compute)
        if rc == 0:
            return
        err = c_int(0)
        hccl.HcclGetCommAsyncError(self.comm, byref(err))
        if err.value != HCCL_E_UNAVAIL:
            check(rc, "aclrtSynchronizeStream")
        self.rebuild_comm()
        self.all_reduce_grads()
        self.optimizer_step()
        check(rt.aclrtSynchronizeStream(self.compute), "aclrtSynchronizeStream")

    # ------------------------------------------------------------------ one step

    def step(self, n: int) -> Optional[str]:
        rt, ops = self.libs.rt, self.ops
        k = (n - 1) % NBATCHES
        # The copy stream uploads the batch once the compute stream is done with the last one.
        if n > 1:
            check(rt.aclrtStreamWaitEvent(self.copy, self.consumed), "aclrtStreamWaitEvent")
        for dst, src in ((self.x, self.xs[k]), (self.t, self.ts[k])):
            check(
                rt.aclrtMemcpyAsync(dst.data, len(src), src, len(src), ACL_MEMCPY_HOST_TO_DEVICE, self.copy),
                "aclrtMemcpyAsync",
            )
        check(rt.aclrtRecordEvent(self.uploaded, self.copy), "aclrtRecordEvent")
        check(rt.aclrtStreamWaitEvent(self.compute, self.uploaded), "aclrtStreamWaitEvent")
        # Forward.
        ops.matmul(self.x, self.w1, self.h1)
        ops.add_(self.h1, self.h1, self.b1)
        ops.relu(self.h1, self.a1)
        ops.matmul(self.a1, self.w2, self.y)
        ops.add_(self.y, self.y, self.b2)
        ops.mse_loss(self.y, self.t, self.loss)
        # Backward.
        ops.mse_loss_backward(self.one, self.y, self.t, self.dy)
        ops.matmul(self.a1_t, self.dy, self.gw2)
        ops.sum0(self.dy, self.gb2)
        ops.matmul(self.dy, self.w2_t, self.da1)
        ops.threshold_backward(self.da1, self.h1, self.dh1)
        ops.matmul(self.x_t, self.dh1, self.gw1)
        check(rt.aclrtRecordEvent(self.consumed, self.compute), "aclrtRecordEvent")
        ops.sum0(self.dh1, self.gb1)
        if self.world > 1:
            self.all_reduce_grads()
        self.optimizer_step()
        if self.world > 1:
            self.sync_collective_step()
        if n % self.args.log_every and n != self.args.steps:
            return None
        check(rt.aclrtSynchronizeStream(self.compute), "aclrtSynchronizeStream")
        (loss,) = array.array("f", self.d2h(self.loss.data, 4))
        params = self.d2h(self.p_addr, 4 * self.nparams)
        return f"step {n} loss {loss:.6f} checksum {zlib.crc32(params):08x}"

    def close(self) -> None:
        rt = self.libs.rt
        rt.aclrtSynchronizeStream(self.compute)
        rt.aclrtSynchronizeStream(self.copy)
        if self.comm.value and self.libs.hccl is not None:
            self.libs.hccl.HcclCommDestroy(self.comm)
        self.segment.release()
        for ev in (self.uploaded, self.consumed):
            rt.aclrtDestroyEvent(ev)
        for s in (self.compute, self.copy):
            rt.aclrtDestroyStream(s)
        rt.aclrtResetDevice(self.device)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="number of steps, 0 = run forever (default 100)")
    ap.add_argument("--interval", type=float, default=0.0, help="seconds to sleep between steps (default 0)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP (default 64)")
    ap.add_argument("--device", type=int, default=0, help="device id (default 0; rank R of a launcher: R)")
    ap.add_argument("--seed", type=int, default=0, help="seed of data and initial parameters (default 0)")
    ap.add_argument("--log-every", type=int, default=1, help="read back and print every N steps (default 1)")
    ap.add_argument(
        "--ranks", type=int, default=1, help="launch this many ranks on devices 0..N-1 (default 1)"
    )
    ap.add_argument("--rank", type=int, default=None, help="run as this rank of --world (started by hand)")
    ap.add_argument("--world", type=int, default=1, help="number of ranks when started with --rank")
    ap.add_argument("--rendezvous", default=None, help="directory the ranks meet in (with --rank)")
    ap.add_argument("--prefix", default="", help="text put before every printed line")
    args = ap.parse_args(argv)
    if args.hidden < 1 or args.log_every < 1 or args.ranks < 1 or args.world < 1:
        ap.error("--hidden, --log-every, --ranks and --world must be at least 1")
    if args.rank is not None and not (0 <= args.rank < args.world):
        ap.error("--rank must be in [0, --world)")
    if args.rank is not None and args.world > 1 and not args.rendezvous:
        ap.error("--rank with --world > 1 needs --rendezvous DIR")
    return args


def launch(args: argparse.Namespace, argv: List[str]) -> int:
    """--ranks N: start N rank processes of this script (devices 0..N-1) and wait for them."""
    rdv = tempfile.mkdtemp(prefix="npu-train-rdv-")
    base: List[str] = []
    skip = False
    for a in argv:  # every option but --ranks is passed on
        if skip:
            skip = False
        elif a == "--ranks":
            skip = True
        elif not a.startswith("--ranks="):
            base.append(a)
    workers: List[subprocess.Popen[bytes]] = []
    for r in range(args.ranks):
        cmd = [sys.executable, os.path.abspath(__file__), *base, "--rank", str(r), "--world", str(args.ranks)]
        cmd += ["--device", str(r), "--rendezvous", rdv, "--prefix", f"[rank {r}] "]
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
    shutil.rmtree(rdv, ignore_errors=True)  # kept until the ranks are gone: a rebuild meets there
    return rc


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.rank is None and args.ranks > 1:
        return launch(args, argv)
    if args.rank is None:
        args.rank, args.world = 0, 1
    try:
        trainer = Trainer(Libs(hccl=args.world > 1), args)
        n = 0
        while args.steps == 0 or n < args.steps:
            n += 1
            line = trainer.step(n)
            if line is not None:
                # One write per line: ranks sharing a stdout never interleave within a line.
                sys.stdout.write(args.prefix + line + "\n")
                sys.stdout.flush()
            if args.interval > 0 and (args.steps == 0 or n < args.steps):
                time.sleep(args.interval)
        trainer.close()
    except (JobError, OSError) as exc:
        print(f"{args.prefix}npu_train: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
