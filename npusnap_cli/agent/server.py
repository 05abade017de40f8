"""The agent proper: the control socket, the snapshot operations, the lease watchdog.

Standard library only, Python 3.9+ (runs inside the target process).

One daemon thread does everything: it waits on the listening socket (and on at most one
connected client) with a short poll timeout, ticks the lease between waits, and carries out the
allowed operations by calling the CANN snapshot API of the runtime this process already loaded.
The thread makes no device calls other than the snapshot ones and the non-blocking state
queries: a locked runtime blocks every other device call, the agent's own too.

Nothing in here may take the application down: every exception is caught, logged to stderr with
an ``npusnap-agent:`` prefix and, where a client asked for something, reported to it.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from npusnap_cli import __version__, paths, protocol
from npusnap_cli.agent import devmem
from npusnap_cli.agent.hooks import HookFailed, HookRegistry
from npusnap_cli.agent.lease import TICK, Lease

RUNNING, LOCKED, BACKED_UP = 0, 1, 2
STATE_NAMES = {RUNNING: "RUNNING", LOCKED: "LOCKED", BACKED_UP: "BACKED_UP"}
SEND_TIMEOUT = 5.0  # a client that does not read its answer for this long is dropped
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


def log(message: str) -> None:
    """Write one line to the target's stderr; never raises (stderr may be closed)."""
    try:
        sys.stderr.write(f"npusnap-agent: [{os.getpid()}] {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


def read_start_time(pid: str = "self") -> Optional[int]:
    """Field 22 of /proc/PID/stat (clock ticks after boot). CRIU restore gives a new value."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
        return int(data[data.rfind(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class OpError(Exception):
    """An operation failed; ``error`` is the protocol error object to send back."""

    def __init__(self, error: Dict[str, Any]) -> None:
        super().__init__(error.get("message", ""))
        self.error = error


def _acl_error(exc: BaseException, what: str) -> OpError:
    code = int(getattr(exc, "code", 0) or 0)
    name = str(getattr(exc, "name", "") or type(exc).__name__)
    hint = str(getattr(exc, "hint", "") or "")
    return OpError(protocol.make_error(protocol.ERR_ACL, name, f"{what} failed: {exc}", code, hint=hint))


def default_runtime_finder() -> Any:
    """The ACL runtime this process already loaded (never loads a second copy), or None."""
    from npusnap_cli import acl

    return acl.AclRuntime.in_process()


class _LockStateError(Exception):
    """Lock asked of a process that is not RUNNING: reported as the runtime's 507906."""

    code = 507906
    name = "ACL_ERROR_SNAPSHOT_LOCK_FAILED"

    def __init__(self, state: str) -> None:
        super().__init__(f"507906: lock failed — the process is {state}, not RUNNING (checked before Lock)")
        self.hint = "a snapshot is already in progress; run `npusnap status` to see its state"


def _is_acl_error(exc: BaseException) -> bool:
    try:
        from npusnap_cli import acl
    except Exception:
        return hasattr(exc, "code")
    return isinstance(exc, acl.AclError)


class Agent:
    """The agent of one process. ``serve_forever`` runs on its own daemon thread."""

    def __init__(
        self,
        socket_path: Optional[Path] = None,
        runtime_finder: Callable[[], Any] = default_runtime_finder,
        hooks: Optional[HookRegistry] = None,
    ) -> None:
        self.pid = os.getpid()
        self.socket_path = Path(socket_path) if socket_path else paths.agent_socket_path(self.pid)
        self.hooks = hooks if hooks is not None else HookRegistry()
        self.lease = Lease()
        self.start_time = read_start_time()
        # restored: CRIU restored this process at least once (reported by hello/status).
        # restore_pending: restored while BACKED_UP (or in an unknown state) and no Restore since:
        # the device memory the app points at is gone until Restore, so Unlock must wait for it.
        self.restored = False
        self.restore_pending = False
        self.events: List[str] = []  # recent notable events, reported by `status`
        # Device memory (see the "device memory" section below): the mode of the current
        # snapshot, whether npusnap holds a copy, and whether a Restore ran since it was taken.
        self.devmem_mode: Optional[str] = None
        self.devmem_saved = False
        self.devmem_restored = False
        # The snapshot flow of the current snapshot: "driver" (the runtime and driver keep device
        # memory: args != NULL), "driver?" (to be tried at Backup), "legacy" (args == NULL).
        self.devmem_flow: Optional[str] = None
        self.devmem_fallback: Optional[str] = None
        # Devices learned from npusnap's own LOCK_PRE callback (CANN 9.0+ calls it once per open
        # device): the real-API way to know them, /dev/davinciN is not held open by the driver.
        self._callback_devices: List[int] = []
        self._callback_state: Optional[str] = None  # None: not tried, "registered", or why not
        self._lock_pre_seen: List[int] = []
        self._find_runtime = runtime_finder
        self._runtime: Any = None
        self._listener: Optional[socket.socket] = None
        self._client: Optional[socket.socket] = None
        self._client_pid = 0
        self._inbuf = protocol.LineBuffer()
        self._stopping = threading.Event()
        self.thread: Optional[threading.Thread] = None

    # -- life cycle ---------------------------------------------------------------------------
    def bind(self) -> None:
        """Create the private directory, remove a stale socket file, bind and listen."""
        directory = self.socket_path.parent
        _ensure_private_dir(directory)
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(errno.EEXIST, f"{self.socket_path} exists and is not a socket; not removing it")
            # A socket named after our own pid can only be left over from a dead process.
            os.unlink(self.socket_path)
        if len(os.fsencode(str(self.socket_path))) >= 108:
            raise OSError(
                errno.ENAMETOOLONG, f"socket path {self.socket_path} exceeds the 107-byte AF_UNIX limit"
            )
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.socket_path))
            # chmod after bind instead of changing umask: umask is process-wide and the
            # application's other threads may be creating files right now.
            os.chmod(self.socket_path, 0o600)
            sock.listen(8)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener = sock

    def start_thread(self) -> None:
        self.thread = threading.Thread(target=self.serve_forever, name="npusnap-agent", daemon=True)
        self.thread.start()

    def stop(self, unlink: bool = True) -> None:
        """Stop serving (tests, interpreter shutdown). The snapshot state is not touched."""
        self._stopping.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5 * TICK + 1)
        self._drop_client()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
            self._listener = None
            if unlink:
                try:
                    if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                        os.unlink(self.socket_path)
                except OSError:
                    pass

    def close_inherited(self) -> None:
        """In a forked child: close the parent's listener and client fds, leave the path alone.

        Touch no lock or Event of the parent's agent thread: it may have held one at fork time,
        and since it does not exist in the child, waiting for it would hang the child forever.
        """
        self._stopping = threading.Event()
        self._stopping.set()
        for sock in (self._client, self._listener):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        self._client = None
        self._listener = None

    # -- the loop -----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            try:
                self._tick()
                self._wait_once()
                failures = 0
            except Exception as exc:
                failures += 1
                log(f"internal error in the agent loop: {type(exc).__name__}: {exc}")
                self._drop_client()
                # Back off so that a persistent failure does not spin the target's CPU.
                time.sleep(min(5.0, TICK * failures))

    def _wait_once(self) -> None:
        listener = self._listener
        if listener is None:
            self._stopping.wait(TICK)
            return
        poller = select.poll()
        poller.register(listener.fileno(), select.POLLIN)
        client = self._client
        if client is not None:
            poller.register(client.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        # poll() is retried by Python after EINTR (PEP 475), e.g. when CRIU seizes the process.
        for fd, _events in poller.poll(int(TICK * 1000)):
            if fd == listener.fileno():
                self._accept()
            elif client is not None and self._client is client and fd == client.fileno():
                self._read_client()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        try:
            pid, uid, _gid = _UCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            if uid not in (os.geteuid(), 0):
                log(
                    f"refused a client with uid {uid} (pid {pid}): "
                    f"only uid {os.geteuid()} or root may connect"
                )
                self._refuse(conn, "PERMISSION_DENIED", f"uid {uid} may not control this process")
                return
            if self._client is not None and not self._client_alive():
                self._drop_client()  # it hung up; its EOF just was not read yet
            if self._client is not None:
                self._refuse(
                    conn, "BUSY", f"another client (pid {self._client_pid}) is connected; one at a time"
                )
                return
            conn.setblocking(True)
            conn.settimeout(SEND_TIMEOUT)
            self._client = conn
            self._client_pid = pid
            self._inbuf = protocol.LineBuffer()
        except Exception:
            conn.close()
            raise

    @staticmethod
    def _refuse(conn: socket.socket, name: str, message: str) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(protocol.encode_error(0, protocol.make_error(protocol.ERR_PROTOCOL, name, message)))
        except OSError:
            pass
        finally:
            conn.close()

    def _client_alive(self) -> bool:
        client = self._client
        if client is None:
            return False
        poller = select.poll()
        poller.register(client.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        for _fd, events in poller.poll(0):
            if events & (select.POLLHUP | select.POLLERR):
                return False
            if events & select.POLLIN:
                try:
                    return client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
                except (BlockingIOError, InterruptedError):
                    return True
                except OSError:
                    return False
        return True

    def _drop_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except OSError:
                pass
        self._client = None
        self._client_pid = 0

    def _read_client(self) -> None:
        client = self._client
        assert client is not None
        try:
            data = client.recv(65536)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return
        except OSError:
            self._drop_client()
            return
        if not data:
            self._drop_client()
            return
        self._inbuf.feed(data)
        while self._client is client:
            try:
                line = self._inbuf.next_line()
            except protocol.ProtocolError as exc:
                self._send(0, None, protocol.make_error(protocol.ERR_PROTOCOL, exc.name, exc.message))
                self._drop_client()
                return
            if line is None:
                return
            self._handle_line(line)

    def _send(self, msg_id: int, result: Optional[Dict[str, Any]], error: Optional[Dict[str, Any]]) -> None:
        client = self._client
        if client is None:
            return
        try:
            if error is not None:
                data = protocol.encode_error(msg_id, error)
            else:
                data = protocol.encode_result(msg_id, result or {})
        except protocol.ProtocolError as exc:
            data = protocol.encode_error(
                msg_id, protocol.make_error(protocol.ERR_INTERNAL, exc.name, exc.message)
            )
        try:
            client.sendall(data)
        except OSError as exc:
            log(f"could not answer client pid {self._client_pid}: {exc}")
            self._drop_client()

    def _handle_line(self, line: bytes) -> None:
        msg_id = 0
        try:
            msg_id, op, args = protocol.decode_request(line)
        except protocol.ProtocolError as exc:
            try:
                msg_id = int(json.loads(line).get("id", 0))
            except Exception:
                msg_id = 0
            self._send(msg_id, None, protocol.make_error(protocol.ERR_PROTOCOL, exc.name, exc.message))
            return
        try:
            result = self.dispatch(op, args)
        except OpError as exc:
            self._send(msg_id, None, exc.error)
        except Exception as exc:
            log(f"internal error in op {op}: {type(exc).__name__}: {exc}")
            self._send(
                msg_id,
                None,
                protocol.make_error(protocol.ERR_INTERNAL, type(exc).__name__, f"agent bug in {op}: {exc}"),
            )
        else:
            self._send(msg_id, result, None)
        finally:
            self.lease.skip_gap()  # time spent in an operation is not silence

    # -- watchdog -----------------------------------------------------------------------------
    def _refresh_restored(self) -> None:
        now = read_start_time()
        if now is None or self.start_time is None or now == self.start_time:
            return
        # A new start time means CRIU restored us; remember it so that a later dump and restore
        # of this same process is noticed too.
        self.start_time = now
        self.restored = True
        state = self.state()
        self.restore_pending = state is None or state == BACKED_UP
        self._event("process was restored by CRIU (start time changed)")
        if self.lease.active:
            self.lease.void("process was restored by CRIU; waiting locked for `restore`")
            self._event("lease voided: the restored process waits, locked, for its restore command")

    def _tick(self) -> None:
        self._refresh_restored()
        if self.lease.tick():
            self._event(
                f"lease of {self.lease.expired_duration or 0:g}s expired without renew: "
                "rolling back by itself"
            )
            try:
                result = self.do_rollback()
                self._event(
                    f"lease rollback done: state {result.get('state')}, actions {result.get('actions')}"
                )
            except OpError as exc:
                self._event(
                    f"lease rollback FAILED: {exc.error.get('message')}; run `npusnap thaw {self.pid}`"
                )
            except Exception as exc:
                self._event(f"lease rollback FAILED (agent bug): {exc}; run `npusnap thaw {self.pid}`")
            self.lease.skip_gap()

    def _event(self, message: str) -> None:
        log(message)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.events.append(f"{stamp} {message}")
        del self.events[:-20]

    # -- operations ---------------------------------------------------------------------------
    def dispatch(self, op: str, args: Dict[str, Any]) -> Dict[str, Any]:
        self._refresh_restored()
        handler = getattr(self, f"op_{op}", None)
        if op not in protocol.OPS or handler is None:
            raise OpError(protocol.make_error(protocol.ERR_PROTOCOL, "UNKNOWN_OP", f"unknown op {op!r}"))
        result: Dict[str, Any] = handler(args)
        return result

    def runtime(self, required: bool = True) -> Any:
        if self._runtime is None:
            self._runtime = self._find_runtime()
        if self._runtime is None and required:
            raise OpError(
                protocol.make_error(
                    protocol.ERR_STATE,
                    "NO_ACL_RUNTIME",
                    "the CANN runtime (libacl_rt.so / libascendcl.so) is not loaded in this process",
                )
            )
        return self._runtime

    def state(self) -> Optional[int]:
        rt = self.runtime(required=False)
        if rt is None:
            return None
        st = rt.state()
        return None if st is None else int(st)

    def _call(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:
            if _is_acl_error(exc):
                raise _acl_error(exc, what) from exc
            raise

    def _run_hooks(self, stage: str) -> List[str]:
        try:
            return self.hooks.run(stage)
        except HookFailed as exc:
            log(str(exc))
            raise

    @staticmethod
    def _hook_error(exc: HookFailed, rolled_back: str) -> OpError:
        return OpError(
            protocol.make_error(
                protocol.ERR_HOOK,
                "HOOK_FAILED",
                f"{exc}; {rolled_back}",
                hook=exc.hook,
                stage=exc.stage,
                exception=exc.error,
            )
        )

    def _state_result(self, **extra: Any) -> Dict[str, Any]:
        st = self.state()
        out: Dict[str, Any] = {
            "state": STATE_NAMES.get(st) if st is not None else None,
            "lease": self.lease.info(),
        }
        out.update(extra)
        return out

    def _move_to(self, target: int) -> List[str]:
        """Drive the runtime back to ``target`` (no hooks) after a hook failed; the steps done."""
        rt = self.runtime()
        steps: List[str] = []
        current = self.state()
        if current == target:
            return steps
        if target == RUNNING or (current == BACKED_UP and target == LOCKED):
            if current == BACKED_UP and self.restore_pending:
                self._device_restore(rt)
                steps.append("restore")
            self._call("Unlock", rt.unlock)
            steps.append("unlock")
            current = RUNNING
            if target == RUNNING:
                self._devmem_after_unlock()
        if target in (LOCKED, BACKED_UP) and current == RUNNING:
            self._call("Lock", rt.lock)
            steps.append("lock")
            current = LOCKED
        if target == BACKED_UP and current == LOCKED:
            self._backup(rt)
            steps.append("backup")
        return steps

    def _abort_after_hook(self, exc: HookFailed, before: Optional[int]) -> OpError:
        if before is None:
            return self._hook_error(exc, "snapshot state unknown, not rolled back")
        try:
            steps = self._move_to(before)
        except OpError as again:
            self._event(f"rollback after hook failure FAILED: {again.error.get('message')}")
            return self._hook_error(
                exc, f"rollback to {STATE_NAMES[before]} FAILED: {again.error.get('message')}"
            )
        if before == RUNNING:
            self.lease.release()
        return self._hook_error(
            exc, f"rolled back to {STATE_NAMES[before]} ({', '.join(steps) or 'no change'})"
        )

    def op_hello(self, args: Dict[str, Any]) -> Dict[str, Any]:
        del args
        rt = self.runtime(required=False)
        boot = _boot_time()
        started = None
        if boot is not None and self.start_time is not None:
            started = boot + self.start_time / os.sysconf("SC_CLK_TCK")
        devices: List[int] = []
        devices_source = None
        dm = self._devmem_report()
        if dm.get("interposed") and dm.get("devices"):
            devices, devices_source = [int(d) for d in dm["devices"]], "aclrtSetDevice (interposed)"
        elif rt is not None:
            try:
                devices = [int(d) for d in rt.devices()]
                devices_source = "runtime"
            except Exception as exc:
                log(f"could not list devices: {exc}")
        return {
            "agent_version": __version__,
            "protocol_version": protocol.PROTOCOL_VERSION,
            "pid": self.pid,
            "start_time_ticks": read_start_time(),
            "started_at": started,
            "restored": self.restored,
            "socket": str(self.socket_path),
            "python": {
                "version": sys.version.split()[0],
                "executable": sys.executable,
                "implementation": sys.implementation.name,
            },
            "acl": {
                "loaded": rt is not None,
                "library": getattr(rt, "path", None) if rt is not None else None,
                "cann_version": getattr(rt, "version", None) if rt is not None else None,
                "devices": devices,
                "devices_source": devices_source,
                "callback_devices": list(self._callback_devices),
            },
            "hooks": self.hooks.names(),
            "device_memory": dm,
        }

    def op_status(self, args: Dict[str, Any]) -> Dict[str, Any]:
        del args
        rt = self.runtime(required=False)
        return self._state_result(
            pid=self.pid,
            acl_loaded=rt is not None,
            restored=self.restored,
            restore_pending=self.restore_pending,
            events=list(self.events[-10:]),
            device_memory=self._devmem_report(),
        )

    def op_lock(self, args: Dict[str, Any]) -> Dict[str, Any]:
        rt = self.runtime()
        mode = str(args.get("device_memory") or devmem.DEFAULT_MODE)
        # Query first: the runtime runs LOCK_PRE callbacks (HCCL's among them) even when Lock
        # then fails on the state, and npusnap's copy must not be taken twice.
        before = self.state()
        if before is not None and before != RUNNING:
            # The runtime's own answer to a Lock in that state, without running its callbacks.
            raise _acl_error(_LockStateError(STATE_NAMES.get(before, str(before))), "Lock")
        start = time.monotonic()
        try:
            ran = self._run_hooks("pre_lock")
        except HookFailed as exc:
            raise self._hook_error(exc, "nothing was locked") from None
        if mode == "preserve" and getattr(rt, "may_have_driver_flow", lambda: False)():
            # The driver-backed flow keeps device memory itself where the driver has the feature;
            # Backup tells (207000 otherwise), and then npusnap falls back to its own copy.
            self._devmem_begin(mode)
            self.devmem_flow = "driver?"
            saved = False
        else:
            saved = self._devmem_save(mode, args.get("timeout_s"))
        self._ensure_lock_pre_callback(rt)
        seen: List[int] = []
        self._lock_pre_seen = seen
        try:
            self._call("Lock", rt.lock)
        except BaseException:
            if saved:
                self._devmem_drop()
            raise
        if args.get("lease_s") is not None:
            self.lease.grant(float(args["lease_s"]))
        if seen:
            self._callback_devices = sorted(set(seen))
        return self._state_result(
            elapsed_s=round(time.monotonic() - start, 6),
            hooks_run=ran,
            device_memory=self._devmem_report(),
            callback_devices=sorted(set(seen)),
            callback=self._callback_state,
        )

    def _ensure_lock_pre_callback(self, rt: Any) -> None:
        """Register npusnap's LOCK_PRE callback once (CANN 9.0+); it records the device ids."""
        if self._callback_state is not None:
            return
        register = getattr(rt, "register_callback", None)
        if register is None:
            self._callback_state = "the runtime object has no callbacks"
            return
        try:
            from npusnap_cli import acl

            register(acl.Stage.LOCK_PRE, self._on_lock_pre)
            self._callback_state = "registered"
        except Exception as exc:  # 8.5 has no callbacks: devices then come from elsewhere
            self._callback_state = f"not registered: {exc}"
            log(f"LOCK_PRE callback {self._callback_state}")

    def _on_lock_pre(self, device_id: int) -> int:
        """Called by the runtime inside Lock, once per open device, holding its callback mutex:
        record the id and return 0 (non-zero would abort the Lock)."""
        self._lock_pre_seen.append(int(device_id))
        return 0

    def op_backup(self, args: Dict[str, Any]) -> Dict[str, Any]:
        rt = self.runtime()
        before = self.state()
        start = time.monotonic()
        self._backup(rt)
        try:
            ran = self._run_hooks("post_backup")
        except HookFailed as exc:
            raise self._abort_after_hook(exc, before) from None
        if args.get("lease_s") is not None:
            self.lease.grant(float(args["lease_s"]))
        return self._state_result(
            elapsed_s=round(time.monotonic() - start, 6), hooks_run=ran, device_memory=self._devmem_report()
        )

    def op_renew(self, args: Dict[str, Any]) -> Dict[str, Any]:
        lease_s = args.get("lease_s")
        if not self.lease.renew(None if lease_s is None else float(lease_s)):
            if self.restored and self.lease.voided_reason:
                reason = self.lease.voided_reason
            else:
                reason = "no lease is active (it expired, was released, or was never granted)"
            raise OpError(protocol.make_error(protocol.ERR_STATE, "NO_LEASE", reason))
        return self._state_result()

    def op_release(self, args: Dict[str, Any]) -> Dict[str, Any]:
        del args
        self.lease.release()
        return self._state_result()

    def op_restore(self, args: Dict[str, Any]) -> Dict[str, Any]:
        del args
        rt = self.runtime()
        before = self.state()
        start = time.monotonic()
        self._device_restore(rt)
        try:
            ran = self._run_hooks("post_restore")
        except HookFailed as exc:
            raise self._abort_after_hook(exc, before) from None
        return self._state_result(elapsed_s=round(time.monotonic() - start, 6), hooks_run=ran)

    def _device_restore(self, rt: Any) -> None:
        """CANN Restore: device state back on the device; Unlock is safe again afterwards."""
        if self.devmem_flow == "driver":
            from npusnap_cli import acl

            self._call("Restore", lambda: rt.restore(flags=acl.DRIVER_FLOW_FLAGS))
        else:
            self._call("Restore", rt.restore)
        self.restore_pending = False
        # CANN's Restore gives the allocations back at their addresses, not their contents.
        self.devmem_restored = True

    def op_unlock(self, args: Dict[str, Any]) -> Dict[str, Any]:
        del args
        rt = self.runtime()
        before = self.state()
        if self.restore_pending and before == BACKED_UP:
            # Unlock here would let the app run on device memory that no longer exists.
            raise OpError(
                protocol.make_error(
                    protocol.ERR_STATE,
                    "RESTORE_REQUIRED",
                    "this process was restored by CRIU and its device state is still backed up: "
                    "run `restore` before `unlock`",
                )
            )
        start = time.monotonic()
        self._call("Unlock", rt.unlock)
        devmem_steps = self._devmem_after_unlock()
        try:
            ran = self._run_hooks("post_unlock")
        except HookFailed as exc:
            raise self._abort_after_hook(exc, before) from None
        self.lease.release()
        return self._state_result(
            elapsed_s=round(time.monotonic() - start, 6),
            hooks_run=ran,
            device_memory=dict(self._devmem_report(), steps=devmem_steps),
        )

    def op_rollback(self, args: Dict[str, Any]) -> Dict[str, Any]:
        del args
        return self.do_rollback()

    def do_rollback(self) -> Dict[str, Any]:
        """Back to RUNNING from any state. From BACKED_UP, Unlock directly (keeps the device
        memory) unless this process was CRIU-restored, where Restore must come first."""
        rt = self.runtime()
        start = time.monotonic()
        before = self.state()
        actions: List[str] = []
        warnings: List[str] = []
        if before == BACKED_UP and self.restore_pending:
            self._device_restore(rt)
            actions.append("restore")
        if before in (LOCKED, BACKED_UP) or before is None:
            try:
                self._call("Unlock", rt.unlock)
                actions.append("unlock")
            except OpError:
                if before is not None:
                    raise
                # State unknown (no GetState): Unlock from RUNNING fails harmlessly.
        devmem_steps = self._devmem_after_unlock()
        self.lease.release()
        if actions:
            try:
                self._run_hooks("post_unlock")
            except HookFailed as exc:
                # Rollback's job is to get the process running; a hook failure is reported, not undone.
                warnings.append(str(exc))
        return self._state_result(
            elapsed_s=round(time.monotonic() - start, 6),
            actions=actions,
            before=STATE_NAMES.get(before) if before is not None else None,
            warnings=warnings,
            device_memory=dict(self._devmem_report(), steps=devmem_steps),
        )

    # -- device memory ------------------------------------------------------------------------
    # npusnap keeps the job's device memory itself (docs/device-memory.md). The only place the
    # Python agent calls libnpusnap_agent.so; the native agent core makes the same calls at the
    # same steps. ctypes drops the GIL during each call.
    def _devmem_report(self) -> Dict[str, Any]:
        try:
            report = devmem.info()
        except Exception as exc:
            report = {"available": False, "error": str(exc)}
        report["mode"] = self.devmem_mode
        report["flow"] = self.devmem_flow
        if self.devmem_fallback:
            report["fallback"] = self.devmem_fallback
        return report

    def _devmem_begin(self, mode: str) -> None:
        if mode not in devmem.MODES:
            raise OpError(
                protocol.make_error(
                    protocol.ERR_PROTOCOL, "BAD_ARGS", f"device_memory must be one of {devmem.MODES}"
                )
            )
        self.devmem_mode = mode
        self.devmem_saved = False
        self.devmem_restored = False
        self.devmem_flow = "legacy"
        self.devmem_fallback = None

    def _devmem_save(self, mode: str, timeout_s: Any) -> bool:
        """Before Lock, in ``preserve`` mode: close npusnap's gate and copy device memory to host."""
        self._devmem_begin(mode)
        if mode != "preserve":
            return False
        timeout_ms = int(float(timeout_s if timeout_s is not None else 30.0) * 1000)
        try:
            devmem.save(timeout_ms)
        except devmem.DevMemError as exc:
            raise OpError(
                protocol.make_error(
                    protocol.ERR_STATE,
                    "DEVICE_MEMORY_SAVE_FAILED",
                    f"npusnap could not copy the job's device memory before Lock: {exc}; nothing was locked",
                )
            ) from None
        self.devmem_saved = True
        return True

    def _backup(self, rt: Any) -> None:
        """Backup in the flow chosen at Lock. Where the driver-backed flow turns out not to be
        supported (207000: the driver lacks the feature; 100000: a build that wants NULL args),
        the runtime does not fall back, so npusnap does: Unlock, its own copy, Lock, legacy Backup."""
        if self.devmem_flow != "driver?":
            self._call("Backup", rt.backup)
            return
        from npusnap_cli import acl

        try:
            rt.backup(flags=acl.DRIVER_FLOW_FLAGS)
        except acl.AclError as exc:
            if exc.code not in (acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT, acl.ACL_ERROR_INVALID_PARAM):
                raise _acl_error(exc, "Backup") from exc
            reason = f"driver-backed Backup refused with {exc.code} ({exc.name})"
            self._event(f"{reason}: npusnap keeps the device memory itself (legacy flow)")
            self._call("Unlock", rt.unlock)
            self._devmem_save("preserve", None)
            self.devmem_fallback = reason
            try:
                self._call("Lock", rt.lock)
                self._call("Backup", rt.backup)
            except BaseException:
                if self.state() == RUNNING:
                    self._devmem_drop()
                raise
            return
        self.devmem_flow = "driver"

    def _devmem_drop(self) -> None:
        devmem.finish()
        self.devmem_saved = False
        self.devmem_restored = False

    def _devmem_after_unlock(self) -> List[str]:
        """After Unlock: write the copy back if a Restore ran since it was taken, then open the gate.

        A failed reload leaves the gate closed: the job stays held rather than computing on
        memory whose contents are gone.
        """
        if not self.devmem_saved:
            return []
        steps: List[str] = []
        if self.devmem_restored:
            try:
                devmem.reload()
            except devmem.DevMemError as exc:
                self._event(f"device memory reload FAILED, the job stays held at npusnap's gate: {exc}")
                raise OpError(
                    protocol.make_error(
                        protocol.ERR_STATE,
                        "DEVICE_MEMORY_RELOAD_FAILED",
                        f"the runtime is unlocked but npusnap could not write the job's device memory "
                        f"back: {exc}; the job's device calls stay held",
                    )
                ) from None
            steps.append("reload device memory")
        self._devmem_drop()
        steps.append("open gate")
        return steps


def _ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` 0700 if missing and verify it is safe to put a socket in."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    else:
        # mkdir's mode is filtered by the umask; we must not change the process-wide umask,
        # so fix the mode of the directory we just created instead.
        os.chmod(directory, 0o700)
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{directory} is not a real directory (symlink or file); refusing to use it")
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{directory} is owned by uid {st.st_uid}, not {os.geteuid()}; refusing to use it"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise PermissionError(
            f"{directory} has mode {stat.S_IMODE(st.st_mode):o}, not 700; refusing to use it "
            f"(fix: chmod 700 {directory})"
        )
