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
# time), on a simulated node of its own, beside pytest's workers (NPUSNAP_ZDTM_AFTER=1: after
# them). Its exclusive and cgroup tests wait until the workers are done (--late-after): they mount
# cgroup v1 hierarchies (net_prio...) and set iptables rules that other tests' CRIU dumps trip on
# ("cg: controller net_prio not found"); so do its socket-tcpbuf tests, whose restored connections
# stalled under that load. The tests marked serial run after all of it. Only for
# the whole suite: a run of chosen tests (arguments) skips it.
ZDTM_GO=.build/zdtm-workers-done
ZDTM_LOG=.build/zdtm.log
ZDTM_REPORT=.build/zdtm-report.json
start_zdtm() {
    zpid=
    if [ $# -ne 0 ]; then return 0; fi
    # An earlier run's report must not count as this run's (scripts/suite_time.py reads it).
    rm -f "$ZDTM_GO" "$ZDTM_REPORT"
    if [ "${NPUSNAP_SKIP_ZDTM:-}" = 1 ]; then return 0; fi
    echo "== CRIU zdtm static tests through npusnap (tests/zdtm/parity.py): started ($ZDTM_LOG)"
    $V/python -m tests.zdtm.parity --jobs 2 --report "$ZDTM_REPORT" --late-after "$ZDTM_GO" \
        >"$ZDTM_LOG" 2>&1 &
    zpid=$!
    # Not left waiting for a gate that never opens if this script is stopped.
    trap 'if [ -n "${zpid:-}" ]; then kill "$zpid" 2>/dev/null; fi' EXIT
}
# After pytest: starts zdtm if it was not started beside the workers, and waits for it.
finish_zdtm() {
    if [ "${NPUSNAP_ZDTM_AFTER:-}" = 1 ]; then start_zdtm "$@"; fi
    if [ -z "$zpid" ]; then return 0; fi
    touch "$ZDTM_GO"
    local zrc=0
    wait "$zpid" || zrc=$?
    zpid=
    echo "== CRIU zdtm static tests through npusnap (tests/zdtm/parity.py): exit $zrc"
    cat "$ZDTM_LOG"
    return $zrc
}
# The whole suite runs in NPUSNAP_TEST_JOBS workers (default 2; 3 are faster on 2 cores but
# still fail there: CONTRIBUTING.md), each a node of its own (tests/conftest.py), with zdtm beside
# them, then the tests marked serial alone (the host's one podman, containerd, Slurm); NPUSNAP_TEST_JOBS=1
# runs everything in one process.
JOBS=${NPUSNAP_TEST_JOBS:-2}
t0=$(date +%s)
set +e
# Beside the workers unless asked: a dump of another test's job no longer fails on `npusnap ps`
# or a restore asking its agent which devices are in use (agent_client.PASSING_CLIENT_WAIT_S).
if [ "${NPUSNAP_ZDTM_AFTER:-}" != 1 ]; then start_zdtm "$@"; fi
if [ $# -eq 0 ] && [ "$JOBS" -gt 1 ]; then
    echo "== pytest: $JOBS workers, then the serial tests"
    $V/python -m pytest -n "$JOBS" --dist loadfile -m "not serial" --durations=30 \
        --junitxml=.build/junit-workers.xml
    rc=$?
    finish_zdtm "$@"
    zrc=$?
    $V/python -m pytest -m serial --durations=10 --junitxml=.build/junit-serial.xml
    rc2=$?
    if [ $rc -eq 0 ]; then rc=$rc2; fi
    $V/python scripts/suite_time.py --wall $(($(date +%s) - t0)) --zdtm "$ZDTM_REPORT" \
        .build/junit-workers.xml .build/junit-serial.xml
else
    echo "== pytest"
    $V/python -m pytest "$@"
    rc=$?
    finish_zdtm "$@"
    zrc=$?
fi
set -e
# pytest exits 5 when it collected nothing: that must never pass.
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
if [ $zrc -ne 0 ]; then rc=1; fi
exit $rc
