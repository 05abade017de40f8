"""`npusnap run -- CMD...`: start a program with the npusnap agent in each of its processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from npusnap_cli import agent, contract, paths
from npusnap_cli.agent import launch
from npusnap_cli.commands._common import JSON_HELP, epilog, output
from npusnap_cli.errors import PreflightError, UsageError
from npusnap_cli.host import pidfile as pidfile_mod


def register(app: typer.Typer) -> None:
    @app.command(
        epilog=epilog("run"),
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )
    def run(
        ctx: typer.Context,
        command: list[str] = typer.Argument(
            ..., metavar="[--] CMD [ARGS]...", help="The program to run, with its arguments."
        ),
        keep_session: bool = typer.Option(
            False,
            "--keep-session",
            help="Never start a new session (by default one is started only when this session's "
            "leader is outside the pid namespace, where CRIU could not dump the program).",
        ),
        detach: bool = typer.Option(
            False,
            "--detach",
            "-d",
            help="Start CMD in the background, in a session of its own, stdin from /dev/null, output to "
            "--output; print its pid (the program's own) on stdout and return.",
        ),
        pidfile: Optional[Path] = typer.Option(
            None, "--pidfile", help="With --detach: write the program's pid into this file (atomically)."
        ),
        output_file: Optional[Path] = typer.Option(
            None,
            "--output",
            "-o",
            help="With --detach: append the program's stdout and stderr to this file (default /dev/null).",
        ),
        pid_ns: bool = typer.Option(
            False,
            "--pid-ns",
            help="Start CMD as init (pid 1) of a new pid namespace (the host's /proc is kept): its "
            "image then restores beside the original and as many times as wanted (restore "
            "--replicas), needing no host pid free. The printed pid is the host's.",
        ),
        io_uring: bool = typer.Option(
            True,
            "--io-uring/--no-io-uring",
            help="--no-io-uring makes io_uring_setup fail (ENOSYS, as on a kernel without io_uring) "
            "in CMD and everything it starts, with a seccomp filter: CRIU cannot dump an io_uring, and "
            "libuv (PyTorch's TCPStore in torchrun's agent) falls back to epoll. Needed for torchrun. "
            "Off by default: a filter is observable (a program can no longer enter "
            "seccomp's strict mode). The ranks' own stores need no filter: run sets USE_LIBUV=0.",
        ),
        json_flag: bool = typer.Option(
            False,
            "--json",
            help=JSON_HELP + " The envelope (with the pid the program will have) is printed before the "
            "program starts; the program's own output follows (with --detach: after it started).",
        ),
    ) -> None:
        """Run CMD with an npusnap agent in every process it starts, Python or not.

        npusnap replaces itself with CMD (same pid), with NPUSNAP_AGENT=1 and the native agent
        library on LD_PRELOAD: each dynamically linked process of the tree serves a control
        socket, so that `npusnap status/freeze/dump PID` can drive it. Python 3.9+ interpreters
        also get the agent's Python face (hooks) through a bootstrap on PYTHONPATH. Statically
        linked and set-uid programs ignore LD_PRELOAD and get no agent.
        """

        out = output(ctx, "run", json_flag)
        problem = paths.runtime_dir_problem()
        if problem:
            # Every agent of the job would refuse this directory and the job would run without
            # one: refuse here, loudly, instead of starting it.
            where = paths.agent_runtime_dir()
            raise PreflightError(
                f"the agents' runtime directory cannot be used: {problem}",
                why="agents listen only in a private directory of their own user (0700); a squatted "
                "one would let another user intercept or block the control sockets",
                fix=f"look at it (ls -ld {where}); remove it if it is not yours (it is recreated), "
                "or set NPUSNAP_RUNTIME_DIR (or XDG_RUNTIME_DIR) to a private directory",
                details={"runtime_dir": str(where)},
            )
        argv = [a for a in command]
        if argv and argv[0] == "--":
            argv = argv[1:]
        if (pidfile is not None or output_file is not None) and not detach:
            raise UsageError(
                "--pidfile and --output need --detach",
                why="without --detach npusnap becomes the program, in the foreground",
                fix="add --detach: npusnap run --detach --pidfile job.pid --output job.log -- CMD...",
            )
        plan = launch.prepare(argv)
        no_io_uring = not io_uring
        if no_io_uring:
            # Installed in this process before it forks or execs: the program inherits it.
            nnp_note = launch.deny_io_uring()
            if nnp_note:
                out.warn(nnp_note)
        if launch.statically_linked(plan.executable):
            out.warn(
                f"{plan.executable} is statically linked: the dynamic loader never runs for it, so it "
                "gets no agent from LD_PRELOAD (link it dynamically, or call npusnap_agent_start())"
            )
        if detach:
            if pidfile is not None:
                pidfile_mod.check(pidfile)
            pid = launch.detach(plan, output_file, pid_ns=pid_ns)
            agent_log = launch.with_job_log(plan.env, pid)[contract.AGENT_LOG_ENV]
            if output_file is None:
                out.warn(
                    "no --output: the program's output goes to /dev/null (pass --output FILE; its "
                    f"agents' messages are in {agent_log})"
                )
            written = pidfile_mod.write(pidfile, pid) if pidfile is not None else None
            out.data(str(pid))
            result = {**plan.to_dict(), "pid": pid, "detached": True, "pidfile": written, "pid_ns": pid_ns}
            result["no_io_uring"] = no_io_uring
            result["output"] = str(output_file) if output_file is not None else None
            result["agent_log"] = agent_log
            out.result({**result, "session_note": None})
            return
        if pid_ns:
            # The program's pid is the one fork gives it, not ours: unknown until it starts.
            out.result(
                {
                    **plan.to_dict(),
                    "pid": None,
                    "detached": False,
                    "session_note": None,
                    "pid_ns": True,
                    "no_io_uring": no_io_uring,
                    "agent_log": plan.env.get(contract.AGENT_LOG_ENV),
                }
            )
            raise typer.Exit(launch.run_in_pid_namespace(plan))
        session_note = None if keep_session else launch.leave_foreign_session()
        out.debug(
            f"exec {' '.join(plan.argv)} (LD_PRELOAD={plan.env.get('LD_PRELOAD')}, "
            f"PYTHONPATH={plan.env.get('PYTHONPATH')})"
        )
        agent_log = launch.with_job_log(plan.env, os.getpid())[contract.AGENT_LOG_ENV]
        if session_note:
            # The program's stderr is the program's: the note goes to the job's log (and `status`
            # names it), and to stderr only when a person is watching it.
            logged = agent.append_log_line(agent_log, f"npusnap run: [{os.getpid()}] {session_note}\n")
            if not logged or sys.stderr.isatty():
                out.warn(session_note)
        out.result(
            {
                **plan.to_dict(),
                "detached": False,
                "session_note": session_note,
                "no_io_uring": no_io_uring,
                "agent_log": agent_log,
            }
        )
        launch.exec_plan(plan)
