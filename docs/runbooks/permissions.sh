#!/usr/bin/env bash
# Runbook: Permissions and running as non-root (permissions.md).
#
# GENERATED from permissions.md by scripts/runbooks.py: edit the page, then run that script.
# The body below is the page's ```bash blocks, in order, exactly as an operator pastes them into
# an interactive shell. This prologue only adds what a test needs: a scratch directory (removed at
# the end), `set -euo pipefail` (a check on the page that does not hold stops the run), and
# killing the jobs the page started. Run it as root, from anywhere:
#
#     NPUSNAP=/path/to/npusnap/.venv/bin/npusnap permissions.sh
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
npusnap sim start
eval "$(npusnap sim env)"
JOB_USER=nobody
JUID=$(id -u "$JOB_USER"); JGID=$(id -g "$JOB_USER")
OTHER_UID=65533
USER_PYTHON=${USER_PYTHON:-/usr/bin/python3}
chmod 711 .   # the user must be able to reach their directory below
UHOME=$PWD/home
install -d -m 700 -o "$JUID" -g "$JGID" "$UHOME"
NPUSNAP_PYTHONPATH=$(python3 -c 'import os, sysconfig, npusnap_cli; print(os.path.dirname(os.path.dirname(npusnap_cli.__file__)) + ":" + sysconfig.get_paths()["purelib"])')
AS_USER=(setpriv --reuid "$JUID" --regid "$JGID" --init-groups -- env -i PATH=/usr/bin:/bin
    HOME="$UHOME" XDG_RUNTIME_DIR="$UHOME" NPUSIM_SOCKET="$UHOME/npusim/npusim.sock"
    ASCEND_HOME_PATH="$ASCEND_HOME_PATH" LD_LIBRARY_PATH="$LD_LIBRARY_PATH"
    PYTHONPATH="$NPUSNAP_PYTHONPATH")
USER_NPUSNAP=("$USER_PYTHON" -m npusnap_cli)
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" sim start
PID=$("${AS_USER[@]}" "${USER_NPUSNAP[@]}" run --detach --pidfile "$UHOME/job.pid" --output "$UHOME/job.log" -- \
    "$USER_PYTHON" -m npusnap_workloads.train --steps 1000 --interval 0.05)
timeout 20 sh -c "until grep -q '^step 3 ' '$UHOME/job.log'; do sleep 0.1; done"
ps -o user=,pid=,args= -p "$PID"

# --- block 2 ---
rc=0; "${AS_USER[@]}" "${USER_NPUSNAP[@]}" dump "$PID" "$UHOME/img" || rc=$?
[ "$rc" -eq 3 ]
[ ! -e "$UHOME/img" ]

# --- block 3 ---
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" status "$PID" | grep RUNNING
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" freeze --no-backup "$PID" | grep LOCKED
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" thaw "$PID"
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" status "$PID" | grep RUNNING

# --- block 4 ---
mkdir -m 700 images
npusnap status "$PID" | grep RUNNING
rc=0; npusnap dump --leave-running "$PID" images/img || rc=$?
echo "root's dump of $JOB_USER's job exited $rc"
case $rc in
0) stat -c '%a %U' images/img | grep '^700 root' ;;
3) npusnap check | grep other-users ;;
*) false ;;
esac
npusnap status "$PID" | grep RUNNING

# --- block 5 ---
SOCK=$UHOME/npusnap/$PID.sock   # $XDG_RUNTIME_DIR/npusnap/PID.sock
stat -c '%A %U %n' "$UHOME/npusnap" "$SOCK"
[ "$(stat -c '%a %u' "$UHOME/npusnap")" = "700 $JUID" ]
[ "$(stat -c '%a %u' "$SOCK")" = "600 $JUID" ]

# --- block 6 ---
setpriv --reuid "$JUID" --regid "$JGID" --init-groups -- env -u XDG_RUNTIME_DIR -u NPUSNAP_RUNTIME_DIR \
    PYTHONPATH="$NPUSNAP_PYTHONPATH" "$USER_PYTHON" -c 'from npusnap_cli import paths; print(paths.agent_runtime_dir())' |
    grep -x "/tmp/npusnap-$JUID"
env -u NPUSNAP_RUNTIME_DIR python3 -c 'from npusnap_cli import paths; print(paths.agent_runtime_dir())' | grep -x /run/npusnap

# --- block 7 ---
rc=0
setpriv --reuid "$OTHER_UID" --regid "$OTHER_UID" --clear-groups -- "$USER_PYTHON" -c \
    'import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])' "$SOCK" 2>other.err || rc=$?
tail -n 1 other.err
[ "$rc" -ne 0 ]
grep -c PermissionError other.err

# --- block 8 ---
rc=0
setpriv --reuid "$OTHER_UID" --regid "$OTHER_UID" --clear-groups -- \
    env -i PATH=/usr/bin:/bin PYTHONPATH="$NPUSNAP_PYTHONPATH" "${USER_NPUSNAP[@]}" attach "$PID" || rc=$?
[ "$rc" -eq 4 ]
cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo "Yama is not active"

# --- block 9 ---
kill "$PID"
"${AS_USER[@]}" "${USER_NPUSNAP[@]}" sim stop

echo OK
