"""`status` while a dump copies a large device memory names the dump that holds the job, instead
of an agent "error", no state, and a warning that npusnap cannot see the device memory."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.integration.dumplib import NPUSNAP, PY, TRAIN, Job, job_env, private_sim

pytestmark = [pytest.mark.integration, requires_root]


def test_status_during_a_long_dump_says_a_dump_holds_the_lock(runtime_dir: Path, tmp_path: Path) -> None:
    with private_sim(devices=1, capacity_bytes=2 << 30) as sim:
        env = job_env(sim, runtime_dir, NPUSNAP_STATE_DIR=str(tmp_path / "state"))
        job = Job(tmp_path, env, [PY, TRAIN, "--interval", "0.05", "--param-bytes", str(512 << 20)])
        try:
            job.wait_lines(2, timeout=120)
            dump = subprocess.Popen(
                [NPUSNAP, "dump", str(job.pid), str(tmp_path / "img"), "--leave-running"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            seen = []
            deadline = time.monotonic() + 120
            while dump.poll() is None and time.monotonic() < deadline:
                p = subprocess.run(
                    [NPUSNAP, "status", str(job.pid)], env=env, capture_output=True, text=True, timeout=60
                )
                seen.append((p.returncode, p.stdout, p.stderr))
                if "a dump holds the lock" in p.stderr:
                    break
            dump.wait(300)
            shown = "\n---\n".join(f"{rc}\n{o}\n{e}" for rc, o, e in seen[-3:])
            assert all(rc == 0 for rc, _, _ in seen), shown
            assert not any("does not see its device memory" in e for _, _, e in seen), shown
            assert not any(" error " in o for _, o, _ in seen), shown
        finally:
            job.cleanup()
