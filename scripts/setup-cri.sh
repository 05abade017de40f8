#!/usr/bin/env bash
# What the Kubernetes tests (tests/integration/test_cri.py) need: a real CRI runtime with the
# CheckpointContainer call, and a Python client for the CRI protocol.
#
#   containerd 2.x   Debian 12 has containerd 1.6 (no CRI checkpoint). Debian's unstable suite has
#                    2.1, whose binary package needs only runc and libc6 >= 2.34 (Debian 12 has
#                    2.36). Its .deb is downloaded with a private apt state (the machine's own apt
#                    configuration and installed packages are untouched) and unpacked with
#                    `dpkg -x` into $CACHE/cri/containerd-VERSION, never installed system-wide.
#   a registry       containerd's CRI restore pulls the checkpoint's base image by digest: Debian's
#                    docker-registry (the distribution registry), unpacked the same way, on 127.0.0.1.
#   the CRI client   the CRI's api.proto from Debian's golang-k8s-cri-api-dev (same suite),
#                    compiled with grpcio-tools into .build/cri/python (api_pb2*.py): the protocol
#                    is never copied by hand. gogoproto options are stripped first when present.
#
# The Debian mirror is the one this machine's apt configuration already names (scripts/setup.sh's
# debian_mirror). Idempotent and cached: a second run only checks. NPUSNAP_NO_CRI=1 skips it all
# (the tests then skip with that reason). Called by scripts/setup-containers.sh.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "$(id -u)" = 0 ]; then
    CACHE=${NPUSNAP_CACHE:-/var/cache/npusnap}
else
    CACHE=${NPUSNAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/npusnap}
fi
SUITE=${NPUSNAP_CRI_SUITE:-sid}
CRI_CACHE=$CACHE/cri
BUILD=${NPUSNAP_BUILD_DIR:-$ROOT/.build}/cri
VENV=$ROOT/.venv

say() { printf '[setup-cri] %s\n' "$*" >&2; }
die() {
    printf '[setup-cri] ERROR: %s\n' "$1" >&2
    [ $# -gt 1 ] && printf '[setup-cri]   fix: %s\n' "$2" >&2
    exit 1
}

[ "${NPUSNAP_NO_CRI:-}" = 1 ] && { say "NPUSNAP_NO_CRI=1: skipped"; exit 0; }

# The mirror from the machine's apt configuration: the same function scripts/setup.sh uses.
# shellcheck source=/dev/null
source <(sed -n '/^debian_mirror()/,/^}/p' "$ROOT/scripts/setup.sh")

apt_opts() {
    local work=$CRI_CACHE/apt
    echo -o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=-" \
        -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives" \
        -o "Dir::State::Status=/dev/null" -o "APT::Sandbox::User=root" -qq
}

# Downloads the newest .deb of each named package from $SUITE into $CRI_CACHE/debs (once).
download_debs() {
    local missing=() pkg mirror work=$CRI_CACHE/apt
    for pkg in "$@"; do
        ls "$CRI_CACHE"/debs/"${pkg}"_*.deb >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    mirror=$(debian_mirror) || die "cannot find the Debian mirror in this machine's apt configuration" \
        "put the .debs of ${missing[*]} (Debian $SUITE) into $CRI_CACHE/debs and rerun"
    mkdir -p "$work/lists/partial" "$work/archives/partial" "$CRI_CACHE/debs"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $SUITE main" >"$work/sources.list"
    say "fetching ${missing[*]} (Debian $SUITE, from the machine's apt mirror)"
    # shellcheck disable=SC2046
    apt-get $(apt_opts) update >"$CRI_CACHE/apt-update.log" 2>&1 ||
        die "could not read the $SUITE package index (log: $CRI_CACHE/apt-update.log)" "check the machine's apt mirror"
    # shellcheck disable=SC2046
    (cd "$CRI_CACHE/debs" && apt-get $(apt_opts) download "${missing[@]}" >"$CRI_CACHE/apt-download.log" 2>&1) ||
        die "apt-get download ${missing[*]} failed (log: $CRI_CACHE/apt-download.log)" \
            "put the .debs into $CRI_CACHE/debs by hand and rerun"
    rm -rf "$work/lists" # the suite's index (~150 MB) is needed only for this download
}

setup_containerd() {
    local deb version prefix
    command -v runc >/dev/null 2>&1 || die "runc is missing" "apt-get install runc (scripts/setup-containers.sh does)"
    download_debs containerd golang-k8s-cri-api-dev docker-registry
    deb=$(ls "$CRI_CACHE"/debs/containerd_*.deb | sort -V | tail -n1)
    version=$(dpkg-deb -f "$deb" Version)
    prefix=$CRI_CACHE/containerd-$version
    if [ ! -x "$prefix/usr/bin/containerd" ]; then
        say "unpacking containerd $version into $prefix (not installed system-wide)"
        rm -rf "$prefix.tmp" && mkdir -p "$prefix.tmp"
        dpkg -x "$deb" "$prefix.tmp"
        mv "$prefix.tmp" "$prefix"
    fi
    "$prefix/usr/bin/containerd" --version >/dev/null 2>&1 ||
        die "containerd $version does not run here" "run: $prefix/usr/bin/containerd --version"
    mkdir -p "$BUILD"
    ln -sfn "$prefix/usr/bin" "$BUILD/bin"
    # The registry the restore pulls the checkpoint's base image from (containerd's CRI restore
    # pulls it by digest even when it is present): Debian's packaging of the distribution
    # registry, unpacked the same way. The tests run it on 127.0.0.1 only.
    deb=$(ls "$CRI_CACHE"/debs/docker-registry_*.deb | sort -V | tail -n1)
    version=$(dpkg-deb -f "$deb" Version)
    prefix=$CRI_CACHE/docker-registry-$version
    if [ ! -x "$prefix/usr/bin/docker-registry" ]; then
        rm -rf "$prefix.tmp" && mkdir -p "$prefix.tmp"
        dpkg -x "$deb" "$prefix.tmp"
        mv "$prefix.tmp" "$prefix"
    fi
    ln -sfn "$prefix/usr/bin/docker-registry" "$BUILD/docker-registry"
}

setup_client() {
    local deb proto stamp want
    deb=$(ls "$CRI_CACHE"/debs/golang-k8s-cri-api-dev_*.deb | sort -V | tail -n1)
    stamp=$BUILD/python/.source
    want="$(basename "$deb") $("$VENV/bin/python" -c 'import grpc_tools, grpc; print(grpc.__version__)' 2>/dev/null || echo none)"
    [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ -f "$BUILD/python/api_pb2_grpc.py" ] && return 0
    "$VENV/bin/python" -c 'import grpc_tools' 2>/dev/null ||
        die "grpcio-tools is not in .venv" "run scripts/setup.sh (it installs the dev dependencies of pyproject.toml)"
    say "generating the Python CRI client from $(basename "$deb")"
    rm -rf "$BUILD/proto" "$BUILD/python.tmp" && mkdir -p "$BUILD/proto" "$BUILD/python.tmp"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$BUILD/proto" --wildcards '*/runtime/v1/api.proto'
    proto=$(find "$BUILD/proto" -name api.proto | head -n1)
    [ -n "$proto" ] || die "no runtime/v1/api.proto in $deb" "check the package's contents: dpkg -c $deb"
    # Older cri-api releases annotate the messages with gogoproto options, which protoc cannot
    # resolve without gogo.proto: drop the import and every (gogoproto.*) option.
    sed -e '/import "github.com\/gogo\/protobuf\/gogoproto\/gogo.proto";/d' \
        -e '/^option (gogoproto\./d' -e 's/ \[(gogoproto\.[^]]*\]//g' "$proto" >"$BUILD/python.tmp/api.proto"
    "$VENV/bin/python" -m grpc_tools.protoc -I "$BUILD/python.tmp" --python_out="$BUILD/python.tmp" \
        --grpc_python_out="$BUILD/python.tmp" "$BUILD/python.tmp/api.proto" ||
        die "protoc could not compile the CRI's api.proto" "see the error above"
    echo "$want" >"$BUILD/python.tmp/.source"
    rm -rf "$BUILD/python" && mv "$BUILD/python.tmp" "$BUILD/python"
}

main() {
    if [ "$(id -u)" != 0 ]; then
        say "not root: the CRI tests will be skipped (containerd needs root)"
        exit 0
    fi
    mkdir -p "$CRI_CACHE"
    setup_containerd
    setup_client
}

main "$@"
