"""Exercise acl.AclRuntime.in_process() the way the agent does, inside a real runtime user.

Run by test_acl_runtime.py under several Pythons (3.9+); prints one JSON document of observations.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

from npusnap_cli import acl

out = {"python": sys.version_info[:2], "before": acl.AclRuntime.in_process() is None}
lib = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libacl_rt.so"))
assert lib.aclrtSetDevice(1) == 0
rt = acl.AclRuntime.in_process()
assert rt is not None
out["path"] = rt.path
out["loaded"] = acl.loaded_acl_library()
out["version"] = rt.version
out["simulated"] = rt.simulated
seen = []
rt.register_callback(acl.Stage.LOCK_PRE, lambda dev: seen.append(("lock_pre", dev)) or 0)
rt.register_callback(acl.Stage.UNLOCK_POST, lambda dev: seen.append(("unlock_post", dev)) or 0)


def boom(dev: int) -> int:
    raise RuntimeError(f"hook failed on {dev}")


states = [rt.state()]
rt.lock()
states.append(rt.state())
try:
    rt.lock()
except acl.AclError as e:
    out["double_lock"] = [e.code, e.name, str(e)]
rt.backup()
states.append(rt.state())
rt.restore()
states.append(rt.state())
rt.unlock()
states.append(rt.state())
out["states"] = [int(s) if s is not None else None for s in states]
out["seen"] = list(seen)
try:
    rt.register_callback(acl.Stage.LOCK_PRE, seen.append)  # type: ignore[arg-type]
    rt.register_callback(acl.Stage.LOCK_PRE, seen.append)  # type: ignore[arg-type]
except acl.AclError as e:
    out["duplicate"] = e.code
rt.unregister_callback(acl.Stage.LOCK_PRE, seen.append)  # type: ignore[arg-type]
try:
    rt.unregister_callback(acl.Stage.BACKUP_PRE, boom)
except acl.AclError as e:
    out["unknown_unregister"] = e.code
rt.register_callback(acl.Stage.BACKUP_PRE, boom)
rt.lock()
try:
    rt.backup()
except acl.AclError as e:
    out["failing_callback"] = [e.code, str(e)]
out["callback_errors"] = [repr(x) for x in rt.callback_errors]
rt.unlock()
out["final_state"] = int(rt.state() or 0)
with open("/proc/self/maps") as f:
    out["acl_copies"] = sorted({line.split()[-1] for line in f if "libacl_rt.so" in line})
print(json.dumps(out))
