"""Where npusnap keeps things on a host: build outputs, the simulator's socket, agent sockets.

Standard library only, Python 3.9+: the agent imports this module inside target processes.

Agent sockets live in a private directory per uid:

* root: ``/run/npusnap/`` (0700);
* other users: ``$XDG_RUNTIME_DIR/npusnap/`` when that is set, else ``/tmp/npusnap-<uid>/`` (0700);
* ``NPUSNAP_RUNTIME_DIR`` overrides both (tests use it to isolate runs).

The CLI does not guess which of these a target used: it finds the target's listening socket in
``/proc/net/unix`` (see ``find_agent_socket``) and then checks the peer's pid with SO_PEERCRED.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from npusnap_cli import contract
from npusnap_cli.host import procfs

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent

SOCKET_SUFFIX = contract.AGENT_SOCKET_NAME.replace("{pid}", "")  # ".sock": what follows the pid
LOCK_TOKEN_SUFFIX = ".lock-token"  # PID.lock-token beside PID.sock: a freeze's token for thaw
# PID.lock-taken: the npusnap pid whose lock on PID a `thaw --force` took, for that command to see
LOCK_TAKEN_SUFFIX = ".lock-taken"
# A copy restored from an image of a job in its own pid namespace keeps its agent listening under
# ``<pid at dump>-<tag>.sock`` (its new host pid is known only once CRIU made it, and the copy may
# run beside the original): the agent's name in every image dumped from such a copy.
COPY_SOCKET_TAG_HEX = 8
COPY_SOCKET_NAME = re.compile(rf"[1-9][0-9]*-[0-9a-f]{{{COPY_SOCKET_TAG_HEX}}}\.sock")


def copy_socket_stem(pid: int, tag: str) -> str:
    """The name (without ``.sock``) a restored copy's agent listens under; ``tag`` hex digits."""
    return f"{pid}-{tag}"


def build_dir() -> Path:
    """Native build outputs (simulator libraries, attach payload): ``<repo>/.build``."""
    return Path(os.environ.get("NPUSNAP_BUILD_DIR") or (REPO_ROOT / ".build"))


# npusnap's own CRIU plugin directory on a node (scripts/setup.sh installs there). Never CRIU's
# shared default (/usr/lib/criu): the vendor's CRIU (Huawei's fork) loads every plugin of that
# directory and refuses to run at all when one declares more hooks than it knows.
CRIU_PLUGIN_INSTALL_DIR = "/usr/lib/npusnap/criu-plugins"


def criu_plugin_dir() -> Path:
    """The plugin directory npusnap hands to the CRIU it runs (CRIU_LIBS_DIR of ``criu swrk``):
    ``CRIU_LIBS_DIR`` when set, else ``NPUSNAP_CRIU_PLUGIN_DIR`` (setup's choice), else the
    installed directory when it exists, else this checkout's build directory."""
    for var in ("CRIU_LIBS_DIR", "NPUSNAP_CRIU_PLUGIN_DIR"):
        value = os.environ.get(var)
        if value and value != "none":
            return Path(value)
    if os.path.isdir(CRIU_PLUGIN_INSTALL_DIR):
        return Path(CRIU_PLUGIN_INSTALL_DIR)
    return build_dir() / "criu-plugin"


ROOT_STATE_DIR = Path("/var/lib/npusnap")  # root's state_dir(): the node's own records


def state_dir() -> Path:
    """npusnap's own records on this node (its history, the images its dumps made): root's
    ``/var/lib/npusnap``; others' ``$XDG_STATE_HOME/npusnap`` or ``~/.local/state/npusnap``;
    ``NPUSNAP_STATE_DIR`` overrides."""
    override = os.environ.get("NPUSNAP_STATE_DIR")
    if override:
        return Path(override)
    if os.geteuid() == 0:
        return ROOT_STATE_DIR
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "npusnap"


def standin_installed(package: str) -> bool:
    """Whether a stand-in's package (``npusnap_sim``, ``npusnap_workloads``) is installed beside
    the product: a checkout has both, a node install (scripts/install-node.sh) neither. Looked up,
    never imported."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


def is_checkout() -> bool:
    """Whether this npusnap runs from a source checkout (scripts/setup.sh is its fix for what is
    missing) rather than a node install (scripts/install-node.sh, docs/real-node.md)."""
    return (REPO_ROOT / "scripts" / "setup.sh").is_file()


def native_src_dir() -> Path:
    return REPO_ROOT / "native"


SIM_CANN_TREES = {"9.1": "cann", "9.0": "cann-9.0", "9.2": "cann-9.2"}
# Where the simulator's CANN trees are, when not in the build directory. On the simulator each
# CANN tree is a node of its own (device/occupancy.py), so copies of the trees make nodes that
# share nothing: tests running side by side each use their own.
SIM_CANN_DIR_ENV = "NPUSIM_CANN_DIR"


def sim_cann_home() -> Path:
    """The simulator's fake CANN tree (lib64/, share/info/runtime/version.info, set_env.sh).

    ``NPUSIM_CANN=9.0`` selects the tree whose snapshot functions take no arguments (CANN
    8.5.x/9.0.x); the default, 9.1, has the ``(pid, args)`` forms with ``args`` NULL; 9.2 stands in
    for the newer builds with the driver-backed flow (``args`` != NULL)."""
    version = os.environ.get("NPUSIM_CANN") or "9.1"
    return sim_cann_dir() / SIM_CANN_TREES.get(version, f"cann-{version}")


def sim_cann_dir() -> Path:
    """The directory of the simulator's CANN trees: ``NPUSIM_CANN_DIR`` or the build directory."""
    base = os.environ.get(SIM_CANN_DIR_ENV)
    return Path(base) if base else build_dir()


# Where a node wheel carries the native parts (scripts/build_node_wheels.py), beside the agent's
# own copy in agent/lib: the attach payload with its gdb driver, and npusnap's CRIU plugin, which
# scripts/install-node.sh copies into npusnap's plugin directory.
PACKAGED_ATTACH_DIR = PACKAGE_DIR / "device" / "attach" / "lib"
PACKAGED_CRIU_PLUGIN = PACKAGE_DIR / "criu" / "plugin" / "npusnap_plugin.so"


def attach_payload_path() -> Path:
    """The attach payload: the build directory's (a checkout), else the one a node wheel carries."""
    built = build_dir() / "attach" / "libnpusnap_attach.so"
    packaged = PACKAGED_ATTACH_DIR / built.name
    if not built.is_file() and packaged.is_file():
        return packaged
    return built


def _user_runtime_base(uid: int) -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg)
    return Path("/tmp")


def sim_socket_path() -> Path:
    """The simulated NPU daemon's socket: ``NPUSIM_SOCKET`` or a per-user default."""
    env = os.environ.get(contract.SIM_SOCKET_ENV)
    if env:
        return Path(env)
    uid = os.geteuid()
    if uid == 0:
        return Path(contract.SIM_SOCKET_ROOT_PATH)
    base = _user_runtime_base(uid)
    if base == Path("/tmp"):
        return Path(contract.SIM_SOCKET_TMP_DIR.format(uid=uid)) / contract.SIM_SOCKET_NAME
    return base / contract.SIM_SOCKET_XDG_SUBDIR / contract.SIM_SOCKET_NAME


def sim_dev_dir(sock_path: str) -> str:
    """Where the simulated device nodes of the daemon at ``sock_path`` are (its /dev/davinciN).

    Here, not in the simulator: the node and restore code find a simulated node's devices through
    it, and the product does not import the simulator."""
    return sock_path + ".dev"


def agent_runtime_dir(uid: Optional[int] = None) -> Path:
    """The directory that holds agent sockets for ``uid`` (default: this process's euid)."""
    env = os.environ.get(contract.AGENT_SOCKET_ENV_DIR)
    if env:
        return Path(env)
    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return Path(contract.AGENT_SOCKET_ROOT_DIR)
    base = _user_runtime_base(uid)
    if base == Path("/tmp"):
        return Path(contract.AGENT_SOCKET_TMP_DIR.format(uid=uid))
    return base / contract.AGENT_SOCKET_XDG_SUBDIR


def runtime_dir_problem(directory: Optional[Path] = None) -> Optional[str]:
    """Why agents of this user could not listen in their runtime directory (None: they can).

    A directory that another user created first (``/tmp/npusnap-<uid>`` in a shared /tmp), a
    symlink, or one that others can enter makes every agent refuse to start; this says so
    before a job is started without one.
    """
    import stat

    directory = directory or agent_runtime_dir()
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None  # the first agent creates it, 0700
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a real directory (a symlink or a file): someone may have planted it"
    if st.st_uid != os.geteuid():
        return (
            f"{directory} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): another user "
            "created it first"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"{directory} has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    return None


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` 0700 if missing and verify it is safe to keep secrets in (a real
    directory of this user, mode 0700); PermissionError naming the fix otherwise."""
    import stat

    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    else:
        # mkdir's mode is filtered by the umask; fix the mode of the directory we just created
        # rather than change the process-wide umask.
        os.chmod(directory, 0o700)
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{directory} is not a real directory (symlink or file); refusing to use it")
    if st.st_uid != os.geteuid():
        raise PermissionError(
            f"{directory} is owned by uid {st.st_uid}, not {os.geteuid()}; refusing to use it "
            "(another user created it first; remove it, or set NPUSNAP_RUNTIME_DIR to a private directory)"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise PermissionError(
            f"{directory} has mode {stat.S_IMODE(st.st_mode):o}, not 700; refusing to use it "
            f"(fix: chmod 700 {directory})"
        )


def agent_socket_path(pid: int, uid: Optional[int] = None) -> Path:
    return agent_runtime_dir(uid) / contract.AGENT_SOCKET_NAME.format(pid=pid)


def agent_log_path(pid: int, uid: Optional[int] = None) -> Path:
    """Where the agents of the job whose first process is ``pid`` write their messages (never
    the job's own stderr): ``<runtime dir>/<pid>.log``, named by `npusnap run` in
    NPUSNAP_AGENT_LOG for the whole tree; an agent started otherwise names it after its own pid."""
    return agent_runtime_dir(uid) / contract.AGENT_LOG_NAME.format(pid=pid)


def listening_unix_paths(proc_net_unix: str = "/proc/net/unix") -> list[str]:
    """Paths of all bound, listening filesystem AF_UNIX sockets visible in this net namespace."""
    paths = []
    try:
        with open(proc_net_unix, encoding="utf-8", errors="replace") as f:
            next(f, None)  # header
            for line in f:
                fields = line.split()
                # Num RefCount Protocol Flags Type St Inode Path; Flags 00010000 = __SO_ACCEPTCON (listening)
                if len(fields) >= 8 and fields[7].startswith("/") and int(fields[3], 16) & 0x10000:
                    paths.append(fields[7])
    except OSError:
        pass
    return paths


def find_agent_socket(pid: int, listening: Optional[list[str]] = None) -> Optional[Path]:
    """The control socket that the agent of ``pid`` listens on, or None.

    Looks first at the default path for this user, then at any listening socket named
    ``<pid>.sock`` in an ``npusnap*`` directory of the process's user or root's (an agent of
    another user, or one started with a different NPUSNAP_RUNTIME_DIR), then the socket the
    process holds (a replica). ``listening``: the listening socket paths, if the caller has them.
    The caller must still verify the peer pid (SO_PEERCRED).
    """
    default = agent_socket_path(pid)
    name = contract.AGENT_SOCKET_NAME.format(pid=pid)
    # In pid's own network namespace, which may not be ours (a rank on a simulated node).
    if listening is None:
        listening = listening_unix_paths(f"/proc/{pid}/net/unix") or listening_unix_paths()
    if str(default) in listening:
        return default
    for path in listening:
        p = Path(path)
        if (
            p.name == name
            and p.parent.name.startswith(contract.AGENT_SOCKET_DIR_PREFIX)
            and may_serve(p, pid)
        ):
            return p
    return held_agent_socket(pid)


def may_serve(socket: Path, pid: int) -> bool:
    """Whether ``socket`` can be the agent socket of ``pid``: its directory belongs to the
    process's user or to root. An agent listens in a directory of its own user's (or one root
    made); a socket named after a pid in a directory another user owns is that user's fake, and
    would otherwise be picked (and refused) in place of the real one."""
    try:
        owner = os.stat(socket.parent).st_uid
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    return owner in (0, uid)


def held_agent_socket(pid: int) -> Optional[Path]:
    """The listening ``*.sock`` in an ``npusnap*`` directory whose socket ``pid`` itself holds.

    A replica restored from an image of a job in its own pid namespace (``restore --replicas``)
    listens under a name of its own, not after its pid, which is new; it is found by the socket
    inode in its fds, in an ``npusnap*`` directory or in this user's runtime directory (which
    NPUSNAP_RUNTIME_DIR may put anywhere). A socket named after another process that shares
    ``pid``'s descriptor table is that process's (fd_table_owner). (The caller still checks the
    peer pid.)"""
    return next((p for p in _held_agent_sockets(pid) if not _anothers(p, pid)), None)


def _held_agent_sockets(pid: int) -> list[Path]:
    own_dir = agent_runtime_dir()
    held = set()
    found: list[Path] = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                held.add(target[8:-1])
    except OSError:
        return found
    try:
        with open(f"/proc/{pid}/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[6] in held and int(fields[3], 16) & 0x10000:
                    p = Path(fields[7])
                    prefixed = p.parent.name.startswith(contract.AGENT_SOCKET_DIR_PREFIX)
                    in_agent_dir = p.parent == own_dir or prefixed
                    if p.suffix == SOCKET_SUFFIX and in_agent_dir:
                        found.append(p)
    except (OSError, ValueError):
        return found
    return found


def fd_table_owner(pid: int) -> Optional[int]:
    """Another process whose agent socket ``pid`` holds only because the two share one descriptor
    table (clone with CLONE_FILES, no fork: no fork handler ran, so ``pid`` has no agent of its
    own); None otherwise."""
    for path in _held_agent_sockets(pid):
        owner = _named_pid(path)
        if owner is not None and owner != pid and procfs.shares_fd_table(pid, owner):
            return owner
    return None


def _named_pid(path: Path) -> Optional[int]:
    stem = path.name[: -len(SOCKET_SUFFIX)] if path.name.endswith(SOCKET_SUFFIX) else ""
    return int(stem) if stem.isdigit() else None


def _anothers(path: Path, pid: int) -> bool:
    """The socket is named after another process that shares ``pid``'s descriptor table."""
    owner = _named_pid(path)
    return owner is not None and owner != pid and bool(procfs.shares_fd_table(pid, owner))
