"""Runs aclnn operators and HCCL collectives on the simulated NPU and prints what they computed.

    ops_driver.py ops DEVICE            -> one JSON line per case: inputs, output or status code
    ops_driver.py allreduce RANK WORLD DEVICE RENDEZVOUS COUNT
    ops_driver.py restore RANK WORLD DEVICE RENDEZVOUS
    ops_driver.py config RANK WORLD DEVICE RENDEZVOUS   (HcclCommInitRootInfoConfig, names)
    ops_driver.py abandoned RANK WORLD DEVICE RENDEZVOUS (rank 1 leaves; rank 0 destroys)
    ops_driver.py vcoll RANK WORLD DEVICE RENDEZVOUS    (AllGatherV, ReduceScatterV, AlltoAllV)
    ops_driver.py torn DEVICE            (NPUSIM_KERNEL_BLOCK_US, TORN_AFTER_S)

The inputs are drawn here (seeded) and printed with the results, so that the test computes its
Python reference from exactly the bytes the device saw. Tensors, operators and the libraries come
from the npu_train workload (its Libs, Tensor and Ops), the path every aclnn call of the job takes.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import random
import struct
import sys
import threading
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "npusnap_workloads"))
import npu_train as nt  # type: ignore[import-not-found]

c_void_p = ctypes.c_void_p


class Device:
    def __init__(self, device: int, hccl: bool = False) -> None:
        self.libs = nt.Libs(hccl=hccl)
        rt = self.libs.rt
        rt.aclrtMalloc.argtypes = [ctypes.POINTER(c_void_p), ctypes.c_size_t, ctypes.c_int]
        rt.aclrtMalloc.restype = ctypes.c_int
        nt.check(rt.aclInit(None), "aclInit")
        nt.check(rt.aclrtSetDevice(device), "aclrtSetDevice")
        self.stream = c_void_p()
        nt.check(
            rt.aclrtCreateStreamWithConfig(ctypes.byref(self.stream), 0, 0), "aclrtCreateStreamWithConfig"
        )
        self.ops = nt.Ops(self.libs, None, self.stream)  # type: ignore[arg-type]

    def buffer(self, values: Sequence[float]) -> int:
        ptr = c_void_p()
        n = max(len(values), 1) * 4
        nt.check(self.libs.rt.aclrtMalloc(ctypes.byref(ptr), n, 0), "aclrtMalloc")
        data = nt.floats(values) if values else bytes(4)
        nt.check(self.libs.rt.aclrtMemcpy(ptr, n, data, n, nt.ACL_MEMCPY_HOST_TO_DEVICE), "aclrtMemcpy")
        return int(ptr.value or 0)

    def read(self, addr: int, n: int) -> List[float]:
        buf = ctypes.create_string_buffer(4 * n)
        nt.check(
            self.libs.rt.aclrtMemcpy(buf, 4 * n, addr, 4 * n, nt.ACL_MEMCPY_DEVICE_TO_HOST), "aclrtMemcpy"
        )
        return list(array.array("f", buf.raw))

    def read_bytes(self, addr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        nt.check(self.libs.rt.aclrtMemcpy(buf, n, addr, n, nt.ACL_MEMCPY_DEVICE_TO_HOST), "aclrtMemcpy")
        return buf.raw

    def sync(self) -> None:
        nt.check(self.libs.rt.aclrtSynchronizeStream(self.stream), "aclrtSynchronizeStream")


def rand(rng: random.Random, n: int) -> List[float]:
    # Values exactly representable in fp32, so the reference sees what the device saw.
    return list(array.array("f", [4.0 * rng.random() - 2.0 for _ in range(n)]))


def _narrow(values: List[float], fmt: str) -> List[float]:
    """Values rounded to float16 ("e") or bfloat16 (truncated: exact values are all the test needs)."""
    return _unpack(_pack(values, fmt, round_bf16=True), fmt)


def _pack(values: List[float], fmt: str, round_bf16: bool = False) -> bytes:
    if fmt == "e":
        return struct.pack(f"<{len(values)}e", *values)
    words = struct.unpack(f"<{len(values)}I", struct.pack(f"<{len(values)}f", *values))
    return struct.pack(f"<{len(values)}H", *((w >> 16) for w in words))


def _unpack(data: bytes, fmt: str) -> List[float]:
    n = len(data) // 2
    if fmt == "e":
        return list(struct.unpack(f"<{n}e", data))
    halves = struct.unpack(f"<{n}H", data)
    return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *((h << 16) for h in halves))))


def _raw_tensor(
    dev: Device, op: ctypes.CDLL, data: bytes, shape: List[int], strides: List[int], dtype: int
) -> Any:
    """A 2-byte-element tensor over a new device buffer holding ``data``."""

    class T:
        pass

    ptr = c_void_p()
    nt.check(dev.libs.rt.aclrtMalloc(ctypes.byref(ptr), len(data), 0), "aclrtMalloc")
    nt.check(
        dev.libs.rt.aclrtMemcpy(ptr, len(data), data, len(data), nt.ACL_MEMCPY_HOST_TO_DEVICE), "aclrtMemcpy"
    )
    t = T()
    t.data = int(ptr.value or 0)  # type: ignore[attr-defined]
    span = sum((d - 1) * st for d, st in zip(shape, strides)) + 1
    dims = (ctypes.c_int64 * 2)(*shape)
    st = (ctypes.c_int64 * 2)(*strides)
    storage = (ctypes.c_int64 * 1)(span)
    t.handle = op.aclCreateTensor(dims, 2, dtype, st, 0, nt.ACL_FORMAT_ND, storage, 1, t.data)  # type: ignore[attr-defined]
    return t


def status(dev: Device, name: str, *args: Any) -> int:
    ws = ctypes.c_uint64(0)
    ex = c_void_p()
    fn = getattr(dev.libs.op, name + "GetWorkspaceSize")
    fn.restype = ctypes.c_int
    return int(fn(*args, ctypes.byref(ws), ctypes.byref(ex)))


def run_ops(device: int) -> None:
    dev = Device(device)
    op, ops = dev.libs.op, dev.ops
    rng = random.Random(11)

    def tensor(
        values: List[float], shape: Sequence[int], strides: Optional[Sequence[int]] = None
    ) -> nt.Tensor:
        return nt.Tensor(op, dev.buffer(values), shape, strides)

    def emit(case: str, inputs: Dict[str, List[float]], out: nt.Tensor, **extra: Any) -> None:
        dev.sync()
        print(
            json.dumps({"case": case, "inputs": inputs, "out": dev.read(out.data, out.numel), **extra}),
            flush=True,
        )

    a, b = rand(rng, 5 * 7), rand(rng, 7 * 3)
    out = tensor([0.0] * 15, [5, 3])
    ops.matmul(tensor(a, [5, 7]), tensor(b, [7, 3]), out)
    emit("matmul", {"a": a, "b": b}, out)
    # A transposed view: storage [5,7], viewed as [7,5] by swapping the strides.
    c = rand(rng, 5 * 3)
    out = tensor([0.0] * 21, [7, 3])
    ops.matmul(tensor(a, [7, 5], [1, 7]), tensor(c, [5, 3]), out)
    emit("matmul_transposed", {"a": a, "c": c}, out)
    out = tensor([0.0] * 15, [5, 3])
    ops.run(
        "aclnnMm",
        c_void_p(tensor(a, [5, 7]).handle),
        c_void_p(tensor(b, [7, 3]).handle),
        c_void_p(out.handle),
        ctypes.c_int8(0),
    )
    emit("mm", {"a": a, "b": b}, out)
    # The same with float16 and bfloat16 operands: b widened to float in panels (exactly), the sums
    # in float, the output rounded to its dtype once.
    for name, dt, fmt in (("f16", 1, "e"), ("bf16", 27, "bf16")):
        m, k, n = 11, 37, 29
        a, w = _narrow(rand(rng, m * k), fmt), _narrow(rand(rng, k * n), fmt)
        for layout, strides in (("", [n, 1]), ("wt_", [1, k])):
            ta = _raw_tensor(dev, op, _pack(a, fmt), [m, k], [k, 1], dt)
            tb = _raw_tensor(dev, op, _pack(w, fmt), [k, n], strides, dt)
            to = _raw_tensor(dev, op, bytes(2 * m * n), [m, n], [n, 1], dt)
            ops.matmul(ta, tb, to)
            dev.sync()
            emit_raw = _unpack(dev.read_bytes(to.data, 2 * m * n), fmt)
            print(
                json.dumps(
                    {
                        "case": f"matmul_bits_{name}_{layout}{m}",
                        "inputs": {"a": a, "b": w, "shape": [m, k, n], "b_strides": strides, "dtype": name},
                        "out": emit_raw,
                    }
                ),
                flush=True,
            )
    # Shapes that cross every edge of the product's blocking (rows in eights, b's rows in fours, columns
    # in eights): b row-major, and b a Linear weight's transpose (w [n, k] seen as [k, n]).
    for m in (3, 11):
        k, n = 37, 29
        a, w = rand(rng, m * k), rand(rng, k * n)
        out = tensor([0.0] * (m * n), [m, n])
        ops.matmul(tensor(a, [m, k]), tensor(w, [k, n]), out)
        emit(f"matmul_bits_{m}", {"a": a, "b": w, "shape": [m, k, n], "b_strides": [n, 1]}, out)
        out = tensor([0.0] * (m * n), [m, n])
        ops.matmul(tensor(a, [m, k]), tensor(w, [k, n], [1, k]), out)
        emit(f"matmul_bits_wt_{m}", {"a": a, "b": w, "shape": [m, k, n], "b_strides": [1, k]}, out)
    x, bias = rand(rng, 12), rand(rng, 3)
    out = tensor([0.0] * 12, [4, 3])
    ops.add_(out, tensor(x, [4, 3]), tensor(bias, [3]), alpha=2.0)
    emit("add_broadcast", {"x": x, "bias": bias}, out, alpha=2.0)
    y, z = rand(rng, 6), rand(rng, 6)
    t = tensor(y, [6])
    ops.inplace_add(t, tensor(z, [6]), -0.5)
    emit("inplace_add", {"y": y, "z": z}, t, alpha=-0.5)
    x2 = rand(rng, 12)
    out = tensor([0.0] * 12, [4, 3])
    ops.run(
        "aclnnMul",
        c_void_p(tensor(x, [4, 3]).handle),
        c_void_p(tensor(x2, [4, 3]).handle),
        c_void_p(out.handle),
    )
    emit("mul", {"x": x, "x2": x2}, out)
    t = tensor(x, [4, 3])
    ops.inplace_muls(t, 0.25)
    emit("inplace_muls", {"x": x}, t, scale=0.25)
    out = tensor([0.0] * 12, [4, 3])
    ops.run("aclnnMuls", c_void_p(tensor(x, [4, 3]).handle), c_void_p(ops.scalar(-3.0)), c_void_p(out.handle))
    emit("muls", {"x": x}, out, scale=-3.0)
    out = tensor([0.0] * 12, [12])
    ops.relu(tensor(x, [12]), out)
    emit("relu", {"x": x}, out)
    g = rand(rng, 12)
    out = tensor([0.0] * 12, [12])
    ops.threshold_backward(tensor(g, [12]), tensor(x, [12]), out)
    emit("threshold_backward", {"g": g, "x": x}, out)
    out = tensor([0.0] * 3, [3])
    ops.sum0(tensor(x, [4, 3]), out)
    emit("reduce_sum_dim0", {"x": x}, out)
    out = tensor([0.0] * 4, [4, 1])
    dims = op.aclCreateIntArray((ctypes.c_int64 * 1)(-1), 1)
    ops.run(
        "aclnnReduceSum",
        c_void_p(tensor(x, [4, 3]).handle),
        c_void_p(dims),
        ctypes.c_bool(True),
        ctypes.c_int(nt.ACL_FLOAT),
        c_void_p(out.handle),
    )
    emit("reduce_sum_dim1_keepdim", {"x": x}, out)
    for reduction in (1, 2):
        out = tensor([0.0], [])
        ops.run(
            "aclnnMseLoss",
            c_void_p(tensor(x, [4, 3]).handle),
            c_void_p(tensor(x2, [4, 3]).handle),
            ctypes.c_int64(reduction),
            c_void_p(out.handle),
        )
        emit("mse_loss", {"x": x, "t": x2}, out, reduction=reduction)
    out = tensor([0.0] * 12, [4, 3])
    ops.run(
        "aclnnMseLoss",
        c_void_p(tensor(x, [4, 3]).handle),
        c_void_p(tensor(x2, [4, 3]).handle),
        ctypes.c_int64(0),
        c_void_p(out.handle),
    )
    emit("mse_loss", {"x": x, "t": x2}, out, reduction=0)
    out = tensor([0.0] * 12, [4, 3])
    ops.mse_loss_backward(tensor([0.5], []), tensor(x, [4, 3]), tensor(x2, [4, 3]), out)
    emit("mse_loss_backward", {"x": x, "t": x2}, out, grad=0.5)

    # The first phase's argument checks.
    h = {
        n: tensor([0.0] * 12, s).handle
        for n, s in (("m43", [4, 3]), ("m34", [3, 4]), ("m44", [4, 4]), ("v5", [5]))
    }
    half = nt.Tensor(op, dev.buffer([0.0] * 12), [4, 3])
    half16 = op.aclCreateTensor(
        (ctypes.c_int64 * 2)(4, 3), 2, 1, None, 0, nt.ACL_FORMAT_ND, None, 0, half.data
    )
    codes = {
        "matmul_inner_mismatch": status(
            dev, "aclnnMatmul", c_void_p(h["m43"]), c_void_p(h["m43"]), c_void_p(h["m44"]), ctypes.c_int8(0)
        ),
        "matmul_out_mismatch": status(
            dev, "aclnnMatmul", c_void_p(h["m43"]), c_void_p(h["m34"]), c_void_p(h["m43"]), ctypes.c_int8(0)
        ),
        "matmul_null": status(
            dev, "aclnnMatmul", None, c_void_p(h["m34"]), c_void_p(h["m44"]), ctypes.c_int8(0)
        ),
        "add_not_broadcastable": status(
            dev,
            "aclnnAdd",
            c_void_p(h["m43"]),
            c_void_p(h["v5"]),
            c_void_p(ops.scalar(1.0)),
            c_void_p(h["m43"]),
        ),
        "add_null_alpha": status(
            dev, "aclnnAdd", c_void_p(h["m43"]), c_void_p(h["m43"]), None, c_void_p(h["m43"])
        ),
        "relu_fp16": status(dev, "aclnnRelu", c_void_p(half16), c_void_p(h["m43"])),
        "reduce_dim_out_of_range": status(
            dev,
            "aclnnReduceSum",
            c_void_p(h["m43"]),
            c_void_p(op.aclCreateIntArray((ctypes.c_int64 * 1)(2), 1)),
            ctypes.c_bool(False),
            ctypes.c_int(0),
            c_void_p(h["m43"]),
        ),
        "mse_bad_reduction": status(
            dev, "aclnnMseLoss", c_void_p(h["m43"]), c_void_p(h["m43"]), ctypes.c_int64(3), c_void_p(h["m43"])
        ),
    }
    # The second phase: an executor is made for one operator and used once.
    ws, ex = ctypes.c_uint64(0), c_void_p()
    op.aclnnReluGetWorkspaceSize(c_void_p(h["m43"]), c_void_p(h["m43"]), ctypes.byref(ws), ctypes.byref(ex))
    op.aclnnMatmul.argtypes = [c_void_p, ctypes.c_uint64, c_void_p, c_void_p]
    op.aclnnRelu.argtypes = [c_void_p, ctypes.c_uint64, c_void_p, c_void_p]
    codes["launch_other_operators_executor"] = int(op.aclnnMatmul(None, ws.value, ex, dev.stream))
    codes["launch_null_executor"] = int(op.aclnnRelu(None, 0, None, dev.stream))
    codes["workspace_size"] = int(ws.value)
    print(json.dumps({"case": "codes", "codes": codes}), flush=True)


def run_torn(device: int) -> None:
    """A copy of a kernel's output taken while the kernel runs (the synchronous aclrtMemcpy is not
    ordered with a stream's work): rows of finished blocks are new, the others still old."""
    dev = Device(device)
    op = dev.libs.op
    a = nt.Tensor(op, dev.buffer([1.0] * 16 * 8), [16, 8])
    b = nt.Tensor(op, dev.buffer([1.0] * 8 * 4), [8, 4])
    out = nt.Tensor(op, dev.buffer([-1.0] * 16 * 4), [16, 4])
    dev.ops.matmul(a, b, out)
    time.sleep(float(os.environ["TORN_AFTER_S"]))
    mid = dev.read(out.data, 64)
    dev.sync()
    final = dev.read(out.data, 64)
    rows = [mid[r * 4 : r * 4 + 4] for r in range(16)]
    print(json.dumps({"mid_rows": [r[0] for r in rows], "final": sorted(set(final))}), flush=True)


def root_info(hccl: ctypes.CDLL, rank: int, rendezvous: str, gen: int) -> ctypes.Array:
    """HCCL's root info: rank 0 makes it and publishes it as file root-GEN, the others read it."""
    info = ctypes.create_string_buffer(nt.HCCL_ROOT_INFO_BYTES)
    path = os.path.join(rendezvous, f"root-{gen}")
    if rank == 0:
        nt.check(hccl.HcclGetRootInfo(info), "HcclGetRootInfo")
        with open(path + ".tmp", "wb") as f:
            f.write(info.raw)
        os.replace(path + ".tmp", path)
    else:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            assert time.monotonic() < deadline, "no root info"
            time.sleep(0.02)
        with open(path, "rb") as f:
            ctypes.memmove(info, f.read(), nt.HCCL_ROOT_INFO_BYTES)
    return info


def init_comm(hccl: ctypes.CDLL, rank: int, world: int, rendezvous: str, gen: int) -> c_void_p:
    """A communicator of ``world`` ranks: rank 0 publishes HCCL's root info as file root-GEN."""
    info = root_info(hccl, rank, rendezvous, gen)
    comm = c_void_p()
    nt.check(hccl.HcclCommInitRootInfo(world, info, rank, ctypes.byref(comm)), "HcclCommInitRootInfo")
    return comm


def run_restore(rank: int, world: int, device: int, rendezvous: str) -> None:
    """A communicator across this process's own Lock, Backup, Restore and Unlock: HCCL's
    RESTORE_POST callback invalidates it; destroyed and built again, it all-reduces."""
    dev = Device(device, hccl=True)
    hccl, rt = dev.libs.hccl, dev.libs.rt
    assert hccl is not None
    values = [float(rank + 1)] * 16
    buf = dev.buffer(values)
    comm = init_comm(hccl, rank, world, rendezvous, 0)

    def all_reduce(c: c_void_p) -> int:
        return int(
            hccl.HcclAllReduce(buf, buf, 16, nt.HCCL_DATA_TYPE_FP32, nt.HCCL_REDUCE_SUM, c, dev.stream)
        )

    out: Dict[str, Any] = {"before": all_reduce(comm)}
    dev.sync()
    out["before_sum"] = dev.read(buf, 1)[0]
    nt.check(rt.aclrtMemcpy(buf, 64, nt.floats(values), 64, nt.ACL_MEMCPY_HOST_TO_DEVICE), "aclrtMemcpy")
    snap = {}
    for name in ("Lock", "Backup", "Restore", "Unlock"):
        fn = getattr(rt, f"aclrtSnapShotProcess{name}")
        fn.argtypes = [ctypes.c_int, c_void_p]
        snap[name] = fn
    out["Lock"] = int(snap["Lock"](os.getpid(), None))
    # An all-reduce called while locked: its launch waits at the lock, and reaches the stream
    # after the restore, on the communicator the restore invalidated.
    late: Dict[str, int] = {}
    t = threading.Thread(target=lambda: late.setdefault("rc", all_reduce(comm)))
    t.start()
    time.sleep(0.3)
    out["late_call_waits"] = t.is_alive()
    for name in ("Backup", "Restore", "Unlock"):
        out[name] = int(snap[name](os.getpid(), None))
    t.join(30)
    out["late_call"] = late.get("rc")
    out["late_sync"] = int(rt.aclrtSynchronizeStream(dev.stream))
    err = ctypes.c_int(-1)
    hccl.HcclGetCommAsyncError.argtypes = [c_void_p, ctypes.POINTER(ctypes.c_int)]
    out["async_error_rc"] = int(hccl.HcclGetCommAsyncError(comm, ctypes.byref(err)))
    out["async_error"] = err.value
    out["after_restore"] = all_reduce(comm)
    size = ctypes.c_uint32()
    out["rank_size_after_restore"] = int(hccl.HcclGetRankSize(comm, ctypes.byref(size)))
    out["resume_after_restore"] = int(hccl.HcclCommResume(comm))
    out["destroy"] = int(hccl.HcclCommDestroy(comm))
    comm = init_comm(hccl, rank, world, rendezvous, 1)
    nt.check(rt.aclrtMemcpy(buf, 64, nt.floats(values), 64, nt.ACL_MEMCPY_HOST_TO_DEVICE), "aclrtMemcpy")
    out["rebuilt"] = all_reduce(comm)
    dev.sync()
    out["rebuilt_sum"] = dev.read(buf, 1)[0]
    nt.check(hccl.HcclCommDestroy(comm), "HcclCommDestroy")
    print(json.dumps(out), flush=True)


def run_allreduce(rank: int, world: int, device: int, rendezvous: str, count: int) -> None:
    dev = Device(device, hccl=True)
    hccl = dev.libs.hccl
    assert hccl is not None
    comm = init_comm(hccl, rank, world, rendezvous, 0)
    values = rand(random.Random(100 + rank), count)
    send = dev.buffer(values)
    recv = dev.buffer([0.0] * count)
    codes = {
        "bad_dtype": int(
            hccl.HcclAllReduce(send, recv, count, 7, nt.HCCL_REDUCE_SUM, comm, dev.stream)
        ),  # uint8: not reduced
        "bad_op": int(hccl.HcclAllReduce(send, recv, count, nt.HCCL_DATA_TYPE_FP32, 9, comm, dev.stream)),
    }
    # Printed at sampled indices (the ends, around each 1 MiB staging slot's edges, the middle)
    # with a CRC-32 of the whole result: every rank must hold the same bits.
    slot = (1 << 20) // 4
    idx = sorted(
        {i for k in range(count // slot + 1) for i in (k * slot - 1, k * slot) if 0 <= i < count}
        | {0, count // 2, count - 1}
    )
    results: Dict[str, Any] = {}
    for name, op, dst in (("sum", nt.HCCL_REDUCE_SUM, recv), ("max", 2, recv), ("inplace_sum", 0, send)):
        nt.check(
            hccl.HcclAllReduce(send, dst, count, nt.HCCL_DATA_TYPE_FP32, op, comm, dev.stream),
            "HcclAllReduce",
        )
        dev.sync()
        got = dev.read(dst, count)
        results[name] = {"at": [got[i] for i in idx], "crc": zlib.crc32(array.array("f", got).tobytes())}
    # Broadcast from rank 1 (in place): every rank ends with rank 1's values.
    bcast = dev.buffer(values)
    hccl.HcclBroadcast.argtypes = [
        c_void_p,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.c_uint32,
        c_void_p,
        c_void_p,
    ]
    nt.check(hccl.HcclBroadcast(bcast, count, nt.HCCL_DATA_TYPE_FP32, 1, comm, dev.stream), "HcclBroadcast")
    dev.sync()
    got = dev.read(bcast, count)
    results["broadcast_from_1"] = {
        "at": [got[i] for i in idx],
        "crc": zlib.crc32(array.array("f", got).tobytes()),
    }
    codes["broadcast_bad_root"] = int(
        hccl.HcclBroadcast(bcast, count, nt.HCCL_DATA_TYPE_FP32, 2, comm, dev.stream)
    )
    nt.check(hccl.HcclCommDestroy(comm), "HcclCommDestroy")
    sample = [values[i] for i in idx]
    print(
        json.dumps({"rank": rank, "idx": idx, "values": sample, "results": results, "codes": codes}),
        flush=True,
    )


class HcclCommConfig(ctypes.Structure):
    """hccl_types.h HcclCommConfig, after the 24-byte header HcclCommConfigInit writes."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magicWord", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64),
        ("hcclBufferSize", ctypes.c_uint32),
        ("hcclDeterministic", ctypes.c_uint32),
        ("hcclCommName", ctypes.c_char * 128),
        ("hcclUdi", ctypes.c_char * 128),
        ("hcclOpExpansionMode", ctypes.c_uint32),
        ("hcclRdmaTrafficClass", ctypes.c_uint32),
        ("hcclRdmaServiceLevel", ctypes.c_uint32),
        ("hcclWorldRankID", ctypes.c_uint32),
        ("hcclJobID", ctypes.c_uint64),
        ("aclGraphZeroCopyEnable", ctypes.c_uint8),
        ("hcclExecTimeOut", ctypes.c_int32),
        ("hcclAlgo", ctypes.c_char * 1600),
        ("hcclRetryEnable", ctypes.c_char * 50),
        ("hcclRetryParams", ctypes.c_char * 128),
        ("hcclBufferName", ctypes.c_char * 128),
        ("hcclQos", ctypes.c_uint32),
    ]


def comm_config(buffer_mib: int = 0xFFFFFFFF, name: bytes = b"", magic: int = 0xF0F0F0F0) -> HcclCommConfig:
    """What the inline HcclCommConfigInit of hccl.h fills in (version 10), then the caller's fields."""
    c = HcclCommConfig()
    c.size, c.magicWord, c.version = ctypes.sizeof(HcclCommConfig), magic, 10
    c.hcclBufferSize, c.hcclDeterministic = buffer_mib, 0xFFFFFFFF
    c.hcclCommName = name
    c.hcclRdmaTrafficClass = c.hcclRdmaServiceLevel = c.hcclQos = 0xFFFFFFFF
    c.hcclExecTimeOut = -1
    return c


def window_sizes() -> List[int]:
    """Sizes of this process's mappings of HCCL windows (the simulated CCL buffers)."""
    sizes = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "npusim-hccl-window" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                sizes.append(hi - lo)
    return sorted(sizes)


def run_config(rank: int, world: int, device: int, rendezvous: str) -> None:
    """HcclCommInitRootInfoConfig as torch_npu calls it: the capability, a bad magic word, the
    buffer size and the name taken from the configuration, then a collective on it."""
    dev = Device(device, hccl=True)
    hccl = dev.libs.hccl
    assert hccl is not None
    hccl.HcclGetCommConfigCapability.restype = ctypes.c_uint32
    hccl.HcclGetCommName.argtypes = [c_void_p, ctypes.c_char_p]
    out: Dict[str, Any] = {"capability": int(hccl.HcclGetCommConfigCapability())}
    bad = c_void_p()
    info = root_info(hccl, rank, rendezvous, 0)
    cfg = comm_config(magic=0x12345678)
    out["bad_magic"] = int(
        hccl.HcclCommInitRootInfoConfig(world, info, rank, ctypes.byref(cfg), ctypes.byref(bad))
    )
    cfg = comm_config(buffer_mib=3, name=b"group_name_7")
    comm = c_void_p()
    before = window_sizes()
    out["init"] = int(
        hccl.HcclCommInitRootInfoConfig(world, info, rank, ctypes.byref(cfg), ctypes.byref(comm))
    )
    out["window_bytes"] = [s for s in window_sizes() if s not in before]
    name = ctypes.create_string_buffer(128)
    out["name_rc"] = int(hccl.HcclGetCommName(comm, name))
    out["name"] = name.value.decode()
    buf = dev.buffer([float(rank + 1)] * 16)
    out["allreduce"] = int(
        hccl.HcclAllReduce(buf, buf, 16, nt.HCCL_DATA_TYPE_FP32, nt.HCCL_REDUCE_SUM, comm, dev.stream)
    )
    dev.sync()
    out["sum"] = dev.read(buf, 1)[0]
    out["prod_bf16"] = int(hccl.HcclAllReduce(buf, buf, 16, 11, 1, comm, dev.stream))
    out["destroy"] = int(hccl.HcclCommDestroy(comm))
    print(json.dumps(out), flush=True)


def run_vcoll(rank: int, world: int, device: int, rendezvous: str) -> None:
    """The V collectives with counts that differ per rank, through a 1 MiB CCL buffer (run with
    HCCL_BUFFSIZE=1) so that the large one needs several rounds. Rank r's values are
    r * 1000 + i; the test computes what each rank must receive."""
    dev = Device(device, hccl=True)
    hccl = dev.libs.hccl
    assert hccl is not None
    comm = init_comm(hccl, rank, world, rendezvous, 0)
    u64s = lambda xs: (ctypes.c_uint64 * len(xs))(*xs)  # noqa: E731
    vp, u64, i32 = c_void_p, ctypes.c_uint64, ctypes.c_int
    hccl.HcclAllGatherV.argtypes = [vp, u64, vp, vp, vp, i32, vp, vp]
    hccl.HcclReduceScatterV.argtypes = [vp, vp, vp, vp, u64, i32, i32, vp, vp]
    out: Dict[str, Any] = {}
    # AllGatherV: rank r sends 5 + 300000 * r elements; they land in rank order, 7 elements apart.
    counts = [5 + 300000 * r for r in range(world)]
    displs = [sum(counts[:r]) + 7 * r for r in range(world)]
    total = displs[-1] + counts[-1]
    send = dev.buffer([float(rank * 1000 + i % 1000) for i in range(counts[rank])])
    recv = dev.buffer([-1.0] * total)
    out["allgatherv"] = int(
        hccl.HcclAllGatherV(
            send, counts[rank], recv, u64s(counts), u64s(displs), nt.HCCL_DATA_TYPE_FP32, comm, dev.stream
        )
    )
    dev.sync()
    got = dev.read(recv, total)
    out["allgatherv_crc"] = zlib.crc32(array.array("f", got).tobytes())
    # ReduceScatterV: each rank sends block k (n elements at displacement 11 * k + k * n) to rank k.
    n = 200003
    sdispls = [k * (n + 11) for k in range(world)]
    send = dev.buffer([float(rank * 1000 + i % 1000) for i in range(sdispls[-1] + n)])
    recv = dev.buffer([-1.0] * n)
    out["reducescatterv"] = int(
        hccl.HcclReduceScatterV(
            send,
            u64s([n] * world),
            u64s(sdispls),
            recv,
            n,
            nt.HCCL_DATA_TYPE_FP32,
            nt.HCCL_REDUCE_SUM,
            comm,
            dev.stream,
        )
    )
    dev.sync()
    out["reducescatterv_crc"] = zlib.crc32(array.array("f", dev.read(recv, n)).tobytes())
    out["reducescatterv_uneven"] = int(
        hccl.HcclReduceScatterV(
            send,
            u64s([n, n + 1][:world]),
            u64s(sdispls),
            recv,
            n,
            nt.HCCL_DATA_TYPE_FP32,
            nt.HCCL_REDUCE_SUM,
            comm,
            dev.stream,
        )
    )
    nt.check(hccl.HcclCommDestroy(comm), "HcclCommDestroy")
    print(json.dumps(out), flush=True)


def run_abandoned(rank: int, world: int, device: int, rendezvous: str) -> None:
    """Rank 1 leaves after the init; rank 0's all-reduce waits for it, and HcclCommDestroy (the
    only abort torch_npu has) ends that wait instead of sitting out HCCL_EXEC_TIMEOUT."""
    dev = Device(device, hccl=True)
    hccl, rt = dev.libs.hccl, dev.libs.rt
    assert hccl is not None
    comm = init_comm(hccl, rank, world, rendezvous, 0)
    if rank == 1:
        print(json.dumps({}), flush=True)
        os._exit(0)
    buf = dev.buffer([1.0] * 16)
    out: Dict[str, Any] = {
        "allreduce": int(
            hccl.HcclAllReduce(buf, buf, 16, nt.HCCL_DATA_TYPE_FP32, nt.HCCL_REDUCE_SUM, comm, dev.stream)
        )
    }
    time.sleep(0.5)
    t0 = time.monotonic()
    out["destroy"] = int(hccl.HcclCommDestroy(comm))
    out["destroy_within_5s"] = time.monotonic() - t0 < 5
    out["sync"] = int(rt.aclrtSynchronizeStream(dev.stream))
    print(json.dumps(out), flush=True)


def main() -> int:
    if sys.argv[1] == "ops":
        run_ops(int(sys.argv[2]))
    elif sys.argv[1] == "torn":
        run_torn(int(sys.argv[2]))
    elif sys.argv[1] == "restore":
        rank, world, device, rdv = sys.argv[2:6]
        run_restore(int(rank), int(world), int(device), rdv)
    elif sys.argv[1] == "vcoll":
        rank, world, device, rdv = sys.argv[2:6]
        run_vcoll(int(rank), int(world), int(device), rdv)
    elif sys.argv[1] == "abandoned":
        rank, world, device, rdv = sys.argv[2:6]
        run_abandoned(int(rank), int(world), int(device), rdv)
    elif sys.argv[1] == "config":
        rank, world, device, rdv = sys.argv[2:6]
        run_config(int(rank), int(world), int(device), rdv)
    else:
        rank, world, device, rdv, count = sys.argv[2:7]
        run_allreduce(int(rank), int(world), int(device), rdv, int(count))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
