#!/usr/bin/env bash
# The test command: ruff (lint + format check), mypy --strict, pytest (unit + integration) and
# CRIU's zdtm static tests through npusnap (tests/zdtm/parity.py).
# Called by `make test` after scripts/setup.sh. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
V=.venv/bin
echo "== ruff check"; $V/ruff check npusnap_cli npusnap_sim npusnap_workloads tests bench
echo "== ruff format --check"; $V/ruff format --check npusnap_cli npusnap_sim npusnap_workloads tests bench
echo "== mypy (strict)"; $V/mypy
echo "== generated contract (native/contract/npusnap.toml) fresh"; $V/python scripts/gencontract.py --check
echo "== generated simulator failures (native/npusim/failures.toml) fresh"; $V/python scripts/genstubs.py --check
echo "== no function-local imports of npusnap modules without a reason"; $V/python scripts/check_imports.py
echo "== floors: no import points up, no cycles, docs/internals.md drawn from the code"; $V/python scripts/check_layers.py --check-doc
echo "== container test set-up"; ./scripts/setup-containers.sh
echo "== torch test set-up"; ./scripts/setup-torch.sh
echo "== torch_npu test set-up"; ./scripts/setup-torch-npu.sh
# CRIU's own zdtm static tests, raw CRIU against npusnap, each test an NPU process (two at a
# time), on a simulated node of its own, after pytest's workers and before the serial tests: not
# beside them, for its cgroup tests mount cgroup v1 hierarchies (net_prio...) that the CRIU dumps
# of other tests then fail on ("cg: controller net_prio not found"). Only for the whole suite: a
# run of chosen tests (arguments) skips it.
run_zdtm() {
    if [ $# -ne 0 ] || [ "${NPUSNAP_SKIP_ZDTM:-}" = 1 ]; then return 0; fi
    echo "== CRIU zdtm static tests through npusnap (tests/zdtm/parity.py)"
    $V/python -m tests.zdtm.parity --jobs 2 --report .build/zdtm-report.json
}
# The whole suite runs in NPUSNAP_TEST_JOBS workers (default 2), each a node of its own
# (tests/conftest.py), then zdtm, then the tests marked serial alone (the host's one
# podman, containerd, Slurm); NPUSNAP_TEST_JOBS=1 runs everything in one process.
JOBS=${NPUSNAP_TEST_JOBS:-2}
set +e
if [ $# -eq 0 ] && [ "$JOBS" -gt 1 ]; then
    echo "== pytest: $JOBS workers, then the serial tests"
    $V/python -m pytest -n "$JOBS" --dist loadfile -m "not serial" --durations=30
    rc=$?
    run_zdtm "$@"
    zrc=$?
    $V/python -m pytest -m serial --durations=10
    rc2=$?
    if [ $rc -eq 0 ]; then rc=$rc2; fi
else
    echo "== pytest"
    $V/python -m pytest "$@"
    rc=$?
    run_zdtm "$@"
    zrc=$?
fi
set -e
# pytest exits 5 when it collected nothing: that must never pass.
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
if [ $zrc -ne 0 ]; then rc=1; fi
exit $rc
