"""`npusnap qualify`: prove or refute, on this node, what npusnap assumes of an Ascend node.

Most of npusnap's device side was shown on the simulated NPU only (docs/real-node.md). qualify
runs a small program of its own (agent/qualifyprobe.py) under npusnap's agent, on an idle device,
and checks each assumption against what the node does:

- ``mappings``: the probe's device memory shows in /proc/PID/maps under a name npusnap's
  classifier (host/devmaps.py) knows; their smaps VmFlags are recorded.
- ``coverage``: the agent's tracked bytes grow by the size of each known allocation (every
  allocation policy), as aclrtGetMemInfo's used memory does: no allocation path behind the
  agent's back.
- ``locked-copy``: what the agent's copy of the device memory, made while LOCKED, saved of an
  allocation is the pattern the probe wrote into it earlier.
- ``vmm-address``: a VMM reservation is still at its address (reachable, writable) after
  Backup and Restore.
- ``criu-plugin``: the CRIU plugin for the device handles in npusnap's plugin directory fits the
  CRIU npusnap runs (its hook count: host/criuplugin.py).
- ``cann``: the CANN installation exports the snapshot API; its version, the driver-backed flow,
  HCCL and the visible-devices variables are noted.

Each check gives a verdict (pass, fail, skip with why). The report (JSON) names the CANN version
and the driver it was made for and is written 0600 into npusnap's state directory; the command
exits 0 only if every check npusnap relies on passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

from npusnap_cli import __version__, acl, contract, paths, safefs
from npusnap_cli.agent import launch, qualifyprobe
from npusnap_cli.device import occupancy
from npusnap_cli.device.agent_client import AgentClient
from npusnap_cli.errors import BusyError, ExitCode, NpusnapError, PreflightError
from npusnap_cli.host import devmaps, preflight, qualifyreport
from npusnap_cli.host.preflight.items import CheckItem
from npusnap_cli.jsontypes import JSONObject, JSONValue

PASS, FAIL, SKIP = "pass", "fail", "skip"
REPORT_FORMAT = qualifyreport.REPORT_FORMAT
REPORT_VERSION = qualifyreport.REPORT_VERSION
REPORT_NAME = qualifyreport.REPORT_NAME  # in paths.state_dir()
FAILED_EXIT = ExitCode.PREFLIGHT  # an assumption npusnap relies on does not hold on this node

MiB = 1 << 20
MAP_BYTES = 4 * MiB  # the allocation the mappings and the locked copy look at
COVER_BYTES = 8 * MiB  # each allocation of the coverage check
VMM_BYTES = 2 * MiB  # one VMM granule
# aclrtGetMemInfo's used memory may move by a page or two besides an allocation on a real device
# (the driver's own structures): more than this untracked is an allocation the agent did not see.
COVER_TOLERANCE = 2 * MiB
# aclrtMalloc's policies (aclrtMemMallocPolicy): each may take its own path in the runtime.
POLICIES = ((0, "huge-first"), (1, "huge-only"), (2, "normal-only"))
PROBE_TIMEOUT_S = 60.0

# (name, the assumption, relied on): the order of the report.
CHECKS: tuple[tuple[str, str, bool], ...] = (
    ("cann", "the CANN runtime exports the snapshot API (Lock, Backup, Restore, Unlock)", True),
    ("criu-plugin", "the CRIU plugin for the device handles fits the CRIU npusnap runs", True),
    ("mappings", "device memory shows in /proc/PID/maps under a name npusnap recognises", True),
    ("coverage", "the agent sees every allocation: its tracked bytes grow as aclrtGetMemInfo's used", True),
    ("locked-copy", "the agent's copy of device memory made while LOCKED holds what was written", True),
    ("vmm-address", "a VMM reservation keeps its address across Backup and Restore", True),
)
ASSUMPTIONS = {name: (what, relied) for name, what, relied in CHECKS}


@dataclass
class Verdict:
    name: str
    verdict: str  # PASS, FAIL, SKIP
    detail: str
    data: JSONObject = field(default_factory=dict)

    @property
    def assumption(self) -> str:
        return ASSUMPTIONS[self.name][0]

    @property
    def relied_on(self) -> bool:
        return ASSUMPTIONS[self.name][1]

    def to_dict(self) -> JSONObject:
        return {
            "name": self.name,
            "assumption": self.assumption,
            "relied_on": self.relied_on,
            "verdict": self.verdict,
            "detail": self.detail,
            "data": self.data,
        }


@dataclass
class Report:
    device: int
    cann: JSONObject
    driver: JSONObject
    verdicts: list[Verdict] = field(default_factory=list)
    notes: JSONObject = field(default_factory=dict)
    created_at: str = ""
    path: Optional[str] = None

    @property
    def passed(self) -> bool:
        """Every check npusnap relies on passed (a skipped one did not prove it)."""
        return all(v.verdict == PASS for v in self.verdicts if v.relied_on) and bool(self.verdicts)

    def failed(self) -> list[str]:
        return [v.name for v in self.verdicts if v.relied_on and v.verdict != PASS]

    def exit_code(self) -> ExitCode:
        return ExitCode.OK if self.passed else FAILED_EXIT

    def to_dict(self) -> JSONObject:
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "npusnap_version": __version__,
            "created_at": self.created_at,
            "host": socket.gethostname(),
            "device": self.device,
            "cann": self.cann,
            "driver": self.driver,
            "passed": self.passed,
            "failed": list(self.failed()),
            "checks": [v.to_dict() for v in self.verdicts],
            "notes": self.notes,
            "report": self.path,
        }


def write_report(report: Report, extra: Optional[Path] = None) -> str:
    """Write the report (0600) into the state directory, and to ``extra`` when given; the path
    in the state directory."""
    where = qualifyreport.report_path()
    report.path = str(where)
    data = (json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n").encode()
    with contextlib.suppress(OSError):
        where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    safefs.write_file(str(where), iter([data]), mode=0o600, check=False)
    if extra is not None:
        safefs.write_file(str(extra), iter([data]), mode=0o600)
    return str(where)


# -- the node, before anything runs ----------------------------------------------------------------


def require_root() -> None:
    if os.geteuid() != 0:
        raise PreflightError(
            "npusnap qualify runs as root only",
            why="it reads the probe's /proc entries and runs CRIU's checks as a dump would",
            fix="run it as root: sudo npusnap qualify",
        )


def physical_device(device: int, simulated: bool) -> int:
    """The node's device behind the program id ``device`` the probe will use."""
    visible = occupancy.visible_list(os.environ.get("ASCEND_RT_VISIBLE_DEVICES"))
    return occupancy.physical([device], occupancy.driver_view(os.getpid(), simulated), visible)[0]


def require_idle(install: acl.CannInstall, device: int) -> None:
    """Refuse a device another process uses (or may use: one whose agent cannot say): the
    coverage check reads the device's used memory, which must change by the probe's only."""
    phys = physical_device(device, install.simulated)
    users = occupancy.device_users(install.home, install.simulated)
    busy = [u for u in users if u.devices is None or phys in u.devices]
    if busy:
        who = ", ".join(u.who() + ("" if u.devices is not None else " (devices unknown)") for u in busy)
        raise BusyError(
            f"device {device} is not idle: {who} uses the NPU",
            why="qualify compares the device's used memory with what its own probe allocated; "
            "another process's allocations would make every verdict meaningless",
            fix="run qualify when no job uses the device (`npusnap ps`, `npu-smi info`), or pick an "
            "idle one with --device N",
            details={"device": device, "pids": [u.pid for u in busy]},
        )


def driver_identity(hal_library: Optional[str]) -> JSONObject:
    """What identifies the driver the report was made with: its version.info, and the driver
    library the probe loaded (path and sha256)."""
    info = qualifyreport.DRIVER_VERSION_INFO
    return {
        "version": qualifyreport.driver_version(info),
        "version_info": info if os.path.isfile(info) else None,
        "hal_library": hal_library,
        "hal_sha256": qualifyreport.file_sha256(hal_library) if hal_library else None,
    }


def loaded_library(pid: int, name: str) -> Optional[str]:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and os.path.basename(parts[5].strip()) == name:
                return parts[5].strip()
    return None


def in_container() -> bool:
    return any(os.path.exists(p) for p in ("/.dockerenv", "/run/.containerenv")) or bool(
        os.environ.get("KUBERNETES_SERVICE_HOST")
    )


# -- /proc ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start


def read_maps(pid: int) -> list[Mapping]:
    out = []
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, _, hi = parts[0].partition("-")
            out.append(Mapping(int(lo, 16), int(hi, 16), parts[5].strip() if len(parts) == 6 else ""))
    return out


def vm_flags(pid: int) -> dict[int, str]:
    """Start address -> its VmFlags line of /proc/PID/smaps."""
    out: dict[int, str] = {}
    start = None
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                with contextlib.suppress(ValueError):
                    start = int(head.partition("-")[0], 16)
            elif head == "VmFlags:" and start is not None:
                out[start] = line.split(":", 1)[1].strip()
    return out


def is_device_mapping(path: str) -> bool:
    return path.startswith(devmaps.DEVICE_MAPPING_PREFIXES)


# VM_PFNMAP | VM_IO (smaps VmFlags "pf" and "io"): pages of a device, not of memory the kernel
# manages, which is how the driver maps device memory (`VM_DONTDUMP|VM_PFNMAP|VM_IO`). A signal
# of device memory that does not depend on the mapping's name.
DEVICE_VM_FLAGS = frozenset({"pf", "io"})


def device_flagged(flags: Optional[str]) -> bool:
    return flags is not None and set(flags.split()) >= DEVICE_VM_FLAGS


def judge_mappings(before: list[Mapping], after: list[Mapping], flags: dict[int, str]) -> Verdict:
    """``mappings`` from the probe's maps before and after it allocated and wrote device memory:
    some mapping under a name npusnap recognises, and none that appeared meanwhile under another
    name with a device's VmFlags (which npusnap would not count as device memory)."""
    known = [m for m in after if is_device_mapping(m.path)]
    old = {(m.start, m.end, m.path) for m in before}
    new = [m for m in after if (m.start, m.end, m.path) not in old and not is_device_mapping(m.path)]
    hidden = [m for m in new if device_flagged(flags.get(m.start))]

    def row(m: Mapping) -> JSONObject:
        return {"path": m.path, "start": hex(m.start), "size": m.size, "vm_flags": flags.get(m.start)}

    data: JSONObject = {
        "recognised": [row(m) for m in known],
        "new_unrecognised": [row(m) for m in new],
        "prefixes": list(devmaps.DEVICE_MAPPING_PREFIXES),
    }
    if known and hidden:
        seen = sorted({m.path or "[anonymous]" for m in hidden})
        return Verdict(
            "mappings",
            FAIL,
            f"device memory is mapped under names npusnap does not recognise too (VmFlags "
            f"{' '.join(sorted(DEVICE_VM_FLAGS))}): {', '.join(seen)}; npusnap would not count it",
            data,
        )
    if known:
        names = sorted({m.path for m in known})
        return Verdict("mappings", PASS, f"{len(known)} device-memory mapping(s): {', '.join(names)}", data)
    seen = sorted({m.path or "[anonymous]" for m in new})
    return Verdict(
        "mappings",
        FAIL,
        "no mapping of the probe's device memory has a name npusnap recognises "
        f"({', '.join(devmaps.DEVICE_MAPPING_PREFIXES)}); mapped since its allocation: "
        + (", ".join(seen) if seen else "nothing"),
        data,
    )


# -- the stream of the agent's copy ------------------------------------------------------------------


def stream_allocation(stream: bytes, ptr: int) -> Optional[bytes]:
    """The bytes the agent's device-memory stream (contract.DEVMEM_FILE_*) holds from ``ptr`` to
    the end of the allocation that holds it (a runtime may hand out a piece of a larger driver
    allocation); None if it lists none there. ValueError on a stream that is not one."""
    hdr = contract.DEVMEM_FILE_HEADER
    rec = contract.DEVMEM_FILE_RECORD
    if len(stream) < hdr.size:
        raise ValueError(f"{len(stream)} bytes, shorter than the stream's header")
    magic, count, _total = hdr.unpack_from(stream, 0)
    if magic.rstrip(b"\0") != contract.DEVMEM_FILE_MAGIC:
        raise ValueError("it does not start with the agent's header")
    off = hdr.size + count * rec.size
    for i in range(count):
        addr, size, _dev, _kind = rec.unpack_from(stream, hdr.size + i * rec.size)
        if addr <= ptr < addr + size:
            return stream[off + ptr - addr : off + size]
        off += size
    return None


def judge_copy(saved: Optional[bytes], want: bytes, ptr: int) -> Verdict:
    data: JSONObject = {"ptr": hex(ptr), "size": len(want)}
    if saved is not None:
        saved = saved[: len(want)]
    if saved is None:
        return Verdict(
            "locked-copy", FAIL, f"the agent's copy has no allocation at {ptr:#x} (the probe's)", data
        )
    if saved == want:
        return Verdict("locked-copy", PASS, f"{len(want)} bytes saved while LOCKED, all as written", data)
    differ = sum(1 for a, b in zip(saved, want) if a != b) + abs(len(saved) - len(want))
    first = next((i for i, (a, b) in enumerate(zip(saved, want)) if a != b), min(len(saved), len(want)))
    data.update(saved_size=len(saved), differing_bytes=differ, first_difference=first)
    return Verdict(
        "locked-copy",
        FAIL,
        f"the copy made while LOCKED differs from what was written: {differ} of {len(want)} bytes, "
        f"from offset {first}",
        data,
    )


@dataclass(frozen=True)
class Growth:
    policy: str
    size: int
    tracked: int  # the change of the agent's tracked bytes
    used: int  # the change of aclrtGetMemInfo's used memory


def judge_coverage(growths: list[Growth], interposed: Optional[bool]) -> Verdict:
    rows: list[JSONValue] = [
        {"policy": g.policy, "size": g.size, "tracked_delta": g.tracked, "used_delta": g.used}
        for g in growths
    ]
    data: JSONObject = {"allocations": rows, "interposed": interposed, "tolerance": COVER_TOLERANCE}
    if interposed is False:
        return Verdict(
            "coverage", FAIL, "the agent does not interpose the driver's allocations in the probe", data
        )
    bad = [g for g in growths if g.tracked < g.size or g.used - g.tracked > COVER_TOLERANCE]
    if bad:
        why = "; ".join(
            f"{g.policy}: {g.size} bytes allocated, the agent tracked {g.tracked}, "
            f"aclrtGetMemInfo's used grew by {g.used}"
            for g in bad
        )
        return Verdict("coverage", FAIL, f"allocations behind the agent's back: {why}", data)
    return Verdict(
        "coverage",
        PASS,
        f"{len(growths)} allocations ({', '.join(g.policy for g in growths)}): each tracked in full, "
        "as aclrtGetMemInfo counted it",
        data,
    )


def judge_plugin(item: CheckItem) -> Verdict:
    verdict = {preflight.OK: PASS, preflight.PROBLEM: FAIL}.get(item.status, SKIP)
    data: JSONObject = dict(item.data or {})
    if item.fix:
        data["fix"] = item.fix
    return Verdict("criu-plugin", verdict, item.detail, data)


def judge_cann(install: acl.CannInstall) -> Verdict:
    missing = [s for s in acl.SNAPSHOT_FUNCTIONS if not install.symbols.get(s)]
    data: JSONObject = {"home": install.home, "library": install.acl_library, "version": install.version}
    if missing:
        return Verdict("cann", FAIL, f"{install.acl_library} does not export {', '.join(missing)}", data)
    return Verdict(
        "cann",
        PASS,
        f"CANN {install.version or '(version unknown)'} at {install.home} exports the snapshot API",
        data,
    )


# -- the probe -------------------------------------------------------------------------------------


class ProbeError(Exception):
    pass


class Probe:
    """The probe program, started under npusnap's agent; one request and answer at a time."""

    def __init__(self, install: acl.CannInstall, device: int, log: IO[bytes]) -> None:
        argv = [sys.executable, qualifyprobe.__file__, install.acl_library, str(device)]
        plan = launch.prepare(argv)
        self.proc = subprocess.Popen(
            plan.argv,
            env=plan.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            close_fds=True,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        first = self._read()
        if not first.get("ok"):
            raise ProbeError(f"the probe could not start: {_failure(first)}")

    def _read(self) -> JSONObject:
        assert self.proc.stdout is not None
        # One answer per request, written whole: nothing is ever buffered beyond it. A probe that
        # hangs (a CANN call held by a lock that stayed) must not hang qualify.
        ready, _w, _x = select.select([self.proc.stdout], [], [], PROBE_TIMEOUT_S)
        if not ready:
            raise ProbeError(f"the probe did not answer within {PROBE_TIMEOUT_S:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise ProbeError(f"the probe ended (exit status {self.proc.poll()})")
        doc = json.loads(line)
        if not isinstance(doc, dict):
            raise ProbeError(f"the probe answered {line!r}")
        return doc

    def ask(self, op: str, **args: int) -> JSONObject:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read()

    def need(self, op: str, **args: int) -> JSONObject:
        answer = self.ask(op, **args)
        if not answer.get("ok"):
            raise ProbeError(_failure(answer))
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError, ProbeError):
            self.ask("quit")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def _failure(answer: JSONObject) -> str:
    code = answer.get("code")
    name = acl.describe(code)[0] if isinstance(code, int) and code > 0 else ""
    return f"{answer.get('call')} returned {code}{f' ({name})' if name else ''}" + (
        f": {answer['error']}" if answer.get("error") else ""
    )


def _int(doc: JSONObject, key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int):
        raise ProbeError(f"the probe's answer has no {key}")
    return value


def _tracked(client: AgentClient) -> tuple[int, Optional[bool]]:
    dm = client.hello().device_memory
    return (dm.bytes or 0) + (dm.vmm_bytes or 0), dm.interposed


def _wait_agent(pid: int) -> AgentClient:
    deadline = time.monotonic() + 20
    while True:
        if paths.find_agent_socket(pid) is not None:
            return AgentClient(pid, timeout=60.0, connect_retry_s=5.0)
        if time.monotonic() > deadline:
            raise ProbeError("the probe's agent never listened (is npusnap's agent library built?)")
        time.sleep(0.05)


def check_mappings(probe: Probe, before: list[Mapping]) -> tuple[Verdict, int]:
    ptr = _int(probe.need("malloc", size=MAP_BYTES, policy=qualifyprobe.ACL_MEM_MALLOC_NORMAL_ONLY), "ptr")
    probe.need("fill", ptr=ptr, size=MAP_BYTES, seed=1)
    verdict = judge_mappings(before, read_maps(probe.pid), vm_flags(probe.pid))
    verdict.data["device_files"] = list(devmaps.device_files(probe.pid) or ())
    return verdict, ptr


def check_coverage(probe: Probe, client: AgentClient) -> Verdict:
    growths = []
    interposed: Optional[bool] = None
    for policy, name in POLICIES:
        tracked0, interposed = _tracked(client)
        used0 = _int(probe.need("meminfo"), "used")
        ptr = _int(probe.need("malloc", size=COVER_BYTES, policy=policy), "ptr")
        tracked1, interposed = _tracked(client)
        used1 = _int(probe.need("meminfo"), "used")
        probe.need("free", ptr=ptr)
        growths.append(Growth(name, COVER_BYTES, tracked1 - tracked0, used1 - used0))
    return judge_coverage(growths, interposed)


def check_locked_copy(probe: Probe, client: AgentClient, ptr: int, workdir: Path) -> Verdict:
    path = workdir / "devmem.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        client.lock(command="qualify", device_memory_file=(fd, str(path)))
        try:
            stream = path.read_bytes()
        finally:
            client.unlock()
    finally:
        os.close(fd)
    try:
        saved = stream_allocation(stream, ptr)
    except ValueError as exc:
        return Verdict("locked-copy", FAIL, f"the agent's copy is not a device-memory stream: {exc}")
    return judge_copy(saved, qualifyprobe.pattern(1, MAP_BYTES), ptr)


def check_vmm(probe: Probe, client: AgentClient) -> Verdict:
    answer = probe.ask("vmm", size=VMM_BYTES)
    if not answer.get("ok"):
        return Verdict("vmm-address", SKIP, f"no VMM range could be made: {_failure(answer)}")
    va = _int(answer, "ptr")
    data: JSONObject = {"ptr": hex(va), "size": VMM_BYTES}
    probe.need("fill", ptr=va, size=VMM_BYTES, seed=3)
    try:
        client.lock(command="qualify")
        client.backup()
        client.restore()
        client.unlock()
    except NpusnapError as exc:
        with contextlib.suppress(NpusnapError):
            client.rollback(force=True)
        return Verdict(
            "vmm-address", FAIL, f"Lock, Backup, Restore, Unlock with a VMM range failed: {exc}", data
        )
    # Written and read anew: the question is whether the address still reaches a mapped range,
    # not what the agent's copy brought back (locked-copy asks that).
    wrote = probe.ask("fill", ptr=va, size=VMM_BYTES, seed=4)
    if not wrote.get("ok"):
        return Verdict(
            "vmm-address",
            FAIL,
            f"after Restore the range reserved at {va:#x} is gone: {_failure(wrote)}",
            data,
        )
    back = probe.need("check", ptr=va, size=VMM_BYTES, seed=4)
    if not back.get("equal"):
        return Verdict(
            "vmm-address",
            FAIL,
            f"after Restore the range at {va:#x} does not hold what is written to it (offset "
            f"{back.get('differ_at')})",
            data,
        )
    return Verdict(
        "vmm-address", PASS, f"the range reserved at {va:#x} is there after Backup and Restore", data
    )


def run(
    device: int, ascend_home: Optional[str] = None, progress: Callable[[str], None] = lambda _s: None
) -> Report:
    """Qualify this node's ``device``: every check, the report (not yet written)."""
    require_root()
    try:
        install = acl.find_cann(ascend_home)
    except acl.CannNotFound as exc:
        raise PreflightError(exc.meaning, fix=exc.hint) from None
    require_idle(install, device)
    report = Report(
        device=device,
        cann={"home": install.home, "version": install.version, "simulated": install.simulated},
        driver=driver_identity(None),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    report.verdicts.append(judge_cann(install))
    report.verdicts.append(judge_plugin(preflight.check_npu_plugin(install.simulated)))
    hccl = [
        os.path.join(d, "libhccl.so")
        for d in acl.library_dirs(install.home)
        if os.path.isfile(os.path.join(d, "libhccl.so"))
    ]
    report.notes = {
        "hccl_library": hccl[0] if hccl else None,
        "in_container": in_container(),
        "ASCEND_VISIBLE_DEVICES": os.environ.get("ASCEND_VISIBLE_DEVICES"),
        "ASCEND_RT_VISIBLE_DEVICES": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
        "physical_device": physical_device(device, install.simulated),
    }
    workdir = Path(tempfile.mkdtemp(prefix="npusnap-qualify-"))
    log_path = workdir / "probe.log"
    probe: Optional[Probe] = None
    try:
        with open(log_path, "wb") as log:
            progress("starting the probe")
            try:
                probe = running = Probe(install, device, log)
                client = _wait_agent(running.pid)
            except (ProbeError, NpusnapError) as exc:
                raise PreflightError(
                    f"the qualification probe did not start: {exc}",
                    why="qualify tries the node with a program of its own under npusnap's agent",
                    fix=f"look at its output in {log_path}",
                ) from None
            with client:
                hal = loaded_library(running.pid, "libascend_hal.so")
                report.driver = driver_identity(hal)
                hello = client.hello()
                report.notes["driver_flow"] = hello.device_memory.flow
                report.notes["agent_visible_devices"] = hello.acl.visible_devices
                before = read_maps(running.pid)
                progress("mappings")
                try:
                    mapped, ptr = check_mappings(running, before)
                except ProbeError as exc:
                    raise PreflightError(f"the probe could not allocate device memory: {exc}") from None
                report.verdicts.append(mapped)
                # In this order: the VMM check's Restore comes last, as it may leave the probe broken.
                steps: tuple[tuple[str, Callable[[], Verdict]], ...] = (
                    ("coverage", lambda: check_coverage(running, client)),
                    ("locked-copy", lambda: check_locked_copy(running, client, ptr, workdir)),
                    ("vmm-address", lambda: check_vmm(running, client)),
                )
                for name, step in steps:
                    progress(name)
                    try:
                        report.verdicts.append(step())
                    except (ProbeError, NpusnapError) as exc:
                        report.verdicts.append(Verdict(name, FAIL, f"the check could not run: {exc}"))
    finally:
        if probe is not None:
            probe.close()
        with contextlib.suppress(OSError):
            report.notes["probe_log"] = log_path.read_text(errors="replace")[-4000:]
        for p in workdir.iterdir():
            with contextlib.suppress(OSError):
                p.unlink()
        with contextlib.suppress(OSError):
            workdir.rmdir()
    return report
