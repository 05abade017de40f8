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
SIM_WAS_RUNNING=$(npusnap --json sim status |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["result"]["running"])')
runbook_cleanup() {
    local rc=$? f p
    cd /
    # The jobs the page started (their pid files, $PID): killed only if the pid still is one.
    for f in $(find "$RUNBOOK_DIR" -name '*.pid' 2>/dev/null); do
        p=$(cat "$f" 2>/dev/null) || continue
        if grep -qs npusnap_workloads "/proc/$p/cmdline"; then kill -9 "$p" 2>/dev/null || true; fi
    done
    p=${PID:-}
    if [ -n "$p" ] && grep -qs npusnap_workloads "/proc/$p/cmdline"; then
        kill -9 "$p" 2>/dev/null || true
    fi
    # Services the page started (pid files *.service.pid: a container runtime, a registry) and what
    # they left: the containers of a runtime whose state is in the scratch directory (processes in
    # a cgroup named after one of its tasks: they outlive their shims), runtime shims (their
    # command line names the scratch directory), then mounts under it.
    tasks=$(find "$RUNBOOK_DIR" -path '*/*.runtime.v2.task/*/*' -prune -printf '%f\n' 2>/dev/null)
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
    for m in $(awk -v d="$RUNBOOK_DIR/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r); do
        umount -l "$m" 2>/dev/null || true
    done
    # A network namespace the page made ($NETNS), if the page stopped before deleting it.
    if [ -n "${NETNS:-}" ] && [ -e "/run/netns/$NETNS" ]; then ip netns del "$NETNS" 2>/dev/null || true; fi
    if [ "$SIM_WAS_RUNNING" = False ]; then npusnap sim stop >/dev/null 2>&1 || true; fi
    # Simulators the page started for other users, with their sockets in the scratch directory.
    for f in $(find "$RUNBOOK_DIR" -name npusim.sock 2>/dev/null); do
        NPUSIM_SOCKET=$f npusnap sim stop >/dev/null 2>&1 || true
    done
    rm -rf "$RUNBOOK_DIR"
    if [ $rc -ne 0 ]; then echo "FAILED (exit $rc)" >&2; fi
    exit $rc
}
trap runbook_cleanup EXIT
trap 'exit 130' INT TERM
cd "$RUNBOOK_DIR"

# --- block 1 ---
export NPUSIM_SOCKET=$PWD/sim/npusim.sock   # a simulator of this page's own (shared hosts)
npusnap sim start
eval "$(npusnap sim env)"
: >faults
NPUSIM_FAULT_FILE=$PWD/faults setsid sh -c \
    'npusnap run -- python3 -m npusnap_workloads.train --steps 1000 --interval 0.05 >>job.log 2>&1 & echo $! >job.pid; wait' \
    </dev/null >/dev/null 2>&1 &
timeout 10 sh -c 'until [ -s job.pid ]; do sleep 0.1; done'
PID=$(cat job.pid)
timeout 20 sh -c 'until grep -q "^step 3 " job.log; do sleep 0.1; done'

# --- block 2 ---
npusnap status "$PID" | grep RUNNING
N=$(grep -c '^step ' job.log); timeout 20 sh -c "until [ \$(grep -c '^step ' job.log) -ge $((N + 2)) ]; do sleep 0.1; done"

# --- block 3 ---
rc=0; npusnap --json dump "$PID" img >dump.json || rc=$?
python3 -c 'import json; e = json.load(open("dump.json"))["error"]; print(e["kind"], "-", e["message"]); print("  fix:", e["fix"])'
[ "$rc" -eq 3 ]
grep -c -- --shell-job dump.json
[ ! -e img ]
npusnap status "$PID" | grep RUNNING

# --- block 4 ---
echo NPUSIM_FAULT_BACKUP=1 >faults
rc=0; npusnap --json dump --shell-job "$PID" img >dump.json || rc=$?
python3 -c 'import json; e = json.load(open("dump.json"))["error"]; print(e["kind"], "-", e["message"]); print("  ACL code:", e["details"]["agent_error"]["code"])'
[ "$rc" -eq 7 ]
: >faults
npusnap status "$PID" | grep RUNNING
N=$(grep -c '^step ' job.log); timeout 20 sh -c "until [ \$(grep -c '^step ' job.log) -ge $((N + 2)) ]; do sleep 0.1; done"

# --- block 5 ---
echo NPUSIM_FAULT_UNLOCK=1 >faults
rc=0; npusnap --json dump --shell-job --leave-running "$PID" img >dump.json || rc=$?
python3 -c 'import json; e = json.load(open("dump.json"))["error"]; print(e["kind"], "-", e["message"]); print("  fix:", e["fix"])'
[ "$rc" -eq 9 ]
grep -c "npusnap thaw $PID" dump.json
npusnap status "$PID" | grep -E 'LOCKED|BACKED_UP'

# --- block 6 ---
: >faults
npusnap thaw "$PID"
npusnap status "$PID" | grep RUNNING
N=$(grep -c '^step ' job.log); timeout 20 sh -c "until [ \$(grep -c '^step ' job.log) -ge $((N + 2)) ]; do sleep 0.1; done"

# --- block 7 ---
IMG=$(npusnap dump --shell-job --leave-running "$PID" img)
npusnap verify "$IMG"
npusnap status "$PID" | grep RUNNING

echo OK
