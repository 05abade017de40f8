"""Host preflight: can this machine dump and restore NPU processes? (`npusnap check`)

Each check yields a ``CheckItem`` with a status, what was found and, for problems, how to fix
it. ``ready`` is true when nothing blocks dump and restore. The dump/restore pipelines reuse the
individual checks (``check_criu`` etc.) for their own preflight.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from npusnap_cli import acl, criu, paths
from npusnap_cli.errors import PreflightError
from npusnap_cli.host import criuplugin, hostclean

OK = "ok"
PROBLEM = "problem"  # blocks dump/restore
WARNING = "warning"  # works, but something is worth knowing
INFO = "info"

# Linux capability bit numbers (include/uapi/linux/capability.h).
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_CHECKPOINT_RESTORE = 40

# CRIU's shared plugin directories: CR_PLUGIN_DEFAULT of CRIU's build and where distributions (and
# the vendor's CRIU) put plugins. npusnap installs nothing there and does not load them: its CRIU
# gets npusnap's own directory (paths.criu_plugin_dir). NPUSNAP_CRIU_SHARED_PLUGIN_DIRS (colon-
# separated) names others for `check` to look at.
CRIU_PLUGIN_DIRS = ("/usr/lib/criu", "/usr/local/lib/criu", "/usr/lib64/criu", "/usr/local/lib64/criu")
NPU_PLUGIN_NAMES = ("npu_plugin.so", "ascend_plugin.so")
NPUSNAP_PLUGIN_NAMES = ("npusnap_plugin.so", "npusim_plugin.so")


def criu_plugin_dir() -> str:
    """The directory the CRIU that npusnap runs loads its plugins from (npusnap hands it over as
    CRIU_LIBS_DIR; see paths.criu_plugin_dir)."""
    return str(paths.criu_plugin_dir())


def shared_plugin_dirs() -> tuple[str, ...]:
    extra = os.environ.get("NPUSNAP_CRIU_SHARED_PLUGIN_DIRS")
    if extra:
        return tuple(d for d in extra.split(":") if d)
    return CRIU_PLUGIN_DIRS


@dataclass(frozen=True)
class CheckItem:
    name: str
    status: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckReport:
    items: tuple[CheckItem, ...]

    @property
    def ready(self) -> bool:
        return all(item.status != PROBLEM for item in self.items)

    def item(self, name: str) -> Optional[CheckItem]:
        return next((i for i in self.items if i.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "checks": [asdict(i) for i in self.items]}


def check_criu() -> list[CheckItem]:

    items: list[CheckItem] = []
    try:
        binary = criu.find_criu()
    except PreflightError as err:
        return [CheckItem("criu", PROBLEM, err.message, err.fix), CheckItem("criu-check", PROBLEM, "not run")]
    items.append(
        CheckItem(
            "criu",
            OK,
            f"{binary.path} version {binary.version}",
            data={"path": binary.path, "version": binary.version},
        )
    )
    if os.geteuid() != 0:
        items.append(
            CheckItem(
                "criu-check",
                PROBLEM,
                "`criu check` needs root",
                "run `sudo npusnap check` (CRIU dump/restore run as root)",
                data={"passed": None, "output": ""},
            )
        )
    else:
        passed, output = criu.run_criu_check(binary)
        last = output.splitlines()[-1] if output else ""
        items.append(
            CheckItem(
                "criu-check",
                OK if passed else PROBLEM,
                f"`criu check`: {last or ('passed' if passed else 'failed')}",
                "" if passed else f"run `{binary.path} check` and read its output (kernel features missing?)",
                data={"passed": passed, "output": output},
            )
        )
    items.append(inet_sockets_item(binary))
    items.append(network_lock_item())
    items.append(lazy_pages_item(binary))
    pyver = criu.pycriu_version()
    if pyver is None:
        items.append(
            CheckItem(
                "pycriu",
                PROBLEM,
                "pycriu cannot be imported",
                "run ./scripts/setup.sh (it installs pycriu from the CRIU source into .venv)",
                data={"version": None},
            )
        )
    elif pyver != binary.version:
        items.append(
            CheckItem(
                "pycriu",
                PROBLEM,
                f"pycriu {pyver} does not match criu {binary.version}",
                "reinstall pycriu from the same CRIU source: ./scripts/setup.sh",
                data={"version": pyver},
            )
        )
    else:
        items.append(CheckItem("pycriu", OK, f"pycriu {pyver} (matches criu)", data={"version": pyver}))
    return items


def inet_sockets_item(binary: Any) -> CheckItem:
    """CRIU before 4.2 fails on every TCP/UDP socket on kernels 6.16+ (a listening one too)."""
    refuses = criu.kernel_refuses_inet_passcred()
    ok = criu.inet_sockets_supported(binary)
    data = {"kernel_refuses_passcred": refuses, "criu": binary.version}
    if ok:
        why = (
            "this kernel refuses SO_PASSCRED on inet sockets, CRIU 4.2+ copes"
            if refuses
            else "no kernel quirk"
        )
        return CheckItem(
            "criu-sockets", OK, f"CRIU {binary.version} can dump TCP/UDP sockets ({why})", data=data
        )
    return CheckItem(
        "criu-sockets",
        PROBLEM,
        f"CRIU {binary.version} cannot dump any TCP/UDP socket on this kernel "
        f"({os.uname().release} refuses SO_PASSCRED on inet sockets)",
        "install CRIU 4.2 or newer: ./scripts/setup.sh builds 4.2.1 (a job with a metrics port, "
        "a torch.distributed store or any UDP socket fails to dump otherwise)",
        data=data,
    )


def lazy_pages_item(binary: Any) -> CheckItem:
    """Can `restore --lazy` work here (userfaultfd with non-cooperative events)? A warning only:
    lazy restore is optional, and `restore --lazy` refuses by itself when it cannot."""
    ok, words = criu.lazy_pages_supported(binary)
    last = words.splitlines()[-1] if words else ""
    if ok:
        return CheckItem("criu-lazy-pages", OK, f"restore --lazy works ({last})", data={"supported": True})
    return CheckItem(
        "criu-lazy-pages",
        WARNING,
        f"restore --lazy is not possible here: {last or 'criu check --feature uffd-noncoop failed'}",
        "needs userfaultfd with non-cooperative events (kernel 4.11+, CONFIG_USERFAULTFD) and root "
        "or vm.unprivileged_userfaultfd=1; plain restore is unaffected",
        data={"supported": False, "output": words},
    )


def network_lock_item() -> CheckItem:
    """Which network lock a dump of established TCP connections will use, and whether it can."""
    import shutil

    method = criu.default_network_lock()
    if method == "nftables" and not criu.has_nftables():
        return CheckItem(
            "network-lock",
            WARNING,
            "neither libnftables nor the iptables binary: --tcp-established dumps cannot lock the network",
            "apt-get install libnftables1 (or iptables)",
            data={"method": None},
        )
    tool = "libnftables, no binary needed" if method == "nftables" else f"binary {shutil.which('iptables')}"
    return CheckItem("network-lock", OK, f"{method} ({tool})", data={"method": method})


def effective_capabilities(pid: str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> list[CheckItem]:
    caps = effective_capabilities()

    def has(bit: int) -> bool:
        return bool(caps >> bit & 1)

    euid = os.geteuid()
    resource = has(CAP_SYS_RESOURCE)
    cap_names = {
        "CAP_SYS_ADMIN": has(CAP_SYS_ADMIN),
        "CAP_CHECKPOINT_RESTORE": has(CAP_CHECKPOINT_RESTORE),
        "CAP_SYS_PTRACE": has(CAP_SYS_PTRACE),
    }
    enough = (cap_names["CAP_SYS_ADMIN"] or cap_names["CAP_CHECKPOINT_RESTORE"]) and cap_names[
        "CAP_SYS_PTRACE"
    ]
    have = ", ".join(k for k, v in cap_names.items() if v) or "none"
    items = [
        CheckItem(
            "privileges",
            OK if enough else PROBLEM,
            f"euid {euid}; capabilities: {have}",
            ""
            if enough
            else "run as root, or grant CAP_CHECKPOINT_RESTORE (or CAP_SYS_ADMIN) and CAP_SYS_PTRACE",
            data={"euid": euid, "capabilities": cap_names},
        ),
        CheckItem(
            "other-users",
            OK if resource else WARNING,
            "CAP_SYS_RESOURCE: processes of any user can be dumped"
            if resource
            else "no CAP_SYS_RESOURCE: only processes of uid "
            f"{euid} can be dumped (CRIU must read other users' rlimits)",
            "" if resource else "run the job as this user, or grant CAP_SYS_RESOURCE",
            data={"cap_sys_resource": resource},
        ),
    ]
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        scope = None
    if scope is None:
        items.append(CheckItem("ptrace-scope", OK, "Yama is not active", data={"ptrace_scope": None}))
    else:
        meaning = {
            0: "classic ptrace permissions",
            1: "restricted: only descendants, unless CAP_SYS_PTRACE",
            2: "admin-only: CAP_SYS_PTRACE needed",
            3: "no ptrace at all: CRIU and attach cannot work until reboot",
        }.get(scope, "unknown")
        status = PROBLEM if scope == 3 else (OK if scope == 0 or cap_names["CAP_SYS_PTRACE"] else WARNING)
        items.append(
            CheckItem(
                "ptrace-scope",
                status,
                f"kernel.yama.ptrace_scope = {scope} ({meaning})",
                "" if status == OK else "run as root (CAP_SYS_PTRACE), or start targets with `npusnap run`",
                data={"ptrace_scope": scope},
            )
        )
    return items


def require_privileges(command: str) -> None:
    """Refuse ``command`` (dump, restore) up front when this npusnap cannot run CRIU: as a user,
    everything after would fail on another path (root's /proc entries, root's image) and blame it."""
    problems = [i for i in check_privileges() if i.status == PROBLEM]
    if problems:
        raise PreflightError(
            f"{command} needs root: {problems[0].detail}",
            why=f"CRIU needs root (or CAP_CHECKPOINT_RESTORE + CAP_SYS_PTRACE) to {command} a process tree",
            fix=problems[0].fix or "run npusnap as root",
            details={"problems": [i.detail for i in problems]},
        )


def other_user_problem(uids: list[int]) -> Optional[CheckItem]:
    """A problem when the tree holds another user's process and CRIU could not read its rlimits.

    prlimit(2) on another user's process needs CAP_SYS_RESOURCE, even for root; without it CRIU
    fails late with "Can't get rlimit 0: Operation not permitted".
    """
    euid = os.geteuid()
    others = sorted({u for u in uids if u != euid})
    if not others or effective_capabilities() >> CAP_SYS_RESOURCE & 1:
        return None
    return CheckItem(
        "other-users",
        PROBLEM,
        f"the process tree has processes of uid {', '.join(map(str, others))}, and this npusnap "
        f"(uid {euid}) lacks CAP_SYS_RESOURCE",
        "dump as the job's user (same uid), or grant CAP_SYS_RESOURCE",
    )


def check_cann(ascend_home: Optional[str] = None) -> list[CheckItem]:
    try:
        install = acl.find_cann(ascend_home)
    except acl.AclError as err:
        return [CheckItem("cann", PROBLEM, err.meaning, err.hint, data={"error": err.to_dict()})]
    data = {
        "home": install.home,
        "source": install.source,
        "version": install.version,
        "library": install.acl_library,
        "runtime_library": install.runtime_library,
        "simulated": install.simulated,
        "symbols": dict(install.symbols),
    }
    label = " (simulated NPU)" if install.simulated else ""
    items = [
        CheckItem(
            "cann",
            OK,
            f"{install.home} (from {install.source}), version {install.version or 'unknown'}{label}",
            data=data,
        )
    ]
    core = ("aclrtSnapShotProcessLock", "aclrtSnapShotProcessBackup", "aclrtSnapShotProcessRestore",
            "aclrtSnapShotProcessUnlock")  # fmt: skip
    missing = [s for s in core if not install.symbols.get(s)]
    items.append(
        CheckItem(
            "snapshot-symbols",
            PROBLEM if missing else OK,
            f"{install.acl_library}: "
            + (f"missing {', '.join(missing)}" if missing else "all four snapshot functions"),
            "upgrade CANN to 8.5 or newer (the snapshot API appeared there)" if missing else "",
            data={"library": install.acl_library, "missing": missing},
        )
    )
    items.append(check_npu_plugin(install.simulated))
    return items


def _plugin_dirs(simulated: bool) -> tuple[str, ...]:
    """Where a device kind's plugin must be: the directory npusnap's CRIU loads (both kinds; a
    plugin elsewhere is not loaded by npusnap's CRIU, see plugin_dirs_item)."""
    return (criu_plugin_dir(),)


def find_npu_plugin(simulated: bool = False) -> Optional[str]:
    """The CRIU plugin for the NPU's device handles: Huawei's for a real NPU, npusim_plugin.so for
    the simulated one."""
    names = criuplugin.SIMULATED.plugin_names if simulated else NPU_PLUGIN_NAMES
    for d in _plugin_dirs(simulated):
        for name in names:
            p = Path(d) / name
            if p.is_file():
                return str(p)
    return None


def check_npu_plugin(simulated: bool) -> CheckItem:
    kind = criuplugin.SIMULATED if simulated else criuplugin.ASCEND
    plugin = find_npu_plugin(simulated)
    if plugin:
        return check_npu_plugin_abi(plugin, kind)
    what = (
        "the simulated NPU keeps its device connection (a unix socket to the npusim daemon) open "
        "across Backup, as real CANN keeps /dev/davinci* open: stock CRIU cannot dump it"
        if simulated
        else "stock CRIU cannot dump /dev/davinci* file descriptors and mappings"
    )
    elsewhere = [
        str(Path(d) / n) for d in shared_plugin_dirs() for n in kind.plugin_names if (Path(d) / n).is_file()
    ]
    if elsewhere:
        what += (
            f"; {', '.join(elsewhere)} is in a shared plugin directory, which npusnap's CRIU does not "
            "load (it may be built for the vendor's CRIU)"
        )
    return CheckItem(
        "criu-npu-plugin",
        PROBLEM,
        f"no CRIU plugin for the {'simulated ' if simulated else ''}NPU's device handles "
        f"({', '.join(kind.plugin_names)}) in {', '.join(_plugin_dirs(simulated))}; {what}",
        kind.install_fix,
        data={"path": None, "kind": kind.key, "plugin_dir": criu_plugin_dir()},
    )


def check_npu_plugin_abi(plugin: str, kind: Any = None) -> CheckItem:
    """The plugin's max_hooks (its CR_PLUGIN_DESC) against the CRIU in use: a plugin built for
    another CRIU (Huawei's fork numbers the hooks differently) is called by the wrong slots."""

    kind = kind or criuplugin.ASCEND
    data: dict[str, Any] = {"path": plugin, "kind": kind.key, "plugin_dir": criu_plugin_dir()}
    try:
        version = criu.find_criu().version
    except Exception as exc:
        return CheckItem(
            "criu-npu-plugin",
            WARNING,
            f"{plugin}: cannot check its ABI, no usable CRIU ({exc})",
            data=data,
        )
    verdict = criuplugin.check_abi(plugin, version)
    if verdict.desc is not None:
        data.update(name=verdict.desc.name, max_hooks=verdict.desc.max_hooks)
    status = OK if verdict.ok else PROBLEM if verdict.ok is False else WARNING
    fix = verdict.fix
    if verdict.ok is False and kind is criuplugin.SIMULATED:
        fix = f"rebuild this project's plugin against CRIU {version} (./scripts/setup.sh)"
    return CheckItem("criu-npu-plugin", status, f"{plugin}: {verdict.detail}", fix, data=data)


def plugin_dirs_item() -> CheckItem:
    """The plugins of CRIU's shared directories and of npusnap's own, by their hook tables.

    A CRIU loads every plugin of its directory; Huawei's fork refuses one that declares more hooks
    than it knows ("Corrupted plugin") and then fails every run, and a plugin with fewer hooks is
    called by the wrong slots. So: npusnap's directory must hold only plugins of the CRIU npusnap
    runs (a problem otherwise); a shared directory whose plugins disagree with each other, or that
    holds npusnap's plugins (left by an older setup), breaks whichever CRIU loads it (a warning:
    npusnap's own CRIU does not load it)."""

    try:
        version = criu.find_criu().version
    except Exception as exc:
        return CheckItem(
            "criu-plugin-dirs", WARNING, f"cannot check plugin directories: no usable CRIU ({exc})"
        )
    have, source = criuplugin.criu_max_hooks(version)
    ours = criu_plugin_dir()
    found: dict[str, list[dict[str, Any]]] = {}
    problems: list[str] = []
    warnings: list[str] = []
    for d in dict.fromkeys((ours, *shared_plugin_dirs())):
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".so"))
        except OSError:
            continue
        entries: list[dict[str, Any]] = []
        for n in names:
            path = os.path.join(d, n)
            try:
                desc = criuplugin.read_plugin_desc(path)
            except (OSError, ValueError):  # elf.ElfError is a ValueError
                desc = None
            entries.append({"path": path, "max_hooks": desc.max_hooks if desc else None,
                            "name": desc.name if desc else None})  # fmt: skip
        found[d] = entries
        hooks = {e["max_hooks"] for e in entries if e["max_hooks"] is not None}
        other = [e for e in entries if have is not None and e["max_hooks"] not in (None, have)]
        if d == ours:
            problems += [
                f"{e['path']} declares {e['max_hooks']} hooks, CRIU {version} has {have}" for e in other
            ]
            continue
        if len(hooks) > 1:
            warnings.append(
                f"{d} mixes plugins of different hook tables ("
                + ", ".join(f"{Path(e['path']).name}: {e['max_hooks']}" for e in entries)
                + "): a CRIU that loads it fails (Huawei's fork refuses one with more hooks than it knows)"
            )
        left = [e["path"] for e in entries if Path(e["path"]).name in NPUSNAP_PLUGIN_NAMES]
        if left:
            warnings.append(
                f"{', '.join(left)}: npusnap's plugins in a shared plugin directory (an older setup put "
                "them there); npusnap does not load them from there"
            )
        if other and len(hooks) == 1:
            warnings.append(
                ", ".join(f"{e['path']} ({e['max_hooks']} hooks)" for e in other)
                + f": built for another CRIU than {version} ({have} hooks, {source}), such as the vendor's "
                "fork; npusnap's CRIU does not load it, the vendor's CRIU may"
            )
    data: dict[str, Any] = {"criu": version, "criu_max_hooks": have, "npusnap_dir": ours, "dirs": found}
    if problems:
        return CheckItem(
            "criu-plugin-dirs",
            PROBLEM,
            f"npusnap's plugin directory {ours} has plugins CRIU {version} cannot load: "
            + "; ".join(problems),
            f"keep only plugins built for CRIU {version} in {ours} (./scripts/setup.sh rebuilds npusnap's)",
            data=data,
        )
    if warnings:
        return CheckItem(
            "criu-plugin-dirs",
            WARNING,
            "; ".join(warnings),
            "leave the vendor's plugins where its CRIU loads them and npusnap's in "
            f"{ours}; remove npusnap_plugin.so/npusim_plugin.so from shared directories; runc, podman "
            f"and CRI runtimes that should use npusnap's plugin need `libdir {ours}` in their CRIU "
            "configuration (docs/runbooks/podman.md)",
            data=data,
        )
    return CheckItem(
        "criu-plugin-dirs",
        OK,
        f"npusnap's CRIU loads plugins from {ours}; every plugin there and in the shared directories "
        f"fits CRIU {version} ({have} hooks)",
        data=data,
    )


def check_session() -> CheckItem:
    """Whether jobs started from here can be dumped as they are: CRIU cannot record a session
    whose leader is outside the dumped processes' pid namespace (getsid reads 0 then)."""
    sid = os.getsid(0)
    if sid == 0:
        return CheckItem(
            "session",
            WARNING,
            "this shell's session leader is outside this pid namespace (docker exec, nsenter, a CI "
            "runner): a job started from here without `setsid` cannot be dumped",
            "start jobs with `npusnap run -- CMD...` (here it gives them a session of their own) or `setsid`",
            data={"sid": sid},
        )
    return CheckItem(
        "session",
        OK,
        f"session leader {sid} is in this pid namespace (a job sharing it is dumped with --shell-job)",
        data={"sid": sid},
    )


def check_runtime_dir() -> CheckItem:
    """The agents' runtime directory is private to this user (or does not exist yet)."""
    where = paths.agent_runtime_dir()
    problem = paths.runtime_dir_problem()
    if problem:
        return CheckItem(
            "runtime-dir",
            PROBLEM,
            f"agents cannot listen: {problem}",
            f"remove {where} if it is not yours, or set NPUSNAP_RUNTIME_DIR to a private directory",
        )
    return CheckItem("runtime-dir", OK, f"{where} (private, or created 0700 by the first agent)")


def check_debris() -> CheckItem:
    """What npusnap left on this host: stale agent sockets, failure logs, demo directories."""

    debris = hostclean.debris_report()
    data = debris.to_dict()
    parts = []
    if debris.stale_sockets:
        where = paths.agent_runtime_dir()
        parts.append(f"{len(debris.stale_sockets)} stale agent socket(s) in {where}")
    if debris.stale_tokens:
        where = paths.agent_runtime_dir()
        pids = ", ".join(str(t.pid) for t in debris.stale_tokens[:5])
        parts.append(f"{len(debris.stale_tokens)} lock token(s) of dead processes in {where} (pids {pids})")
    if debris.demo_dirs:
        parts.append(f"{len(debris.demo_dirs)} demo work dir(s) ({', '.join(debris.demo_dirs[:3])})")
    logs = (
        f"{len(debris.failure_logs)} failure log dir(s) in {hostclean.log_base()} "
        f"(the newest {hostclean.KEEP_LOGS} are kept)"
    )
    if not parts:
        return CheckItem("debris", OK, f"no stale agent sockets or demo dirs; {logs}", data=data)
    return CheckItem(
        "debris",
        WARNING,
        "; ".join(parts) + f"; {logs}",
        "stale sockets and lock tokens are removed by the next `npusnap status` or `npusnap dump`; "
        "remove demo dirs "
        "with rm -r (`npusnap demo` removes its own unless --keep)",
        data=data,
    )


def run_checks(ascend_home: Optional[str] = None) -> CheckReport:
    items = (
        check_criu() + check_privileges() + [check_session(), check_runtime_dir()] + check_cann(ascend_home)
    )
    items.append(plugin_dirs_item())
    items.append(check_debris())
    return CheckReport(tuple(items))


# --------------------------------------------------------------------------------------------
# Descriptors CRIU cannot dump
# --------------------------------------------------------------------------------------------
#
# CRIU 4.2.1 dumps an anon-inode descriptor only of the kinds dump_one_file() knows
# (criu/files.c: eventfd, eventpoll, inotify, fanotify, signalfd, timerfd, pidfd; bpf-map only
# when CRIU was built with libbpf); anything else goes to dump_unsupp_fd(), which fails the dump
# unless a plugin claims it (none does for anon inodes). Found only by CRIU, that failure comes
# after the NPU lock (then rolled back); /proc/PID/fd shows it before anything is touched.

CRIU_ANON_KINDS = ("[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]")
IO_URING_ENTER = 426  # the same number on x86_64 and aarch64 (the unified syscall table)

_ANON_FIX = {
    "[io_uring]": (
        "an io_uring instance: CRIU cannot save its rings or in-flight requests",
        "start the job again under `npusnap run --no-io-uring -- CMD...`: io_uring_setup then fails "
        "in the whole tree (ENOSYS, as on a kernel without io_uring) and libuv, like most programs, "
        "falls back to epoll; or make the program close its ring before the dump",
    ),
    "[perf_event]": (
        "a perf event (a profiler or `perf` attached from inside)",
        "stop the profiler in the job before the dump (perf_event fds cannot be saved)",
    ),
    "[userfaultfd]": (
        "a userfaultfd (a user-space pager, a live-migration or GC runtime)",
        "make the program close it before the dump",
    ),
}


# PyTorch's TCPStore server on libuv (the default since torch 2.4) names its loop thread so
# (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp); libuv 1.50 and later always set up a
# ring for that loop (src/unix/linux.c, the epoll_ctl batching ring), whatever UV_USE_IO_URING
# says. torchrun's elastic agent runs as "pt_elastic" (torch/distributed/run.py).
TORCH_STORE_THREAD = "pt_tcpstore_uv"
TORCHRUN_COMM = "pt_elastic"
TORCHRUN_MODULES = ("torchrun", "torch.distributed.run", "torch.distributed.launch")

_TORCHRUN_FIX = (
    "this is torchrun's elastic agent: its rendezvous stores hold the ring, and torch (2.13) has no "
    "setting for them (USE_LIBUV reaches only stores that ranks host themselves, and "
    "UV_USE_IO_URING=0 does not remove this ring). Start the job again as `npusnap run "
    "--no-io-uring -- torchrun ...`: io_uring_setup then fails in the agent and its workers and "
    "libuv uses epoll (docs/distributed.md, PyTorch)"
)
_TORCH_RANK_FIX = (
    "this process hosts PyTorch's rendezvous store (rank 0 of ranks started without torchrun): "
    "start every rank with USE_LIBUV=0 in its environment (torch/distributed/rendezvous.py reads "
    "it for env:// and tcp://; or `?use_libuv=0` in a tcp:// init_method URL), or start the job "
    "under `npusnap run --no-io-uring` (docs/distributed.md, PyTorch)"
)


@dataclass(frozen=True)
class UndumpableFd:
    pid: int
    fd: int
    kind: str  # the anon-inode name: "[io_uring]", "bpf-prog", ...
    comm: str
    threads: tuple[tuple[int, str], ...]  # (tid, name) of threads in a system call on it
    # (tid, name) of PyTorch's libuv TCPStore threads in the process (for a ring: its user)
    store_threads: tuple[tuple[int, str], ...] = ()
    torchrun: bool = False  # the process is torchrun's elastic agent

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "fd": self.fd,
            "kind": self.kind,
            "comm": self.comm,
            "threads": [{"tid": t, "name": n} for t, n in self.threads],
            "torch_store_threads": [{"tid": t, "name": n} for t, n in self.store_threads],
            "torchrun": self.torchrun,
        }

    def fix(self) -> tuple[str, str]:
        """What the descriptor is, and the exact way out."""
        what, fix = _ANON_FIX.get(
            self.kind,
            (f"an anon inode of kind {self.kind}", "make the program close it before the dump"),
        )
        if self.kind == "[io_uring]" and self.store_threads:
            what = f"{what} (PyTorch's TCPStore, on libuv)"
            fix = _TORCHRUN_FIX if self.torchrun else _TORCH_RANK_FIX
        return what, fix


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _threads_on(pid: int, fd: int, kind: str) -> tuple[tuple[int, str], ...]:
    """Threads of ``pid`` blocked in a system call whose first argument is ``fd`` (io_uring_enter
    for a ring), and the kernel's io_uring workers (iou-wrk-*, iou-sqp-*) of a ring."""
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return ()
    for tid in tids:
        name = _read(f"/proc/{pid}/task/{tid}/comm")
        fields = _read(f"/proc/{pid}/task/{tid}/syscall").split()
        try:
            on_fd = len(fields) > 1 and int(fields[1], 16) == fd
        except ValueError:
            on_fd = False
        if on_fd or (kind == "[io_uring]" and name.startswith(("iou-wrk-", "iou-sqp-"))):
            out.append((tid, name))
    return tuple(out)


def _torch_store_threads(pid: int) -> tuple[tuple[int, str], ...]:
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return ()
    named = ((tid, _read(f"/proc/{pid}/task/{tid}/comm")) for tid in tids)
    return tuple((tid, name) for tid, name in named if name == TORCH_STORE_THREAD)


def _is_torchrun(pid: int, comm: str) -> bool:
    if comm == TORCHRUN_COMM:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:4]
    except OSError:
        return False
    words = [os.path.basename(a.decode(errors="replace")) for a in argv]
    return any(w in TORCHRUN_MODULES for w in words)


def find_undumpable_fds(pids: list[int], bpf_maps: bool = False) -> list[UndumpableFd]:
    """Descriptors of the processes that CRIU 4.2.1 refuses to dump (anon inodes of kinds it
    does not know), with the threads that are using them."""
    known = CRIU_ANON_KINDS + (("bpf-map",) if bpf_maps else ())
    found = []
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in sorted(names, key=lambda n: int(n) if n.isdigit() else -1):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if not link.startswith("anon_inode:"):
                continue
            kind = link[len("anon_inode:") :]
            if kind in known:
                continue
            fd = int(name)
            comm = _read(f"/proc/{pid}/comm") or "?"
            threads = _threads_on(pid, fd, kind)
            store = _torch_store_threads(pid) if kind == "[io_uring]" else ()
            found.append(
                UndumpableFd(
                    pid=pid,
                    fd=fd,
                    kind=kind,
                    comm=comm,
                    threads=threads,
                    store_threads=store,
                    torchrun=bool(store) and _is_torchrun(pid, comm),
                )
            )
    return found


def undumpable_fds_error(found: list[UndumpableFd]) -> Optional[Any]:
    """The preflight refusal naming the first such descriptor and its fix, or None."""
    if not found:
        return None

    e = found[0]
    what, fix = e.fix()
    threads = ", ".join(f"{tid} ({name})" for tid, name in e.threads)
    store = ", ".join(f"{tid} ({name})" for tid, name in e.store_threads)
    others = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return PreflightError(
        f"pid {e.pid} ({e.comm}) holds anon_inode:{e.kind} on fd {e.fd}{others}"
        + (f", used by thread(s) {threads}" if threads else "")
        + (f"; PyTorch's TCPStore runs on libuv in thread(s) {store}" if store else ""),
        why=f"it is {what}; CRIU dumps only the anon-inode kinds it knows ({', '.join(CRIU_ANON_KINDS)}) "
        "and would fail after the job was locked",
        fix=fix,
        details={"undumpable_fds": [x.to_dict() for x in found]},
    )


def criu_has_libbpf(binary_path: str) -> bool:
    """Whether this CRIU was linked with libbpf (then it dumps bpf maps)."""
    try:
        with open(binary_path, "rb") as f:
            return b"libbpf.so" in f.read()
    except OSError:
        return False
