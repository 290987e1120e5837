# `make demo` and `make test` are the README's two commands; both set everything up first.
VENV ?= $(HOME)/.cache/edgefl/venv
export EDGEFL_VENV := $(VENV)
BIN := $(VENV)/bin

.PHONY: setup demo test check lint typecheck bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/coordinator demo

test: setup
	$(BIN)/python -m pytest -q

lint:
	$(BIN)/ruff check protocol models edge_agent coordinator export tests benchmarks
	$(BIN)/ruff format --check protocol models edge_agent coordinator export tests benchmarks

typecheck:
	$(BIN)/mypy protocol models edge_agent coordinator export
	# the benchmark scripts import their shared modules (harness, experiment) from benchmarks/
	MYPYPATH=benchmarks $(BIN)/mypy benchmarks/*.py benchmarks/experiment/*.py

check: lint typecheck
