#!/usr/bin/env bash
# What the PyTorch tests (tests/integration/test_torchrun.py) need: a virtualenv with PyTorch's
# CPU build (gloo, the libuv TCPStore, torchrun), apart from .venv so that npusnap itself never
# depends on torch.
#
#   the venv   $CACHE/torch-VERSION-pyX.Y (cached: built once per machine, 30 s from a local
#              wheel), created with .venv's interpreter; torch from pip as configured on this
#              machine (its index, find-links and constraints). The CPU build is asked for by its
#              local version (+cpu): an index that has only the CUDA build fails here instead of
#              pulling gigabytes of CUDA libraries.
#   the link   .build/torch (or $NPUSNAP_BUILD_DIR/torch) points at it; the tests look only there.
#
# Idempotent: a second run only checks the link. NPUSNAP_NO_TORCH=1 skips it all (the tests then
# skip with that reason); NPUSNAP_TORCH_SPEC overrides the requirement (default torch==2.13.0+cpu).
# Called by scripts/test.sh.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "$(id -u)" = 0 ]; then
    CACHE=${NPUSNAP_CACHE:-/var/cache/npusnap}
else
    CACHE=${NPUSNAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npusnap}
fi
SPEC=${NPUSNAP_TORCH_SPEC:-torch==2.13.0+cpu}
LINK=${NPUSNAP_BUILD_DIR:-$ROOT/.build}/torch
PY=$ROOT/.venv/bin/python

say() { printf '[setup-torch] %s\n' "$*" >&2; }
die() {
    printf '[setup-torch] ERROR: %s\n' "$1" >&2
    [ $# -gt 1 ] && printf '[setup-torch]   fix: %s\n' "$2" >&2
    exit 1
}

[ "${NPUSNAP_NO_TORCH:-}" = 1 ] && { say "NPUSNAP_NO_TORCH=1: skipped"; exit 0; }
[ -x "$PY" ] || die "$PY is missing" "run scripts/setup.sh first"

pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
name=$(printf '%s' "$SPEC" | sed 's/==*/-/; s/[^A-Za-z0-9.+-]/-/g')
VENV=$CACHE/$name-py$pyver
mkdir -p "$CACHE" "$(dirname "$LINK")"

# Built in place (a venv's scripts name its path: bin/torchrun's #! line), under a lock, since
# other checkouts' setups may run at the same time; a build that died midway has no stamp.
exec 9>"$CACHE/.torch-venv.lock"
flock -w 600 9 || die "another setup-torch.sh has held $CACHE/.torch-venv.lock for 10 minutes" \
    "check for a hung pip (ps aux | grep pip)"
if [ ! -f "$VENV/.npusnap-ok" ]; then
    say "creating $VENV with $SPEC (once per machine; the torchrun tests need it)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV" || die "could not create $VENV" "apt-get install python3-venv"
    "$VENV/bin/python" -m pip install --quiet --only-binary=:all: "$SPEC" >"$VENV/pip.log" 2>&1 || {
        tail -n 20 "$VENV/pip.log" >&2
        die "pip could not install $SPEC for Python $pyver (log: $VENV/pip.log)" \
            "set NPUSNAP_TORCH_SPEC to a CPU build the index has, or NPUSNAP_NO_TORCH=1 to skip the torch tests"
    }
    "$VENV/bin/python" -W ignore::UserWarning -c 'import torch.distributed as d; assert d.is_gloo_available()' ||
        die "$SPEC imports but has no gloo backend" "use a CPU build of torch (every one has gloo)"
    echo "$SPEC" >"$VENV/.npusnap-ok"
fi
exec 9>&-
ln -sfn "$VENV" "$LINK"
say "ok: $LINK -> $VENV ($(cat "$VENV/.npusnap-ok"))"
