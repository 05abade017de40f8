"""Application hooks that the agent runs around the snapshot calls.

Standard library only, Python 3.9+ (runs inside the target).

Stages (the names are part of the public API, see ``npusnap_cli.agent.register_hook``):

* ``pre_lock``     before Lock: quiesce the app (synchronize streams, save weights);
* ``post_backup``  after Backup succeeded;
* ``post_restore`` after Restore, while the runtime is still LOCKED: device-resource calls
  block until Unlock, so a hook here must not allocate/copy on the device;
* ``post_unlock``  after Unlock: resume the app (reload weights, rebuild communicators).

Hooks take no arguments and run on a helper thread that the native agent waits for with a
deadline (see ``npusnap_cli.agent``). A hook that raises aborts the operation:
the agent rolls the snapshot state back to what it was before and reports the failure.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Tuple

from npusnap_cli import contract

STAGES = contract.HOOK_STAGES

Hook = Callable[[], object]


class HookFailed(Exception):
    """A hook raised; carries the stage, the hook's name and the exception text."""

    def __init__(self, stage: str, hook: str, error: str) -> None:
        super().__init__(f"hook {hook!r} at stage {stage} failed: {error}")
        self.stage = stage
        self.hook = hook
        self.error = error


def hook_name(fn: Hook) -> str:
    module = getattr(fn, "__module__", None) or "?"
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{qual}"


class HookRegistry:
    """Hooks per stage, in registration order; safe to change from any application thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: Dict[str, List[Tuple[str, Hook]]] = {stage: [] for stage in STAGES}

    def reinit_after_fork(self) -> None:
        """In a forked child: the agent thread may have held the lock at fork time, and that
        thread does not exist here, so the lock would stay taken forever. Replace it."""
        self._lock = threading.Lock()

    def register(self, stage: str, fn: Hook, name: str = "") -> str:
        if stage not in STAGES:
            raise ValueError(f"unknown hook stage {stage!r}; stages: {', '.join(STAGES)}")
        if not callable(fn):
            raise TypeError("a hook must be callable")
        label = name or hook_name(fn)
        with self._lock:
            self._hooks[stage].append((label, fn))
        return label

    def unregister(self, stage: str, fn: Hook) -> bool:
        with self._lock:
            hooks = self._hooks.get(stage, [])
            for i, (_label, f) in enumerate(hooks):
                if f is fn:
                    del hooks[i]
                    return True
        return False

    def names(self) -> Dict[str, List[str]]:
        with self._lock:
            return {stage: [label for label, _ in hooks] for stage, hooks in self._hooks.items()}

    def run(self, stage: str) -> List[str]:
        """Run the hooks of ``stage`` in order; raise HookFailed at the first that raises."""
        with self._lock:
            hooks = list(self._hooks[stage])
        ran = []
        for label, fn in hooks:
            try:
                fn()
            except Exception as exc:  # any failure of app code aborts the op, never the agent
                raise HookFailed(stage, label, f"{type(exc).__name__}: {exc}") from exc
            ran.append(label)
        return ran
