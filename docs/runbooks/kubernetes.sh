#!/usr/bin/env bash
# Runbook: NPU containers under Kubernetes: checkpoint a container, restore it into a new pod, checkpoint and restore a job (kubernetes.md).
#
# GENERATED from kubernetes.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap kubernetes.sh
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
REPO=$(cd "$(dirname "$(command -v npusnap)")/../.." && pwd)
CRI=$REPO/.build/cri
NODE=$PWD/node
mkdir -p "$NODE/pods"
# A simulated NPU of this node's own: other jobs on the host's simulator (one holding device 0)
# change nothing here. On a real node the pods get their devices from the device plugin.
export NPUSIM_SOCKET=$NODE/sim/npusim.sock
npusnap sim start >/dev/null
eval "$(npusnap sim env)"
PLUGIN_DIR=${NPUSNAP_CRIU_PLUGIN_DIR:-$REPO/.build/criu-plugin}
printf 'libdir %s\ntimeout 600\n' "$PLUGIN_DIR" >"$NODE/runc.conf"
REG_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
REGISTRY=localhost:$REG_PORT
IMAGE=$REGISTRY/npu-job:1
printf 'version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
    "$NODE/registry" "$REG_PORT" >"$NODE/registry.yml"
"$CRI/docker-registry" serve "$NODE/registry.yml" >"$NODE/registry.log" 2>&1 &
echo $! >"$NODE/registry.service.pid"
cat >"$NODE/containerd.toml" <<EOF
version = 3
root = "$NODE/root"
state="$NODE/state"  # containerd's state directory
[grpc]
  address = "$NODE/containerd.sock"
[ttrpc]
  address = "$NODE/containerd.sock.ttrpc"
[debug]
  address = "$NODE/debug.sock"
[plugins.'io.containerd.internal.v1.opt']
  path = "$NODE/opt"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = false
  restrict_oom_score_adj = true
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  container_annotations = ["org.criu.config"]
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  Root = "$NODE/runc"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "$IMAGE"
EOF
PATH=$CRI/bin:$PATH "$CRI/bin/containerd" --config "$NODE/containerd.toml" >"$NODE/containerd.log" 2>&1 &
echo $! >"$NODE/containerd.service.pid"
ENDPOINT=unix://$NODE/containerd.sock
for i in $(seq 300); do [ -S "$NODE/containerd.sock" ] && break; sleep 0.1; done
[ -S "$NODE/containerd.sock" ]

# --- block 2 ---
. "$REPO/docs/runbooks/container-image.bash"
build_npu_image localhost/npu-job-rootfs:1 "$NODE/image"
podman import --change 'CMD ["/bin/sleep", "2147483647"]' "$NODE/image/rootfs.tar" "$IMAGE" >/dev/null
podman push --tls-verify=false "$IMAGE" >/dev/null 2>&1
podman rmi -f localhost/npu-job-rootfs:1 "$IMAGE" >/dev/null

# --- block 3 ---
SIM_DIR=$(dirname "$NPUSIM_SOCKET")
pod_json() {  # NAME; the kubelet makes the pod's log directory before the pod
    mkdir -p "$NODE/pods/$1"
    printf '{"metadata": {"name": "%s", "namespace": "default", "uid": "uid-%s"},
      "log_directory": "%s/pods/%s",
      "linux": {"security_context": {"namespace_options": {"network": "NODE", "pid": "CONTAINER"}}}}\n' \
        "$1" "$1" "$NODE" "$1"
}
container_json() {  # POD IMAGE MEMBER: MEMBER -1 for a container that is no job member; member N uses NPU N
    local job=""
    if [ "$3" -ge 0 ]; then
        job=", {\"key\": \"NPUSNAP_JOB_COORDINATOR\", \"value\": \"127.0.0.1:$COORD_PORT\"},
               {\"key\": \"NPUSNAP_JOB_MEMBER\", \"value\": \"$3\"}"
    fi
    printf '{"metadata": {"name": "trainer"}, "image": {"image": "%s"},
      "command": ["/opt/npu/npu_stepper", "--interval-ms", "50", "--device", "%s"],
      "envs": [{"key": "LD_PRELOAD", "value": "/opt/npu/libnpusnap_agent.so"},
               {"key": "NPUSNAP_AGENT", "value": "1"},
               {"key": "ASCEND_HOME_PATH", "value": "/opt/npu/cann"},
               {"key": "LD_LIBRARY_PATH", "value": "/opt/npu/cann/lib64"},
               {"key": "NPUSIM_SOCKET", "value": "%s"}%s],
      "mounts": [{"container_path": "%s", "host_path": "%s"}],
      "log_path": "trainer.log",
      "labels": {"io.kubernetes.pod.namespace": "default", "io.kubernetes.pod.name": "%s",
                 "io.kubernetes.container.name": "trainer"},
      "annotations": {"org.criu.config": "%s/runc.conf"},
      "linux": {"security_context": {"namespace_options": {"network": "NODE", "pid": "CONTAINER"}}}}\n' \
        "$2" "$(( $3 > 0 ? $3 : 0 ))" "$NPUSIM_SOCKET" "$job" "$SIM_DIR" "$SIM_DIR" "$1" "$NODE"
}
pod_json trainer-0 >"$NODE/trainer-0.pod.json"
container_json trainer-0 "$IMAGE" -1 >"$NODE/trainer-0.container.json"
read -r POD CTR < <(npusnap k8s run --cri-endpoint "$ENDPOINT" "$NODE/trainer-0.pod.json" "$NODE/trainer-0.container.json")
LOG=$NODE/pods/trainer-0/trainer.log
for i in $(seq 100); do grep -q ' step 5 ' "$LOG" 2>/dev/null && break; sleep 0.1; done
grep ' step ' "$LOG" | tail -n 2

# --- block 4 ---
npusnap k8s checkpoint "$PWD/ckpt-1" --member default/trainer-0/trainer --cri-endpoint "$ENDPOINT"
ARCHIVE=$(ls "$PWD"/ckpt-1/checkpoint-trainer-0_default-trainer-*.tar)
npusnap verify "$ARCHIVE"
npusnap inspect "$ARCHIVE"

# --- block 5 ---
sleep 0.5
grep ' step ' "$LOG" | tail -n 1

# --- block 6 ---
npusnap k8s rm --cri-endpoint "$ENDPOINT" "$POD"
pod_json trainer-0-restored >"$NODE/restored.pod.json"
container_json trainer-0-restored "$ARCHIVE" -1 >"$NODE/restored.container.json"
read -r POD CTR < <(npusnap k8s run --cri-endpoint "$ENDPOINT" "$NODE/restored.pod.json" "$NODE/restored.container.json")
LOG=$NODE/pods/trainer-0-restored/trainer.log
LAST=$(tar -xOf "$ARCHIVE" container.log | awk '$4 == "step" { n = $5 } END { print n }')
for i in $(seq 100); do [ "$(awk '$4 == "step" { n = $5 } END { print n + 0 }' "$LOG")" -ge $((LAST + 10)) ] && break; sleep 0.1; done
python3 - "$LOG" "$LAST" <<'EOF'
import sys
seen, steps = {}, []
for line in open(sys.argv[1]):
    p = line.split()
    if p[3:4] != ["step"]:
        continue
    s, c = int(p[4]), int(p[6])
    if s in seen:  # the archive's copy of the log may end a step or two past the checkpoint
        assert seen[s] == c, f"step {s} printed twice with different checksums"
        continue
    seen[s] = c
    steps.append((s, c))
n = [s for s, _ in steps]
assert n == list(range(n[0], n[0] + len(n))), f"steps lost or repeated: {n}"
assert n[-1] >= int(sys.argv[2]) + 10, f"the restored container did not go on: last step {n[-1]}"
host, want = [0] * 256, []
for step in range(n[-1] + 1):
    host = [(host[i] * 31 + step + i) % 251 for i in range(256)]
    want.append(sum(host))
assert all(c == want[s] for s, c in steps), "wrong checksums (device memory lost?)"
print(f"steps {n[0]}..{n[-1]}: continuous, checksums right; the archive's log ended at step {sys.argv[2]}")
EOF
npusnap k8s rm --cri-endpoint "$ENDPOINT" "$POD"

# --- block 7 ---
COORD_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for m in 0 1; do
    pod_json "job-$m" >"$NODE/job-$m.pod.json"
    container_json "job-$m" "$IMAGE" "$m" >"$NODE/job-$m.container.json"
    npusnap k8s run --cri-endpoint "$ENDPOINT" "$NODE/job-$m.pod.json" "$NODE/job-$m.container.json" >"$NODE/job-$m.ids"
done
for i in $(seq 100); do grep -q ' step 5 ' "$NODE/pods/job-1/trainer.log" 2>/dev/null && break; sleep 0.1; done
npusnap k8s checkpoint "$PWD/job-1" --listen "127.0.0.1:$COORD_PORT" --cri-endpoint "$ENDPOINT" \
    --member default/job-0/trainer --member default/job-1/trainer
npusnap k8s verify "$PWD/job-1"
python3 -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["barriers"], [(x["member"], x["archive"], x["sha256"][:12]) for x in m["members"]])' "$PWD/job-1/npusnap-k8s-job.json"

# --- block 8 ---
RUNS=()
for m in 0 1; do
    read -r P C <"$NODE/job-$m.ids"
    npusnap k8s rm --cri-endpoint "$ENDPOINT" "$P"
    pod_json "job-$m-restored" >"$NODE/job-$m-restored.pod.json"
    container_json "job-$m-restored" "" "$m" >"$NODE/job-$m-restored.container.json"
    RUNS+=(--run "$NODE/job-$m-restored.pod.json:$NODE/job-$m-restored.container.json")
done
npusnap k8s restore "$PWD/job-1" --cri-endpoint "$ENDPOINT" "${RUNS[@]}" >"$NODE/restored.ids"
for m in 0 1; do
    LAST=$(tar -xOf "$PWD"/job-1/checkpoint-job-"$m"_default-trainer-*.tar container.log | awk '$4 == "step" { n = $5 } END { print n }')
    LOG=$NODE/pods/job-$m-restored/trainer.log
    for i in $(seq 100); do [ "$(awk '$4 == "step" { n = $5 } END { print n + 0 }' "$LOG")" -ge $((LAST + 5)) ] && break; sleep 0.1; done
    [ "$(awk '$4 == "step" { n = $5 } END { print n + 0 }' "$LOG")" -ge $((LAST + 5)) ]
    echo "member $m: checkpointed at step $LAST, now at step $(awk '$4 == "step" { n = $5 } END { print n }' "$LOG")"
done

# --- block 9 ---
while read -r P C; do npusnap k8s rm --cri-endpoint "$ENDPOINT" "$P"; done <"$NODE/restored.ids"
kill "$(cat "$NODE/containerd.service.pid")" "$(cat "$NODE/registry.service.pid")"

echo OK
