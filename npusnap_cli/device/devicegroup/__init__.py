"""The device half of a snapshot for several processes at once (for dump, restore, freeze, thaw).

``DeviceGroup(pids)`` holds one ``AgentClient`` per pid and runs each step on all of them in
parallel threads. The contract the pipelines rely on:

* ``lock_and_backup(backup=True)``: Lock (+ Backup) every process under a lease. If any process
  fails, every process is rolled back to RUNNING and the first failure is raised (its
  ``details["failures"]`` lists every pid's error). If a rollback fails too: ``StateUnknownError``.
* ``close()``: drop every connection (needed before a CRIU dump: CRIU refuses to dump a connected
  stream socket whose peer is outside the tree). The leases keep running in the agents, counted
  in run time only, so a CRIU freeze does not eat them.
* ``reconnect()``: connect again (after the dump, or to the restored processes).
* ``renew()`` / ``release()``: keep / drop the leases.
* ``unlock()``: Unlock every process (e.g. ``--leave-running`` from BACKED_UP).
* ``restore_and_unlock()``: in CRIU-restored processes: Restore, then Unlock. A failure leaves
  that process locked (never half-running) and raises with the retry command.
* ``rollback()``: back to RUNNING from any state; ``StateUnknownError`` if that fails.

Lock ownership (docs/internals.md, "Lock ownership"): each lock is taken as ``npusnap COMMAND``
and its token kept per pid (``tokens()``; ``set_tokens()`` hands a dump's or a freeze's tokens to
restore or thaw). ``ensure_unlocked()`` is the preflight that refuses, with who holds it and
since when, a job that another command locked. After a failure only the processes this group
locked are rolled back: a dump that fails at Lock never thaws someone else's freeze.

Results are dicts keyed by pid (the agent's result for that pid).

The modules: group.py (``DeviceGroup``), agentops.py (what it asks of one agent, the refusals
before), tokens.py (the locks freeze hands to thaw).
"""

from __future__ import annotations

from npusnap_cli.device.devicegroup.agentops import (
    STATE_NOW_S,
    NotRolledBack,
    RollbackResult,
    refuse_stopped,
    status_now,
    tree_targets,
)
from npusnap_cli.device.devicegroup.group import DeviceGroup, LockedAndBackedUp, RestoredAndUnlocked
from npusnap_cli.device.devicegroup.tokens import (
    forget_lock_tokens,
    forget_taken_over,
    load_lock_tokens,
    record_taken_over,
    save_lock_tokens,
    taken_over,
)

__all__ = [
    "STATE_NOW_S",
    "DeviceGroup",
    "LockedAndBackedUp",
    "NotRolledBack",
    "RestoredAndUnlocked",
    "RollbackResult",
    "forget_lock_tokens",
    "forget_taken_over",
    "load_lock_tokens",
    "record_taken_over",
    "refuse_stopped",
    "save_lock_tokens",
    "status_now",
    "taken_over",
    "tree_targets",
]
