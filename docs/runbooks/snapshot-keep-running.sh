#!/usr/bin/env bash
# Runbook: Snapshot a job and keep it running (snapshot-keep-running.md).
#
# GENERATED from snapshot-keep-running.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap snapshot-keep-running.sh
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

# --- block 2 ---
TORCH_NPU_PYTHON=$(python3 -c 'from npusnap_cli import paths; print(paths.build_dir() / "torch-npu/bin/python")')
JOB=$(python3 -c 'from npusnap_workloads import script_path; print(script_path("torch_npu_block"))')
PID=$(npusnap run --detach --pidfile job.pid --output job.log -- \
    "$TORCH_NPU_PYTHON" "$JOB" --steps 1000 --interval 0.05)
echo "job pid $PID"
timeout 120 sh -c 'until grep -q "^step 5 " job.log; do sleep 0.1; done'
npusnap status "$PID" | grep RUNNING

# --- block 3 ---
IMG=$(npusnap dump --leave-running "$PID" ./img)
echo "image: $IMG"

# --- block 4 ---
AT_DUMP=$(awk '$1 == "step" { n = $2 } END { print n }' job.log)
timeout 20 sh -c "until grep -q '^step $((AT_DUMP + 5)) ' job.log; do sleep 0.1; done"
npusnap status "$PID" | grep RUNNING

# --- block 5 ---
npusnap verify "$IMG"
stat -c '%a %n' "$IMG" | grep '^700 '
npusnap inspect "$IMG"

# --- block 6 ---
rc=0; npusnap restore "$IMG" || rc=$?
echo "restore exited $rc"
[ "$rc" -eq 11 ]

# --- block 7 ---
kill -9 "$PID"
timeout 10 sh -c "while [ -e /proc/$PID ]; do sleep 0.1; done"
BEFORE=$(wc -l <job.log)
PID=$(npusnap restore --pidfile job.pid "$IMG")
echo "restored pid $PID"
timeout 20 sh -c "until [ \$(wc -l <job.log) -ge $((BEFORE + 5)) ]; do sleep 0.1; done"

# --- block 8 ---
FIRST=$(tail -n +$((BEFORE + 1)) job.log | awk '$1 == "step" { print $2; exit }')
grep "^step $FIRST " job.log
[ "$(grep -c "^step $FIRST " job.log)" -eq 2 ]
[ "$(grep "^step $FIRST " job.log | sort -u | wc -l)" -eq 1 ]

echo OK
