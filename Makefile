# `make demo` and `make test` each set everything up on a fresh machine: a venv, CPU torch
# 2.13.0 (unless the system Python already imports torch), ddpmon itself, and for the
# integration tests Debian's prometheus package. ddpmon does not depend on torch: it is
# installed here, pinned, because the tests and the demo run DDP jobs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= 2.13.0
JOBS ?= 2

.PHONY: all setup demo lint test test-unit test-fast test-compat bench prometheus chromium dashboards metrics-table clean

all: test

$(VENV)/.ready: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install -q torch==$(TORCH); \
	fi
	$(VENV)/bin/pip install -q -e '.[test]'
	@touch $@

setup: $(VENV)/.ready

prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's prometheus package (for the integration tests)"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null || \
			echo "could not install prometheus: the integration tests will be skipped"; \
		else echo "prometheus not found (and not root): the integration tests will be skipped"; fi; }

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's chromium package (for the report's browser test)"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null || \
			echo "could not install chromium: the report's browser test will be skipped"; \
		else echo "chromium not found (and not root): the report's browser test will be skipped"; fi; }

demo: setup
	$(PY) -m ddpmon.demo

# The gates: ruff (lint, and the format check: `ruff format` fixes it) over the code and the
# tests, and mypy over ddpmon/ (strict on the public API and the shared leaves: pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check ddpmon tests benchmarks tools
	$(VENV)/bin/ruff format --check ddpmon tests benchmarks tools
	$(VENV)/bin/mypy

# Everything: unit, processes, distributed (real multi-process DDP jobs), scenarios,
# integration (Prometheus, promtool, chromium, a torch-free venv) and gpu (skipped without one).
# Two pytest workers, a test file each at a time (JOBS=1: one, nearly twice as long): the jobs
# mostly wait, so two run the suite in 11 to 13 minutes on a 2-core Intel VM and about 20 on a
# 2-core AMD EPYC one; other work on the machine lengthens it (over 20 minutes at a load
# average of 15 to 30). The 25 slowest tests are listed at the end.
test: setup prometheus chromium
	$(PY) -m pytest -q --durations=25 $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile) tests

# The quick loop: tests/unit only, no process started (a unit test that starts one fails);
# under a minute.
test-unit: setup
	$(PY) -m pytest -q tests/unit

# Unit, and the quick tests that start ordinary processes of their own (tests/processes: the
# commands as a user runs them, processes standing in for ranks); no DDP job, nothing to
# install. About a minute, well under the full run.
test-fast: setup
	$(PY) -m pytest -q tests/unit tests/processes

# One torch version in a venv of its own, .venv-torch-<version>: the unit and distributed
# suites (real multi-process gloo jobs). `make test-compat TORCH=2.15.0`; a version other
# than 2.13.0 comes from the package index, PyPI's default (CUDA) build, a few GB, which
# runs on CPU. docs/install.md lists the versions that passed.
test-compat: .venv-torch-$(TORCH)/.ready
	.venv-torch-$(TORCH)/bin/python -c "import sys, torch; print('torch', torch.__version__); \
		sys.exit(torch.__version__.split('+')[0] != '$(TORCH)')"
	.venv-torch-$(TORCH)/bin/python -m pytest -q tests/unit tests/distributed

.venv-torch-%/.ready: pyproject.toml
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/pip install -q torch==$*
	.venv-torch-$*/bin/pip install -q -e '.[test]'
	@# torch before 2.3 was built against NumPy 1 (the tests turn tensors into arrays)
	.venv-torch-$*/bin/python -c "import torch; torch.zeros(1).numpy()" 2>/dev/null || \
		.venv-torch-$*/bin/pip install -q 'numpy<2'
	@touch $@

bench: setup
	$(PY) benchmarks/overhead.py

# Rewrite the generated boards (dashboards/*.json) and Kubernetes manifests of this checkout
# after changing ddpmon/dashboards/ or deploy/prometheus/ddpmon-rules.yml (tools/dashboards.py).
dashboards: setup
	$(PY) -m tools.dashboards --write-repo $(CURDIR)

# Regenerate the metric table in docs/metrics.md from ddpmon/metrics/catalog.py after changing
# the catalog (tools/metrics_table.py).
metrics-table: setup
	$(PY) -m tools.metrics_table docs/metrics.md

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info
