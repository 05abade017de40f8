#!/usr/bin/env bash
# Runbook: Recover from a failed dump (recover-failed-dump.md).
#
# GENERATED from recover-failed-dump.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap recover-failed-dump.sh
#
# NPUSNAP: the npusnap to use (its directory goes first on PATH, so `python3` is its Python too).
set -euo pipefail
if [ -n "${NPUSNAP:-}" ]; then
    case $NPUSNAP in
    */*) PATH=$(cd "$(dirname "$NPUSNAP")" && pwd):$PATH ;;
    esac
fi
RUNBOOK_DIR=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
SIM_WAS_RUNNING=$(npusnap --json sim status | python3 -c 'import json,sys; print(json.load(sys.stdin)["result"]["running"])')
runbook_cleanup() {
    local rc=$? f p
    cd /
    # The jobs the page started (their pid files, $PID): killed only if the pid still is one.
    for f in "$RUNBOOK_DIR"/*.pid "$RUNBOOK_DIR"/*/*.pid; do
        p=$(cat "$f" 2>/dev/null) || continue
        if grep -qs npusnap_cli.workloads "/proc/$p/cmdline"; then kill -9 "$p" 2>/dev/null || true; fi
    done
    p=${PID:-}
    if [ -n "$p" ] && grep -qs npusnap_cli.workloads "/proc/$p/cmdline"; then kill -9 "$p" 2>/dev/null || true; fi
    if [ "$SIM_WAS_RUNNING" = False ]; then npusnap sim stop >/dev/null 2>&1 || true; fi
    rm -rf "$RUNBOOK_DIR"
    if [ $rc -ne 0 ]; then echo "FAILED (exit $rc)" >&2; fi
    exit $rc
}
trap runbook_cleanup EXIT
trap 'exit 130' INT TERM
cd "$RUNBOOK_DIR"

# --- block 1 ---
dump_expect 3 "$JOB" "$WORK/img"

# --- block 2 ---
echo NPUSIM_FAULT_BACKUP=1 >faults
dump_expect 7 --shell-job "$JOB" "$WORK/img"

# --- block 3 ---
echo NPUSIM_FAULT_UNLOCK=1 >faults
dump_expect 9 --shell-job --leave-running "$JOB" "$WORK/img"

# --- block 4 ---
: >faults
npj thaw.json thaw "$JOB"

# --- block 5 ---
npj ok.json dump --shell-job --leave-running "$JOB" "$WORK/img"

echo OK
