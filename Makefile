# One-command entry points. `make test` and `make serve` install what is missing into .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export TRITON_INTERPRET ?= 1

.PHONY: install test lint serve bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-install only when the dependency list changes (idempotent).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check bole kernels tests benchmarks scripts

bench: install
	$(BIN)/python benchmarks/gdn_verify.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
