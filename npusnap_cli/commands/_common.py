"""Helpers shared by the command modules: global options, the current Output, option types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:  # imported when a command runs, not for every --help
    from npusnap_cli.ui import Output

JSON_HELP = "Print one JSON envelope on stdout instead of text, also on failure (diagnostics stay on stderr)."


@dataclass(frozen=True)
class GlobalOptions:
    json_output: bool = False
    verbose: int = 0
    quiet: bool = False


_current: Optional[Output] = None


def output(ctx: typer.Context, command: str, json_flag: bool = False) -> Output:
    """The Output for this command; ``--json`` may be given globally or on the command."""
    from npusnap_cli.ui import Output  # lazy: --help cost (check_imports.py --costs)

    global _current
    opts = ctx.find_root().obj if ctx.find_root().obj is not None else GlobalOptions()
    _current = Output(
        command, json_mode=json_flag or opts.json_output, verbose=opts.verbose, quiet=opts.quiet
    )
    return _current


def reset_output() -> None:
    global _current
    _current = None


def options_part(argv: list[str]) -> list[str]:
    """The arguments before ``--`` (what follows is a program's command line, e.g. `run`'s)."""
    return argv[: argv.index("--")] if "--" in argv else argv


_GLOBAL_FLAGS = frozenset({"--verbose", "--quiet", "-q"})


def _is_global_flag(arg: str) -> bool:
    return arg in _GLOBAL_FLAGS or (len(arg) > 1 and arg[0] == "-" and set(arg[1:]) == {"v"})


def hoist_global_flags(argv: list[str]) -> list[str]:
    """Move -v/-vv/--verbose/-q/--quiet to the front, where the global options are parsed, so that
    they work anywhere on the line (`npusnap dump -v PID DIR`). Never from a program's command
    line: not after ``--``, and for `run` not after the first word of the program."""
    front: list[str] = []
    rest: list[str] = []
    command: Optional[str] = None
    frozen = False
    for arg in argv:
        if frozen:
            rest.append(arg)
            continue
        if arg == "--":
            frozen = True
            rest.append(arg)
            continue
        if _is_global_flag(arg):
            front.append(arg)
            continue
        if not arg.startswith("-"):
            if command is None:
                command = arg
            elif command == "run":
                frozen = True  # CMD starts here: its own -v is its own
        rest.append(arg)
    return front + rest


def json_requested(argv: list[str]) -> bool:
    return "--json" in options_part(argv)


def command_name(argv: list[str]) -> str:
    """Best guess at the command from raw arguments (before typer parsed them): its words."""
    words = [a for a in options_part(argv) if not a.startswith("-")]
    if not words:
        return "npusnap"
    return " ".join(words[:2]) if words[0] == "sim" and len(words) > 1 else words[0]


def verbosity(argv: list[str]) -> int:
    """How many -v/--verbose (``-vv`` counts two) are in the raw arguments."""
    count = 0
    for arg in argv:
        if arg == "--verbose":
            count += 1
        elif arg.startswith("-v") and set(arg[1:]) == {"v"}:
            count += len(arg) - 1
    return count


def current_output(argv: list[str]) -> Output:
    """The command's Output if it got that far, else one built from the raw arguments."""
    from npusnap_cli.ui import Output  # lazy: --help cost (check_imports.py --costs)

    if _current is not None:
        return _current
    return Output(command_name(argv), json_mode=json_requested(argv))


def clean_stale_sockets(out: Output) -> None:
    """Remove agent sockets whose process is gone (see hostclean.py); commands that look for
    agents call this first, so that /run/npusnap holds only live agents."""
    from npusnap_cli.host import hostclean  # lazy: --help cost (check_imports.py --costs)

    for entry in hostclean.remove_stale_agent_sockets():
        out.debug(f"removed stale agent socket or lock token {entry.path} ({entry.reason})")


# Examples shown at the end of every command's --help (click's "\b" keeps the lines as written).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "check": (
        'eval "$(npusnap sim env)"; npusnap check     # with the simulated NPU',
        "npusnap check --json | jq '.result.checks[] | select(.status != \"ok\")'",
    ),
    "qualify": (
        "npusnap qualify                       # as root, on an idle device 0",
        "npusnap qualify --device 1 --report qualify.json",
    ),
    "sim start": ("npusnap sim start --devices 2", 'eval "$(npusnap sim env)"'),
    "sim stop": ("npusnap sim stop",),
    "sim status": ("npusnap sim status --json",),
    "sim env": ('eval "$(npusnap sim env)"',),
    "sim ops": ("npusnap sim ops --missing", "npusnap sim ops --json | jq .result.missing_count"),
    "run": (
        "npusnap run -- python3 train.py                 # in the foreground, same pid",
        "PID=$(npusnap run -d --pidfile job.pid -o job.log -- python3 train.py)",
    ),
    "attach": ("npusnap attach 4242", "npusnap attach 4242 --json"),
    "status": ("npusnap status 4242", "npusnap status 4242 | grep LOCKED"),
    "ps": (
        "npusnap ps",
        "npusnap ps --json | jq '.result.processes[] | select(.state != \"RUNNING\")'",
    ),
    "freeze": ("npusnap freeze 4242 --lease 600", "npusnap freeze 4242 --no-lease --json"),
    "thaw": ("npusnap thaw 4242", "npusnap thaw 4242 --force   # a lock another command holds"),
    "dump": (
        "npusnap dump 4242 ./img                          # the job is gone afterwards",
        "npusnap dump -R 4242 /snap/job-$(date +%s) --keep-last 3 --latest",
        "npusnap dump -R -e job.tar.zst 4242 ./img        # and an archive to ship",
        "npusnap dump -vv 4242 ./img                      # with the end of CRIU's log",
    ),
    "restore": (
        "npusnap restore ./img",
        "npusnap restore --dry-run ./img                  # what it would check, nothing touched",
        "npusnap restore -i job.tar.zst ./img             # import the archive, then restore",
        "PID=$(npusnap restore ./img --pidfile job.pid)",
    ),
    "inspect": ("npusnap inspect ./img", "npusnap inspect --json job.tar.zst | jq .result.files"),
    "verify": ("npusnap verify ./img", "npusnap verify job.tar.zst --require-signature key.pub"),
    "list": ("npusnap list /snap", "npusnap list --valid --paths /snap | head -n 1   # newest good one"),
    "export": ("npusnap export ./img", "npusnap export ./img /backup/job.tar.zst --level 9"),
    "import": ("npusnap import job.tar.zst ./img", 'npusnap restore "$(npusnap import job.tar.zst ./img)"'),
    "demo": ("npusnap demo", "npusnap demo --keep"),
    "k8s checkpoint": (
        "npusnap k8s checkpoint ./job-1 --listen 10.0.0.5:7711 --kubelet-cert c.crt --kubelet-key c.key "
        "--member default/trainer-0/trainer@node-a --member default/trainer-1/trainer@node-b",
        'npusnap k8s checkpoint ./ckpt --member default/trainer-0/trainer --cri-endpoint "$CRI"',
    ),
    "k8s verify": ("npusnap k8s verify ./job-1",),
    "k8s restore": (
        "npusnap k8s restore ./job-1 &   # serves the barrier; then create the pods (kubectl apply)",
        'npusnap k8s restore ./job-1 --cri-endpoint "$CRI" --run p0.json:c0.json --run p1.json:c1.json',
    ),
    "k8s run": ("npusnap k8s run --cri-endpoint unix:///run/containerd/containerd.sock pod.json ctr.json",),
    "k8s rm": ('npusnap k8s rm --cri-endpoint "$CRI" POD_ID',),
}


def epilog(command: str) -> str:
    lines = EXAMPLES[command]
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)
