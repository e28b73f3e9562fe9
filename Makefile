# pdserve: `make demo` and `make test` do all set-up on a fresh machine.
# This checkout's .venv is synced from the committed uv.lock (uv comes from PyPI when
# the machine lacks it); cluster binaries, Helm and the rest are built or fetched into
# caches outside the checkout, keyed by version, so the second run is fast.

SHELL := /bin/bash
PYTHON ?= python3
UV_VERSION := 0.13.9
CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/pdserve
BIN := .venv/bin
PY := $(BIN)/python
DEMO_MODEL := $(CACHE_DIR)/models/tiny-llama
PYTEST_ARGS ?=
# Test processes for `make unit`: most tests wait on worker processes rather than
# compute (the tests' own processes and the workers they start use about one core of
# two over the run), so twice as many processes as cores shortens the run. Files stay
# whole (module fixtures start their workers once), and are handed out in the order
# collected: xdist's default reorders them by test count, which left the long
# one-test files (the fuzz test) and the `starts_first` marker's order to the end.
TEST_WORKERS ?= 4
CODE := base protocol cli operator workers native tests scripts

.PHONY: venv lock demo test lint typecheck unit e2e bench crd clean

# Cheap when nothing changed (a fraction of a second), so every target runs it.
venv:
	@scripts/sync-venv.sh $(UV_VERSION) $(PYTHON)

# After changing a dependency in any pyproject.toml.
lock:
	@$$(scripts/ensure-uv.sh $(UV_VERSION) $(PYTHON)) lock --python $(PYTHON)

demo: venv
	$(BIN)/pdserve demo --model-dir "$(DEMO_MODEL)"

lint: venv
	$(BIN)/ruff check $(CODE)
	$(BIN)/ruff format --check $(CODE)
	$(BIN)/lint-imports --no-cache

# The packages, then the tests (their own folders; tests/cluster is the devcluster
# package): the tests' calls are checked against the packages' types. mypy takes
# packages or files in one run, not both; the second run reads the first one's cache.
TYPED_TESTS := tests/unit tests/integration tests/support tests/bench tests/e2e tests/node
typecheck: venv
	$(BIN)/mypy -p pdserve.base -p pdserve.protocol -p pdserve.cli -p pdserve.operator -p pdserve.workers -p pdserve.native -p pdserve.devcluster
	$(BIN)/mypy $(TYPED_TESTS)

# Unit and integration tests: real worker processes, no Kubernetes.
unit: venv
	$(BIN)/pytest tests -m "not slow and not cluster" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Against a real control plane (etcd, kube-apiserver, controller-manager, scheduler,
# kwok), built from Go modules once per machine (see mk/cluster.mk).
e2e: venv cluster-bin
	$(BIN)/pytest tests/e2e -m "cluster and not slow" $(PYTEST_ARGS)

# Unit and e2e tests at once: the e2e tests mostly wait on the control plane. Each
# target's output is printed whole when it ends.
test: lint typecheck
	$(MAKE) --no-print-directory -j2 --output-sync=target unit e2e

bench: venv
	$(BIN)/pytest tests/bench -m slow -s $(PYTEST_ARGS)

# Every generated file: the CRD from the API models (into the chart, where Helm and
# kustomize read it), routing.json's schema, and deploy/ (the chart rendered).
crd: venv
	$(BIN)/pdserve crd -o charts/pdserve/crds/servingpool.yaml
	$(PY) -m pdserve.protocol.routing > docs/routing.schema.json
	$(MAKE) deploy

# Leaves .venv and the caches: `rm -rf .venv` removes this checkout's environment.
clean:
	rm -rf build out .mypy_cache .pytest_cache .ruff_cache

# Feature-specific targets (the local cluster, ...) live in mk/.
-include mk/*.mk
