#!/usr/bin/env bash
# Runbook: use freeze/thaw with an external checkpoint tool (docs/runbooks/freeze-thaw-external.md).
#
# Self-contained against the simulated NPU. npusnap does only the device half; plain `criu`
# stands in for the external tool (runc, podman, a Kubernetes checkpoint, your own CRIU wrapper):
#   npusnap freeze PID  ->  criu dump  ->  (the job is gone)  ->  criu restore  ->  npusnap thaw PID
# The restored job's whole output must equal an uninterrupted run's.
#
# Environment: NPUSNAP (default: npusnap), PYTHON (default: python3), CRIU (default: criu on
# PATH, else /usr/local/sbin/criu), WORKLOADS (the directory of the sample workloads; default:
# the repository's npusnap_cli/workloads).
set -euo pipefail

NPUSNAP=${NPUSNAP:-npusnap}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORKLOADS=${WORKLOADS:-$HERE/../../npusnap_cli/workloads}
case $NPUSNAP in */*) NPUSNAP=$(cd "$(dirname "$NPUSNAP")" && pwd)/$(basename "$NPUSNAP") ;; esac

WORK=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
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

CRIU=${CRIU:-$(command -v criu || echo /usr/local/sbin/criu)}
cd "$WORK"
npj sim.json sim start
SIM_STARTED=$(json sim.json 'd["result"]["started"]')
eval "$("$NPUSNAP" sim env)"

ARGS=(--steps 50 --seed 5)
"$PYTHON" "$WORKLOADS/train.py" "${ARGS[@]}" --interval 0 >reference.log
setsid "$NPUSNAP" run -- "$PYTHON" "$WORKLOADS/train.py" "${ARGS[@]}" --interval 0.05 \
    </dev/null >job.log 2>job.err &
JOB=$!
wait_step job.log 5

# 1. Device half: Lock + Backup. The lease is the safety net: if nothing thaws the job within
#    600 s of *run time* it thaws itself (time frozen by CRIU does not count).
npj freeze.json freeze --lease 600 "$JOB"
[ "$(state)" = BACKED_UP ] || fail "freeze did not back up the job"
AT=$(last_step job.log)
sleep 0.3
[ "$(last_step job.log)" -le $((AT + 1)) ] || fail "a frozen job kept computing"

# 2. Host half, by the external tool. npusnap closed its connection to the agent, so the agent's
#    listening socket is all CRIU sees; Backup released the device connection.
mkdir -m 700 ckpt
"$CRIU" dump -t "$JOB" -D ckpt -o dump.log -v4 # kills the job when done, as podman does by default
wait "$JOB" 2>/dev/null || true
[ ! -e "/proc/$JOB" ] || fail "the job still exists after criu dump"

# (Here you would ship ckpt/ to another node, with the job's files: see restore-on-another-node.)

# 3. External restore. The agent socket's directory must exist first (CRIU re-binds the socket
#    but does not create its directory): `npusnap restore` does this itself, an external tool
#    does not. The path is in `npusnap status` / the freeze output; here it still exists.
SOCKET_DIR=$(dirname "$(json status.json 'd["result"]["processes"][0]["agent_socket"]')")
install -d -m 700 "$SOCKET_DIR"
"$CRIU" restore -D ckpt -d -o restore.log -v4 --pidfile "$WORK/restored.pid"
RESTORED=$(cat "$WORK/restored.pid")
[ "$RESTORED" = "$JOB" ] || fail "criu restored pid $RESTORED, expected $JOB"
# Restored but still BACKED_UP: the device state is not back yet and device calls block.
[ "$(state)" = BACKED_UP ] || fail "the restored job is $(state), expected BACKED_UP"

# 4. thaw: in a CRIU-restored process the agent runs Restore (device memory back on the same
#    device id, at the same addresses) before Unlock.
npj thaw.json thaw "$RESTORED"
[ "$(json thaw.json "d['result']['processes']['$RESTORED']['actions']")" = "['restore', 'unlock']" ] ||
    fail "thaw did not restore then unlock: $(cat thaw.json)"
[ "$(state)" = RUNNING ] || fail "the job is not RUNNING after thaw"
for _ in $(seq 200); do [ -e "/proc/$RESTORED" ] || break; sleep 0.05; done
[ ! -e "/proc/$RESTORED" ] || fail "the restored job did not finish in 10 s"
cmp job.log reference.log || fail "the restored job's output differs from the uninterrupted run"
echo "restored job ran to step $(last_step job.log); output identical to the uninterrupted run"
echo "OK"
