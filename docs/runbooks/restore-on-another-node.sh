#!/usr/bin/env bash
# Runbook: Restore on another node (restore-on-another-node.md).
#
# GENERATED from restore-on-another-node.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap restore-on-another-node.sh
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
FILES=$(for fd in /proc/"$JOB"/fd/*; do f=$(readlink "$fd"); if [ -f "$f" ]; then echo "$f"; fi; done | sort -u)
npj dump.json dump "$JOB" "$WORK/nodeA/img" # the job is gone afterwards
for f in $FILES; do stat -c '%s %n' "$f"; done >files-at-dump.txt

# --- block 2 ---
tar -C "$WORK/nodeA" -cpf - img | tar -C "$WORK/nodeB" -xpf -

# --- block 3 ---
"$NPUSNAP" verify "$IMG"
[ "$(stat -c %a "$IMG")" = 700 ] || fail "the copied image is not 0700 any more"

# --- block 4 ---
npj manifest.json inspect "$IMG"
npj check.json check # exit 3 with the reasons if this node cannot restore
[ "$IMG_CRIU" = "$HERE_CRIU" ] || fail "CRIU $IMG_CRIU in the image, $HERE_CRIU here"
[ "$IMG_CANN" = "$HERE_CANN" ] || fail "CANN $IMG_CANN in the image, $HERE_CANN here"
[ ! -e "/proc/$pid" ] || fail "pid $pid is in use on this node: $(tr '\0' ' ' </proc/"$pid"/cmdline)"
npj sim-status.json sim status
[ "$(stat -c %s "$path")" = "$size" ] || fail "$path: size $(stat -c %s "$path"), the image expects $size"

# --- block 5 ---
npj restore.json restore --pidfile "$WORK/restored.pid" "$IMG"

# --- block 6 ---
cmp job.log reference.log || fail "the restored job's output differs from the uninterrupted run"

echo OK
