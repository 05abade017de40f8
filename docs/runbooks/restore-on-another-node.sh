#!/usr/bin/env bash
# Runbook: Restore on another node (restore-on-another-node.md).
#
# GENERATED from restore-on-another-node.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap restore-on-another-node.sh
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
mkdir -m 700 nodeA nodeB
# The same job uninterrupted, for comparison: its output depends only on --steps and --seed.
python3 -m npusnap_workloads.train --steps 50 --seed 3 --interval 0 >reference.log
PID=$(npusnap run --detach --pidfile job.pid --output job.log -- \
    python3 -m npusnap_workloads.train --steps 50 --seed 3 --interval 0.05)
timeout 20 sh -c 'until grep -q "^step 5 " job.log; do sleep 0.1; done'

# --- block 2 ---
FILES=$(for fd in /proc/"$PID"/fd/*; do f=$(readlink "$fd"); if [ -f "$f" ]; then echo "$f"; fi; done | sort -u)
npusnap dump "$PID" nodeA/img
for f in $FILES; do stat -c '%s %n' "$f"; done >files-at-dump.txt
cat files-at-dump.txt

# --- block 3 ---
ARCHIVE=$(npusnap export nodeA/img nodeA/img.tar.zst)
cp "$ARCHIVE" nodeB/

# --- block 4 ---
npusnap verify nodeB/img.tar.zst
npusnap import nodeB/img.tar.zst nodeB/img
stat -c '%a %n' nodeB/img | grep '^700 '

# --- block 5 ---
cp -a nodeB/img nodeB/damaged
PAGES=$(ls nodeB/damaged/criu/pages-*.img | head -n 1)
printf 'X' | dd of="$PAGES" bs=1 seek=100 conv=notrunc status=none
rc=0; npusnap verify nodeB/damaged || rc=$?
[ "$rc" -eq 8 ]

# --- block 6 ---
npusnap --json inspect nodeB/img >manifest.json
npusnap --json check >check.json
npusnap --json sim status >devices.json
python3 - <<'EOF'
import json, os, time
image = json.load(open("manifest.json"))["result"]
checks = {c["name"]: c["data"] for c in json.load(open("check.json"))["result"]["checks"]}
owners = {d["id"]: d["owner"] for d in json.load(open("devices.json"))["result"]["devices"]}
here = (checks["criu"]["version"], checks["cann"]["version"])
want = (image["versions"]["criu"], image["versions"]["cann"])
print("CRIU, CANN of the image:", want, "of this node:", here)
assert want == here, "different versions: restore on a node that has the image's versions"
for p in image["processes"]:
    # (One host here: the original was killed by the dump a moment ago; init reaps it shortly.)
    deadline = time.monotonic() + 10
    while os.path.exists("/proc/%d" % p["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    in_use = os.path.exists("/proc/%d" % p["pid"])
    print("pid", p["pid"], "IN USE" if in_use else "free")
    assert not in_use, "a pid of the image is in use on this node"
    for d in p["devices"]:
        print("device", d, "occupied: %s" % owners[d] if owners.get(d) else "free")
        assert not owners.get(d), "a device of the image is occupied"
EOF
while read -r size path; do [ "$(stat -c %s "$path")" = "$size" ]; echo "$path: $size bytes, as at the dump"; done <files-at-dump.txt

# --- block 7 ---
PID=$(npusnap restore --pidfile job.pid nodeB/img)
echo "restored pid $PID"

# --- block 8 ---
timeout 30 sh -c "while [ -e /proc/$PID ]; do sleep 0.1; done"
grep '^step ' job.log | cmp - reference.log

echo OK
