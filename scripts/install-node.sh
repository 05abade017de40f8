#!/usr/bin/env bash
# Install npusnap on a node that has CANN and CRIU: the CLI with its agent (a node wheel, built by
# scripts/build_node_wheels.py) into a virtualenv of its own, and npusnap's CRIU plugin into
# npusnap's own plugin directory. Nothing of the simulator is built or installed, and nothing of
# the node's CRIU is touched (neither its binary nor its plugin directory).
#
#   scripts/install-node.sh [--wheels DIR | --wheel FILE] [--prefix DIR] [--plugin-dir DIR]
#                           [--bin-dir DIR|none] [--python PY] [--online]
#   scripts/install-node.sh --uninstall [--prefix DIR]
#
# Layout: PREFIX/versions/<version>/ (a virtualenv per version), PREFIX/current -> the one in
# use, PREFIX/bin/npusnap (runs the current one with the plugin directory), BIN_DIR/npusnap -> it.
# Installing over an existing prefix is the upgrade: the new version gets its own virtualenv and
# `current` moves to it; the older versions stay, because an image holds the agent library of the
# npusnap that dumped it by its path, and CRIU restores that mapping from the same file. Neither
# an upgrade nor --uninstall touches images or npusnap's state (history, records:
# /var/lib/npusnap for root, NPUSNAP_STATE_DIR when set).
#
# The wheel and its dependencies come from DIR only (pip --no-index --find-links DIR): the
# directory scripts/build_node_wheels.py --deps PYVER writes installs offline. --online lets pip
# fetch the dependencies from its configured index instead. With no wheel given, DIR defaults to
# the checkout's dist/; from a checkout with no wheel there, one is built first.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=/opt/npusnap
PLUGIN_DIR=/usr/lib/npusnap/criu-plugins
BIN_DIR=/usr/local/bin
PYTHON=""
WHEELS=""
WHEEL=""
ONLINE=0
ACTION=install
PY_MIN=3.10 # pyproject.toml's requires-python
CRIU_MIN=4.0

say() { printf '[install-node] %s\n' "$*" >&2; }
die() {
    printf '[install-node] ERROR: %s\n' "$1" >&2
    [ $# -gt 1 ] && printf '[install-node]   fix: %s\n' "$2" >&2
    exit 1
}
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case $1 in
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --plugin-dir) PLUGIN_DIR=${2:?--plugin-dir needs a directory}; shift 2 ;;
    --bin-dir) BIN_DIR=${2:?--bin-dir needs a directory or none}; shift 2 ;;
    --python) PYTHON=${2:?--python needs an interpreter}; shift 2 ;;
    --wheels) WHEELS=${2:?--wheels needs a directory}; shift 2 ;;
    --wheel) WHEEL=${2:?--wheel needs a file}; shift 2 ;;
    --online) ONLINE=1; shift ;;
    --uninstall) ACTION=uninstall; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument: $1" "$0 --help" ;;
    esac
done

abspath() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s/%s\n' "$PWD" "$1" ;; esac; }
PREFIX=$(abspath "${PREFIX%/}")
PLUGIN_DIR=$(abspath "${PLUGIN_DIR%/}")
[ "$BIN_DIR" = none ] || BIN_DIR=$(abspath "${BIN_DIR%/}")
MANIFEST=$PREFIX/install-manifest
case $PREFIX in / | /usr | /usr/local | /opt | /etc | /var | /home | /root | "")
    die "--prefix $PREFIX is a system directory" "use a directory of npusnap's own, such as /opt/npusnap" ;;
esac

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# --- what the node must have --------------------------------------------------------------------
pick_python() {
    local c v found=""
    for c in ${PYTHON:-python3 python3.13 python3.12 python3.11 python3.10}; do
        command -v "$c" >/dev/null 2>&1 || continue
        v=$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue
        if version_ge "$v" "$PY_MIN"; then
            "$c" -c 'import venv, ensurepip' 2>/dev/null ||
                die "$c ($v) cannot make virtualenvs (no venv/ensurepip module)" \
                    "install its venv package (Debian/Ubuntu: apt-get install python3-venv; openEuler: dnf install python3)"
            command -v "$c"
            return 0
        fi
        found="$found $c ($v)"
    done
    die "npusnap needs Python $PY_MIN or newer; found:${found:- none}" \
        "install Python $PY_MIN+ and pass --python /path/to/python3 (the job itself may use another Python: docs/agent.md)"
}

criu_version_of() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1; }

find_criu() {
    # The order npusnap itself looks in (npusnap_cli/criu/binary.py): NPUSNAP_CRIU, when set, alone.
    local c v seen="" candidates
    if [ -n "${NPUSNAP_CRIU:-}" ]; then
        candidates=("$NPUSNAP_CRIU")
    else
        candidates=(/usr/local/sbin/criu /usr/local/bin/criu /usr/sbin/criu /usr/bin/criu "$(command -v criu 2>/dev/null || true)")
    fi
    for c in "${candidates[@]}"; do
        if [ -z "$c" ] || [ ! -x "$c" ]; then continue; fi
        v=$(criu_version_of "$c")
        if [ -n "$v" ] && version_ge "$v" "$CRIU_MIN"; then
            printf '%s %s\n' "$c" "$v"
            return 0
        fi
        seen="$seen $c (${v:-version unknown})"
    done
    if [ -z "$seen" ]; then
        die "CRIU is not installed (npusnap saves the host side of a process with CRIU $CRIU_MIN or newer)" \
            "install CRIU $CRIU_MIN+ (4.2+ on kernels 6.16 and newer) from the distribution or from source, then rerun; or set NPUSNAP_CRIU=/path/to/criu"
    fi
    die "CRIU is too old:$seen; npusnap needs $CRIU_MIN or newer" \
        "install CRIU $CRIU_MIN+ (4.2+ on kernels 6.16 and newer; CRIU before 4.0 fails on recent kernels), or set NPUSNAP_CRIU=/path/to/criu"
}

check_plugin_dir() {
    case $PLUGIN_DIR in /usr/lib/criu | /usr/local/lib/criu | /usr/lib64/criu | /usr/local/lib64/criu)
        die "--plugin-dir $PLUGIN_DIR is CRIU's shared plugin directory" \
            "use a directory of npusnap's own (default /usr/lib/npusnap/criu-plugins): the vendor's CRIU loads every plugin of its own directory and refuses one built for another CRIU" ;;
    esac
    [ -L "$PLUGIN_DIR" ] && die "$PLUGIN_DIR is a symlink" "remove it: npusnap installs its CRIU plugin into a real directory"
    return 0
}

# --- the wheel ----------------------------------------------------------------------------------
ARCH=$(uname -m)

newest_wheel() {
    local w
    for w in "$WHEELS"/npusnap-*-py3-none-linux_"$ARCH".whl; do [ -f "$w" ] && printf '%s\n' "$w"; done | sort -V | tail -n1
}

pick_wheel() {
    if [ -n "$WHEEL" ]; then
        [ -f "$WHEEL" ] || die "no such wheel: $WHEEL" "pass the npusnap-*.whl file scripts/build_node_wheels.py wrote"
        WHEEL=$(abspath "$WHEEL")
        [ -n "$WHEELS" ] || WHEELS=$(dirname "$WHEEL")
    else
        [ -n "$WHEELS" ] || WHEELS=$ROOT/dist
        WHEEL=$(newest_wheel)
        if [ -z "$WHEEL" ] && [ -f "$ROOT/scripts/build_node_wheels.py" ] && [ -d "$ROOT/native" ]; then
            local py=$ROOT/.venv/bin/python
            [ -x "$py" ] || py=$(command -v python3)
            say "no npusnap wheel for $ARCH in $WHEELS: building one from this checkout"
            "$py" "$ROOT/scripts/build_node_wheels.py" --out "$WHEELS" >/dev/null ||
                die "could not build the node wheel" "run: $py $ROOT/scripts/build_node_wheels.py and read its error"
            WHEEL=$(newest_wheel)
        fi
        [ -n "$WHEEL" ] || die "no npusnap wheel for $ARCH in $WHEELS" \
            "pass --wheels DIR (the directory scripts/build_node_wheels.py wrote) or --wheel FILE"
    fi
    WHEELS=$(abspath "$WHEELS")
    case $(basename "$WHEEL") in
    npusnap-*-py3-none-linux_"$ARCH".whl) ;;
    npusnap-*-py3-none-linux_*.whl) die "$(basename "$WHEEL") is not for this machine ($ARCH)" \
        "use the npusnap-*-linux_$ARCH.whl scripts/build_node_wheels.py --arch $ARCH writes" ;;
    *) die "$(basename "$WHEEL") is not a node wheel of npusnap" "use scripts/build_node_wheels.py's npusnap-*-linux_$ARCH.whl" ;;
    esac
    VERSION=$(basename "$WHEEL" | sed 's/^npusnap-\([^-]*\)-.*/\1/')
}

# The wheel's node-build.json against this machine: architecture, glibc.
check_wheel() {
    local py=$1 info need have
    info=$("$py" - "$WHEEL" <<'EOF'
import json, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    try:
        d = json.loads(z.read("npusnap_cli/node-build.json"))
    except KeyError:
        sys.exit("none")
print(d.get("arch", ""), d.get("glibc", "0"), d.get("criu_plugin_header", ""))
EOF
    ) || die "$(basename "$WHEEL") has no npusnap_cli/node-build.json: it is not a node wheel" \
        "build one with scripts/build_node_wheels.py (a plain \`pip wheel .\` carries the simulator and no native parts)"
    read -r WHEEL_ARCH need CRIU_HEADER <<<"$info"
    [ "$WHEEL_ARCH" = "$ARCH" ] || die "the wheel's native parts are for $WHEEL_ARCH, this machine is $ARCH" \
        "use the npusnap-*-linux_$ARCH.whl"
    have=$("$py" -c 'import platform; print(platform.libc_ver()[1] or "0")')
    version_ge "$have" "$need" || die "the wheel's native parts need glibc $need or newer; this node has glibc $have" \
        "build the wheel on a system whose glibc is not newer than the node's (a container of the node's distribution): scripts/build_node_wheels.py"
}

site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# Every directory above the agent library must let other users in, and the library be readable:
# `npusnap run` preloads it into jobs that run as another user (CANN's HwHiAiUser convention).
others_can_read() {
    local p=$1
    [ "$(($(stat -c %a "$p" | sed 's/^/0/') & 04))" -ne 0 ] || return 1
    p=$(dirname "$p")
    while [ "$p" != / ]; do
        [ "$(($(stat -c %a "$p" | sed 's/^/0/') & 01))" -ne 0 ] || { echo "$p"; return 1; }
        p=$(dirname "$p")
    done
}

write_wrapper() {
    local tmp=$PREFIX/bin/.npusnap.tmp
    mkdir -p "$PREFIX/bin"
    cat >"$tmp" <<EOF
#!/bin/sh
# npusnap as scripts/install-node.sh installed it: the version PREFIX/current points at, with the
# CRIU plugin directory it installed npusnap's plugin into (NPUSNAP_CRIU_PLUGIN_DIR overrides).
if [ -z "\${NPUSNAP_CRIU_PLUGIN_DIR:-}" ] && [ -z "\${CRIU_LIBS_DIR:-}" ]; then
    NPUSNAP_CRIU_PLUGIN_DIR='$PLUGIN_DIR'
    export NPUSNAP_CRIU_PLUGIN_DIR
fi
exec '$PREFIX/current/bin/npusnap' "\$@"
EOF
    chmod 0755 "$tmp"
    mv -f "$tmp" "$PREFIX/bin/npusnap"
}

install_plugin() {
    local so=$1 created=0
    if [ ! -d "$PLUGIN_DIR" ]; then
        { mkdir -p "$PLUGIN_DIR" && chmod 0755 "$PLUGIN_DIR"; } || die "cannot create $PLUGIN_DIR" "run as root, or pass --plugin-dir DIR"
        created=1
    fi
    if ! cmp -s "$so" "$PLUGIN_DIR/npusnap_plugin.so"; then
        if ! { install -m 0755 "$so" "$PLUGIN_DIR/.npusnap_plugin.so.tmp" &&
            mv -f "$PLUGIN_DIR/.npusnap_plugin.so.tmp" "$PLUGIN_DIR/npusnap_plugin.so"; }; then
            die "cannot install npusnap_plugin.so into $PLUGIN_DIR" "run as root, or pass --plugin-dir DIR"
        fi
    fi
    [ -f "$PLUGIN_DIR/npusim_plugin.so" ] && say "note: $PLUGIN_DIR/npusim_plugin.so is the simulator's plugin" \
        "(a development setup left it); a node does not need it"
    # Whether this install made the directory: kept from the first install, for --uninstall.
    PLUGIN_DIR_CREATED=$(sed -n 's/^plugin_dir_created //p' "$MANIFEST" 2>/dev/null || true)
    [ -n "$PLUGIN_DIR_CREATED" ] || PLUGIN_DIR_CREATED=$created
}

link_bin() {
    [ "$BIN_DIR" = none ] && return 0
    local link=$BIN_DIR/npusnap
    if [ -e "$link" ] || [ -L "$link" ]; then
        [ -L "$link" ] && [ "$(readlink "$link")" = "$PREFIX/bin/npusnap" ] && return 0
        say "$link exists and is not this install's link ($(readlink "$link" 2>/dev/null || echo 'a file')): left alone"
        say "  run npusnap as $PREFIX/bin/npusnap, or remove $link and rerun (or pass --bin-dir)"
        BIN_LINK=""
        return 0
    fi
    if ! { mkdir -p "$BIN_DIR" && ln -s "$PREFIX/bin/npusnap" "$link"; }; then
        die "cannot link $link" "run as root, or pass --bin-dir DIR (or none)"
    fi
}

do_install() {
    umask 022
    local py criu criu_v found venv fresh=0 sp pip_args log old="" blocked pycriu_v
    local pkgs=()
    case $ARCH in x86_64 | aarch64) ;; *) die "unsupported machine $ARCH" "npusnap's node wheels are for x86_64 and aarch64" ;; esac
    py=$(pick_python) || exit 1
    found=$(find_criu) || exit 1
    read -r criu criu_v <<<"$found"
    check_plugin_dir
    pick_wheel
    check_wheel "$py"
    say "npusnap $VERSION ($(basename "$WHEEL")) into $PREFIX with $py; CRIU $criu_v at $criu (not touched)"
    pip_args=(--disable-pip-version-check --quiet --find-links "$WHEELS")
    [ "$ONLINE" = 1 ] || pip_args+=(--no-index)
    # pycriu is not on the package index: its wheel (built from CRIU's source) comes with npusnap's.
    if ls "$WHEELS"/pycriu-*.whl >/dev/null 2>&1; then
        pkgs=(pycriu)
    elif [ "$ONLINE" = 1 ]; then
        say "warning: no pycriu wheel in $WHEELS: npusnap cannot dump until pycriu is installed into its virtualenv"
    else
        die "no pycriu wheel in $WHEELS (pycriu is not on the package index; npusnap drives CRIU through it)" \
            "put the pycriu wheel built from CRIU $criu_v's source next to the npusnap wheel (scripts/build_node_wheels.py --pycriu-src <criu source>/lib writes one)"
    fi

    [ -L "$PREFIX/current" ] && old=$(basename "$(readlink "$PREFIX/current")")
    mkdir -p "$PREFIX/versions" || die "cannot create $PREFIX" "run as root, or pass --prefix DIR"
    venv=$PREFIX/versions/$VERSION
    if [ ! -x "$venv/bin/python" ]; then
        fresh=1
        "$py" -m venv "$venv" >/dev/null || { rm -rf "$venv"; die "could not create a virtualenv at $venv" "install the venv module of $py"; }
    fi
    log=$PREFIX/versions/.pip-$VERSION.log
    # The same version again replaces its files in place (its path stays what its images name).
    if ! "$venv/bin/python" -m pip install "${pip_args[@]}" --force-reinstall "$WHEEL" "${pkgs[@]}" >"$log" 2>&1; then
        tail -n 15 "$log" >&2
        [ "$fresh" = 1 ] && rm -rf "$venv"
        if grep -q "No matching distribution" "$log"; then
            die "pip found not every dependency in $WHEELS (log: $log)" \
                "build the directory with its dependencies (scripts/build_node_wheels.py --deps $("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')), or pass --online"
        fi
        die "pip could not install $(basename "$WHEEL") (log: $log)" "read the log's last lines above"
    fi
    rm -f "$log"
    "$venv/bin/python" -m compileall -q "$(site_packages "$venv")" >/dev/null 2>&1 || true
    sp=$(site_packages "$venv")
    if [ -e "$sp/npusnap_sim" ] || [ -e "$sp/npusnap_workloads" ]; then
        die "the wheel carried the simulator ($sp/npusnap_sim)" "build the node wheel with scripts/build_node_wheels.py"
    fi
    [ -f "$sp/npusnap_cli/criu/plugin/npusnap_plugin.so" ] ||
        die "the wheel carries no CRIU plugin" "build the node wheel with scripts/build_node_wheels.py"
    blocked=$(others_can_read "$sp/npusnap_cli/agent/lib/libnpusnap_agent.so") || say "warning: other users cannot" \
        "read the agent library (${blocked:-its mode}): jobs of a non-root user (HwHiAiUser) cannot preload it; install under a prefix they can enter"

    install_plugin "$sp/npusnap_cli/criu/plugin/npusnap_plugin.so"
    ln -sfn "versions/$VERSION" "$PREFIX/.current.tmp" && mv -Tf "$PREFIX/.current.tmp" "$PREFIX/current"
    write_wrapper
    BIN_LINK=$BIN_DIR/npusnap
    [ "$BIN_DIR" = none ] && BIN_LINK=""
    link_bin
    {
        echo "version $VERSION"
        echo "plugin_dir $PLUGIN_DIR"
        echo "plugin_dir_created $PLUGIN_DIR_CREATED"
        echo "plugin_sha256 $(sha256sum "$PLUGIN_DIR/npusnap_plugin.so" | cut -d' ' -f1)"
        [ -n "$BIN_LINK" ] && echo "bin_link $BIN_LINK"
    } >"$MANIFEST.tmp" && mv -f "$MANIFEST.tmp" "$MANIFEST"

    "$PREFIX/bin/npusnap" --version >/dev/null || die "the installed npusnap does not start" "run: $PREFIX/bin/npusnap --version"
    pycriu_v=$("$venv/bin/python" -c 'import pycriu; print(getattr(pycriu, "__version__", "?"))' 2>/dev/null || echo none)
    [ "$pycriu_v" = "$criu_v" ] || say "warning: pycriu $pycriu_v does not match CRIU $criu_v; build pycriu from CRIU $criu_v's source (its lib/) and install it:" \
        "$venv/bin/pip install <criu-$criu_v>/lib"
    [ "${criu_v%.*}" = "${CRIU_HEADER%.*}" ] || say "note: npusnap_plugin.so was built against CRIU $CRIU_HEADER's" \
        "criu-plugin.h, this node runs CRIU $criu_v: \`npusnap check\` (criu-plugin-dirs) says whether their hook tables agree"
    [ -n "$old" ] && [ "$old" != "$VERSION" ] && say "upgraded from $old; $PREFIX/versions/$old stays (its images name its agent library)"
    say "ok: npusnap $VERSION: ${BIN_LINK:-$PREFIX/bin/npusnap}; CRIU plugin: $PLUGIN_DIR/npusnap_plugin.so"
    say "next: npusnap check (as root), then docs/real-node.md"
}

do_uninstall() {
    local plugin_dir sum created link kept
    [ -f "$MANIFEST" ] || [ -d "$PREFIX/versions" ] ||
        die "$PREFIX holds no npusnap installed by this script" "pass the --prefix it was installed with"
    plugin_dir=$(sed -n 's/^plugin_dir //p' "$MANIFEST" 2>/dev/null || true)
    sum=$(sed -n 's/^plugin_sha256 //p' "$MANIFEST" 2>/dev/null || true)
    created=$(sed -n 's/^plugin_dir_created //p' "$MANIFEST" 2>/dev/null || true)
    link=$(sed -n 's/^bin_link //p' "$MANIFEST" 2>/dev/null || true)
    if [ -n "$link" ] && [ -L "$link" ] && [ "$(readlink "$link")" = "$PREFIX/bin/npusnap" ]; then
        rm -f "$link" && say "removed $link"
    fi
    if [ -n "$plugin_dir" ] && [ -f "$plugin_dir/npusnap_plugin.so" ]; then
        if [ "$(sha256sum "$plugin_dir/npusnap_plugin.so" | cut -d' ' -f1)" = "$sum" ]; then
            rm -f "$plugin_dir/npusnap_plugin.so" && say "removed $plugin_dir/npusnap_plugin.so"
        else
            say "$plugin_dir/npusnap_plugin.so is not the one this install put there: left alone"
        fi
        [ "$created" = 1 ] && rmdir "$plugin_dir" 2>/dev/null && say "removed $plugin_dir (empty)"
    fi
    rm -rf "${PREFIX:?}/versions" "${PREFIX:?}/current" "${PREFIX:?}/.current.tmp" "${PREFIX:?}/bin" "$MANIFEST"
    if rmdir "$PREFIX" 2>/dev/null; then
        say "removed $PREFIX"
    else
        say "kept in $PREFIX (not installed by this script): $(shopt -s nullglob dotglob; echo "$PREFIX"/*)"
    fi
    if [ -n "${NPUSNAP_STATE_DIR:-}" ]; then kept=$NPUSNAP_STATE_DIR; elif [ "$(id -u)" = 0 ]; then kept=/var/lib/npusnap; else
        kept=${XDG_STATE_HOME:-$HOME/.local/state}/npusnap; fi
    say "kept: npusnap's state and history ($kept) and every image; reinstalling the same version restores them"
}

case $ACTION in
install) do_install ;;
uninstall) do_uninstall ;;
esac
