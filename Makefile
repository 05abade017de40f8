# The README's two commands. Both set everything up themselves through scripts/setup.sh.
.PHONY: test demo setup lint unit node-wheels

setup:
	./scripts/setup.sh

# Lint, type check, then every test (unit and integration). Used by .ci/run.
test: setup
	./scripts/test.sh

# The demo trains a real torch_npu model when the torch_npu venv (.build/torch-npu) can be built;
# where it cannot, setup-torch-npu.sh leaves the reason in .build/torch-npu.why, and the demo says
# it and runs its built-in workload.
demo: setup
	./scripts/setup-torch-npu.sh || echo "torch_npu venv not built: the demo runs its built-in workload" >&2
	.venv/bin/npusnap demo

lint: setup
	.venv/bin/ruff check npusnap_cli npusnap_sim npusnap_workloads tests bench agent-dist scripts
	.venv/bin/ruff format --check npusnap_cli npusnap_sim npusnap_workloads tests bench agent-dist scripts
	.venv/bin/mypy
	.venv/bin/python scripts/gencontract.py --check
	.venv/bin/python scripts/genstubs.py --check
	.venv/bin/python scripts/check_imports.py
	.venv/bin/python scripts/check_layers.py --check-doc
	.venv/bin/python scripts/runbooks.py --check

# The node wheels, x86_64 and aarch64 from the same sources (the other architecture cross-compiled),
# and pycriu's, into dist/; scripts/install-node.sh installs them on a node (docs/real-node.md).
# Its set-up builds nothing of the simulator and installs nothing (setup.sh --node-build).
node-wheels:
	./scripts/setup.sh --node-build
	.venv/bin/python scripts/build_node_wheels.py --arch x86_64 --arch aarch64
