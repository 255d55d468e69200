# One-command entry points. `make test` and `make serve` install what is missing into .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install test lint serve serve-mixed bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-install only when the dependency list changes (idempotent).
# On a machine with an NVIDIA GPU the `gpu` extra too (flash-linear-attention's GDN prefill).
EXTRAS  := test$(shell nvidia-smi >/dev/null 2>&1 && echo ,gpu)
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check bole kernels deployments tests benchmarks scripts

# Serve the embedded model on a local Ray cluster: http://127.0.0.1:8000/v1 (prints an openai snippet).
# SERVE_CONFIG=... picks another Serve config; SERVE_FLAGS=--no-ray serves in one process without Ray.
SERVE_CONFIG ?= cluster_configs/local.yaml
serve: install
	$(BIN)/python -m deployments.launch $(SERVE_CONFIG) $(SERVE_FLAGS)

# cluster_configs/mixed.yaml's A100 (TP=2) + GB10 fleet simulated on this CPU machine: a local Ray head with
# the fleet nodes' resources and cluster_configs/overlays/mixed-cpu.yaml (embedded model, CPU bundles,
# 127.0.0.1, gloo). Ctrl-C drains and stops. `serve run cluster_configs/mixed.yaml` stays the real fleet.
MIXED_RESOURCES ?= {"accelerator_type:A100": 1, "gb10": 2}
serve-mixed: install
	$(BIN)/python -m deployments.launch cluster_configs/mixed.yaml --overlay cluster_configs/overlays/mixed-cpu.yaml \
		--num-cpus 8 --resources '$(MIXED_RESOURCES)' $(SERVE_FLAGS)

bench: install
	$(BIN)/python benchmarks/gdn_verify.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
