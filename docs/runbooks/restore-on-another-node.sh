#!/usr/bin/env bash
# Runbook: restore on another node (docs/runbooks/restore-on-another-node.md).
#
# Self-contained against the simulated NPU. "Node A" and "node B" are two directories of this
# host: the job is dumped on A, the image is shipped to B with its permissions, B is checked
# (versions, image integrity, pids, devices, the job's files), and the job is restored from B's
# copy. The restored job's whole output must equal an uninterrupted run's. Also shows that a
# damaged copy is caught by `npusnap verify` (exit 8) before anything is started.
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

cd "$WORK"
mkdir -m 700 nodeA nodeB
npj sim.json sim start
SIM_STARTED=$(json sim.json 'd["result"]["started"]')
eval "$("$NPUSNAP" sim env)"

ARGS=(--steps 50 --seed 3)
# The reference: the same job, uninterrupted and without pauses (its output depends only on
# --steps, --seed and the parameter size, not on --interval).
"$PYTHON" "$WORKLOADS/train.py" "${ARGS[@]}" --interval 0 >reference.log

# --- on node A -----------------------------------------------------------------------------
setsid "$NPUSNAP" run -- "$PYTHON" "$WORKLOADS/train.py" "${ARGS[@]}" --interval 0.05 </dev/null >job.log 2>job.err &
JOB=$!
wait_step job.log 5
# The regular files the job has open: CRIU reopens them at restore, by path, and checks their
# size. On node B they must exist at the same paths with the same contents (shared filesystem,
# or copy them after the dump).
FILES=$(for fd in /proc/"$JOB"/fd/*; do f=$(readlink "$fd"); if [ -f "$f" ]; then echo "$f"; fi; done | sort -u)
npj dump.json dump "$JOB" "$WORK/nodeA/img" # the job is gone afterwards
wait "$JOB" 2>/dev/null || true
for f in $FILES; do stat -c '%s %n' "$f"; done >files-at-dump.txt
echo "dumped pid $JOB after step $(last_step job.log); files it had open:"
cat files-at-dump.txt

# Ship the image, keeping its modes (0700 directory, 0600 files: it holds process memory).
# Between hosts: `tar -C /images -cpf - img | ssh nodeB tar -C /images -xpf -`, or `rsync -a`.
tar -C "$WORK/nodeA" -cpf - img | tar -C "$WORK/nodeB" -xpf -
IMG=$WORK/nodeB/img

# --- on node B -----------------------------------------------------------------------------
# a) The copy is intact (sizes and sha256 of every file against the manifest).
"$NPUSNAP" verify "$IMG"
[ "$(stat -c %a "$IMG")" = 700 ] || fail "the copied image is not 0700 any more"

# b) Same software stack: CRIU and CANN versions of the image = those of this node.
npj manifest.json inspect "$IMG"
npj check.json check # exit 3 with the reasons if this node cannot restore
IMG_CRIU=$(json manifest.json 'd["result"]["versions"]["criu"]')
IMG_CANN=$(json manifest.json 'd["result"]["versions"]["cann"]')
HERE_CRIU=$(json check.json '[c for c in d["result"]["checks"] if c["name"] == "criu"][0]["data"]["version"]')
HERE_CANN=$(json check.json '[c for c in d["result"]["checks"] if c["name"] == "cann"][0]["data"]["version"]')
[ "$IMG_CRIU" = "$HERE_CRIU" ] || fail "CRIU $IMG_CRIU in the image, $HERE_CRIU here"
[ "$IMG_CANN" = "$HERE_CANN" ] || fail "CANN $IMG_CANN in the image, $HERE_CANN here"
echo "versions match: CRIU $HERE_CRIU, CANN $HERE_CANN"

# c) The pids are free (CRIU restores the original pids).
for pid in $(json manifest.json '" ".join(str(p["pid"]) for p in d["result"]["processes"])'); do
    [ ! -e "/proc/$pid" ] || fail "pid $pid is in use on this node: $(tr '\0' ' ' </proc/"$pid"/cmdline)"
done

# d) The devices are free (CANN restores on the same device id). Simulator: `npusnap sim status`;
#    real hardware: `npu-smi info` shows the processes on each device.
npj sim-status.json sim status
for dev in $(json manifest.json '" ".join(str(x) for p in d["result"]["processes"] for x in p["devices"])'); do
    owner=$(json sim-status.json "[x['owner'] for x in d['result']['devices'] if x['id'] == $dev][0]")
    [ "$owner" = None ] || fail "device $dev is occupied: $owner"
done

# e) The job's files are there with the sizes they had at dump time.
while read -r size path; do
    [ "$(stat -c %s "$path")" = "$size" ] || fail "$path: size $(stat -c %s "$path"), the image expects $size"
done <files-at-dump.txt

# f) A damaged copy is refused before anything starts (exit 8, the file is named).
cp -a "$IMG" "$WORK/nodeB/damaged"
PAGES=$(ls "$WORK"/nodeB/damaged/criu/pages-*.img | head -1)
printf 'X' | dd of="$PAGES" bs=1 seek=100 conv=notrunc status=none
set +e
"$NPUSNAP" verify --json "$WORK/nodeB/damaged" >damaged.json
rc=$?
set -e
[ $rc -eq 8 ] || fail "verify of a damaged image exited $rc, expected 8"
echo "damaged copy refused: $(json damaged.json 'd["error"]["message"]')"

# g) Restore. The job continues where it stopped, device memory included.
npj restore.json restore --pidfile "$WORK/restored.pid" "$IMG"
[ "$(cat "$WORK/restored.pid")" = "$JOB" ] || fail "restored under another pid"
for _ in $(seq 200); do [ -e "/proc/$JOB" ] || break; sleep 0.05; done
[ ! -e "/proc/$JOB" ] || fail "the restored job did not finish in 10 s"
cmp job.log reference.log || fail "the restored job's output differs from the uninterrupted run"
echo "restored job ran to step $(last_step job.log); output identical to the uninterrupted run"
echo "OK"
