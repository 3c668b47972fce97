# The README's two commands. Both do all the set-up on a fresh machine and are fast when re-run:
# the venv is rebuilt only when pyproject.toml changes (the stamp file below is older than it).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# No model hub and no telemetry: everything runs on this machine (and 127.0.0.1).
export HF_HUB_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Extra arguments for the default run, e.g. `make train ARGS="--set iterations=5"`.
ARGS   ?=

.PHONY: setup train test lint typecheck bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first: the 2.13.0 CPU wheel is on disk; an unpinned torch could pull a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	# DeepSpeed builds no ops at install time (DS_BUILD_OPS=0) and must see the torch above.
	DS_BUILD_OPS=0 $(PIP) install --quiet --no-build-isolation "deepspeed>=0.15"
	$(PIP) install --quiet -e '.[dev,gpu]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/ragen train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check ragen_tasks flows tests bench
	$(VENV)/bin/ruff format --check ragen_tasks flows tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/ragen bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
