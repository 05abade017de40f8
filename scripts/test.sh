#!/usr/bin/env bash
# The test command: ruff (lint + format check), mypy --strict, then pytest (unit + integration).
# Called by `make test` after scripts/setup.sh. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
V=.venv/bin
echo "== ruff check"; $V/ruff check npusnap_cli tests bench
echo "== ruff format --check"; $V/ruff format --check npusnap_cli tests bench
echo "== mypy (strict)"; $V/mypy
echo "== generated contract (native/contract/npusnap.toml) fresh"; $V/python scripts/gencontract.py --check
echo "== generated simulator failures (native/npusim/failures.toml) fresh"; $V/python scripts/genstubs.py --check
echo "== no function-local imports of npusnap_cli without a reason"; $V/python scripts/check_imports.py
echo "== floors: no import points up, no cycles, docs/internals.md drawn from the code"; $V/python scripts/check_layers.py --check-doc
echo "== container test set-up"; ./scripts/setup-containers.sh
echo "== torch test set-up"; ./scripts/setup-torch.sh
echo "== torch_npu test set-up"; ./scripts/setup-torch-npu.sh
echo "== pytest"
set +e
$V/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: that must never pass.
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
