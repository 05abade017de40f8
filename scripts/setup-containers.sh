#!/usr/bin/env bash
# What the container tests (tests/integration/test_podman.py) need besides scripts/setup.sh:
# podman, runc (Debian 12's crun, podman's default runtime, has no CRIU support), busybox-static
# (the test image's rootfs) and zstd (podman's export archives). Installed with apt as root;
# called by scripts/test.sh. Idempotent: nothing happens when all are present. Then
# scripts/setup-cri.sh: containerd 2.x and the CRI client of the Kubernetes tests.
set -euo pipefail
missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v busybox >/dev/null 2>&1 || missing+=(busybox-static)
command -v zstd >/dev/null 2>&1 || missing+=(zstd)
HERE=$(dirname "${BASH_SOURCE[0]}")
[ ${#missing[@]} -eq 0 ] && exec "$HERE/setup-cri.sh"
if [ "$(id -u)" != 0 ]; then
    echo "[setup-containers] not root: the podman tests will be skipped (missing: ${missing[*]})" >&2
    exit 0
fi
echo "[setup-containers] installing ${missing[*]}" >&2
# Only a stale package list needs an update; an install failure is reported, not hidden.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || {
        echo "[setup-containers] apt-get install ${missing[*]} failed; install them by hand, then rerun" >&2
        exit 1
    }
}
exec "$HERE/setup-cri.sh"
