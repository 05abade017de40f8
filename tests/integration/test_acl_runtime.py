"""acl.AclRuntime inside a real process using the simulated runtime, on Python 3.9 and ours.

The agent runs in the target's interpreter, which may be an older Python: acl.py must work there.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import pytest

from npusnap_cli import paths
from tests.integration.sim_helpers import HERE

pytestmark = pytest.mark.integration

PY39 = sorted(glob.glob("/root/.pyenv/versions/3.9*/bin/python3") + glob.glob("/usr/bin/python3.9"))
_PY39_PARAM = (
    pytest.param(PY39[0], id="py3.9")
    if PY39
    else pytest.param(
        "", id="py3.9", marks=pytest.mark.skip(reason="no Python 3.9 at ~/.pyenv/versions/3.9*")
    )
)
PYTHONS = [pytest.param(sys.executable, id="venv"), _PY39_PARAM]


@pytest.mark.parametrize("python", PYTHONS)
def test_in_process_runtime_drives_the_snapshot_calls(sim_env: dict[str, str], python: str) -> None:
    env = dict(sim_env, PYTHONPATH=str(paths.REPO_ROOT))
    res = subprocess.run(
        [python, str(HERE / "acl_inproc.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    lib = sim_env["ASCEND_HOME_PATH"] + "/lib64/libacl_rt.so"
    assert out["before"] is True  # no runtime loaded yet: None, and nothing loaded by asking
    assert out["path"] == out["loaded"] == lib
    assert out["acl_copies"] == [lib]  # RTLD_NOLOAD: never a second copy
    assert out["version"] == "9.1.0" and out["simulated"] is True
    assert out["states"] == [0, 1, 2, 1, 0]
    # LOCK_PRE runs before Lock's state check: also for the second Lock, which then fails 507906.
    assert out["seen"] == [["lock_pre", 1], ["lock_pre", 1], ["unlock_post", 1]]
    code, name, msg = out["double_lock"]
    assert (code, name) == (507906, "ACL_ERROR_SNAPSHOT_LOCK_FAILED")
    assert msg.startswith("507906: lock failed") and "npusnap status" in msg
    assert out["duplicate"] == 507913
    assert out["unknown_unregister"] == 107000
    assert out["failing_callback"][0] == 507912 and "callback" in out["failing_callback"][1]
    assert out["callback_errors"] == ["RuntimeError('hook failed on 1')"]
    assert out["final_state"] == 0
