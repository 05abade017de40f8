# Shared by podman.sh and kubernetes.md (sourced, not run): builds the runbooks' container image
# locally, without a registry. The rootfs holds busybox, the C workload (tests/data/npu_stepper.c:
# a buffer in device memory, one "step N checksum C" line per step), the simulated CANN tree,
# libnpusnap_agent.so and the shared libraries they need (found with ldd).
#
# On a real node your image already holds your job and CANN; what it must add is
# libnpusnap_agent.so (and LD_PRELOAD + NPUSNAP_AGENT=1 in the container's environment, or the job
# calls npusnap_cli.agent.start()).

# build_npu_image TAG DIR: make the rootfs under DIR and `podman import` it as TAG.
build_npu_image() {
    local tag=$1 dir=$2 repo build lib
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    build=${NPUSNAP_BUILD_DIR:-$repo/.build}
    local root=$dir/rootfs
    mkdir -p "$root"/{bin,opt/npu,run,tmp,proc,sys,dev,etc}
    cp "$(command -v busybox)" "$root/bin/busybox"
    for t in sh sleep cat ls; do ln -s busybox "$root/bin/$t"; done
    cp -a "$build/cann" "$root/opt/npu/cann"
    cp "$build/agent/libnpusnap_agent.so" "$root/opt/npu/"
    cc -O1 -o "$root/opt/npu/npu_stepper" "$repo/tests/data/npu_stepper.c" -L"$build/cann/lib64" -lacl_rt
    for lib in $(LD_LIBRARY_PATH=$build/cann/lib64 ldd "$root/opt/npu/npu_stepper" "$root/opt/npu/libnpusnap_agent.so" \
        "$build"/cann/lib64/*.so | awk '/=>/ && $3 ~ /^\// { print $3; next } $1 ~ /^\// && $1 !~ /:$/ { print $1 }' | sort -u); do
        case $lib in "$build"/*) continue ;; esac
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
    tar -C "$root" -cf "$dir/rootfs.tar" .
    podman import "$dir/rootfs.tar" "$tag" >/dev/null
}

# The simulated NPU's part of a container's arguments (the pages' DEVICE_ARGS): the simulated
# CANN and the simulator's socket (its directory is bind-mounted at the same path). The agent's
# part (LD_PRELOAD, NPUSNAP_AGENT=1) is on the pages themselves.
npu_sim_args() {
    local sim_dir
    sim_dir=$(dirname "$NPUSIM_SOCKET")
    echo "-v $sim_dir:$sim_dir -e ASCEND_HOME_PATH=/opt/npu/cann" \
        "-e LD_LIBRARY_PATH=/opt/npu/cann/lib64 -e NPUSIM_SOCKET=$NPUSIM_SOCKET"
}

# page_block PAGE N: the Nth runnable bash block of the runbook PAGE (podman.md),
# for the scripts to run what the page shows (eval "$(page_block podman.md 3)"). Read with
# npusnap's own Python, which has the Markdown parser (markdown-it-py) scripts/runbooks.py uses.
page_block() {
    local here py=${PYTHON:-python3}
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    case ${NPUSNAP:-} in */*) [ -x "$(dirname "$NPUSNAP")/python" ] && py=$(dirname "$NPUSNAP")/python ;; esac
    "$py" "$here/../../scripts/runbooks.py" --block "$here/$1" "$2"
}

# run_block PAGE N: run that block here, as if pasted (its variables stay set); fails if the page
# has no such block.
run_block() {
    local __block
    __block=$(page_block "$1" "$2") || return 1
    eval "$__block"
}
