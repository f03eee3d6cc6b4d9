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

test: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest tests

.PHONY: install demo test
