# dsgpt2: make demo | make test | make bench | make lint
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The wire-protocol test server (mongoeco: MongoDB's protocol over TCP on SQLite, SCRAM auth)
# needs Python >= 3.13, in an environment of its own. Without one the mongo_live tests skip.
WIRE_VENV ?= .venv-wire
WIRE_SPEC ?= mongoeco[wire]==4.11.0
WIRE_STAMP := $(WIRE_VENV)/.installed
WIRE_PYTHON ?= $(shell for p in python3.14 python3.13 $(wildcard $(HOME)/.pyenv/versions/3.1[3-9]*/bin/python3); do \
	v=$$(command -v $$p) && $$v -c 'import sys; sys.exit(sys.version_info < (3, 13))' 2>/dev/null && { echo $$v; break; }; done)

.PHONY: venv wire test test-fast demo bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

$(WIRE_STAMP):
	@if [ -z "$(WIRE_PYTHON)" ]; then \
	  echo "no Python >= 3.13 found: the mongo_live tests will skip (set WIRE_PYTHON=...)"; \
	else \
	  { test -x $(WIRE_VENV)/bin/python || $(WIRE_PYTHON) -m venv $(WIRE_VENV); } && \
	  $(WIRE_VENV)/bin/python -m pip install -q "$(WIRE_SPEC)" && touch $@; \
	fi

wire: $(WIRE_STAMP)

test: $(STAMP) wire
	$(PY) -m pytest -x -q

# The quick lane: no DeepSpeed runs, no wire server.
test-fast: $(STAMP)
	$(PY) -m pytest -x -q -m "not slow"

demo: $(STAMP)
	$(VENV)/bin/dsgpt2 demo --out runs/demo

bench: $(STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/shellcheck pipelines/*.sh .ci/run

clean:
	rm -rf runs .pytest_cache .ruff_cache
