"""The restore in order (``STEPS``), each step's undo its share of the rollback, and ``restore``,
which runs them."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from npusnap_cli import criu, criuimages
from npusnap_cli.errors import BusyError, CriuError, NpusnapError
from npusnap_cli.host import ghostlock, hostres, lazypages, pidns
from npusnap_cli.host import pidfile as pidfile_mod
from npusnap_cli.host.lazypages import LazyPhase
from npusnap_cli.image import devchunks, digest, integrity, layout, publishing
from npusnap_cli.image.manifest import load_manifest, open_device_memory_files
from npusnap_cli.pipelines import restoreguard
from npusnap_cli.pipelines.engine import Pipeline, SignalGuard, Step
from npusnap_cli.pipelines.restore.agents import (
    _check_none_left_locked,
    _restore_and_unlock,
    rebuild_communicators,
)
from npusnap_cli.pipelines.restore.checks import preflight
from npusnap_cli.pipelines.restore.options import RestoreCallbacks, RestoreOptions, RestoreOutcome
from npusnap_cli.pipelines.restore.state import RestoreState, _close_inherited
from npusnap_cli.pipelines.restore.tree import check_alive_after, criu_options, open_pipe_targets
from npusnap_cli.pipelines.restore.verify import (
    Checksums,
    _device_files_verified,
    _release_when_verified,
    verify_entries,
)


def _verify(st: RestoreState) -> None:
    """Structure and sizes now; the checksum of every file in a thread that overlaps with the
    checks and with CRIU's own reading. CRIU leaves the restored tree stopped until the sums are
    known: nothing of the image runs before it is verified."""
    o = st.options
    if not st.overlap:
        integrity.verify(st.image, checksums=o.verify, require_signature=o.require_signature)
        return
    total = sum(f.size for f in st.manifest.files)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        st.cb.progress("verifying", done[0], total)

    integrity.verify(st.image, checksums=False, require_signature=o.require_signature)
    # Chunks and their indexes are checked while restore puts them together (_open_files).
    chunked = [f for f in st.manifest.files if devchunks.is_chunk_layout_rel(f.path)]
    device_entries = [
        f for f in st.manifest.files if f.path.startswith(layout.DEVICE_SUBDIR + "/") and f not in chunked
    ]
    if o.verify and o.lazy:
        # Lazy: everything but the page files now (small: CRIU's metadata, tmpfs copies); the page
        # files while the job already runs (lazypages.py's contract, docs/image-format.md).
        pages, rest = lazypages.split_page_files(st.manifest)
        verify_entries(st.image, rest, advance)
        st.verifying.checksums = Checksums(st.image, advance, entries=pages)
    elif o.verify and (device_entries or chunked):
        # The device-memory files on a thread of their own: the tree may run once everything
        # else matched (its host memory is verified; its device calls are held until the
        # agents reload), and the agents reload them only after they matched too.
        others = [f for f in st.manifest.files if f not in device_entries and f not in chunked]
        st.verifying.checksums = Checksums(st.image, advance, entries=others)
        if device_entries:
            # On every core: with the device memory kept poisoned by the simulator (or on a
            # device), the agents' Restore answers at once, and this is what their reload waits for.
            st.verifying.device_checks = Checksums(
                st.image, advance, entries=device_entries, threads=digest.usable_cores()
            )
    elif o.verify:
        st.verifying.checksums = Checksums(st.image, advance)
    if st.verifying.checksums is not None and not o.lazy and _stopped_by_other_signals(st):
        # CRIU's --leave-stopped stops every task with SIGSTOP at the end, and a task that was
        # stopped by another signal (a shell's ^Z: SIGTSTP) would then report SIGSTOP to its
        # parent: verify first, and let CRIU restore each task's own stop.
        error = st.verifying.checksums.join()
        st.verifying.checksums = None
        if error is not None:
            raise error


def _stopped_by_other_signals(st: RestoreState) -> bool:
    return any(sig not in (0, signal.SIGSTOP) for sig in _image_stops(st).values())


def _image_stops(st: RestoreState) -> dict[int, int]:
    if st.checks.stopped_in_image is None:
        st.checks.stopped_in_image = criuimages.stopped(layout.criu_dir(st.image))
    return st.checks.stopped_in_image


def _preflight(st: RestoreState) -> None:
    try:
        st.checks.pre = preflight(st.image, st.manifest, st.options, st.checks.binary, note=st.cb.note)
    except BusyError:
        # A corrupt image is the answer that holds after the original is stopped (exit 8, not 11).
        for c in (st.verifying.checksums, st.verifying.device_checks):
            corrupt = c.join() if c is not None else None
            if corrupt is not None:
                raise corrupt from None
        raise


def _open_files(st: RestoreState) -> None:
    """The device-memory files, and the new outputs of --pipe-to and --output: once CRIU has
    started, nothing of the restore may depend on the image staying where it is (a lazy
    restore's image may be removed)."""
    st.host.device_memory_files = open_device_memory_files(st.image, st.manifest)
    indexes = devchunks.read_indexes(st.image, st.manifest)
    if indexes:
        st.verifying.assembly = devchunks.Assembly(
            st.image, indexes, verify=st.options.verify, threads=digest.usable_cores()
        )
        for pid, fd in st.verifying.assembly.memfds.items():
            st.host.device_memory_files[pid] = (fd, os.path.abspath(st.image / devchunks.index_rel(pid)))
    st.host.inherit = open_pipe_targets(st.manifest, st.options.pipe_to)
    st.host.inherit += pidns.open_output_target(layout.criu_dir(st.image), st.manifest, st.options.output)
    st.verifying.verified_at = time.monotonic()


def _make_host_nodes(st: RestoreState) -> None:
    to_make = st.checked.to_make
    if to_make:
        st.cb.note(f"creating {len(to_make)} director(ies)/fifo(s) the job needs: {to_make[-1].path}")
        st.host.made = hostres.make_host_nodes(
            to_make, {p.uid for p in st.manifest.processes}, st.manifest.host_nodes
        )


def _remove_host_nodes(st: RestoreState, _err: BaseException) -> None:
    hostres.remove_host_nodes(st.host.made)


def _put_back(st: RestoreState) -> None:
    to_put_back = st.checked.to_put_back
    if not to_put_back:
        return
    st.cb.note(f"putting back {len(to_put_back)} file(s) from the image (tmpfs, deleted files)")
    st.host.created = hostres.absent(to_put_back)  # removed again if the restore fails
    try:
        hostres.put_back(to_put_back, st.image, st.manifest.host_nodes)
    except BaseException:
        hostres.remove_copies(st.host.created)
        raise


def _remove_put_back(st: RestoreState, _err: BaseException) -> None:
    hostres.remove_copies(st.host.created)  # a failed restore leaves no file it wrote


def _start_lazy(st: RestoreState) -> None:
    """--lazy: the `criu lazy-pages` daemon, listening in the restore's work directory."""
    if not st.options.lazy:
        return
    logs = str(st.checked.logs)
    daemon = criu.LazyPagesDaemon(st.checked.criu_binary(), str(layout.criu_dir(st.image)), logs)
    pids = [p.pid for p in st.manifest.processes]
    st.tree.lazy = LazyPhase(
        daemon,
        pids,
        st.verifying.checksums,
        st.options.lazy_timeout_s,
        st.start,
        str(Path(logs) / layout.RESTORE_LOG),
    )


def _abort_lazy(st: RestoreState, _err: BaseException) -> None:
    if st.tree.lazy is not None:
        st.tree.lazy.abort()


def _stays_stopped(st: RestoreState) -> bool:
    """CRIU leaves the tree stopped until npusnap releases it (verified, or its pages served)."""
    return st.verifying.checksums is not None or st.options.lazy


def _start_stop_guard(st: RestoreState) -> None:
    """Should npusnap die before it released the stopped tree, the watcher kills the CRIU it
    starts next and its unverified tree (a new restore brings it back)."""
    if _stays_stopped(st):
        st.tree.stop_guard = restoreguard.restore_stop_guard()


def _enter_device_view(st: RestoreState) -> None:
    """--device-map: CRIU, and so the tree, start in a container of the simulated NPU holding
    the mapped devices (host/pidns.py)."""
    if st.options.device_map:
        held = pidns.enter_device_view(st.manifest, st.options.device_map)
        st.cb.note(f"the restored tree runs in a container of the simulated NPU holding device(s) {held}")


def _make_view(st: RestoreState) -> None:
    """A --pid-ns image: the CRIU image directory as this copy restores it (host/pidns.py)."""
    if st.manifest.pid_ns:
        st.host.view = pidns.criu_view(layout.criu_dir(st.image), st.manifest)


def _drop_view(st: RestoreState, _err: Optional[BaseException] = None) -> None:
    if st.host.view is not None:
        pidns.drop_view(st.host.view)
        st.host.view = None


def _criu_restore(st: RestoreState) -> None:
    """CRIU restores the tree, detached; it stays stopped while checksums or lazy pages are
    pending. A failure here leaves nothing CRIU restored; a corrupt image, or another restore
    that took the image's pids, is the better explanation of it."""
    pre = st.checked
    try:
        # CRIU's ghost files have one name per image: overlapping restores of it take turns here
        with ghostlock.for_image(layout.criu_dir(st.image), st.cb.note):
            st.tree.result = criu.restore(
                str(st.host.view or layout.criu_dir(st.image)),
                str(pre.logs),
                options=replace(
                    criu_options(st.manifest, tuple(st.host.inherit)),
                    # lazy: stopped until npusnap holds the daemon's userfaultfds (lazypages.py)
                    leave_stopped=_stays_stopped(st),
                    lazy_pages=st.tree.lazy is not None,
                    tcp_close=pre.options.tcp_close,
                    passthrough=pre.options.criu_passthrough,
                ),
                log_name=layout.RESTORE_LOG,
                binary=pre.criu_binary(),
                on_notify=st.tree.lazy.on_notify if st.tree.lazy is not None else None,
            )
    except NpusnapError as err:
        corrupt = st.verifying.checksums.join() if st.verifying.checksums is not None else None
        if corrupt is not None:
            raise corrupt from None
        pids = [p.pid for p in st.manifest.processes]
        busy = restoreguard.concurrent_restore(err, pids) if isinstance(err, CriuError) else None
        if busy is not None:
            raise busy from None
        raise
    finally:
        _drop_view(st)
        _close_inherited(st)
        hostres.drop_remaps(pre.to_put_back)  # CRIU's restore consumes them; a failed one leaves them
    st.tree.criu_done = time.monotonic()
    if st.tree.stop_guard is not None:
        st.tree.stop_guard.tell("tree", st.restored.pid)


def _finish_stop_guard(st: RestoreState, _err: Optional[BaseException] = None) -> None:
    if st.tree.stop_guard is not None:
        st.tree.stop_guard.finish()
        st.tree.stop_guard = None


def _release(st: RestoreState) -> None:
    """A --pid-ns copy's host pids; then the stopped tree runs once verified."""
    root_pid = st.restored.pid
    try:
        stopped = _stopped_in_image(st) if _stays_stopped(st) else set()
        if st.manifest.pid_ns:  # from here on, the restored copy's host pids
            st.manifest, moved = pidns.translate(st.manifest, root_pid)
            st.host.device_memory_files = {moved.get(k, k): v for k, v in st.host.device_memory_files.items()}
            stopped = {moved.get(p, p) for p in stopped}
        if st.tree.lazy is not None:
            st.tree.lazy.criu_log = st.restored.log_path
            st.tree.lazy.guard()
            st.tree.lazy.release(stays_stopped=stopped)
            st.cb.note(
                f"the job runs (root pid {root_pid}) while CRIU's lazy-pages daemon (pid "
                f"{st.tree.lazy.daemon.pid}, log {st.tree.lazy.daemon.log_path}) pages in the rest of "
                "its memory"
                + (" and its page files are verified" if st.verifying.checksums is not None else "")
                + "; npusnap watches until every page is in"
            )
        elif st.verifying.checksums is not None:
            _release_when_verified(st.manifest, st.verifying.checksums, st.cb, stopped)
    finally:
        _finish_stop_guard(st)  # released (or killed unverified): nothing left stopped
    st.tree.released = time.monotonic()


def _write_pidfile(st: RestoreState) -> None:
    """Written before the device step: if that fails the tree is running (locked), and the
    operator's scripts need its pid all the same. A write that fails in spite of the check
    must not leave the job locked: the device step runs first, the error comes after."""
    assert st.options.pidfile is not None
    try:
        st.device.pidfile = pidfile_mod.write(st.options.pidfile, st.restored.pid)
    except NpusnapError as err:
        st.device.pidfile_error = err


def _device_restore(st: RestoreState) -> None:
    """Restore + Unlock every NPU process (each as soon as its own Restore is done)."""
    res = st.restored
    npu_pids = st.npu_pids
    publishing.stop_point("restore:device-restore")
    try:
        if npu_pids:
            tokens = {p.pid: p.lock_token for p in st.manifest.npu_processes if p.lock_token}
            before_unlock = None
            waits = [c for c in (st.verifying.device_checks, st.verifying.assembly) if c is not None]
            if waits:
                before_unlock = _device_files_verified(st.manifest, waits, st.cb)
            _restore_and_unlock(
                npu_pids, st.options, res.pid, res.log_path, tokens, st.host.device_memory_files,
                before_unlock, st.guard,
            )  # fmt: skip
            rebuild_communicators(npu_pids, res.pid, st.cb.note)
        _check_none_left_locked(st.manifest, res.pid, res.log_path)
        st.device.device_done = time.monotonic()
        settle(st)
    except NpusnapError as err:
        if st.tree.lazy is not None:
            # The tree stays (locked, or partly running): its memory must still come in, or it dies.
            try:
                st.tree.lazy.finish()
            except NpusnapError as lazy_err:
                raise lazy_err from err
        raise


def settle(st: RestoreState) -> None:
    """Watch the resumed tree ``settle_s``: a process that died fails the restore."""
    res = st.restored
    watched = tuple(dict.fromkeys((res.pid, *st.npu_pids)))
    for note in check_alive_after(watched, st.options.settle_s, res.log_path):
        st.cb.note(note)


def _lazy_page_in(st: RestoreState) -> None:
    assert st.tree.lazy is not None
    st.tree.lazy_report = st.tree.lazy.finish()


def _report(st: RestoreState) -> None:
    err = st.device.pidfile_error
    if err is not None:
        err.message = f"restored and running (root pid {st.restored.pid}), but {err.message}"
        err.details["restored_root_pid"] = st.restored.pid
        raise err
    if st.guard.received is not None:
        st.cb.note(f"{st.guard.name} was received during the restore; the restore was completed first")


# A signal before CRIU starts stops the restore with nothing touched; once CRIU has started,
# stopping halfway would leave processes locked with nobody to restore them, so it finishes.
UNTOUCHED = ("before anything was started", "nothing was restored")
VERIFY: Step[RestoreState] = Step("verify", _verify, phase="verify", checkpoint=UNTOUCHED)
PREFLIGHT: Step[RestoreState] = Step("preflight", _preflight, checkpoint=UNTOUCHED)
OPEN_FILES: Step[RestoreState] = Step("open files", _open_files, checkpoint=UNTOUCHED)
HOST_NODES: Step[RestoreState] = Step(
    "host nodes", _make_host_nodes, _remove_host_nodes, checkpoint=UNTOUCHED
)
PUT_BACK: Step[RestoreState] = Step("put back files", _put_back, _remove_put_back, checkpoint=UNTOUCHED)


def _criu_phase(st: RestoreState) -> str:
    return "criu restore" + (" (lazy pages)" if st.options.lazy else "")


DEVICE_VIEW: Step[RestoreState] = Step("device view", _enter_device_view, checkpoint=UNTOUCHED)
# These three make what CRIU's restore needs, each only where it applies (and announce its phase).
PID_NS_VIEW: Step[RestoreState] = Step(
    "pid-ns view", _make_view, _drop_view, phase=_criu_phase, checkpoint=UNTOUCHED
)
LAZY_DAEMON: Step[RestoreState] = Step("lazy-pages daemon", _start_lazy, _abort_lazy, checkpoint=UNTOUCHED)
STOP_GUARD: Step[RestoreState] = Step(
    "stop guard", _start_stop_guard, _finish_stop_guard, checkpoint=UNTOUCHED
)
# The single restore's commit: once CRIU restored the tree, stopping would leave it locked.
CRIU_RESTORE: Step[RestoreState] = Step("criu restore", _criu_restore, commit=True)
RELEASE: Step[RestoreState] = Step("release", _release)
PIDFILE: Step[RestoreState] = Step("pidfile", _write_pidfile, when=lambda st: st.options.pidfile is not None)
DEVICE_RESTORE: Step[RestoreState] = Step("device restore", _device_restore, phase="device restore")
LAZY_PAGE_IN: Step[RestoreState] = Step(
    "lazy page-in", _lazy_page_in, phase="lazy page-in", when=lambda st: st.tree.lazy is not None
)
REPORT: Step[RestoreState] = Step("report", _report)

STEPS: tuple[Step[RestoreState], ...] = (
    VERIFY,
    PREFLIGHT,
    # Before the files the restored tree inherits (--output) are opened: opened in the host's
    # mount namespace, they would be on a mount the tree's own namespace does not have, and CRIU
    # could not dump the copy again ("Can't lookup mount").
    DEVICE_VIEW,
    OPEN_FILES,
    HOST_NODES,
    PUT_BACK,
    PID_NS_VIEW,
    LAZY_DAEMON,
    STOP_GUARD,
    CRIU_RESTORE,
    RELEASE,
    PIDFILE,
    DEVICE_RESTORE,
    LAZY_PAGE_IN,
    REPORT,
)


def restore(
    directory: Path,
    options: RestoreOptions = RestoreOptions(),
    callbacks: RestoreCallbacks = RestoreCallbacks(),
) -> RestoreOutcome:
    """Run the whole restore pipeline (see the package's docstring); raise NpusnapError on failure."""
    with SignalGuard(callbacks.note, what="restore") as guard:
        final = layout.follow_pointer(directory)
        state = RestoreState(final, load_manifest(final), options, callbacks, guard)
        try:
            Pipeline("restore", STEPS, cb=callbacks, guard=guard).run(state)
        finally:
            state.close()
        return state.outcome()


def _stopped_in_image(st: RestoreState) -> set[int]:
    """The manifest's pids of the processes that were stopped when dumped (CRIU restores them
    stopped): releasing the tree must leave them so."""
    ids = set(_image_stops(st))
    if not st.manifest.pid_ns:
        return ids
    host = {ns: int(h) for h, ns in st.manifest.pid_ns.items()}
    return {host[i] for i in ids if i in host}
