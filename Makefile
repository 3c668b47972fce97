# The README's two commands. Both do all the set-up on a fresh machine and are fast when re-run:
# the venv is rebuilt only when pyproject.toml or requirements.lock changes (the stamp file below is
# older than them). requirements.lock holds the exact versions the tests passed with: `make lock`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
# No model hub and no telemetry: everything runs on this machine (and 127.0.0.1).
export HF_HUB_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Extra arguments for the default run, e.g. `make train ARGS="--set iterations=5"`.
ARGS   ?=

.PHONY: setup train test lint typecheck bench clean lock lock-check images

setup: $(STAMP)

# The install recipe, shared by setup (constrained by the lock) and lock (unconstrained, fresh venv).
# $(1): the venv; $(2): pip options.
define install
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	# torch first: the 2.13.0 CPU wheel is on disk; an unpinned torch could pull a multi-GB CUDA build.
	$(1)/bin/python -m pip install --quiet torch==2.13.0
	# DeepSpeed builds no ops at install time (DS_BUILD_OPS=0) and must see the torch above.
	DS_BUILD_OPS=0 $(1)/bin/python -m pip install --quiet --no-build-isolation $(2) "deepspeed>=0.15"
	$(1)/bin/python -m pip install --quiet $(2) -e '.[dev,gpu]'
endef

$(STAMP): pyproject.toml $(LOCK)
	$(call install,$(VENV),-c $(LOCK))
	$(PY) tools/lock.py check
	touch $(STAMP)

# Re-resolve every dependency in a fresh venv and write requirements.lock (commit it).
lock:
	rm -rf .lock-venv
	$(call install,.lock-venv,)
	.lock-venv/bin/python tools/lock.py write .lock-venv > $(LOCK)
	rm -rf .lock-venv

# Fails (exit 1, naming the problem) when requirements.lock no longer fits pyproject.toml.
lock-check:
	$(PYTHON) tools/lock.py check

# Build and push the three images (where Docker runs), tagged with the short git SHA, and point the
# cluster deployments at them through Prefect variables; then `prefect deploy --all`.
# Needs REGISTRY (e.g. ghcr.io/acme), `docker login` to it, and PREFECT_API_URL.
images:
	@test -n "$(REGISTRY)" || { echo "error: set REGISTRY, e.g. make images REGISTRY=ghcr.io/acme" >&2; exit 2; }
	for kind in cpu gpu vllm; do \
	  ref=$(REGISTRY)/ragen-$$kind:$$(git rev-parse --short HEAD); \
	  docker build -f docker/Dockerfile.$$kind -t $$ref . && docker push $$ref && \
	  prefect variable set ragen_image_$$kind $$ref --overwrite || exit 1; \
	done

train: $(STAMP)
	$(VENV)/bin/ragen train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check ragen_tasks flows tests bench tools
	$(VENV)/bin/ruff format --check ragen_tasks flows tests bench tools

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/ragen bench

clean:
	rm -rf $(VENV) .lock-venv .pytest_cache .mypy_cache .ruff_cache
