# Two commands: `make run` (set up, then the end-to-end pipeline on the defaults) and
# `make test` (set up, then the whole test suite). Set-up is skipped when nothing changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test workers (pytest-xdist), one module each at a time: two overlap the suite's waits for
# servers and subprocesses on a 2-core machine (README, Development).
TEST_WORKERS ?= 2
# Keep MLflow, Prefect and Lightning quiet and offline.
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: run test lint bench setup test-tools clean

setup: $(STAMP)

# Install torch first: on a machine without a GPU the CPU build (on disk here) satisfies
# Lightning's torch requirement, so pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q "torch>=2.13,<2.15"; \
	else \
	  $(BIN)/python -m pip install -q torch==2.13.0; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev,postgres,dask]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/journeys pipeline

test: $(STAMP)
	$(BIN)/ruff check journeys flows tests benchmarks scripts
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check journeys flows tests benchmarks scripts
	$(BIN)/ruff format --check journeys flows tests benchmarks scripts

# The PostgreSQL server the shared-servers tests start a throwaway cluster of (Debian's
# package, where missing; .ci/run runs this before the tests).
test-tools:
	bash scripts/install_test_tools.sh

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,bench]"
	$(BIN)/python benchmarks/ingest.py

clean:
	rm -rf $(VENV) data/raw data/journeys data/quarantine data/scores data/reports data/checkpoints mlflow.db mlruns
