"""Helpers for the simulated-NPU tests: drive a real runtime user process from a test.

``Driver`` runs acl_driver.py (ctypes on the built libacl_rt.so) as a child process and sends it
one JSON command at a time; every answer comes back with a timeout so a test never hangs.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` passes; whether it held (for an assert)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


DRIVER = HERE / "acl_driver.py"


class Driver:
    def __init__(
        self, env: dict[str, str], extra_env: Optional[dict[str, str]] = None, stderr: Optional[Path] = None
    ) -> None:
        full = dict(env)
        full.update(extra_env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=full,
            bufsize=0,
            stderr=open(stderr, "wb") if stderr else None,  # noqa: SIM115 - the child owns it
        )
        self._buf = b""
        self.pid = self.proc.pid

    def send(self, *cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(list(cmd)) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout: float = 10.0) -> Optional[dict[str, Any]]:
        """The next answer, or None if none came within ``timeout`` (the command is blocked)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"driver exited with {self.proc.wait()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def call(self, *cmd: Any, timeout: float = 10.0) -> dict[str, Any]:
        self.send(*cmd)
        res = self.recv(timeout)
        assert res is not None, f"{cmd} did not answer within {timeout} s"
        assert "error" not in res, res
        return res

    def rc(self, *cmd: Any, timeout: float = 10.0) -> int:
        return int(self.call(*cmd, timeout=timeout)["rc"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
