#!/usr/bin/env python3
"""Write each runbook's script from its page: docs/runbooks/NAME.sh runs NAME.md's bash blocks.

The pages are what operators paste into an interactive shell, so the pages are what is tested:
every ```bash block of a page, in order, is the body of its script, after a fixed prologue
(a scratch directory, cleanup of the jobs the page started, `set -euo pipefail` so that a check
that does not hold stops the run). CI runs the scripts (tests/integration/test_runbooks.py) and
checks that they are up to date with the pages (tests/integration/test_runbooks.py, unit part).

Blocks are found by a CommonMark parser (markdown-it-py), as a renderer finds them: a fence a
regular expression would close but CommonMark does not (text after the closing backticks) is
caught by tests/unit/test_docs.py instead of running prose as shell. A block that cannot run on a
test machine (it needs a Kubernetes cluster, a git clone) is preceded by the HTML comment
``<!-- not run in CI: REASON -->``; it is still parsed with `bash -n`.

    scripts/runbooks.py                 rewrite the scripts
    scripts/runbooks.py --check         exit 1 if a script differs from its page
    scripts/runbooks.py --block PAGE N  print the Nth runnable bash block of PAGE (1-based): the
                                        hand-written script (podman.sh) runs
                                        its page's blocks through this
    scripts/runbooks.py --count PAGE    how many runnable bash blocks PAGE has
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DOCS = Path(__file__).resolve().parent.parent / "docs"
RUNBOOKS = DOCS / "runbooks"
SHELLS = frozenset({"bash", "sh", "shell"})
NOT_RUN = re.compile(r"<!--\s*not run in CI:\s*(.+?)\s*-->", re.S)


@dataclass(frozen=True)
class Block:
    """One fenced block of a page, as a CommonMark renderer sees it."""

    lang: str  # the info string's first word ("" if none)
    content: str
    line: int  # 1-based line of the opening fence
    not_run: Optional[str]  # the reason, for a shell block marked <!-- not run in CI: ... -->

    @property
    def runnable(self) -> bool:
        return self.lang in SHELLS and self.not_run is None


def blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, in order."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(text)
    found = []
    for i, tok in enumerate(tokens):
        if tok.type != "fence":
            continue
        prev = tokens[i - 1] if i > 0 else None
        marked = NOT_RUN.search(prev.content) if prev is not None and prev.type == "html_block" else None
        found.append(
            Block(
                lang=(tok.info.split() or [""])[0],
                content=tok.content,
                line=(tok.map[0] + 1) if tok.map else 0,
                not_run=marked.group(1) if marked else None,
            )
        )
    return found


def runnable_blocks(page: Path) -> list[str]:
    return [b.content for b in blocks(page.read_text()) if b.runnable]


PROLOGUE = """#!/usr/bin/env bash
# Runbook: {title} ({page}).
#
# GENERATED from {page} by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap {script}
#
# NPUSNAP: the npusnap to use (its directory goes first on PATH, so `python3` is its Python too).
set -euo pipefail
if [ -n "${{NPUSNAP:-}}" ]; then
    case $NPUSNAP in
    */*) PATH=$(cd "$(dirname "$NPUSNAP")" && pwd):$PATH ;;
    esac
fi
RUNBOOK_DIR=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
SIM_WAS_RUNNING=$(npusnap --json sim status |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["result"]["running"])')
runbook_cleanup() {{
    local rc=$? f p
    cd /
    # The jobs the page started (their pid files, $PID): killed only if the pid still is one.
    for f in $(find "$RUNBOOK_DIR" -name '*.pid' 2>/dev/null); do
        p=$(cat "$f" 2>/dev/null) || continue
        if grep -qs npusnap_workloads "/proc/$p/cmdline"; then kill -9 "$p" 2>/dev/null || true; fi
    done
    p=${{PID:-}}
    if [ -n "$p" ] && grep -qs npusnap_workloads "/proc/$p/cmdline"; then
        kill -9 "$p" 2>/dev/null || true
    fi
    # Services the page started (pid files *.service.pid: a container runtime, a registry) and what
    # they left: the containers of a runtime whose state is in the scratch directory (processes in
    # a cgroup named after one of its tasks: they outlive their shims), runtime shims (their
    # command line names the scratch directory), then mounts under it.
    tasks=$(find "$RUNBOOK_DIR" -path '*/*.runtime.v2.task/*/*' -prune -printf '%f\\n' 2>/dev/null)
    for id in $tasks; do
        for p in $(grep -lsF -- "$id" /proc/[0-9]*/cgroup | cut -d/ -f3); do
            kill -9 "$p" 2>/dev/null || true
        done
    done
    for f in $(find "$RUNBOOK_DIR" -name '*.service.pid' 2>/dev/null); do
        p=$(cat "$f" 2>/dev/null) || continue
        kill "$p" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    done
    for p in $(ls /proc | grep -E '^[0-9]+$'); do
        if grep -qsaF -- "$RUNBOOK_DIR/" "/proc/$p/cmdline"; then kill -9 "$p" 2>/dev/null || true; fi
    done
    for m in $(awk -v d="$RUNBOOK_DIR/" 'index($2, d) == 1 {{ print $2 }}' /proc/self/mounts | sort -r); do
        umount -l "$m" 2>/dev/null || true
    done
    # A network namespace the page made ($NETNS), if the page stopped before deleting it.
    if [ -n "${{NETNS:-}}" ] && [ -e "/run/netns/$NETNS" ]; then ip netns del "$NETNS" 2>/dev/null || true; fi
    if [ "$SIM_WAS_RUNNING" = False ]; then npusnap sim stop >/dev/null 2>&1 || true; fi
    # Simulators the page started for other users, with their sockets in the scratch directory.
    for f in $(find "$RUNBOOK_DIR" -name npusim.sock 2>/dev/null); do
        NPUSIM_SOCKET=$f npusnap sim stop >/dev/null 2>&1 || true
    done
    rm -rf "$RUNBOOK_DIR"
    if [ $rc -ne 0 ]; then echo "FAILED (exit $rc)" >&2; fi
    exit $rc
}}
trap runbook_cleanup EXIT
trap 'exit 130' INT TERM
cd "$RUNBOOK_DIR"
"""


def render(page: Path) -> str:
    text = page.read_text()
    title = text.splitlines()[0].lstrip("# ").strip()
    found = runnable_blocks(page)
    body = "\n".join(f"# --- block {i} ---\n{block}" for i, block in enumerate(found, 1))
    prologue = PROLOGUE.format(title=title, page=page.name, script=page.with_suffix(".sh").name)
    return prologue + "\n" + body + "\necho OK\n"


# Pages whose scripts are written by hand: they first build a container image from this host's
# files (the simulated CANN, the agent library), which a page pasted into a shell leaves to the
# operator's own image build. Their scripts are still run by the tests.
HAND_WRITTEN = frozenset({"podman.md"})


def pages() -> list[Path]:
    return sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md" and p.name not in HAND_WRITTEN)


def doc_pages() -> list[Path]:
    """Pages outside docs/runbooks/ whose shell blocks run: their scripts are rendered at test
    time (tests/integration/test_runbooks.py), not kept in the tree."""
    return sorted(
        p
        for p in DOCS.rglob("*.md")
        if RUNBOOKS not in p.parents and any(b.runnable for b in blocks(p.read_text()))
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--count"] and len(argv) == 2:
        print(len(runnable_blocks(Path(argv[1]))))
        return 0
    if argv[:1] == ["--block"] and len(argv) == 3:
        page = Path(argv[1])
        if not page.is_absolute() and not page.exists():
            page = RUNBOOKS / page
        found = runnable_blocks(page)
        n = int(argv[2])
        if not 1 <= n <= len(found):
            print(f"{page.name} has {len(found)} runnable bash block(s), not {n}", file=sys.stderr)
            return 2
        sys.stdout.write(found[n - 1])
        return 0
    check = "--check" in argv
    stale = []
    for page in pages():
        script = page.with_suffix(".sh")
        want = render(page)
        if script.exists() and script.read_text() == want:
            continue
        if check:
            stale.append(script.name)
        else:
            script.write_text(want)
            script.chmod(0o755)
            print(f"wrote {script}")
    if stale:
        print(f"out of date with their pages: {', '.join(stale)}; run scripts/runbooks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
