"""`npusnap run -- CMD...`: start a program with the npusnap agent in each of its processes."""

from __future__ import annotations

import typer

from npusnap_cli.commands._common import JSON_HELP, output


def register(app: typer.Typer) -> None:
    @app.command(
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
        json_flag: bool = typer.Option(
            False,
            "--json",
            help=JSON_HELP + " The envelope (with the pid the program will have) is printed before the "
            "program starts; the program's own output follows.",
        ),
    ) -> None:
        """Run CMD with an npusnap agent in every process it starts, Python or not.

        npusnap replaces itself with CMD (same pid), with NPUSNAP_AGENT=1 and the native agent
        library on LD_PRELOAD: each dynamically linked process of the tree serves a control
        socket, so that `npusnap status/freeze/dump PID` can drive it. Python 3.9+ interpreters
        also get the agent's Python face (hooks) through a bootstrap on PYTHONPATH. Statically
        linked and set-uid programs ignore LD_PRELOAD and get no agent.
        """
        from npusnap_cli.agent import launch

        out = output(ctx, "run", json_flag)
        argv = [a for a in command]
        if argv and argv[0] == "--":
            argv = argv[1:]
        plan = launch.prepare(argv)
        if launch.statically_linked(plan.executable):
            out.warn(
                f"{plan.executable} is statically linked: the dynamic loader never runs for it, so it "
                "gets no agent from LD_PRELOAD (link it dynamically, or call npusnap_agent_start())"
            )
        session_note = None if keep_session else launch.leave_foreign_session()
        if session_note:
            out.warn(session_note)
        out.debug(
            f"exec {' '.join(plan.argv)} (LD_PRELOAD={plan.env.get('LD_PRELOAD')}, "
            f"PYTHONPATH={plan.env.get('PYTHONPATH')})"
        )
        out.result({**plan.to_dict(), "session_note": session_note})
        launch.exec_plan(plan)
