#!/usr/bin/env bash
# One setup path for everything: the README's commands, CI and `npusnap demo` all come through here.
#
#   scripts/setup.sh              virtualenv (.venv), CRIU >= 4.0 + matching pycriu, simulator build
#   scripts/setup.sh --node-build what `make node-wheels` needs and nothing of the simulator: the
#                                 virtualenv and CRIU built from source in the cache (criu-plugin.h,
#                                 pycriu), installed nowhere; no simulator, no plugin installed
#
# It is idempotent and caches its slow steps (the CRIU build under $NPUSNAP_CACHE), so a second
# run takes seconds. Every failure names what is missing and how to fix it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CRIU_VERSION=${NPUSNAP_CRIU_VERSION:-4.2.1}
if [ "$(id -u)" = 0 ]; then
    CACHE=${NPUSNAP_CACHE:-/var/cache/npusnap}
else
    CACHE=${NPUSNAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npusnap}
fi
VENV=$ROOT/.venv
CRIU_SRC=$CACHE/criu-$CRIU_VERSION
CRIU_PREFIX=${NPUSNAP_CRIU_PREFIX:-/usr/local}

say() { printf '[setup] %s\n' "$*" >&2; }
die() {
    printf '[setup] ERROR: %s\n' "$1" >&2
    [ $# -gt 1 ] && printf '[setup]   fix: %s\n' "$2" >&2
    exit 1
}

is_root() { [ "$(id -u)" = 0 ]; }

# --- Python: the CLI needs 3.10+ ------------------------------------------------------------
pick_python() {
    local c
    for c in ${NPUSNAP_PYTHON:-} python3 python3.13 python3.12 python3.11 python3.10 \
        "$HOME"/.pyenv/versions/3.1[0-3]*/bin/python3; do
        [ -n "$c" ] || continue
        command -v "$c" >/dev/null 2>&1 || continue
        if "$c" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
            command -v "$c"
            return 0
        fi
    done
    return 1
}

setup_venv() {
    local py stamp want
    if [ ! -x "$VENV/bin/python" ]; then
        py=$(pick_python) || die "no Python 3.10 or newer found" \
            "install one (apt-get install python3 python3-venv) or set NPUSNAP_PYTHON=/path/to/python3"
        say "creating virtualenv .venv with $py"
        "$py" -m venv "$VENV" || die "could not create $VENV" "apt-get install python3-venv"
    fi
    stamp=$VENV/.npusnap-installed
    want=$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        say "installing npusnap and its dependencies into .venv"
        "$VENV/bin/python" -m pip install --quiet --upgrade pip >"$CACHE/pip-upgrade.log" 2>&1 ||
            die "pip could not upgrade itself" "check access to the Python package index"
        # compat: the editable install is one path line in a .pth. The default (a flat layout gets
        # an import finder that site loads) costs 10-30 ms on every start, `npusnap --help` included
        # (bench/startup.py). setuptools calls compat transitional; where it is gone, the default.
        "$VENV/bin/python" -m pip install --quiet -e "$ROOT[dev]" --config-settings editable_mode=compat \
            >"$CACHE/pip-install.log" 2>&1 || {
            say "  the compat editable install failed; installing with setuptools' default editable mode"
            "$VENV/bin/python" -m pip install --quiet -e "$ROOT[dev]" >>"$CACHE/pip-install.log" 2>&1
        } || {
            tail -n 30 "$CACHE/pip-install.log" >&2
            die "pip install failed (log: $CACHE/pip-install.log)" "check access to the Python package index"
        }
        echo "$want" >"$stamp"
        rm -f "$VENV/.npusnap-pycriu"
    fi
}

# --- CRIU -----------------------------------------------------------------------------------
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

criu_version_of() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1; }

criu_ok() {
    # $1: binary. Usable when it is 4.0+, is the version our pycriu comes from, and `criu check` passes.
    local bin=$1 v
    [ -x "$bin" ] || return 1
    v=$(criu_version_of "$bin")
    [ -n "$v" ] && version_ge "$v" 4.0 && [ "$v" = "$CRIU_VERSION" ] || return 1
    if is_root; then "$bin" check >/dev/null 2>&1 || return 1; fi
    return 0
}

apt_install() {
    is_root || die "missing system packages: $*" "run as root, or: sudo apt-get install -y $*"
    if [ ! -f "$CACHE/.apt-updated" ]; then
        say "apt-get update"
        apt-get update -qq >/dev/null || die "apt-get update failed" "check the machine's apt sources"
        touch "$CACHE/.apt-updated"
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null ||
        die "apt-get install failed for: $*" "run: apt-get install -y $* and read its error"
}

CRIU_BUILD_DEPS="build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
    libprotobuf-dev python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev
    libnftables-dev uuid-dev libdrm-dev xz-utils iproute2 dpkg-dev"

# The Debian mirror this machine already uses, read from its apt configuration (never hard-coded).
debian_mirror() {
    local f uri
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        uri=$(awk 'BEGIN{RS=""} /Suites:/ && /Types:/ && !/-security/ {
                 for (i = 1; i <= NF; i++) if ($i == "URIs:") { print $(i+1); exit } }' "$f")
        [ -n "$uri" ] && { echo "$uri"; return 0; }
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        uri=$(awk '$1 ~ /^deb(-src)?$/ && $0 !~ /security/ && $0 ~ /debian/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' "$f")
        [ -n "$uri" ] && { echo "$uri"; return 0; }
    done
    return 1
}

fetch_criu_source() {
    [ -f "$CRIU_SRC/Makefile" ] && return 0
    local tarball work mirror
    tarball=$(ls "$CACHE"/criu_"$CRIU_VERSION".orig.tar.* 2>/dev/null | head -n1 || true)
    if [ -z "$tarball" ]; then
        mirror=$(debian_mirror) || die "cannot find the Debian mirror in this machine's apt configuration" \
            "put CRIU $CRIU_VERSION's source tarball at $CACHE/criu_$CRIU_VERSION.orig.tar.xz"
        # CRIU 4.2.1 (the first release that dumps inet sockets on kernels >= 6.16) is the criu
        # source package of Debian's unstable suite; older pins are found in the newer stable suites.
        # A private apt state leaves the machine's own apt configuration untouched.
        work=$CACHE/apt-src
        local suite
        for suite in ${NPUSNAP_CRIU_SUITES:-sid trixie}; do
            rm -rf "$work" && mkdir -p "$work/lists/partial" "$work/archives/partial"
            echo "deb-src $mirror $suite main" >"$work/sources.list"
            local opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=-"
                -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives" -qq)
            say "fetching CRIU $CRIU_VERSION source (Debian $suite source package, from the machine's apt mirror)"
            apt-get "${opts[@]}" update >/dev/null 2>&1 || { say "  the $suite source index could not be read"; continue; }
            # apt-get source takes an exact version (no pattern): the suite's own 4.2.1-N, if any.
            local version
            version=$(apt-cache "${opts[@]}" showsrc criu 2>/dev/null |
                awk -v want="$CRIU_VERSION-" '$1 == "Version:" && index($2, want) == 1 { print $2; exit }')
            [ -n "$version" ] || { say "  no criu $CRIU_VERSION source package in $suite"; continue; }
            # Only the orig tarball is needed; the .dsc/.debian.tar may 404 on some mirrors.
            (cd "$CACHE" && apt-get "${opts[@]}" source --download-only "criu=$version" >/dev/null 2>&1) || true
            ls "$CACHE"/criu_"$CRIU_VERSION".orig.tar.* >/dev/null 2>&1 && break
        done
        tarball=$(ls "$CACHE"/criu_"$CRIU_VERSION".orig.tar.* 2>/dev/null | head -n1 || true)
        [ -n "$tarball" ] || die "could not download criu_$CRIU_VERSION.orig.tar.xz" \
            "download CRIU $CRIU_VERSION's source tarball into $CACHE and rerun"
    fi
    say "unpacking $(basename "$tarball")"
    rm -rf "$CRIU_SRC.tmp" && mkdir -p "$CRIU_SRC.tmp"
    tar -xf "$tarball" -C "$CRIU_SRC.tmp" --strip-components=1
    mv "$CRIU_SRC.tmp" "$CRIU_SRC"
}

# CRIU keeps its kernel probe (kerndat) between runs only on a tmpfs: as root in /run/criu.kdat.
# Where /run is no tmpfs (these VMs), every CRIU run probes again, and under the writeback of a dump
# that took 0.15 s of the job's frozen time here. CRIU is then built to keep it in KDAT_DIR, a small
# tmpfs only root can write, which setup_kdat_dir mounts (again after a reboot, on the next setup).
KDAT_DIR=/run/npusnap-criu
criu_rundir() {
    if [ "$(findmnt -n -o FSTYPE -T /run 2>/dev/null)" = tmpfs ]; then echo /run; else echo "$KDAT_DIR"; fi
}

build_criu() {
    fetch_criu_source
    local rundir
    rundir=$(criu_rundir)
    if [ -x "$CRIU_SRC/criu/criu" ] && ! grep -qaF "$rundir/criu.kdat" "$CRIU_SRC/criu/criu"; then
        rm -f "$CRIU_SRC/criu/kerndat.o" "$CRIU_SRC/criu/criu" # built for another kerndat place
    fi
    if [ ! -x "$CRIU_SRC/criu/criu" ] || [ ! -f "$CRIU_SRC/lib/pycriu/rpc_pb2.py" ]; then
        say "building CRIU $CRIU_VERSION from source (about a minute on 2 cores)"
        make -C "$CRIU_SRC" -j"$(nproc)" criu RUNDIR="$rundir" >"$CACHE/criu-build.log" 2>&1 ||
            die "CRIU build failed (log: $CACHE/criu-build.log)" "read the log's last lines; missing -dev packages are the usual cause"
        make -C "$CRIU_SRC" lib >>"$CACHE/criu-build.log" 2>&1 ||
            die "building CRIU's lib (pycriu) failed (log: $CACHE/criu-build.log)" "read the log's last lines"
    fi
}

setup_criu() {
    mkdir -p "$CACHE"
    local sys_criu
    sys_criu=$(command -v criu || true)
    [ "$sys_criu" = "$CRIU_PREFIX/sbin/criu" ] && sys_criu="" # ours: rebuilt and reinstalled as needed
    if [ -n "$sys_criu" ] && criu_ok "$sys_criu" && [ -f "$CRIU_SRC/lib/pycriu/rpc_pb2.py" ]; then
        CRIU_BIN=$sys_criu
        return 0
    fi
    # Debian 13 packages CRIU 4.1.1, which cannot dump TCP/UDP sockets on kernels 6.16+: a system
    # criu is used only when it is the version pycriu is built from (checked by criu_ok below).
    dpkg -s $CRIU_BUILD_DEPS >/dev/null 2>&1 || apt_install $CRIU_BUILD_DEPS
    build_criu
    if [ -n "$sys_criu" ] && criu_ok "$sys_criu"; then
        CRIU_BIN=$sys_criu
        return 0
    fi
    if ! cmp -s "$CRIU_SRC/criu/criu" "$CRIU_PREFIX/sbin/criu" || ! criu_ok "$CRIU_PREFIX/sbin/criu"; then
        is_root || die "CRIU $CRIU_VERSION is not installed" "run this setup as root once (it installs CRIU under $CRIU_PREFIX)"
        say "installing CRIU $CRIU_VERSION under $CRIU_PREFIX"
        install -D -m 0755 "$CRIU_SRC/criu/criu" "$CRIU_PREFIX/sbin/criu"
        criu_ok "$CRIU_PREFIX/sbin/criu" || die "CRIU $CRIU_VERSION was built but \`criu check\` fails" \
            "run: $CRIU_PREFIX/sbin/criu check  (kernel features or privileges are missing)"
    fi
    CRIU_BIN=$CRIU_PREFIX/sbin/criu
}

setup_kdat_dir() {
    [ "$(criu_rundir)" = "$KDAT_DIR" ] && is_root || return 0
    [ "$(findmnt -n -o FSTYPE "$KDAT_DIR" 2>/dev/null)" = tmpfs ] && return 0
    [ -L "$KDAT_DIR" ] && die "$KDAT_DIR is a symlink" "remove it (CRIU keeps its kernel probe there) and rerun"
    mkdir -p -m 0700 "$KDAT_DIR"
    if mount -t tmpfs -o size=1m,mode=0700,nosuid,nodev,noexec npusnap-criu "$KDAT_DIR"; then
        say "CRIU keeps its kernel probe in $KDAT_DIR (a tmpfs: /run is none here)"
    else
        say "could not mount a tmpfs on $KDAT_DIR: CRIU probes the kernel on every run (slower, not wrong)"
    fi
}

setup_pycriu() {
    local stamp=$VENV/.npusnap-pycriu
    [ "$(cat "$stamp" 2>/dev/null)" = "$CRIU_VERSION" ] && "$VENV/bin/python" -c 'import pycriu' 2>/dev/null && return 0
    say "installing pycriu $CRIU_VERSION into .venv from the CRIU source"
    "$VENV/bin/python" -m pip install --quiet "$CRIU_SRC/lib" >/dev/null 2>&1 ||
        "$VENV/bin/python" -m pip install --quiet --no-build-isolation "$CRIU_SRC/lib" ||
        die "pip install of pycriu from $CRIU_SRC/lib failed" "rerun: $VENV/bin/pip install $CRIU_SRC/lib"
    "$VENV/bin/python" -c 'import pycriu' || die "pycriu does not import" "see the error above"
    echo "$CRIU_VERSION" >"$stamp"
}

# --- the simulated NPU and the attach payload (C, built from this repository's sources) ---------
setup_native() {
    command -v gcc >/dev/null 2>&1 || apt_install gcc libc6-dev make
    # The simulated tree's error manager is C++, as the real liberror_manager.so (native/npusim).
    command -v g++ >/dev/null 2>&1 || apt_install g++
    # `npusnap attach` on Python 3.9-3.13 drives gdb (with its Python scripting) to a safe point.
    command -v gdb >/dev/null 2>&1 || apt_install gdb
    # The tests watch what an agent opens with strace (an open file in a dump is a restore's risk).
    if is_root; then command -v strace >/dev/null 2>&1 || apt_install strace; fi
    # The agent links libffi in (static, hidden) for its operator wrappers' write tracking; without
    # it every operator launch counts as writing all device memory (native/agent/writes.c).
    [ -f "$(gcc -print-file-name=libffi_pic.a)" ] || dpkg -s libffi-dev >/dev/null 2>&1 || apt_install libffi-dev
    make -s -C "$ROOT/native" NPUSNAP_CACHE="$CACHE" CRIU_VERSION="$CRIU_VERSION" >/dev/null ||
        die "building the simulator (native/) failed" "run: make -C native"
}

# --- the CRIU plugins --------------------------------------------------------------------------
# npusnap_plugin.so (container engines: podman/CRI-O -> runc -> CRIU -> npusnap's agent) and
# npusim_plugin.so (the simulated NPU's device connection, which CRIU cannot dump without it, as
# stock CRIU cannot dump a real NPU's /dev/davinci* without Huawei's plugin). Installed into a
# directory of npusnap's own, /usr/lib/npusnap/criu-plugins (NPUSNAP_CRIU_PLUGIN_DIR=DIR for another
# one; NPUSNAP_CRIU_PLUGIN_DIR=none to skip), never into CRIU's shared /usr/lib/criu: the vendor's
# CRIU (Huawei's fork) loads every plugin there and refuses to run when one has more hooks than its
# own table. npusnap hands its directory to the CRIU it runs; runc/podman/CRI runtimes get it with
# one line, `libdir DIR`, in their CRIU configuration (docs/runbooks/podman.md).
setup_criu_plugin() {
    local name so dir=${NPUSNAP_CRIU_PLUGIN_DIR:-/usr/lib/npusnap/criu-plugins}
    for name in npusnap_plugin.so npusim_plugin.so; do
        so=$ROOT/.build/criu-plugin/$name
        [ -f "$so" ] || die "the CRIU plugin $name was not built ($so)" "run: make -C native/criu-plugin NPUSNAP_CACHE=$CACHE"
    done
    for name in npusnap_plugin.so npusim_plugin.so; do
        [ -f "/usr/lib/criu/$name" ] && say "note: /usr/lib/criu/$name was left by an older setup; CRIU's shared" \
            "plugin directory is not npusnap's any more (remove it if no runc.conf names that directory)"
    done
    [ "$dir" = none ] && return 0
    case $dir in /usr/lib/criu | /usr/lib/criu/ | /usr/local/lib/criu | /usr/lib64/criu)
        die "NPUSNAP_CRIU_PLUGIN_DIR=$dir is CRIU's shared plugin directory" \
            "use a directory of npusnap's own (default /usr/lib/npusnap/criu-plugins) and name it with libdir" ;;
    esac
    if ! is_root; then
        say "not root: the CRIU plugins are not installed; as root: install -D -m 0755 $ROOT/.build/criu-plugin/*.so -t $dir/"
        return 0
    fi
    [ -L "$dir" ] && die "$dir is a symlink" "remove it: npusnap installs its CRIU plugins into a real directory"
    mkdir -p -m 0755 "$dir"
    for name in npusnap_plugin.so npusim_plugin.so; do
        so=$ROOT/.build/criu-plugin/$name
        cmp -s "$so" "$dir/$name" && continue
        install -m 0755 "$so" "$dir/$name.tmp" && mv -f "$dir/$name.tmp" "$dir/$name" ||
            die "cannot install the CRIU plugin $name into $dir" "check $dir, or set NPUSNAP_CRIU_PLUGIN_DIR"
        say "CRIU plugin installed: $dir/$name"
    done
}

# --- Slurm for the distributed-job tests (tests/integration/test_slurm.py starts its own daemons) --
setup_slurm() {
    [ "${NPUSNAP_NO_SLURM:-}" = 1 ] && return 0
    command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && return 0
    is_root || { say "slurm-wlm/munge not installed: the Slurm tests will be skipped"; return 0; }
    apt_install slurmctld slurmd slurm-client munge
}

# Bytecode for the CLI and its libraries: pip leaves none where PYTHONDONTWRITEBYTECODE is set
# (it is on these machines), and then every `npusnap` call compiles typer, click and rich again
# (~30 ms of `npusnap --help`). Quick when everything is compiled already.
compile_bytecode() {
    "$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" "$ROOT/npusnap_cli" "$ROOT/npusnap_sim" \
        "$ROOT/npusnap_workloads" >/dev/null 2>&1 ||
        say "warning: could not precompile the virtualenv's Python files (the CLI works, it starts slower)"
}

# The node wheels' build machine: no simulator is built, no CRIU or plugin installed on it.
node_build() {
    mkdir -p "$CACHE"
    setup_venv
    command -v gcc >/dev/null 2>&1 || apt_install gcc libc6-dev make
    [ -f "$(gcc -print-file-name=libffi_pic.a)" ] || dpkg -s libffi-dev >/dev/null 2>&1 || apt_install libffi-dev
    dpkg -s $CRIU_BUILD_DEPS >/dev/null 2>&1 || apt_install $CRIU_BUILD_DEPS
    build_criu
    say "ok: .venv and CRIU $CRIU_VERSION's source built in $CRIU_SRC (for the node wheels; nothing installed)"
}

main() {
    if [ "${1:-}" = --node-build ]; then
        node_build
        return 0
    fi
    [ $# -eq 0 ] || die "unknown argument: $1" "scripts/setup.sh [--node-build]"
    mkdir -p "$CACHE"
    setup_venv
    setup_criu
    setup_kdat_dir
    setup_pycriu
    compile_bytecode
    setup_native
    setup_criu_plugin
    setup_slurm
    say "ok: .venv ready, CRIU $(criu_version_of "$CRIU_BIN") at $CRIU_BIN"
}

main "$@"
