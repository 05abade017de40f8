#!/usr/bin/env bash
# Runbook: Use freeze/thaw with an external checkpoint tool (freeze-thaw-external.md).
#
# GENERATED from freeze-thaw-external.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap freeze-thaw-external.sh
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
python3 -m npusnap_workloads.train --steps 50 --seed 5 --interval 0 >reference.log
PID=$(npusnap run --detach --pidfile job.pid --output job.log -- \
    python3 -m npusnap_workloads.train --steps 50 --seed 5 --interval 0.05)
timeout 20 sh -c 'until grep -q "^step 5 " job.log; do sleep 0.1; done'
SOCKET=$(npusnap --json status "$PID" | python3 -c 'import json,sys; print(json.load(sys.stdin)["result"]["processes"][0]["agent_socket"])')
echo "agent socket: $SOCKET"

# --- block 2 ---
npusnap freeze --lease 120 "$PID"

# --- block 3 ---
npusnap status "$PID" | grep BACKED_UP
N=$(grep -c '^step ' job.log); sleep 0.5; [ "$(grep -c '^step ' job.log)" -le $((N + 1)) ]

# --- block 4 ---
mkdir -m 700 ckpt
PLUGINS=${NPUSNAP_CRIU_PLUGIN_DIR:-/usr/lib/npusnap/criu-plugins}  # npusnap's plugin directory
rc=0; criu dump -L "$PLUGINS" -t "$PID" -D ckpt -o dump.log -v4 || rc=$?  # kills the job when done, as podman does
[ "$rc" -eq 0 ] || { tail -n 5 ckpt/dump.log; npusnap thaw "$PID"; false; }
timeout 10 sh -c "while [ -e /proc/$PID ]; do sleep 0.1; done"

# --- block 5 ---
install -d -m 700 "$(dirname "$SOCKET")"
criu restore -L "$PLUGINS" -D ckpt -d -o restore.log -v4 --pidfile "$PWD/restored.pid"
PID=$(cat restored.pid)
echo "restored pid $PID"

# --- block 6 ---
npusnap status "$PID" | grep BACKED_UP | grep 's left'

# --- block 7 ---
npusnap thaw "$PID" | grep 'restore, unlock'
npusnap status "$PID" | grep RUNNING

# --- block 8 ---
timeout 30 sh -c "while [ -e /proc/$PID ]; do sleep 0.1; done"
grep '^step ' job.log | cmp - reference.log

echo OK
