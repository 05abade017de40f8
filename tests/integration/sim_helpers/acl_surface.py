"""Call the simulated tree's ACL surface that torch_npu needs beyond memory and streams, with
ctypes, and print what each call answered as one JSON object on the last line of stdout.

Run by tests/integration/test_sim_exports.py in the environment of `npusnap sim env` (a private
daemon). Each key is one observation; the test asserts the values. The libraries are loaded the
way torch_npu loads them: by bare name, from the tree's lib64 on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from typing import Any

c_int, c_int32, c_int64, c_uint32, c_uint64, c_size_t = (
    ctypes.c_int,
    ctypes.c_int32,
    ctypes.c_int64,
    ctypes.c_uint32,
    ctypes.c_uint64,
    ctypes.c_size_t,
)
vp = ctypes.c_void_p
out: dict[str, Any] = {}

acl = ctypes.CDLL("libascendcl.so", mode=ctypes.RTLD_GLOBAL)
opc = ctypes.CDLL("libacl_op_compiler.so")
prof = ctypes.CDLL("libprofapi.so")
rt = ctypes.CDLL("libruntime.so")
acl.aclGetRecentErrMsg.restype = ctypes.c_char_p
acl.aclrtGetSocName.restype = ctypes.c_char_p


def recent() -> str:
    msg = acl.aclGetRecentErrMsg()
    return msg.decode() if msg else ""


# ---- initialisation, as torch_npu's NpuSysCtrl does it
out["init"] = acl.aclInit(None)
dev = c_int32(-1)
out["get_device_before_set"] = acl.aclrtGetDevice(ctypes.byref(dev))
out["msg_after_quiet_get_device"] = recent()
out["soc"] = acl.aclrtGetSocName().decode()
out["set_device"] = acl.aclrtSetDevice(0)
out["get_device"] = (acl.aclrtGetDevice(ctypes.byref(dev)), dev.value)

v64 = c_int64(-1)
out["sys_opt_default"] = (acl.aclrtGetSysParamOpt(0, ctypes.byref(v64)), v64.value)
acl.aclrtSetSysParamOpt.argtypes = [c_int, c_int64]
out["sys_opt_set"] = acl.aclrtSetSysParamOpt(0, 1)
out["sys_opt_after_set"] = (acl.aclrtGetSysParamOpt(0, ctypes.byref(v64)), v64.value)
out["sys_opt_bad"] = acl.aclrtGetSysParamOpt(9, ctypes.byref(v64))
out["sys_opt_bad_msg"] = recent()
acl.aclrtCtxSetSysParamOpt.argtypes = [c_int, c_int64]
out["ctx_opt_set"] = acl.aclrtCtxSetSysParamOpt(0, 1)
out["ctx_opt_get"] = (acl.aclrtCtxGetSysParamOpt(0, ctypes.byref(v64)), v64.value)

mode = c_int(-1)
out["sat_infnan"] = acl.aclrtSetDeviceSatMode(1)
out["sat_saturation"] = acl.aclrtSetDeviceSatMode(0)
out["sat_saturation_msg"] = recent()
out["sat_get"] = (acl.aclrtGetDeviceSatMode(ctypes.byref(mode)), mode.value)

u32 = c_uint32(0)
u64 = c_uint64(0)
out["op_timeout"] = acl.aclrtSetOpExecuteTimeOut(c_uint32(10))
out["op_timeout_get_ms"] = (acl.aclrtGetOpExecuteTimeOut(ctypes.byref(u32)), u32.value)
acl.aclrtSetOpExecuteTimeOutV2.argtypes = [c_uint64, vp]
out["op_timeout_v2"] = (acl.aclrtSetOpExecuteTimeOutV2(5_000_000, ctypes.byref(u64)), u64.value)
out["op_wait_timeout"] = acl.aclrtSetOpWaitTimeout(c_uint32(3))

status, model = c_int(7), vp(1)
out["capture_info"] = (
    acl.aclmdlRICaptureGetInfo(None, ctypes.byref(status), ctypes.byref(model)),
    status.value,
)
out["capture_model_null"] = model.value is None

i32 = c_int32(-1)
out["cann_attr_inf_nan"] = (acl.aclGetCannAttribute(0, ctypes.byref(i32)), i32.value)
out["cann_attr_bf16"] = (acl.aclGetCannAttribute(1, ctypes.byref(i32)), i32.value)
out["cann_attr_bad"] = acl.aclGetCannAttribute(5, ctypes.byref(i32))

stream = vp()
out["stream"] = acl.aclrtCreateStream(ctypes.byref(stream))
acl.aclrtSetStreamOverflowSwitch.argtypes = [vp, c_uint32]
acl.aclrtSetStreamFailureMode.argtypes = [vp, c_uint64]
out["overflow_switch"] = acl.aclrtSetStreamOverflowSwitch(stream, 1)
out["overflow_switch_bad"] = acl.aclrtSetStreamOverflowSwitch(stream, 2)
out["failure_mode"] = acl.aclrtSetStreamFailureMode(stream, 1)
out["peek_last_error"] = acl.aclrtPeekAtLastError(0)
out["get_last_error"] = (acl.aclrtGetLastError(0), acl.aclrtGetLastError(0))
acl.aclrtDestroyStreamForce.argtypes = [vp]
out["destroy_stream_force"] = acl.aclrtDestroyStreamForce(stream)


class Version(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_char * 128),
        ("major", ctypes.c_char * 64),
        ("minor", ctypes.c_char * 64),
        ("release", ctypes.c_char * 64),
        ("patch", ctypes.c_char * 64),
        ("reserved", ctypes.c_char * 128),
    ]


ver = Version()
out["cann_version"] = (
    acl.aclsysGetCANNVersion(1, ctypes.byref(ver)),
    ver.version.decode(),
    ver.major.decode(),
)
buf = ctypes.create_string_buffer(128)
out["version_str_ops_math"] = (acl.aclsysGetVersionStr(b"ops_math", buf), buf.value.decode())

out["capability_aicore"] = (acl.aclGetDeviceCapability(c_uint32(0), 0, ctypes.byref(v64)), v64.value)
out["capability_bad_device"] = acl.aclGetDeviceCapability(c_uint32(99), 0, ctypes.byref(v64))

acl.aclAppLog.argtypes = [c_int, ctypes.c_char_p, ctypes.c_char_p, c_uint32, ctypes.c_char_p]
acl.aclAppLog(3, b"main", b"acl_surface.py", 7, b"app log line")

# ---- host objects: data buffers, tensor descriptors, operator attributes
acl.aclCreateDataBuffer.restype = vp
acl.aclCreateDataBuffer.argtypes = [vp, c_size_t]
acl.aclGetDataBufferAddr.restype = vp
acl.aclGetDataBufferAddr.argtypes = [vp]
acl.aclGetDataBufferSizeV2.restype = c_size_t
acl.aclGetDataBufferSizeV2.argtypes = [vp]
acl.aclDestroyDataBuffer.argtypes = [vp]
db = acl.aclCreateDataBuffer(0x1000, 64)
out["data_buffer"] = (
    acl.aclGetDataBufferAddr(db),
    acl.aclGetDataBufferSizeV2(db),
    acl.aclDestroyDataBuffer(db),
)
out["data_buffer_destroy_null"] = acl.aclDestroyDataBuffer(None)

acl.aclCreateTensorDesc.restype = vp
acl.aclCreateTensorDesc.argtypes = [c_int, c_int, vp, c_int]
for name in ("aclGetTensorDescType", "aclGetTensorDescFormat", "aclDestroyTensorDesc"):
    getattr(acl, name).argtypes = [vp]
acl.aclGetTensorDescNumDims.restype = c_size_t
acl.aclGetTensorDescNumDims.argtypes = [vp]
acl.aclGetTensorDescDimV2.argtypes = [vp, c_size_t, vp]
acl.aclSetTensorShape.argtypes = [vp, c_int, vp]
acl.aclSetTensorFormat.argtypes = [vp, c_int]
acl.aclSetTensorPlaceMent.argtypes = [vp, c_int]
acl.aclSetTensorDescName.argtypes = [vp, ctypes.c_char_p]
dims = (c_int64 * 3)(2, 3, 4)
desc = acl.aclCreateTensorDesc(0, 2, dims, 2)
dim = c_int64(-1)
out["desc"] = [
    acl.aclGetTensorDescType(desc),
    acl.aclGetTensorDescFormat(desc),
    acl.aclGetTensorDescNumDims(desc),
    acl.aclGetTensorDescDimV2(desc, 1, ctypes.byref(dim)),
    dim.value,
]
out["desc_dim_out_of_range"] = acl.aclGetTensorDescDimV2(desc, 5, ctypes.byref(dim))
acl.aclSetTensorDescName(desc, b"x")
out["desc_set"] = [
    acl.aclSetTensorShape(desc, 3, dims),
    acl.aclGetTensorDescNumDims(desc),
    acl.aclSetTensorFormat(desc, 29),
    acl.aclGetTensorDescFormat(desc),
    acl.aclSetTensorPlaceMent(desc, 1),
    acl.aclSetTensorPlaceMent(desc, 7),
]
acl.aclDestroyTensorDesc(desc)

acl.aclopCreateAttr.restype = vp
acl.aclopDestroyAttr.argtypes = [vp]
attr = acl.aclopCreateAttr()
ints = (c_int64 * 2)(1, 2)
floats = (ctypes.c_float * 2)(1.0, 2.0)
bools = (ctypes.c_uint8 * 2)(1, 0)
nums = (c_int * 1)(2)
lists = (ctypes.POINTER(c_int64) * 1)(ctypes.cast(ints, ctypes.POINTER(c_int64)))
acl.aclopSetAttrInt.argtypes = [vp, ctypes.c_char_p, c_int64]
acl.aclopSetAttrFloat.argtypes = [vp, ctypes.c_char_p, ctypes.c_float]
acl.aclopSetAttrBool.argtypes = [vp, ctypes.c_char_p, ctypes.c_uint8]
acl.aclopSetAttrString.argtypes = [vp, ctypes.c_char_p, ctypes.c_char_p]
acl.aclopSetAttrDataType.argtypes = [vp, ctypes.c_char_p, c_int]
acl.aclopSetAttrListInt.argtypes = [vp, ctypes.c_char_p, c_int, vp]
acl.aclopSetAttrListFloat.argtypes = [vp, ctypes.c_char_p, c_int, vp]
acl.aclopSetAttrListBool.argtypes = [vp, ctypes.c_char_p, c_int, vp]
acl.aclopSetAttrListListInt.argtypes = [vp, ctypes.c_char_p, c_int, vp, vp]
out["attrs"] = [
    acl.aclopSetAttrInt(attr, b"i", 3),
    acl.aclopSetAttrFloat(attr, b"f", 1.5),
    acl.aclopSetAttrBool(attr, b"b", 1),
    acl.aclopSetAttrString(attr, b"s", b"v"),
    acl.aclopSetAttrDataType(attr, b"d", 0),
    acl.aclopSetAttrListInt(attr, b"li", 2, ints),
    acl.aclopSetAttrListFloat(attr, b"lf", 2, floats),
    acl.aclopSetAttrListBool(attr, b"lb", 2, bools),
    acl.aclopSetAttrListListInt(attr, b"lli", 1, nums, lists),
]
out["attr_null_name"] = acl.aclopSetAttrInt(attr, None, 3)
acl.aclopDestroyAttr(attr)

# ---- the operator compiler: options, and the aclop path failing loudly
opc.aclGetCompileoptSize.restype = c_size_t
opc.aclGetCompileopt.argtypes = [c_int, vp, c_size_t]
opt = ctypes.create_string_buffer(256)
out["jit_size"] = opc.aclGetCompileoptSize(10)
out["jit_default"] = (opc.aclGetCompileopt(10, opt, 256), opt.value.decode())
out["jit_set"] = opc.aclSetCompileopt(10, b"enable")
out["jit_after_set"] = (opc.aclGetCompileopt(10, opt, 256), opt.value.decode())
out["precision_set"] = opc.aclSetCompileopt(0, b"allow_fp32_to_fp16")
out["precision_size"] = opc.aclGetCompileoptSize(0)
out["precision_get"] = opc.aclGetCompileopt(0, opt, 256)
out["unset_size"] = opc.aclGetCompileoptSize(1)
recent()
opc.aclopCompileAndExecute.argtypes = [
    ctypes.c_char_p,
    c_int,
    vp,
    vp,
    c_int,
    vp,
    vp,
    vp,
    c_int,
    c_int,
    vp,
    vp,
]
out["aclop"] = opc.aclopCompileAndExecute(b"Erfinv", 0, None, None, 0, None, None, None, 0, 0, None, None)
out["aclop_msg"] = recent()
out["msg_read_twice"] = recent()

# ---- deliberate failures of the other layers, and peer access
out["export_handle"] = acl.aclrtMemExportToShareableHandle(None, 0, c_uint64(0), ctypes.byref(u64))
out["export_handle_msg"] = recent()
out["rt_kernel_launch"] = rt.rtKernelLaunch(None, 1, None, 0, None, None)
out["rt_kernel_launch_msg"] = recent()
can = c_int32(-1)
out["peer"] = (acl.aclrtDeviceCanAccessPeer(ctypes.byref(can), 0, 1), can.value)
out["peer_same_device"] = acl.aclrtDeviceCanAccessPeer(ctypes.byref(can), 0, 0)
recent()
out["bare_tgid"] = (acl.aclrtDeviceGetBareTgid(ctypes.byref(i32)), i32.value == os.getpid())

# ---- messages are per thread: another thread's failure is not this thread's text
seen: list[str] = []


def other() -> None:
    acl.aclrtGetSysParamOpt(9, ctypes.byref(c_int64()))
    seen.append(recent())


t = threading.Thread(target=other)
t.start()
t.join()
out["other_thread_msg"] = seen[0]
out["this_thread_msg"] = recent()

# ---- profiling entry points
CB = ctypes.CFUNCTYPE(c_int32, c_uint32, vp, c_uint32)
cb = CB(lambda t, d, n: 0)
prof.MsprofRegisterCallback.argtypes = [c_uint32, vp]
out["prof_register_null"] = prof.MsprofRegisterCallback(1, None)
out["prof_register"] = prof.MsprofRegisterCallback(1, ctypes.cast(cb, vp))
prof.MsprofSysCycleTime.restype = c_uint64
t0 = prof.MsprofSysCycleTime()
out["prof_cycles_advance"] = prof.MsprofSysCycleTime() >= t0 > 0
prof.MsprofGetHashId.restype = c_uint64
prof.MsprofGetHashId.argtypes = [ctypes.c_char_p, c_size_t]
out["prof_hash"] = prof.MsprofGetHashId(b"op", 2)
out["prof_report_api"] = prof.MsprofReportApi(1, ctypes.byref(u64))

# ---- the remaining memory, event, context and kernel entry points of the front-end
ptr = vp()
data = (ctypes.c_uint8 * 100)(*range(100))
back = (ctypes.c_uint8 * 100)()
acl.aclrtMemcpy.argtypes = [vp, c_size_t, vp, c_size_t, c_int]
acl.aclrtFree.argtypes = [vp]
out["malloc_align32"] = acl.aclrtMallocAlign32(ctypes.byref(ptr), c_size_t(100), 0)
acl.aclrtMemcpy(ptr, 100, data, 100, 1)
acl.aclrtMemcpy(back, 100, ptr, 100, 2)
out["align32_roundtrip"] = bytes(back) == bytes(data)
out["free_align32"] = acl.aclrtFree(ptr)
out["malloc_cached"] = acl.aclrtMallocCached(ctypes.byref(ptr), c_size_t(4096), 0)
out["free_cached"] = acl.aclrtFree(ptr)
ctx = vp()
out["context"] = (acl.aclrtGetCurrentContext(ctypes.byref(ctx)), acl.aclrtSetCurrentContext(ctx))
ev, ev2, stream = vp(), vp(), vp()
acl.aclrtCreateStream(ctypes.byref(stream))
acl.aclrtResetEvent.argtypes = [vp, vp]
acl.aclrtDestroyEvent.argtypes = [vp]
out["events"] = [
    acl.aclrtCreateEventWithFlag(ctypes.byref(ev), c_uint32(0)),
    acl.aclrtCreateEventExWithFlag(ctypes.byref(ev2), c_uint32(0)),
    acl.aclrtResetEvent(ev, stream),
    acl.aclrtDestroyEvent(ev),
    acl.aclrtDestroyEvent(ev2),
]
out["sync_device_timeout"] = acl.aclrtSynchronizeDeviceWithTimeout(-1)
out["binary_unload_null"] = acl.aclrtBinaryUnLoad(None)
print(json.dumps(out))
