# pdserve: `make demo` and `make test` do all set-up on a fresh machine.
# The virtual environment lives in a cache outside the checkout, keyed by the
# dependency list, so a second run (or a second checkout) reuses it.

SHELL := /bin/bash
PYTHON ?= python3
CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/pdserve
VENV_KEY := $(shell $(PYTHON) scripts/venv-key.py)
VENV_DIR := $(CACHE_DIR)/venv-$(VENV_KEY)
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
DEMO_MODEL := $(CACHE_DIR)/models/tiny-llama
PYTEST_ARGS ?=

.PHONY: venv demo test lint typecheck unit e2e bench crd cluster clean

# Dependencies are installed once per key; the editable install of this checkout
# (a strict link tree that mypy can read) is redone whenever the checkout moves or
# gains a module. Cheap when nothing changed, so it runs every time.
venv:
	@scripts/ensure-venv.sh "$(PYTHON)" "$(VENV_DIR)" "$(VENV)"

demo: venv
	$(PY) -m pdserve demo --model-dir "$(DEMO_MODEL)"

lint: venv
	$(BIN)/ruff check cli operator workers tests
	$(BIN)/ruff format --check cli operator workers tests

typecheck: venv
	$(BIN)/mypy -p pdserve

# Unit and integration tests: real worker processes, no Kubernetes.
unit: venv
	$(BIN)/pytest tests -m "not slow and not cluster" $(PYTEST_ARGS)

# Against a real control plane (etcd, kube-apiserver, controller-manager, scheduler,
# kwok), built from Go modules once per machine (see mk/cluster.mk).
e2e: venv cluster-bin
	$(BIN)/pytest tests/e2e -m "cluster and not slow" $(PYTEST_ARGS)

test: lint typecheck unit e2e

bench: venv
	$(BIN)/pytest tests/bench -m slow -s $(PYTEST_ARGS)

crd: venv
	$(PY) -m pdserve crd -o crds/servingpool.yaml

clean:
	rm -rf build .mypy_cache .pytest_cache .ruff_cache

# Feature-specific targets (the local cluster, ...) live in mk/.
-include mk/*.mk
