"""Coordinated snapshots of a distributed job: every rank at the same logical moment, or none.

A *job* is several process trees (one per rank: ``npusnap dump PID PID ... DIR``). Each rank runs
the ordinary dump pipeline (dump/) in its own thread, and a ``JobCoordinator`` holds them at
the phase boundaries::

    preflight everywhere  | barrier "preflight"
    lock + backup         | barrier "backup"     (no rank is frozen by CRIU before all are backed up)
    CRIU dump             | barrier "criu"       (no rank is unlocked or killed before all are dumped)
    publish rank-N/       | barrier "publish"    (its action commits the job: one rename)
    kill (or unlock with --leave-running)

Any failure, in any rank and at any step (or a signal), aborts the barriers: every other rank
raises at its next boundary and rolls back exactly as a failed single dump does (running,
unlocked), and the job's work directory, with every rank image in it, is removed.

A rank whose root process lives in another network namespace (ranks on "nodes" simulated by
namespaces, or containers) is dumped by a thread that entered that namespace first: CRIU, which
the thread starts, then runs there, as it must for ``--tcp-established`` and its network lock.

Job image layout (docs/image-format.md)::

    DIR/npusnap-job.json   {"schema": "npusnap-job/1", "ranks": [{"rank": 0, "dir": "rank-0", ...}]}
    DIR/rank-0/            an ordinary image (npusnap.json, criu/, ...)
    DIR/rank-1/

Restore runs the single restore's steps (restore/) once per rank, each rank in a thread inside
its network namespace, with barriers between them (RESTORE_PHASES)::

    verify + preflight    | barrier "verified"        (nothing restored before every rank checked)
    CRIU restore          | barrier "criu-restored"   (every rank exists again, locked)
    device restore        | barrier "device-restored" (no rank unlocked before all have their state)
    unlock, settle        | barrier "settled"

If anything fails on the way, in any rank, every rank undoes its steps: a restored rank's tree is
killed (the undo of its CRIU step), nothing is left half-running, the image is intact.
While the ranks are being restored, the TCP resets their namespaces would send on the job's
connections are dropped (tcpunlock.ResetHold), so that the end restored first keeps them.

Across nodes (``--coordinator``), one npusnap per node runs the above for its ranks, and every
barrier's action also waits for every other node (netcoord.NetLink); see docs/distributed.md.

Core module: returns frozen dataclasses, never prints.

The modules, imported by name (this package re-exports nothing, so that a dump never loads the
restore side, nor a restore the dump side): barriers.py (``JobCoordinator``, ``run_ranks``, the
phases), netns.py (entering a rank's network namespace), jobdump.py (``dump_job``),
jobrestore.py (``restore_job``, ``RANK_STEPS``, ``wait_for_exit``).
"""
