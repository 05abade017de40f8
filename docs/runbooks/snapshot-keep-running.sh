#!/usr/bin/env bash
# Runbook: snapshot a job and keep it running (docs/runbooks/snapshot-keep-running.md).
#
# Self-contained against the simulated NPU: starts it if needed, launches a sample training job
# with an agent, snapshots it with `npusnap dump --leave-running`, checks that the job never
# stopped computing and that the image is sound, then shows the snapshot is usable: after the
# job dies, `npusnap restore` brings it back at the snapshot point. Cleans up after itself.
#
# Environment: NPUSNAP (default: npusnap), PYTHON (default: python3), WORKLOADS (the directory of
# the sample workloads; default: the repository's npusnap_cli/workloads).
set -euo pipefail

NPUSNAP=${NPUSNAP:-npusnap}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORKLOADS=${WORKLOADS:-$HERE/../../npusnap_cli/workloads}
# A relative NPUSNAP (e.g. .venv/bin/npusnap) must keep working after we cd elsewhere.
case $NPUSNAP in */*) NPUSNAP=$(cd "$(dirname "$NPUSNAP")" && pwd)/$(basename "$NPUSNAP") ;; esac

WORK=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
JOB=""
SIM_STARTED=False
cleanup() {
    local rc=$?
    # Kill the job we started, but only if that pid still is our job (pids get reused).
    if [ -n "$JOB" ] && grep -qs train.py "/proc/$JOB/cmdline"; then kill -9 "$JOB" 2>/dev/null || true; fi
    if [ "$SIM_STARTED" = True ]; then "$NPUSNAP" sim stop >/dev/null 2>&1 || true; fi
    rm -rf "$WORK"
    if [ $rc -ne 0 ]; then echo "FAILED (exit $rc)" >&2; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }
# json FILE EXPR: evaluate a Python expression over the JSON document `d` read from FILE.
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
wait_step() { # wait_step LOG N: until LOG shows step N (10 s at most)
    for _ in $(seq 100); do [ "$(last_step "$1")" -ge "$2" ] && return 0; sleep 0.1; done
    fail "$1 did not reach step $2 (last: $(last_step "$1"))"
}

cd "$WORK"

# 1. The simulated NPU (idempotent) and its environment, as `source set_env.sh` on real hardware.
npj sim.json sim start
SIM_STARTED=$(json sim.json 'd["result"]["started"]')
eval "$("$NPUSNAP" sim env)"

# 2. The job: started with an agent (`npusnap run`), detached from this shell (setsid), output
#    appended (>>) to files: the original keeps writing after the snapshot, and CRIU accepts a
#    file whose size changed only if it was opened for appending.
setsid "$NPUSNAP" run -- "$PYTHON" "$WORKLOADS/train.py" --steps 1000 --interval 0.05 \
    </dev/null >>job.log 2>>job.err &
JOB=$!
wait_step job.log 5
npj status.json status "$JOB"
[ "$(json status.json 'd["result"]["processes"][0]["status"]["state"]')" = RUNNING ] || fail "job is not RUNNING"

# 3. The snapshot. The job is frozen only for the lock + backup + CRIU dump, then unlocked.
npj dump.json dump --leave-running "$JOB" "$WORK/img"
echo "dumped pid $JOB, frozen for $(json dump.json 'd["result"]["timings"]["frozen_s"]') s," \
    "image $(json dump.json 'd["result"]["bytes"]["image_bytes"]') bytes"
[ "$(json dump.json 'd["result"]["leave_running"]')" = True ] || fail "dump did not leave the job running"

# 4. The job carries on: alive, RUNNING, and its step counter keeps increasing.
kill -0 "$JOB" || fail "the job is gone after --leave-running"
AT_DUMP=$(last_step job.log)
wait_step job.log $((AT_DUMP + 5))
npj status.json status "$JOB"
[ "$(json status.json 'd["result"]["processes"][0]["status"]["state"]')" = RUNNING ] || fail "job not RUNNING"

# 5. The image is complete and private.
"$NPUSNAP" verify "$WORK/img"
[ "$(stat -c %a "$WORK/img")" = 700 ] || fail "image directory is not 0700"
"$NPUSNAP" inspect "$WORK/img"

# 6. While the original runs, its pids are taken: restore refuses before touching anything (exit 3).
set +e
"$NPUSNAP" restore --json "$WORK/img" >refused.json
rc=$?
set -e
[ $rc -eq 3 ] || fail "restore next to the running original exited $rc, expected 3"
echo "restore refused while the original runs: $(json refused.json 'd["error"]["message"]')"

# 7. Later the job dies (node fault, OOM, preemption). Restore brings it back at the snapshot.
kill -9 "$JOB"
wait "$JOB" 2>/dev/null || true # reap it: CRIU needs the pid free, not a zombie
BEFORE=$(wc -l <job.log)
npj restore.json restore "$WORK/img"
[ "$(json restore.json 'd["result"]["root_pid"]')" = "$JOB" ] || fail "restored under another pid"
for _ in $(seq 100); do [ "$(wc -l <job.log)" -ge $((BEFORE + 5)) ] && break; sleep 0.1; done
# The restored job repeats the steps it had done after the snapshot, with identical output
# (same loss, same checksum of the device-resident parameters), then carries on.
FIRST=$(tail -n +$((BEFORE + 1)) job.log | awk '$1 == "step" { print $2; exit }')
[ -n "$FIRST" ] && [ "$FIRST" -le "$((AT_DUMP + 1))" ] || fail "restored job did not resume at the snapshot"
ORIGINAL=$(head -n "$BEFORE" job.log | awk -v s="$FIRST" '$1 == "step" && $2 == s')
RESTORED=$(tail -n +$((BEFORE + 1)) job.log | awk -v s="$FIRST" '$1 == "step" && $2 == s')
[ "$ORIGINAL" = "$RESTORED" ] || fail "step $FIRST differs: original '$ORIGINAL', restored '$RESTORED'"
echo "restored pid $JOB resumed at step $FIRST with identical output: $RESTORED"
echo "OK"
