#!/usr/bin/env bash
# Runbook: recover from a failed dump (docs/runbooks/recover-failed-dump.md).
#
# Self-contained against the simulated NPU. One job, three failed dumps, each read the way an
# operator (or a script) should read it, each followed by proof that the job is running, then a
# dump that succeeds:
#   1. Preflight refuses (exit 3) before touching the job: it shares its launcher's session, which
#      CRIU dumps only as a shell job; the fix names --shell-job.
#   2. A CANN snapshot call fails (exit 7): Backup returns 507908 (simulator fault switch).
#   3. The rollback itself fails (exit 9, state unknown): Unlock returns 507907; the job stays
#      locked until `npusnap thaw PID`, which the error tells you to run.
#
# Environment: NPUSNAP (default: npusnap), PYTHON (default: python3), WORKLOADS (the directory of
# the sample workloads; default: the repository's npusnap_cli/workloads).
set -euo pipefail

NPUSNAP=${NPUSNAP:-npusnap}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORKLOADS=${WORKLOADS:-$HERE/../../npusnap_cli/workloads}
case $NPUSNAP in */*) NPUSNAP=$(cd "$(dirname "$NPUSNAP")" && pwd)/$(basename "$NPUSNAP") ;; esac

WORK=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
# npusnap keeps the CRIU logs of failed dumps in $TMPDIR/npusnap-dump-logs-*/: these go away with $WORK.
export TMPDIR=$WORK
JOB=""
SIM_STARTED=False
cleanup() {
    local rc=$?
    if [ -n "$JOB" ] && grep -qs train.py "/proc/$JOB/cmdline"; then kill -9 "$JOB" 2>/dev/null || true; fi
    if [ "$SIM_STARTED" = True ]; then "$NPUSNAP" sim stop >/dev/null 2>&1 || true; fi
    rm -rf "$WORK"
    if [ $rc -ne 0 ]; then echo "FAILED (exit $rc)" >&2; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }
json() { "$PYTHON" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"; }
# npj FILE ARGS...: `npusnap ARGS --json` into FILE; on failure show the error and its fix, and fail.
npj() {
    local out=$1 rc=0
    shift
    "$NPUSNAP" "$@" --json >"$out" || rc=$?
    if [ $rc -ne 0 ]; then
        json "$out" '"%s\n  why: %s\n  fix: %s" % (d["error"]["message"], d["error"]["why"], d["error"]["fix"])' >&2 || true
        fail "npusnap $* exited $rc"
    fi
}
last_step() { awk '$1 == "step" { n = $2 } END { print n + 0 }' "$1"; }
wait_step() {
    for _ in $(seq 100); do [ "$(last_step "$1")" -ge "$2" ] && return 0; sleep 0.1; done
    fail "$1 did not reach step $2 (last: $(last_step "$1"))"
}
state() { npj status.json status "$JOB" && json status.json 'd["result"]["processes"][0]["status"]["state"]'; }
# running: the job is alive, RUNNING, and computes (its step counter moves on).
running() {
    kill -0 "$JOB" || fail "the job is gone"
    [ "$(state)" = RUNNING ] || fail "the job is $(state), not RUNNING"
    wait_step job.log $(($(last_step job.log) + 2))
}
# dump_expect CODE ARGS...: a dump that must exit CODE; its envelope is left in dump.json.
dump_expect() {
    local want=$1 rc=0
    shift
    "$NPUSNAP" dump --json "$@" >dump.json || rc=$?
    [ $rc -eq "$want" ] || fail "dump exited $rc, expected $want: $(cat dump.json)"
    echo "dump exited $rc ($(json dump.json 'd["error"]["kind"]')): $(json dump.json 'd["error"]["message"]')"
    echo "  fix: $(json dump.json 'd["error"]["fix"]')"
    [ ! -e "$WORK/img" ] || fail "a failed dump left $WORK/img behind"
}

cd "$WORK"
npj sim.json sim start
SIM_STARTED=$(json sim.json 'd["result"]["started"]')
eval "$("$NPUSNAP" sim env)"

# The job. NPUSIM_FAULT_FILE lets this script make the simulated CANN calls fail on demand
# (KEY=VALUE lines, re-read at every snapshot call; see docs/reference/sim.md). The job is not a
# session leader: like a job started from an interactive shell or by a launcher script, it shares
# the session of its launcher (here a small `sh`, which owns a new session so that this works the
# same wherever the runbook itself was started).
: >faults
NPUSIM_FAULT_FILE=$WORK/faults setsid sh -c '"$@" & echo $! >job.pid; wait' sh \
    "$NPUSNAP" run -- "$PYTHON" "$WORKLOADS/train.py" --steps 1000 --interval 0.05 </dev/null >>job.log 2>>job.err &
for _ in $(seq 100); do [ -s job.pid ] && break; sleep 0.05; done
JOB=$(cat job.pid)
wait_step job.log 3

# 1. Preflight refuses: exit 3, before anything was locked (CRIU would have refused this tree
#    without --shell-job). The job never stopped; the fix names the option.
dump_expect 3 "$JOB" "$WORK/img"
json dump.json 'd["error"]["fix"]' | grep -q -- --shell-job || fail "the fix does not name --shell-job"
running

# 2. A device call fails: exit 7, with the ACL code in details.agent_error; rolled back.
echo NPUSIM_FAULT_BACKUP=1 >faults
dump_expect 7 --shell-job "$JOB" "$WORK/img"
[ "$(json dump.json 'd["error"]["details"]["agent_error"]["code"]')" = 507908 ] || fail "expected ACL 507908"
: >faults
running

# 3. The rollback fails: exit 9. Unlock fails, so the job cannot be unlocked: it is stuck
#    (frozen, BACKED_UP), and the error lists the commands to run. The image was removed.
echo NPUSIM_FAULT_UNLOCK=1 >faults
dump_expect 9 --shell-job --leave-running "$JOB" "$WORK/img"
json dump.json 'd["error"]["fix"]' | grep -q "npusnap thaw $JOB" || fail "the fix does not say npusnap thaw"
STUCK=$(state)
case $STUCK in LOCKED | BACKED_UP) echo "job is $STUCK: its device calls block" ;; *) fail "job is $STUCK" ;; esac
AT=$(last_step job.log)
sleep 0.5
[ "$(last_step job.log)" -le $((AT + 1)) ] || fail "a locked job kept computing"
# What a person does: find out why Unlock failed (here: the fault switch), fix it, then thaw.
: >faults
npj thaw.json thaw "$JOB"
echo "thaw: $(json thaw.json 'd["result"]')"
running

# After the cause is fixed, the same dump succeeds.
npj ok.json dump --shell-job --leave-running "$JOB" "$WORK/img"
"$NPUSNAP" verify "$WORK/img"
running
echo "OK"
