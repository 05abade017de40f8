#!/usr/bin/env bash
# Runbook: permissions and running as non-root (docs/runbooks/permissions.md).
#
# Self-contained against the simulated NPU; run it as root (it switches to an unprivileged user
# with setpriv). It shows, and checks:
#   1. where agent sockets live and their modes (0700 directory, 0600 socket), for root and users;
#   2. a non-root user drives their own job (status, freeze, thaw) but cannot dump it (exit 3:
#      CRIU needs root);
#   3. another unprivileged user cannot reach the job's agent at all, and cannot attach (exit 4);
#   4. root can drive any user's job, and dump it where root has CAP_SYS_RESOURCE.
#
# Environment: NPUSNAP (default: npusnap), PYTHON (default: python3), JOB_USER (default: nobody),
# OTHER_UID (default: 65533), USER_PYTHON (an interpreter JOB_USER may run, same major.minor as
# npusnap's own; default: /usr/bin/python3), WORKLOADS (the directory of the sample workloads;
# default: the repository's npusnap_cli/workloads).
set -euo pipefail

NPUSNAP=${NPUSNAP:-npusnap}
PYTHON=${PYTHON:-python3}
JOB_USER=${JOB_USER:-nobody}
OTHER_UID=${OTHER_UID:-65533}
USER_PYTHON=${USER_PYTHON:-/usr/bin/python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORKLOADS=${WORKLOADS:-$(cd "$HERE/../../npusnap_cli/workloads" && pwd)}
case $NPUSNAP in */*) NPUSNAP=$(cd "$(dirname "$NPUSNAP")" && pwd)/$(basename "$NPUSNAP") ;; esac

[ "$(id -u)" = 0 ] || { echo "run this runbook as root: it switches users with setpriv" >&2; exit 1; }
JUID=$(id -u "$JOB_USER")
JGID=$(id -g "$JOB_USER")

WORK=$(mktemp -d /tmp/npusnap-runbook.XXXXXX)
# npusnap keeps the CRIU logs of failed dumps in $TMPDIR/npusnap-dump-logs-*/: these go away with $WORK.
export TMPDIR=$WORK
chmod 711 "$WORK" # the user's own directory below must be reachable by that user
UHOME=$WORK/home # stands in for the user's home and $XDG_RUNTIME_DIR (/run/user/UID)
install -d -m 700 -o "$JUID" -g "$JGID" "$UHOME"
JOB=""
SIM_STARTED=False
USER_SIM=False
cleanup() {
    local rc=$?
    if [ -n "$JOB" ] && grep -qs train.py "/proc/$JOB/cmdline"; then kill -9 "$JOB" 2>/dev/null || true; fi
    if [ "$USER_SIM" = True ]; then "${AS_USER[@]}" "${USER_NPUSNAP[@]}" sim stop >/dev/null 2>&1 || true; fi
    if [ "$SIM_STARTED" = True ]; then "$NPUSNAP" sim stop >/dev/null 2>&1 || true; fi
    rm -rf "$WORK"
    if [ $rc -ne 0 ]; then echo "FAILED (exit $rc)" >&2; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { echo "FAIL: $*" >&2; exit 1; }
json() { "$PYTHON" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"; }
last_step() { awk '$1 == "step" { n = $2 } END { print n + 0 }' "$1"; }
wait_step() {
    for _ in $(seq 100); do [ "$(last_step "$1")" -ge "$2" ] && return 0; sleep 0.1; done
    fail "$1 did not reach step $2 (last: $(last_step "$1"))"
}
# expect CODE FILE CMD...: CMD (an npusnap call with --json) must exit CODE; envelope in FILE.
expect() {
    local want=$1 out=$2 rc=0
    shift 2
    "$@" >"$out" || rc=$?
    if [ $rc -ne "$want" ]; then
        cat "$out" >&2
        fail "$* exited $rc, expected $want"
    fi
}

cd "$WORK"
"$NPUSNAP" sim start --json >sim.json
SIM_STARTED=$(json sim.json 'd["result"]["started"]')
eval "$("$NPUSNAP" sim env)"

# npusnap as the user. A real deployment installs npusnap where users can run it (a shared
# virtualenv, a system package). This one may live under /root: give the user an interpreter of
# the same Python version with npusnap's package and dependencies on its path.
NPUSNAP_PY=$(head -1 "$(command -v "$NPUSNAP")" | sed 's/^#!//')
NPUSNAP_PYTHONPATH=$("$NPUSNAP_PY" -c '
import os, sysconfig, npusnap_cli
print(os.path.dirname(os.path.dirname(npusnap_cli.__file__)) + ":" + sysconfig.get_paths()["purelib"])')
[ "$("$NPUSNAP_PY" -c 'import sys; print(sys.version_info[:2])')" = \
  "$("$USER_PYTHON" -c 'import sys; print(sys.version_info[:2])')" ] ||
    fail "USER_PYTHON=$USER_PYTHON is not the Python version of $NPUSNAP; set USER_PYTHON"
USER_NPUSNAP=("$USER_PYTHON" -m npusnap_cli)
# AS_USER CMD...: run CMD as JOB_USER, in the user's own environment: their home as
# $XDG_RUNTIME_DIR (so their agent sockets go to $XDG_RUNTIME_DIR/npusnap/), their own simulated
# NPU daemon (root's socket is not theirs to use; on real hardware the user needs access to the
# device nodes instead, e.g. the HwHiAiUser group), and no NPUSNAP_RUNTIME_DIR override, so the
# defaults are what you get. An array, not a function: a backgrounded function runs in a
# subshell, and $! would not be the job's pid.
AS_USER=(setpriv --reuid "$JUID" --regid "$JGID" --init-groups -- env -i PATH=/usr/bin:/bin
    HOME="$UHOME" XDG_RUNTIME_DIR="$UHOME" NPUSIM_SOCKET="$UHOME/npusim/npusim.sock"
    ASCEND_HOME_PATH="$ASCEND_HOME_PATH" LD_LIBRARY_PATH="$LD_LIBRARY_PATH"
    PYTHONPATH="$NPUSNAP_PYTHONPATH")
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" --help >/dev/null || fail "$JOB_USER cannot run npusnap (USER_PYTHON?)"

# --- 1. The user's job and where its agent listens ------------------------------------------
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" sim start --json >user-sim.json
USER_SIM=True
# `npusnap run` as the user; setsid: detached from this shell; output to files the user owns.
install -m 600 -o "$JUID" -g "$JGID" /dev/null "$UHOME/job.log"
install -m 600 -o "$JUID" -g "$JGID" /dev/null "$UHOME/job.err"
"${AS_USER[@]}" setsid "${USER_NPUSNAP[@]}" run -- "$USER_PYTHON" "$WORKLOADS/train.py" --steps 1000 --interval 0.05 \
    </dev/null >>"$UHOME/job.log" 2>>"$UHOME/job.err" &
JOB=$!
wait_step "$UHOME/job.log" 3
SOCK=$UHOME/npusnap/$JOB.sock # $XDG_RUNTIME_DIR/npusnap/PID.sock
[ -S "$SOCK" ] || fail "no agent socket at $SOCK"
stat -c '%A %U %n' "$UHOME/npusnap" "$SOCK"
[ "$(stat -c %a "$UHOME/npusnap")" = 700 ] || fail "socket directory is not 0700"
[ "$(stat -c %a "$SOCK")" = 600 ] || fail "socket is not 0600"
[ "$(stat -c %u "$SOCK")" = "$JUID" ] || fail "socket is not owned by $JOB_USER"

# Without $XDG_RUNTIME_DIR a user's agent uses /tmp/npusnap-UID/, and root's /run/npusnap/
# (NPUSNAP_RUNTIME_DIR overrides both). Ask the agent module where it would go:
for who in user root; do
    if [ $who = user ]; then run=(setpriv --reuid "$JUID" --regid "$JGID" --init-groups --); else run=(); fi
    "${run[@]}" env -u XDG_RUNTIME_DIR -u NPUSNAP_RUNTIME_DIR PYTHONPATH="$NPUSNAP_PYTHONPATH" \
        "$USER_PYTHON" -c 'import os; from npusnap_cli import paths; print(os.geteuid(), paths.agent_runtime_dir())'
done >defaults.txt
grep -qx "$JUID /tmp/npusnap-$JUID" defaults.txt || fail "unexpected default for $JOB_USER: $(cat defaults.txt)"
grep -qx "0 /run/npusnap" defaults.txt || fail "unexpected default for root: $(cat defaults.txt)"

# --- 2. The user drives their own job; dumping needs root ------------------------------------
expect 0 status.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" status "$JOB" --json
[ "$(json status.json 'd["result"]["processes"][0]["status"]["state"]')" = RUNNING ] || fail "not RUNNING"
expect 0 freeze.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" freeze --no-backup "$JOB" --json
expect 0 thaw.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" thaw "$JOB" --json
wait_step "$UHOME/job.log" $(($(last_step "$UHOME/job.log") + 2))
expect 3 user-dump.json "${AS_USER[@]}" "${USER_NPUSNAP[@]}" dump "$JOB" "$UHOME/img" --json
echo "$JOB_USER: dump refused: $(json user-dump.json 'd["error"]["message"]')"
[ ! -e "$UHOME/img" ] || fail "a refused dump left an image"

# --- 3. Another unprivileged user gets nowhere ------------------------------------------------
# The 0700 directory stops them before the agent's SO_PEERCRED check (own uid or root) would.
if setpriv --reuid "$OTHER_UID" --regid "$OTHER_UID" --clear-groups -- "$USER_PYTHON" -c '
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])' "$SOCK" 2>other.err; then
    fail "uid $OTHER_UID could connect to $SOCK"
fi
grep -q PermissionError other.err || fail "uid $OTHER_UID: unexpected failure: $(cat other.err)"
echo "uid $OTHER_UID: $(tail -1 other.err)"
# Attaching needs ptrace rights over the target: the same user or root (exit 4 otherwise).
expect 4 other-attach.json setpriv --reuid "$OTHER_UID" --regid "$OTHER_UID" --clear-groups -- \
    env -i PATH=/usr/bin:/bin PYTHONPATH="$NPUSNAP_PYTHONPATH" "${USER_NPUSNAP[@]}" attach "$JOB" --json
echo "uid $OTHER_UID: attach refused: $(json other-attach.json 'd["error"]["message"]')"
echo "Yama ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo 'not present')"

# --- 4. Root drives and dumps anyone's job ----------------------------------------------------
# npusnap finds the agent socket through /proc/net/unix and checks the server's pid
# (SO_PEERCRED); the agent accepts root.
expect 0 root-status.json "$NPUSNAP" status "$JOB" --json
[ "$(json root-status.json 'd["result"]["processes"][0]["agent_socket"]')" = "$SOCK" ] || fail "wrong socket"
mkdir -m 700 "$WORK/images"
# CRIU reads the target's resource limits (prlimit); for a process of another user that needs
# CAP_SYS_RESOURCE. Some containers drop it from root (this project's CI VMs do): there the
# dump's preflight refuses (exit 3) before anything is locked, and the job runs on untouched.
CAPEFF=$(awk '/^CapEff:/ { print $2 }' /proc/self/status)
if (((0x$CAPEFF >> 24) & 1)); then
    expect 0 root-dump.json "$NPUSNAP" dump --leave-running "$JOB" "$WORK/images/img" --json
    [ "$(stat -c '%a %U' "$WORK/images/img")" = "700 root" ] || fail "image is not private to root"
    echo "root dumped $JOB_USER's job $JOB (left running): $(json root-dump.json 'd["result"]["image"]')"
else
    expect 3 root-dump.json "$NPUSNAP" dump --leave-running "$JOB" "$WORK/images/img" --json
    json root-dump.json 'd["error"]["message"]' | grep -q CAP_SYS_RESOURCE || fail "unexpected refusal"
    echo "root lacks CAP_SYS_RESOURCE here: npusnap refuses to dump another user's job (exit 3)"
fi
expect 0 root-status.json "$NPUSNAP" status "$JOB" --json
[ "$(json root-status.json 'd["result"]["processes"][0]["status"]["state"]')" = RUNNING ] || fail "not RUNNING"
wait_step "$UHOME/job.log" $(($(last_step "$UHOME/job.log") + 2))
echo "OK"
