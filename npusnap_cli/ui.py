"""The one place that renders output.

Data goes to **stdout** and diagnostics to **stderr**, as every Unix tool does: a command's
tables, trees and key/value blocks (``npusnap status PID | grep LOCKED``) and its one-line
answers (``dump`` prints the image path, ``restore`` the restored root pid) are on stdout;
progress, phases, notes, warnings and errors are on stderr. With ``--json`` stdout holds
exactly one JSON envelope instead. The envelope is stable (docs/json-output.md)::

    {"schema": 1, "command": "dump", "ok": true, "exit_code": 0,
     "result": {...}, "error": null, "warnings": []}

``warnings`` holds every warning a person would have seen on stderr, in order (``warn``, and
the notes the pipelines hand to it), so that a script does not lose what a human was told.

On failure ``ok`` is false, ``result`` may hold partial data and ``error`` is
``{"kind", "exit_code", "message", "why", "fix", "details"}``.

Core modules never import this module (or rich); commands hand it plain data.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Optional

from npusnap_cli.errors import ExitCode, NpusnapError, settle_no_space, settle_permission
from npusnap_cli.jsontypes import JSONObject, JSONValue
from npusnap_cli.units import human_bytes as human_bytes  # the tables' spelling of sizes

ENVELOPE_SCHEMA = 1

# C0 and C1 controls (ESC starts an ANSI sequence; CR and a newline forge lines), DEL, and the
# Unicode line separators and bidirectional overrides, which reorder what a terminal shows.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(m: re.Match[str]) -> str:
    ch = m.group()
    return _NAMED.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def safe_text(value: object) -> str:
    """``value`` as one line of plain text a terminal shows as it is: every control character,
    ANSI escape, newline and bidi override written as a visible escape (``\\x1b``, ``\\n``).

    Job command lines, paths, image fields and agent replies are chosen by whoever started the
    job or wrote the image, possibly another user than the one reading root's ``ps``: what they
    chose must neither repaint the terminal nor forge a line. Everything printed for people goes
    through here and is then printed as rich ``Text`` (never parsed as markup, so ``[/]`` in a
    command line is text, not a markup error)."""
    return _UNSAFE.sub(_escaped, "" if value is None else str(value))


def _markup_safe(value: object) -> str:
    """``safe_text`` for the few places rich parses as markup (a progress bar's description)."""
    from rich.markup import escape

    return str(escape(safe_text(value)))


def plain(value: object, style: Optional[str] = None) -> Any:
    """``safe_text(value)`` as a rich Text (``style`` for all of it): rendered, never parsed."""
    from rich.text import Text

    return Text(safe_text(value), style=style or "")


class Output:
    """Renders one command's output, for people (stderr) or scripts (stdout JSON)."""

    def __init__(
        self, command: str, *, json_mode: bool = False, verbose: int = 0, quiet: bool = False
    ) -> None:
        self.command = command
        self.json_mode = json_mode
        self.verbose = verbose
        # --quiet: no progress, phases or notes; warnings, errors and data still appear.
        self.quiet = quiet and not verbose
        self.warnings: list[str] = []
        self._console: Any = None
        self._stdout: Any = None
        self._emitted = False

    # -- rich consoles, created lazily so `--json` runs never import rich ----------------------
    @property
    def console(self) -> Any:
        """Diagnostics: progress, phases, notes, warnings, errors (stderr)."""
        if self._console is None:
            self._console = make_console(stderr=True)
        return self._console

    @property
    def data_console(self) -> Any:
        """Data: tables, trees, key/value blocks (stdout)."""
        if self._stdout is None:
            self._stdout = make_console(stderr=False)
        return self._stdout

    def _print(self, stream: str, renderable: Any) -> None:
        if stream != "stdout":
            if not self.quiet:
                self.console.print(renderable)
            return
        with _reader_may_go():
            self.data_console.print(renderable)

    def data(self, text: str) -> None:
        """One plain line of data on stdout (no styling): an image path, a pid."""
        if not self.json_mode:
            with _reader_may_go():
                sys.stdout.write(text + "\n")
                sys.stdout.flush()

    # -- human output (suppressed in JSON mode, which keeps stderr for logs only) ---------------
    def line(self, text: str = "", style: Optional[str] = None) -> None:
        if not self.json_mode and not self.quiet:
            self.console.print(plain(text, style))

    def ok(self, text: str) -> None:
        self.line(f"✔ {text}", style="green")

    def warn(self, text: str) -> None:
        """A warning: on stderr for people (also with --quiet), in ``warnings[]`` for --json."""
        self.warnings.append(text)
        if not self.json_mode:
            self.console.print(plain(f"! {text}", "yellow"))

    def record_warning(self, text: str) -> None:
        """A warning people already saw in a table row: into ``warnings[]`` only."""
        self.warnings.append(text)

    def info(self, text: str) -> None:
        """A progress note (a phase starting), on stderr in human mode unless --quiet."""
        if not self.json_mode and not self.quiet:
            self.console.print(plain(text, "dim"))

    def debug(self, text: str) -> None:
        if self.verbose and not self.json_mode:
            self.console.print(plain(text, "dim"))
        elif self.verbose:
            print(safe_text(text), file=sys.stderr)

    def kv(self, title: str, items: Mapping[str, Any], *, stream: str = "stdout") -> None:
        if self.json_mode:
            return
        from rich.table import Table

        table = Table(
            title=plain(title, "table.title"),
            show_header=False,
            box=None,
            title_justify="left",
            pad_edge=False,
        )
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in items.items():
            table.add_row(plain(key), plain(value))
        self._print(stream, table)

    def table(
        self,
        title: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        *,
        styles: Optional[Sequence[Optional[str]]] = None,
        stream: str = "stdout",
    ) -> None:
        """A table; ``styles`` gives an optional rich style per row.

        Cells fold instead of ending in "…": a path or a command line cut at 80 columns loses
        exactly the part an operator needs.
        """
        if self.json_mode:
            return
        from rich.table import Table

        table = Table(title=plain(title, "table.title"), title_justify="left")
        for col in columns:
            table.add_column(plain(col), overflow="fold")
        for i, row in enumerate(rows):
            style = styles[i] if styles and i < len(styles) else None
            table.add_row(*(plain(c) for c in row), style=style)
        self._print(stream, table)

    def tree(self, title: str, nodes: Sequence[tuple[int, str]], *, stream: str = "stdout") -> None:
        """A tree from (depth, label) pairs in pre-order."""
        if self.json_mode:
            return
        from rich.tree import Tree

        root = Tree(plain(title))
        stack: list[tuple[int, Any]] = [(-1, root)]
        for depth, label in nodes:
            while stack and stack[-1][0] >= depth:
                stack.pop()
            node = stack[-1][1].add(plain(label))
            stack.append((depth, node))
        self._print(stream, root)

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Show a phase starting and how long it took (human mode only)."""
        start = time.monotonic()
        if not self.json_mode and not self.quiet:
            self.console.print(plain(f"… {label}", "dim"))
        try:
            yield
        finally:
            if not self.json_mode and not self.quiet:
                self.console.print(plain(f"  {label}: {time.monotonic() - start:.2f}s", "dim"))

    @contextmanager
    def progress(self, label: str, total: Optional[int]) -> Iterator[Any]:
        """A byte-progress bar on stderr. Yields ``advance(n)``/``update(completed)`` callables' owner.

        In JSON mode the returned object accepts the same calls and does nothing.
        """
        if self.json_mode or self.quiet:
            yield _NullProgress()
            return
        if not sys.stderr.isatty():
            # A log (systemd, CI, `2>file`): no bar, but a line now and then, so a long copy
            # does not look like a hang there either.
            line = _LineProgress(label, total, lambda text: self.console.print(plain(text)))
            try:
                yield line
            finally:
                line.finish()
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            _binary_columns(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        ) as prog:
            task = prog.add_task(_markup_safe(label), total=total)
            yield _RichProgress(prog, task)

    # -- the result ---------------------------------------------------------------------------
    def result(self, result: JSONValue, *, exit_code: int = 0) -> None:
        """Emit the JSON envelope for a finished command (human output was printed already)."""
        if self.json_mode and not self._emitted:
            self._emit(exit_code == 0, int(exit_code), result, None)

    def error(self, err: NpusnapError, *, partial: JSONValue = None) -> int:
        """Render an error; return its exit code."""
        err = settle_no_space(err) or err  # a full disk is exit 3 in every command
        code = int(err.exit_code)
        if self.json_mode:
            self._emit(False, code, partial, err.to_dict())
            return code
        self.console.print(plain(f"✘ {err.message}", "bold red"))
        if err.why:
            self.console.print(plain(f"  why: {err.why}"))
        if err.fix:
            self.console.print(plain(f"  fix: {err.fix}"))
        for key, value in err.details.items():
            if isinstance(value, dict) or (
                isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)
            ):
                continue  # structured detail is for --json
            if isinstance(value, list):
                self.console.print(plain(f"  {key}:"))
                for item in value:
                    self.console.print(plain(f"    {item}", "dim"))
            else:
                self.console.print(plain(f"  {key}: {value}", "dim"))
        return code

    def _emit(self, ok: bool, exit_code: int, result: JSONValue, error: Optional[JSONObject]) -> None:
        envelope: JSONObject = {
            "schema": ENVELOPE_SCHEMA,
            "command": self.command,
            "ok": ok,
            "exit_code": exit_code,
            "result": result,
            "error": error,
            "warnings": list(self.warnings),
        }
        sys.stdout.write(json.dumps(envelope, indent=2, sort_keys=False, default=str) + "\n")
        sys.stdout.flush()
        self._emitted = True


@contextmanager
def _reader_may_go() -> Iterator[None]:
    """Data for a reader that may stop reading: `npusnap list --paths DIR | head -n 1`.

    A reader that has what it wants and closes the pipe is not a failure of the command (which
    has done its work by the time it prints its data): the rest of the data goes to /dev/null,
    and the command ends with its own exit code, not with a traceback or SIGPIPE's 141 that
    `set -o pipefail` would turn into a failed script.
    """
    try:
        yield
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def no_color() -> bool:
    """https://no-color.org: a non-empty NO_COLOR disables every style, not only colours."""
    return bool(os.environ.get("NO_COLOR"))


# Tables do not expand to the console's width, so a huge width costs nothing; it only removes
# the wrap.
PIPE_WIDTH = 1 << 20


def make_console(*, stderr: bool) -> Any:
    """A rich console for one stream. NO_COLOR turns off all styling (bold, italics, dim too:
    rich's own NO_COLOR support removes colours only); output that is not a terminal is never
    styled and has no line width to speak of, so that a piped row stays one line whatever the
    length of a command line or path in it (`npusnap status PID | grep RUNNING`)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    wide = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(
        file=stream,
        highlight=False,
        soft_wrap=False,
        color_system=None if no_color() else "auto",  # rich's own default: "auto"
        width=PIPE_WIDTH if wide else None,  # None: rich's default, the terminal's width
    )


def _binary_columns() -> Any:
    """Done/total and speed in binary units (MiB), as every summary npusnap prints."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BinaryColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = "?" if task.total is None else human_bytes(task.total)
            speed = task.finished_speed or task.speed
            rate = f"{human_bytes(speed)}/s" if speed else "-"
            return Text(f"{human_bytes(task.completed)} / {total}  {rate}")

    return BinaryColumn()


class _NullProgress:
    def advance(self, n: int) -> None:
        pass

    def describe(self, text: str) -> None:
        pass

    def update(self, completed: int, total: Optional[int] = None) -> None:
        pass


class _LineProgress:
    """Progress as plain lines on a stream that is not a terminal: one when the work has gone on
    for a while, then one every ``EVERY_S`` seconds, and one at the end of a work that printed."""

    EVERY_S = 3.0

    def __init__(self, label: str, total: Optional[int], emit: Any) -> None:
        self._clock = time.monotonic
        self._label = label
        self._total = total
        self._done = 0
        self._emit = emit
        self._last = self._clock()
        self._printed = False

    def _text(self) -> str:
        if self._total:
            pct = 100.0 * min(self._done, self._total) / self._total
            return f"{self._label}: {human_bytes(self._done)} / {human_bytes(self._total)} ({pct:.0f}%)"
        return f"{self._label}: {human_bytes(self._done)}"

    def _maybe(self) -> None:
        now = self._clock()
        if now - self._last >= self.EVERY_S:
            self._last = now
            self._printed = True
            self._emit(f"… {self._text()}")

    def advance(self, n: int) -> None:
        self._done += n
        self._maybe()

    def update(self, completed: int, total: Optional[int] = None) -> None:
        self._done = completed
        if total is not None:
            self._total = total
        self._maybe()

    def describe(self, text: str) -> None:
        self._label = text
        self._maybe()

    def finish(self) -> None:
        if self._printed:
            self._emit(f"… {self._text()}")


class _RichProgress:
    def __init__(self, prog: Any, task: Any) -> None:
        self._prog = prog
        self._task = task

    def advance(self, n: int) -> None:
        self._prog.advance(self._task, n)

    def update(self, completed: int, total: Optional[int] = None) -> None:
        self._prog.update(self._task, completed=completed, total=total)

    def describe(self, text: str) -> None:
        """Say what the bar is doing, or waiting for."""
        self._prog.update(self._task, description=_markup_safe(text))


def unexpected(out: Output, exc: BaseException) -> int:
    """Report a bug (an exception that is not an NpusnapError); returns the INTERNAL exit code,
    unless a full disk caused it (a library's own exception around ENOSPC): that is exit 3."""
    settled = settle_no_space(exc) or settle_permission(exc)
    if settled is not None:
        return out.error(settled)
    err = NpusnapError(
        f"internal error: {type(exc).__name__}: {exc}",
        why="this is a bug in npusnap",
        fix="rerun with -v for the traceback and report it",
    )
    out.error(err)
    return int(ExitCode.INTERNAL)
