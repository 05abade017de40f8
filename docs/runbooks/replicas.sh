#!/usr/bin/env bash
# Runbook: Replicas: one image restored many times, beside its original, on another node (replicas.md).
#
# GENERATED from replicas.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap replicas.sh
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
mkdir -m 700 sim nodeA nodeB
export NPUSIM_SOCKET=$PWD/sim/npusim.sock
npusnap sim start --devices 4 --capacity 512MiB
eval "$(npusnap sim env)"
# The same job uninterrupted, for comparison: its output depends only on --steps and --seed.
# (200 steps of 0.05 s: the copies still run when they are looked at below.)
python3 -m npusnap_workloads.train --steps 200 --seed 5 --interval 0 >reference.log
PID=$(npusnap run --pid-ns --detach --pidfile job.pid --output job.log -- \
    python3 -m npusnap_workloads.train --steps 200 --seed 5 --interval 0.05)
grep NSpid "/proc/$PID/status"     # host pid, then 1: init of its own namespace
timeout 20 sh -c 'until grep -q "^step 5 " job.log; do sleep 0.1; done'
npusnap status "$PID"

# --- block 2 ---
npusnap dump "$PID" nodeA/img --leave-running
npusnap inspect nodeA/img
ARCHIVE=$(npusnap export nodeA/img nodeA/img.tar.zst)
cp "$ARCHIVE" nodeB/
npusnap import nodeB/img.tar.zst nodeB/img

# --- block 3 ---
NETNS=npusnap-nodeB-$$
ip netns add "$NETNS"
nsenter --net="/run/netns/$NETNS" npusnap restore nodeB/img --replicas 3 \
    --device-map 0=1 --device-map 0=2 --device-map 0=3 --pidfile 'replica-{n}.pid'
R0=$(cat replica-0.pid); R1=$(cat replica-1.pid); R2=$(cat replica-2.pid)
grep NSpid "/proc/$R0/status" "/proc/$R1/status" "/proc/$R2/status"
[ "$(stat -L -c %i "/proc/$R0/ns/net")" = "$(stat -L -c %i "/run/netns/$NETNS")" ]
npusnap status "$R1"
npusnap --json sim status | python3 -c '
import json, sys
st = json.load(sys.stdin)["result"]
print({d["id"]: ([o["pid"] for o in d["owners"]], d["used"]) for d in st["devices"]})
print({o["pid"]: o["visible_devices"] for o in st["owners"]})'
# Each copy is in a container of the simulated NPU: its device nodes are its device's only, so
# its device 0 (the id it uses, and keeps) is device 1, 2 or 3; the host still sees all four.
ls "/proc/$R0/root$NPUSIM_SOCKET.dev" "/proc/$R2/root$NPUSIM_SOCKET.dev" "$NPUSIM_SOCKET.dev"
[ "$(ls "/proc/$R1/root$NPUSIM_SOCKET.dev")" = davinci2 ]

# --- block 4 ---
for p in "$PID" "$R0" "$R1" "$R2"; do timeout 60 sh -c "while [ -e /proc/$p ]; do sleep 0.1; done"; done
grep '^step' job.log | cmp - reference.log
for n in 0 1 2; do
    N=$(grep -c '^step' "job.log.replica-$n")
    grep '^step' "job.log.replica-$n" | cmp - <(tail -n "$N" reference.log)
done
ip netns del "$NETNS"

# --- block 5 ---
PID2=$(npusnap run --detach --pidfile job2.pid --output job2.log -- \
    python3 -m npusnap_workloads.train --steps 400 --interval 0.05)
timeout 20 sh -c 'until grep -q "^step 3 " job2.log; do sleep 0.1; done'
npusnap dump "$PID2" nodeA/img2 --leave-running
rc=0; npusnap restore nodeA/img2 --replicas 2 --device-map 0=1 --device-map 0=2 || rc=$?
[ "$rc" -eq 2 ]
kill "$PID2"
npusnap sim stop

echo OK
