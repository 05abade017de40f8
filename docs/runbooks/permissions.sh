#!/usr/bin/env bash
# Runbook: Permissions and running as non-root (permissions.md).
#
# GENERATED from permissions.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap permissions.sh
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
expect 3 user-dump.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" dump "$JOB" "$UHOME/img" --json

# --- block 2 ---
expect 0 status.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" status "$JOB" --json
expect 0 freeze.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" freeze --no-backup "$JOB" --json
expect 0 thaw.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" thaw "$JOB" --json

# --- block 3 ---
SOCK=$UHOME/npusnap/$JOB.sock # $XDG_RUNTIME_DIR/npusnap/PID.sock
[ "$(stat -c %a "$UHOME/npusnap")" = 700 ] || fail "socket directory is not 0700"
[ "$(stat -c %a "$SOCK")" = 600 ] || fail "socket is not 0600"

# --- block 4 ---
grep -q PermissionError other.err || fail "uid $OTHER_UID: unexpected failure: $(cat other.err)"

# --- block 5 ---
expect 4 other-attach.json setpriv --reuid "$OTHER_UID" --regid "$OTHER_UID" --clear-groups -- \
    env -i PATH=/usr/bin:/bin PYTHONPATH="$NPUSNAP_PYTHONPATH" "${USER_NPUSNAP[@]}" attach "$JOB" --json

echo OK
