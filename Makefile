# The two commands a user needs:  `make run`  (the pipeline)  and  `make test`  (the tests).
# Each creates or updates the project virtualenv (.venv) first.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
PROFILE ?=

# Every tool's state inside the project and every phone-home off: the `crucible` command and the
# tests set those defaults themselves; other commands run under them through WITH_DEFAULTS (the one
# list is in tasks/runtime/env.py).
WITH_DEFAULTS := $(BIN)/python -m tasks.runtime.env
# stage commands in dvc.yaml (`crucible stage ...`) come from the project virtualenv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install run lint test test-fast test-determinism test-long dvc-repro ui deploy serve clean-env gpu-check

# torch: the CUDA build (with its triton) where `nvidia-smi -L` lists a GPU, from PyTorch's index for
# CUDA $(TORCH_CUDA) (`make install TORCH_CUDA=cu128` for an older driver); the CPU build elsewhere, as
# requirements/torch.txt pins it. `make install GPU=0` forces the CPU build, `GPU=1` the CUDA one.
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
TORCH_CUDA ?= cu130
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements/torch.txt)

install: $(STAMP)

$(STAMP): pyproject.toml requirements/torch.txt requirements/base.txt requirements/lock.txt requirements/data-nodeps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifeq ($(filter-out 0,$(GPU)),)
	$(PIP) install -q -r requirements/torch.txt
else
	$(PIP) install -q "torch==$(TORCH_VERSION)+$(TORCH_CUDA)" \
	    --index-url https://download.pytorch.org/whl/$(TORCH_CUDA) --extra-index-url https://pypi.org/simple
endif
	$(PIP) install -q -r requirements/base.txt -c requirements/lock.txt -c requirements/torch.txt
	$(PIP) install -q --no-deps -r requirements/data-nodeps.txt
	$(PIP) install -q --no-deps -e .
	$(BIN)/python -m tasks.runtime.dvc_plots .
	touch $(STAMP)

# What only the tests need (requirements/test.txt), on top of the runtime install.
$(TEST_STAMP): $(STAMP) requirements/test.txt
	$(PIP) install -q -r requirements/test.txt -c requirements/lock.txt -c requirements/torch.txt
	touch $(TEST_STAMP)

# The whole pipeline as a Prefect flow (one MLflow parent run; DVC state left consistent).
# `make run PROFILE=tiny` runs the small profile in a scratch copy under build/tiny.
run: install
	$(BIN)/crucible run $(if $(PROFILE),--profile $(PROFILE),)

# The same stages under DVC alone.
dvc-repro: install
	$(WITH_DEFAULTS) $(BIN)/dvc repro

# ruff (pyproject.toml [tool.ruff]): lint and format check; `make test` runs it first.
lint: install $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# TEST_WORKERS test processes (pytest-xdist), each test file on one of them; TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install $(TEST_STAMP) lint
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not determinism and not operations and not long"

test-fast: install $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-determinism: install $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m determinism

# The long end-to-end checks kept out of `make test`: determinism (threads, Dask, dvc repro; dvc repro
# and the flow agree, a report-only change reruns only its stages), operations (a Prefect server
# with the deployments; concurrent runs) and long (the stage-level runs of other model families, SIGKILL
# of a stage, register tests that register several versions, dvc.yaml under dvc, the SmolLM2 GGUF),
# a test file per worker as in `make test`.
test-long: install $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "determinism or operations or long"

ui: install
	$(BIN)/crucible ui

# The scheduled deployments (prefect.yaml) on a local Prefect server at 127.0.0.1:4200; Ctrl-C stops.
# (`crucible serve` serves the registered model over HTTP; see docs/operations.md.)
deploy: install
	$(BIN)/crucible deploy

# Deprecated alias of `make deploy`, kept for one release.
serve:
	@echo "make serve is deprecated: it runs the scheduled deployments, now \`make deploy\`" >&2
	@$(MAKE) --no-print-directory deploy

clean-env:
	rm -rf $(VENV)

# The prepared GPU check (benchmarks/gpu_check.py): one table; exits 2 on a machine without a CUDA GPU.
gpu-check: install
	$(WITH_DEFAULTS) $(BIN)/python benchmarks/gpu_check.py
