"""How `npusnap run` starts a program with the agent: environment and exec.

Any dynamically linked program gets the native agent: ``LD_PRELOAD`` names
``libnpusnap_agent.so``, whose constructor starts the agent thread when ``NPUSNAP_AGENT=1``
(inherited by the whole tree, exec'd children included). Python interpreters also get the
bootstrap, so that the agent's Python face (hooks, interpreter info) is set up there: the
bootstrap directory (``agent/bootstrap``, holding an env-gated ``sitecustomize.py``) goes
first on PYTHONPATH; ``NPUSNAP_AGENT=1`` switches it on; ``NPUSNAP_PKG_PARENT`` tells it where
this copy of ``npusnap_cli`` lives, so the target imports the agent of the same npusnap version
as the CLI, whatever Python (3.9+) the target runs.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from npusnap_cli import contract, elf, paths, safefs
from npusnap_cli.agent import native
from npusnap_cli.errors import PreflightError, TargetError, UsageError
from npusnap_cli.host import iouring
from npusnap_cli.jsontypes import JSONObject

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
PKG_PARENT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    executable: str
    env: dict[str, str] = field(repr=False)

    def to_dict(self) -> JSONObject:
        return {
            "pid": os.getpid(),
            "argv": self.argv,
            "executable": self.executable,
            "env": {
                k: self.env[k] for k in ("NPUSNAP_AGENT", "NPUSNAP_PKG_PARENT", "PYTHONPATH", "LD_PRELOAD")
            },
        }


def agent_library() -> Path:
    """libnpusnap_agent.so (the native agent core and the device-memory part), built by setup."""
    lib = native.library_path(include_mapped=False)
    if lib is None:
        raise PreflightError(
            f"the native agent library {native.LIBRARY_NAME} is not built",
            why="looked at " + ", ".join(str(p) for p in native.candidates()),
            fix="run scripts/setup.sh (or `make -C native`) in the npusnap checkout"
            if paths.is_checkout()
            else "reinstall npusnap from its node wheel (scripts/install-node.sh), which carries it",
        )
    return Path(lib)


def agent_environment(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``base`` (default: os.environ) plus what the native agent needs: its library first in
    LD_PRELOAD (the agent core, and the device-memory part whose aclrt* and dlsym definitions must
    come before libacl's), the switch that starts it, and the Python bootstrap."""
    env = dict(os.environ if base is None else base)
    lib = agent_library()
    # ld.so splits LD_PRELOAD at spaces and colons: a path with either cannot be preloaded.
    if any(c in str(lib) for c in " :"):
        raise PreflightError(
            f"cannot preload {lib}: its path contains a space or a colon",
            why="ld.so splits LD_PRELOAD at spaces and colons",
            fix="install npusnap under a path without spaces or colons",
        )
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p and p != str(lib)]
    env["LD_PRELOAD"] = " ".join([str(lib), *preload])
    env["NPUSNAP_AGENT_LIB"] = str(lib)
    # PyTorch's rendezvous store (rank 0 of a torch.distributed job started with env:// or tcp://)
    # runs on libuv, whose loop holds an io_uring that CRIU cannot dump; USE_LIBUV=0 (read by
    # torch/distributed/rendezvous.py) gives it the store without libuv, which prints nothing
    # different. A value of the caller's own stays. (torchrun's agent does not read it: run
    # --no-io-uring, docs/reference/run.md.)
    env.setdefault("USE_LIBUV", "0")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOTSTRAP_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *parts])
    env["NPUSNAP_AGENT"] = "1"
    env["NPUSNAP_PKG_PARENT"] = str(PKG_PARENT)
    return env


def with_job_log(env: dict[str, str], pid: int) -> dict[str, str]:
    """``env`` naming the job's agent log for every process of the tree (NPUSNAP_AGENT_LOG):
    ``<runtime dir>/<pid>.log`` after the job's first process. The agents write there and never
    into the job's stderr. A path already in the environment (yours, or an enclosing job's) stays."""
    if env.get(contract.AGENT_LOG_ENV):
        return env
    return {**env, contract.AGENT_LOG_ENV: str(paths.agent_log_path(pid))}


def host_pid() -> int:
    """This process's pid as the host's /proc names it: in a pid namespace of our own (``--pid-ns``
    keeps the host's /proc) getpid() says 1."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


def statically_linked(path: str) -> bool:
    """True for an ELF executable without an interpreter (PT_INTERP): ld.so never runs for it,
    so LD_PRELOAD cannot give it an agent. Scripts and unreadable files count as not static."""
    try:
        with elf.open_elf(path) as exe:
            return not exe.has_interpreter()
    except (OSError, elf.ElfError):
        return False


def prepare(argv: list[str], base_env: Optional[dict[str, str]] = None) -> LaunchPlan:
    if not argv:
        raise UsageError("no command given", fix="npusnap run -- python train.py")
    env = agent_environment(base_env)
    exe = shutil.which(argv[0], path=env.get("PATH"))
    if exe is None:
        raise TargetError(
            f"command not found: {argv[0]}",
            why="it is not an executable file and not on PATH",
            fix="give the full path of the program",
        )
    return LaunchPlan(argv=list(argv), executable=exe, env=env)


def leave_foreign_session() -> Optional[str]:
    """Start a new session when this one's leader is outside our pid namespace; what was done.

    CRIU cannot dump a process whose session leader it cannot see (getsid reads 0: the job was
    started by `docker exec`, `nsenter` or a CI runner from outside the namespace), not even as a
    shell job. Such a session gives no job control from inside anyway, so a job started through
    `npusnap run` gets a session of its own, which makes it dumpable. None: nothing to do.
    """
    if os.getsid(0) != 0:
        return None
    try:
        os.setsid()
    except PermissionError:
        # Already a process group leader (setsid(2) refuses those): the pid must stay, no fork.
        return (
            "this session's leader is outside the pid namespace and the program leads its own "
            "process group, so it keeps that session: it cannot be dumped; start it with `setsid`"
        )
    return (
        "this session's leader is outside the pid namespace (CRIU could not dump the program in "
        "it): the program runs in a new session of its own"
    )


def deny_io_uring() -> Optional[str]:
    """`run --no-io-uring`: from here on, io_uring_setup fails with ENOSYS in this process and in
    the program it becomes or starts (host/iouring.py). A note when set-uid programs lose their
    privileges in the job (no CAP_SYS_ADMIN: the no_new_privs bit was needed), else None."""
    nnp = iouring.needs_no_new_privs()
    try:
        iouring.deny_io_uring()
    except OSError as exc:
        raise PreflightError(
            f"cannot keep io_uring out of the program: {exc.strerror}",
            why="installing a seccomp filter needs CAP_SYS_ADMIN or the no_new_privs bit, and a "
            "kernel built with CONFIG_SECCOMP_FILTER",
            fix="run npusnap as root, or start the program without --no-io-uring",
        ) from None
    if nnp:
        return (
            "--no-io-uring without CAP_SYS_ADMIN sets no_new_privs: set-uid programs in the job run "
            "without their privileges"
        )
    return None


def exec_plan(plan: LaunchPlan) -> None:
    """Replace this process with the program (same pid). Returns only by raising."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.executable, plan.argv, with_job_log(plan.env, os.getpid()))
    except OSError as exc:
        raise TargetError(
            f"cannot execute {plan.argv[0]}: {exc.strerror}",
            why="the file is not executable or its interpreter is missing",
            fix=f"check `ls -l {plan.executable}`",
        ) from None


# How long `run --detach` waits for the child to exec the program (or to report why it could not).
DETACH_EXEC_TIMEOUT_S = 10.0


CLONE_NEWPID = 0x20000000  # include/uapi/linux/sched.h


def enter_new_pid_namespace() -> None:
    """unshare(CLONE_NEWPID): the next child of this process is init (pid 1) of a new pid
    namespace, as `unshare --pid --fork` makes it. /proc stays the host's (no new mount
    namespace): CRIU restores a mount namespace only with --root and every mount of it, while a
    pid namespace alone it restores by itself, so the job needs no host pid free at restore."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        raise PreflightError(
            f"cannot create a pid namespace: {os.strerror(err)}",
            why="unshare(CLONE_NEWPID) needs CAP_SYS_ADMIN (root), or a user namespace",
            fix="run npusnap as root, or start the job without --pid-ns",
        )


def run_in_pid_namespace(plan: LaunchPlan) -> int:
    """Start the program as init of a new pid namespace, in a session of its own, and wait for
    it, handing on SIGINT/SIGTERM/SIGHUP/SIGQUIT; its exit status (128+N for signal N)."""
    import signal

    enter_new_pid_namespace()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()  # CRIU cannot dump a namespace whose session leader is outside it
            os.execvpe(plan.executable, plan.argv, with_job_log(plan.env, host_pid()))
        except BaseException as exc:
            sys.stderr.write(f"npusnap run: cannot execute {plan.argv[0]}: {exc}\n")
        finally:
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def detach(plan: LaunchPlan, output: Optional[Path], pid_ns: bool = False) -> int:
    """Start the program in the background in a session of its own; return its pid.

    The pid is the program's own (the child execs it: no shell, no setsid(1) in between), and it
    leads its own session, which CRIU needs to dump it without --shell-job. stdin is /dev/null;
    stdout and stderr are appended to ``output`` (default /dev/null). Returns once the exec
    succeeded: a failed exec is reported here as an error, through a close-on-exec pipe.
    """
    out_path = str(output) if output is not None else os.devnull
    try:
        if output is None:
            out_fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        else:
            # --output may name a file in a shared directory (/tmp): a symlink or hard link a
            # user planted there must not make us append to another file (as root: any file).
            out_fd = safefs.open_append(out_path, 0o644)
    except safefs.UnsafePath as exc:
        raise UsageError(
            f"refusing {out_path} for the program's output: {exc.strerror}",
            why="the output file is opened without following a symbolic link, and must be a regular "
            "file of yours with a single link: otherwise whoever planted it chooses what file the "
            "job's output goes to (or reads it)",
            fix="pass a new file name to --output, in a directory only you can write to",
            details={"output": out_path, "unsafe": exc.filename},
        ) from None
    except OSError as exc:
        why = (
            "it is a symbolic link (never followed), or a directory on the way is"
            if exc.errno in (errno.ELOOP, errno.ENOTDIR)
            else ""
        )
        raise UsageError(
            f"cannot open {out_path} for the program's output: {exc.strerror}",
            why=why,
            fix="pass a writable file to --output",
        ) from None
    null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    sys.stdout.flush()
    sys.stderr.flush()
    if pid_ns:
        enter_new_pid_namespace()  # the child below is its init; we only wait for its exec
    pid = os.fork()
    if pid == 0:  # the child: becomes the program
        try:
            os.close(rfd)
            os.setsid()
            os.dup2(null_fd, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            # Descriptors the launcher inherited (a pipe from a CI runner or a shell's coprocess)
            # must not follow the job: CRIU would dump them as pipes whose other end is outside
            # the tree, and restore them without it. Only 0-2 and the exec-status pipe stay.
            os.closerange(3, wfd)
            os.closerange(wfd + 1, _max_fd())
            os.execvpe(plan.executable, plan.argv, with_job_log(plan.env, host_pid()))
        except BaseException as exc:
            try:
                os.write(wfd, f"{getattr(exc, 'strerror', None) or exc}".encode(errors="replace"))
            finally:
                os._exit(127)
    os.close(wfd)
    os.close(out_fd)
    os.close(null_fd)
    try:
        message = _read_until_eof(rfd, DETACH_EXEC_TIMEOUT_S)
    finally:
        os.close(rfd)
    if message is None:
        raise TargetError(
            f"the program (pid {pid}) did not start within {DETACH_EXEC_TIMEOUT_S:g}s",
            why="the exec did not complete (an overloaded host?)",
            fix=f"check `ps -p {pid}` and the program's output",
        )
    if message:
        os.waitpid(pid, 0)
        raise TargetError(
            f"cannot execute {plan.argv[0]}: {message}",
            why="the file is not executable or its interpreter is missing",
            fix=f"check `ls -l {plan.executable}`",
        )
    return pid


def _max_fd() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if 0 < soft < 1 << 20 else 1 << 16


def _read_until_eof(fd: int, timeout_s: float) -> Optional[str]:
    """Everything written to ``fd`` until EOF; None if EOF does not come within ``timeout_s``."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return data.decode(errors="replace")
        data += chunk
