#!/usr/bin/env bash
# Runbook: checkpoint and restore an NPU container with podman (docs/runbooks/podman.md).
#
# Self-contained against the simulated NPU: builds a small image locally (no registry), runs the
# C workload in a container under runc, then uses podman alone — no npusnap command — to
# checkpoint, restore, checkpoint with --leave-running, export and import under another name.
# npusnap's CRIU plugin (installed by scripts/setup.sh into /usr/lib/npusnap/criu-plugins, named to
# CRIU with `libdir` in a CRIU configuration file) does the device side.
# Checks that no step is lost or repeated and every checksum is right. Cleans up after itself.
#
# Environment: NPUSNAP (default: npusnap), PYTHON (default: python3), NPUSNAP_CRIU_PLUGIN_DIR (npusnap's
# plugin directory, default /usr/lib/npusnap/criu-plugins, named through an org.criu.config annotation).
set -euo pipefail

NPUSNAP=${NPUSNAP:-npusnap}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case $NPUSNAP in */*) NPUSNAP=$(cd "$(dirname "$NPUSNAP")" && pwd)/$(basename "$NPUSNAP") ;; esac
# shellcheck source=container-image.bash
. "$HERE/container-image.bash"

WORK=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
TAG=localhost/npusnap-runbook:$$
C=npusnap-runbook-$$
SIM_STARTED=False
cleanup() {
    local rc=$?
    podman rm -f -t 0 "$C" "$C-copy" >/dev/null 2>&1 || true
    podman rmi -f "$TAG" >/dev/null 2>&1 || true
    if [ "$SIM_STARTED" = True ]; then "$NPUSNAP" sim stop >/dev/null 2>&1 || true; fi
    rm -rf "$WORK"
    if [ $rc -ne 0 ]; then echo "FAILED (exit $rc)" >&2; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }
json() { "$PYTHON" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"; }
last_step() { podman logs "$1" 2>/dev/null | awk '$1 == "step" { n = $2 } END { print n + 0 }'; }
wait_step() { # wait_step CONTAINER N: until its log shows step N (20 s at most)
    for _ in $(seq 200); do [ "$(last_step "$1")" -ge "$2" ] && return 0; sleep 0.1; done
    fail "$1 did not reach step $2 (last: $(last_step "$1"))"
}
# check_steps CONTAINER: every step once, in order, with the checksum of an uninterrupted run.
check_steps() {
    podman logs "$1" 2>/dev/null | "$PYTHON" -c '
import sys
steps = [(int(p[1]), int(p[3])) for p in (l.split() for l in sys.stdin) if p[:1] == ["step"]]
n = [s for s, _ in steps]
assert n == list(range(n[0], n[0] + len(n))), f"steps lost or repeated: {n}"
host, want = [0] * 256, []
for step in range(n[-1] + 1):
    host = [(host[i] * 31 + step + i) % 251 for i in range(256)]
    want.append(sum(host))
bad = [(s, c) for s, c in steps if c != want[s]]
assert not bad, f"wrong checksums (device memory lost?): {bad[:3]}"
print(f"{len(steps)} steps, continuous, checksums right")' || fail "$1: output is not continuous"
}

cd "$WORK"

# The simulated NPU and its environment (on real hardware: your CANN and devices): a simulator
# of this script's own, so that other jobs on the host's simulator (one holding device 0, as CI
# runs it) change nothing here.
export NPUSIM_SOCKET=$WORK/sim/npusim.sock
"$NPUSNAP" sim start --json >sim.json
SIM_STARTED=$(json sim.json 'd["result"]["started"]')
eval "$("$NPUSNAP" sim env)"
# shellcheck disable=SC2207
DEVICE_ARGS=($(npu_sim_args))

# The page's settings (C, TAG, WORK, NPUSNAP: this script's own are kept).
run_block podman.md 1
# 1. The plugin: CRIU loads it from its plugin directory; configuration reaches runc and CRIU
#    through a file (podman hands them a scrubbed environment).
[ -f "${NPUSNAP_CRIU_PLUGIN_DIR:-/usr/lib/npusnap/criu-plugins}/npusnap_plugin.so" ] ||
    fail "no npusnap_plugin.so in ${NPUSNAP_CRIU_PLUGIN_DIR:-/usr/lib/npusnap/criu-plugins}: run scripts/setup.sh as root"
run_block podman.md 2

# 2. The image and the container. runc, not crun: Debian 12's crun has no CRIU support.
build_npu_image "$TAG" "$WORK"
run_block podman.md 3
wait_step "$C" 10

# 3. Checkpoint: podman -> runc -> CRIU -> npusnap_plugin.so locks and backs up the device state
#    through the agent in the container, before CRIU freezes it; then the restore.
run_block podman.md 4
run_block podman.md 5
STEP=$(last_step "$C")
wait_step "$C" $((STEP + 10))
check_steps "$C"

# 4. A checkpoint that keeps the container running (what the kubelet always does).
run_block podman.md 6
STEP=$(last_step "$C")
wait_step "$C" $((STEP + 10))

# Export to an archive and import it as another container (here, on another node).
run_block podman.md 7
STEP=$(last_step "$C-copy")
wait_step "$C-copy" $((STEP + 10))
check_steps "$C-copy"

# 5. What the plugin did, in its helper's log.
run_block podman.md 8
echo OK
