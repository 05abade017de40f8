#!/usr/bin/env bash
# Runbook: Periodic snapshots, and restoring the newest good one after a crash (periodic-snapshots.md).
#
# GENERATED from periodic-snapshots.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap periodic-snapshots.sh
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
PID=$(npusnap run --detach --pidfile job.pid --output job.log -- \
    python3 -m npusnap_workloads.train --steps 1000 --interval 0.05)
timeout 20 sh -c 'until grep -q "^step 3 " job.log; do sleep 0.1; done'
mkdir -m 700 snaps

# --- block 2 ---
for round in 1 2 3 4 5; do
    rc=0
    npusnap dump --leave-running --keep-last 3 --latest "$PID" "snaps/$(date -u +%Y%m%dT%H%M%S.%NZ)" || rc=$?
    echo "round $round: dump exited $rc"
    sleep 1
done

# --- block 3 ---
npusnap list snaps
[ "$(npusnap list --valid --paths snaps | wc -l)" -eq 3 ]
readlink snaps/latest

# --- block 4 ---
kill -9 "$PID"
timeout 10 sh -c "while [ -e /proc/$PID ]; do sleep 0.1; done"

# --- block 5 ---
NEWEST=$(npusnap list --paths snaps | head -n 1)
PAGES=$(ls "$NEWEST"/criu/pages-*.img | head -n 1)
printf 'X' | dd of="$PAGES" bs=1 seek=100 conv=notrunc status=none
npusnap list --checksums snaps

# --- block 6 ---
IMG=$(npusnap list --checksums --valid --paths snaps | head -n 1)
echo "restoring $IMG"
BEFORE=$(wc -l <job.log)
[ "$IMG" != "$NEWEST" ]
rc=0; PID=$(npusnap restore --pidfile job.pid "$IMG") || rc=$?
echo "restore exited $rc, pid $PID"

# --- block 7 ---
[ "$rc" -eq 0 ]
npusnap status "$PID" | grep RUNNING
timeout 20 sh -c "until [ \$(wc -l <job.log) -ge $((BEFORE + 5)) ]; do sleep 0.1; done"
awk '$1 == "step"' job.log | sort | uniq -d | head -n 3
[ -n "$(awk '$1 == "step"' job.log | sort | uniq -d)" ]

# --- block 8 ---
ARCHIVE=$(npusnap export "$IMG" snapshot.tar.zst)
npusnap verify "$ARCHIVE"
npusnap import "$ARCHIVE" restored-img
npusnap inspect restored-img | grep -c npusnap_workloads.train

echo OK
