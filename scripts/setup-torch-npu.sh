#!/usr/bin/env bash
# What the torch_npu tests (tests/integration/test_torch_npu.py) need: a virtualenv with PyTorch's
# CPU build and Huawei's torch_npu wheel on top, run against the simulated NPU with nothing more
# than `eval "$(npusnap sim env)"`. Apart from .build/torch: torch 2.13 auto-loads torch_npu from
# any venv that holds it (the torch.backends entry point), and the CPU-only tests (torchrun, gloo)
# must not start doing that.
#
#   the venv   $CACHE/torch-npu-<digest of the spec>-pyX.Y (cached: built once per machine),
#              created with .venv's interpreter; torch (+cpu), numpy and pyyaml from pip as
#              configured on this machine, then torch-npu with --no-deps (its requirements name
#              the plain torch wheel, which would pull CUDA libraries in place of the CPU build).
#   the link   .build/torch-npu (or $NPUSNAP_BUILD_DIR/torch-npu) points at it.
#   the stamp  the venv's .npusnap-ok holds the spec it was built from; a venv built from another
#              spec (an older pin) is rebuilt, so an old cache is upgraded by the next setup.
#
# Idempotent: a second run only checks the stamp and the link. NPUSNAP_NO_TORCH=1 skips it (the
# tests then skip with that reason, or fail under CI=true); NPUSNAP_TORCH_NPU_SPEC overrides the
# requirement (default "torch==2.13.0+cpu torch-npu==2.13.0 numpy pyyaml"). Called by
# scripts/test.sh and the Makefile's test and demo targets.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "$(id -u)" = 0 ]; then
    CACHE=${NPUSNAP_CACHE:-/var/cache/npusnap}
else
    CACHE=${NPUSNAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npusnap}
fi
SPEC=${NPUSNAP_TORCH_NPU_SPEC:-torch==2.13.0+cpu torch-npu==2.13.0 numpy pyyaml}
LINK=${NPUSNAP_BUILD_DIR:-$ROOT/.build}/torch-npu
PY=$ROOT/.venv/bin/python

# Why there is no venv, for `npusnap demo` to say (it then runs its built-in workload): the last
# failure's message and fix, next to the link; removed once the link is made.
WHY=$LINK.why
say() { printf '[setup-torch-npu] %s\n' "$*" >&2; }
die() {
    printf '[setup-torch-npu] ERROR: %s\n' "$1" >&2
    [ $# -gt 1 ] && printf '[setup-torch-npu]   fix: %s\n' "$2" >&2
    mkdir -p "$(dirname "$WHY")" && printf '%s\n' "$1" "${2:-}" >"$WHY" || true
    exit 1
}

if [ "${NPUSNAP_NO_TORCH:-}" = 1 ]; then
    say "NPUSNAP_NO_TORCH=1: skipped"
    [ -e "$LINK" ] || { mkdir -p "$(dirname "$WHY")" && printf '%s\n' "NPUSNAP_NO_TORCH=1 was set: the torch_npu venv was not built" "unset it and run scripts/setup-torch-npu.sh" >"$WHY"; }
    exit 0
fi
[ -x "$PY" ] || die "$PY is missing" "run scripts/setup.sh first"

pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# torch-npu goes in with --no-deps; everything else of the spec with its dependencies.
npu_reqs=() other_reqs=()
for req in $SPEC; do
    case $req in torch-npu* | torch_npu*) npu_reqs+=("$req") ;; *) other_reqs+=("$req") ;; esac
done
[ ${#npu_reqs[@]} -gt 0 ] || die "NPUSNAP_TORCH_NPU_SPEC names no torch-npu requirement: $SPEC" \
    "add one, e.g. torch-npu==2.13.0"
digest=$(printf '%s' "$SPEC" | sha256sum | cut -c1-12)
VENV=$CACHE/torch-npu-$digest-py$pyver
mkdir -p "$CACHE" "$(dirname "$LINK")"

# Built in place under a lock (other checkouts' setups may run at the same time); a build that died
# midway has no stamp and is built again.
exec 9>"$CACHE/.torch-npu-venv.lock"
flock -w 900 9 || die "another setup-torch-npu.sh has held $CACHE/.torch-npu-venv.lock for 15 minutes" \
    "check for a hung pip (ps aux | grep pip)"
if [ "$(cat "$VENV/.npusnap-ok" 2>/dev/null)" != "$SPEC" ]; then
    say "creating $VENV with $SPEC (once per machine; the torch_npu tests need it)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV" || die "could not create $VENV" "apt-get install python3-venv"
    {
        "$VENV/bin/python" -m pip install --quiet --only-binary=:all: "${other_reqs[@]}" &&
            "$VENV/bin/python" -m pip install --quiet --only-binary=:all: --no-deps "${npu_reqs[@]}"
    } >"$VENV/pip.log" 2>&1 || {
        tail -n 20 "$VENV/pip.log" >&2
        die "pip could not install $SPEC for Python $pyver (log: $VENV/pip.log)" \
            "set NPUSNAP_TORCH_NPU_SPEC to versions the index has, or NPUSNAP_NO_TORCH=1 to skip the torch tests"
    }
    # Loading torch_npu needs a CANN tree; importing torch with auto-loading off proves the CPU build.
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/python" -c 'import torch, numpy, yaml; assert "+cpu" in torch.__version__, torch.__version__' ||
        die "the venv's torch is not the CPU build (or numpy/pyyaml are missing)" "check NPUSNAP_TORCH_NPU_SPEC"
    [ -f "$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("torch_npu").origin)')" ] ||
        die "torch_npu is not installed in $VENV" "read $VENV/pip.log"
    # A venv of another spec stays: another checkout may still link it.
    for old in "$CACHE"/torch-npu-*-py"$pyver"; do
        [ "$old" = "$VENV" ] || [ ! -d "$old" ] || say "note: $old (another spec) remains; remove it once no checkout links it"
    done
    echo "$SPEC" >"$VENV/.npusnap-ok"
fi
exec 9>&-
ln -sfn "$VENV" "$LINK"
rm -f "$WHY"
say "ok: $LINK -> $VENV ($(cat "$VENV/.npusnap-ok"))"
