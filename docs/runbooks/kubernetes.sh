#!/usr/bin/env bash
# Runbook: NPU containers under Kubernetes — the node-side layer (docs/runbooks/kubernetes.md).
#
# There is no kubelet or CRI-O on the machines this is tested on, so this script runs the layer
# under them with podman, which shares CRI-O's checkpoint code and archive format: what the
# kubelet's checkpoint API makes CRI-O do (runc checkpoint --leave-running, CRIU with the
# node's runc.conf, an uncompressed archive), the operator's check of the archive with
# `npusnap verify`, and restoring the archive as a new container after the original is gone.
# Checks the workload's output is continuous and its checksums right. Cleans up after itself.
#
# Environment: NPUSNAP (default: npusnap), PYTHON (default: python3), NPUSNAP_CRIU_PLUGIN_DIR.
set -euo pipefail

NPUSNAP=${NPUSNAP:-npusnap}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case $NPUSNAP in */*) NPUSNAP=$(cd "$(dirname "$NPUSNAP")" && pwd)/$(basename "$NPUSNAP") ;; esac
# shellcheck source=container-image.bash
. "$HERE/container-image.bash"

WORK=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
TAG=localhost/npusnap-runbook-k8s:$$
C=npusnap-runbook-k8s-$$
SIM_STARTED=False
cleanup() {
    local rc=$?
    podman rm -f -t 0 "$C" "$C-restored" >/dev/null 2>&1 || true
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
wait_step() {
    for _ in $(seq 200); do [ "$(last_step "$1")" -ge "$2" ] && return 0; sleep 0.1; done
    fail "$1 did not reach step $2 (last: $(last_step "$1"))"
}
# check_steps CONTAINER: every step in order with the checksum of an uninterrupted run. The
# archive of a --leave-running checkpoint carries a copy of the container log taken after the
# original went on, so its last lines may be printed again by the restored process: a repeated
# step must be identical, then it counts once.
check_steps() {
    podman logs "$1" 2>/dev/null | "$PYTHON" -c '
import sys
seen, steps = {}, []
for s, c in ((int(p[1]), int(p[3])) for p in (l.split() for l in sys.stdin) if p[:1] == ["step"]):
    if s in seen:
        assert seen[s] == c, f"step {s} printed twice with different checksums"
        continue
    seen[s] = c
    steps.append((s, c))
n = [s for s, _ in steps]
assert n == list(range(n[0], n[0] + len(n))), f"steps lost or repeated: {n}"
host, want = [0] * 256, []
for step in range(n[-1] + 1):
    host = [(host[i] * 31 + step + i) % 251 for i in range(256)]
    want.append(sum(host))
assert all(c == want[s] for s, c in steps), "wrong checksums (device memory lost?)"
print(f"{len(steps)} steps, continuous, checksums right")' || fail "$1: output is not continuous"
}

cd "$WORK"
"$NPUSNAP" sim start --json >sim.json
SIM_STARTED=$(json sim.json 'd["result"]["started"]')
eval "$("$NPUSNAP" sim env)"
# shellcheck disable=SC2207
DEVICE_ARGS=($(npu_sim_args))
[ -f "${NPUSNAP_CRIU_PLUGIN_DIR:-/usr/lib/npusnap/criu-plugins}/npusnap_plugin.so" ] ||
    fail "no npusnap_plugin.so in ${NPUSNAP_CRIU_PLUGIN_DIR:-/usr/lib/npusnap/criu-plugins}: run scripts/setup.sh as root"

# The page's blocks, in order (its settings first: this script's C, TAG, WORK are kept).
run_block kubernetes.md 1
# 1. The node's CRIU configuration for runc (here through the org.criu.config annotation).
run_block kubernetes.md 2
grep -qx "timeout 600" "$WORK/runc.conf" || fail "runc.conf was not written"

# 2. The NPU container, as CRI-O would run it for a pod (runc runtime).
build_npu_image "$TAG" "$WORK"
run_block kubernetes.md 3
wait_step "$C" 10

# 3. What `POST /checkpoint/{namespace}/{pod}/{container}` makes CRI-O do: checkpoint with
#    --leave-running into an uncompressed tar under /var/lib/kubelet/checkpoints/.
run_block kubernetes.md 4
STEP=$(last_step "$C")
wait_step "$C" $((STEP + 10))

# 4. The operator checks the archive before shipping it.
run_block kubernetes.md 5
[ "$(json inspect.json 'd["result"]["processes"][0]["ns_pid"]')" = 1 ] || fail "the archive lists no NPU process"

# 5. The node is lost; the archive is restored as a new container (in Kubernetes: a new pod
#    whose image is built from the archive, see the page).
run_block kubernetes.md 6
STEP=$(last_step "$C-restored")
wait_step "$C-restored" $((STEP + 10))
check_steps "$C-restored"
echo OK
