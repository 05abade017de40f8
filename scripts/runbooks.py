#!/usr/bin/env python3
"""Write each runbook's script from its page: docs/runbooks/NAME.sh runs NAME.md's bash blocks.

The pages are what operators paste into an interactive shell, so the pages are what is tested:
every ```bash block of a page, in order, is the body of its script, after a fixed prologue
(a scratch directory, cleanup of the jobs the page started, `set -euo pipefail` so that a check
that does not hold stops the run). CI runs the scripts (tests/integration/test_runbooks.py) and
checks that they are up to date with the pages (tests/unit/test_runbook_pages.py).

    scripts/runbooks.py          rewrite the scripts
    scripts/runbooks.py --check  exit 1 if a script differs from its page
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

RUNBOOKS = Path(__file__).resolve().parent.parent / "docs" / "runbooks"
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)

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
        if grep -qs npusnap_cli.workloads "/proc/$p/cmdline"; then kill -9 "$p" 2>/dev/null || true; fi
    done
    p=${{PID:-}}
    if [ -n "$p" ] && grep -qs npusnap_cli.workloads "/proc/$p/cmdline"; then
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
    blocks = FENCE.findall(text)
    body = "\n".join(f"# --- block {i} ---\n{block}" for i, block in enumerate(blocks, 1))
    prologue = PROLOGUE.format(title=title, page=page.name, script=page.with_suffix(".sh").name)
    return prologue + "\n" + body + "\necho OK\n"


# Pages whose scripts are written by hand: they first build a container image from this host's
# files (the simulated CANN, the agent library), which a page pasted into a shell leaves to the
# operator's own image build. Their scripts are still run by the tests.
HAND_WRITTEN = frozenset({"podman.md"})


def pages() -> list[Path]:
    return sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md" and p.name not in HAND_WRITTEN)


def main(argv: list[str]) -> int:
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
