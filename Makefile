# `make test` and `make demo` work on a fresh machine: they build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint demo clean

venv: $(STAMP)

# torch is pinned to the CPU build that lies on local disk; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q transformers==5.17.0 triton==3.6.0 -e '.[serve,bench,dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check rimuru tests benchmarks scripts
	$(BIN)/python -m pytest tests

# The main job: a tiny demo MoE checkpoint served in each offload mode, replayed with ShareGPT (CPU without a GPU).
demo: $(STAMP)
	$(BIN)/python -m rimuru.demo

lint: $(STAMP)
	$(BIN)/ruff check rimuru tests benchmarks scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
