# dsgpt2: make demo | make test | make bench | make lint | make test-floor | make test-latest | make lock
#         | make image | make test-image
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The exact version of every package that make, CI and the Docker image install (pip constraints, the
# transitive ones included). pyproject.toml keeps ranges for installs into other environments.
LOCK := requirements.lock
# From pip's indexes: PyPI's Linux wheel is the CUDA build (2.6 GB of wheels with its nvidia-* packages),
# unless pip's configuration finds a CPU build first; on a machine without a GPU,
# TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu' names the CPU build. GPU users
# name their own build (TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126'); the
# lock less its torch line constrains everything else.
TORCH_SPEC ?= torch==2.13.0
LOCKED_TORCH := $(shell sed -n 's/^torch==//p' $(LOCK))
STAMP := $(VENV)/.installed
# The floor lane: the oldest torch pyproject.toml admits and the GPU image's, each in an environment of
# its own beside the lock's other packages, where what runs under torch.compile must train as eager.
FLOOR_TORCH ?= 2.7.0 2.11.0
FLOOR_DISK_GB ?= 10
FLOOR_KEEP ?= 1
# Fresh environments with the newest versions the ranges allow: the drift lane, and where a new lock comes from.
LATEST_VENV ?= .venv-latest
# Four workers on two cores: part of the suite's time is spent waiting on processes, servers and
# sockets (two workers left the cores idle for it: 17 minutes against 11 and a half; on the same tree,
# idle, three took 13 min 59 s and four 13 min 4 s, the cores 92 % and 90 % busy; on a fresh clone, four
# took 15 min 19 s and six 15 min 57 s, the cores 92 % busy: more workers only share the same cores).
PYTEST_WORKERS ?= 4

# DeepSpeed compiles its CPU communication op at its first initialize on a machine: done here, with the
# install, rather than inside the first run (or test) that needs it. Nothing to do where CUDA is the device.
define BUILD_DEEPSPEED_OPS
from dsgpt2.train.engine import build_cpu_ops
print("built", build_cpu_ops() or "nothing: the device is not the CPU")
endef
export BUILD_DEEPSPEED_OPS

# The lock as pip constraints for everything but torch. Beside a torch that is not the lock's (a CUDA build
# kept in the environment, the floor lane's releases) the packages that torch pins itself are left to its
# pins (torch 2.11 wants setuptools<82): the lock's versions would refuse the install.
define CONSTRAINTS_BESIDE_TORCH
import re, sys
from importlib.metadata import distribution
def name(req): return re.sub(r"[-_.]+", "-", re.split(r"[\s\[;<>=!~]", req, maxsplit=1)[0]).lower()
lines = open(sys.argv[1]).read().splitlines()
locked = next((line.split("==")[1] for line in lines if line.startswith("torch==")), None)
torch = distribution("torch")
pins = [r for r in torch.requires or () if "extra ==" not in r]
own = set() if torch.version.split("+")[0] == locked else {name(r) for r in pins}
print("\n".join(line for line in lines if line.startswith("#") or name(line) not in own | {"torch"}))
endef
export CONSTRAINTS_BESIDE_TORCH

.PHONY: venv test test-fast test-floor test-latest latest lock demo bench lint docs reference clean image test-image

# pip and setuptools first, at their locked versions: setuptools is also the build backend, held by
# --build-constraint in pip's isolated build environment.
# A torch already in the environment (the CUDA build a GPU user installed first) is kept, and said so,
# unless TORCH_SPEC is given.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	grep -v '^torch==' $(LOCK) > $(VENV)/build-constraints.txt
	$(PIP) install -q -c $(VENV)/build-constraints.txt pip
	@if [ "$(origin TORCH_SPEC)" = file ] && have=$$($(PY) -c 'import torch; print(torch.__version__)' 2>/dev/null) \
	    && [ "$${have%%+*}" != "$(LOCKED_TORCH)" ]; then \
	  echo "keeping torch $$have, found in $(VENV) (the lock's is $(LOCKED_TORCH); make TORCH_SPEC=torch==$(LOCKED_TORCH) replaces it)"; \
	else \
	  echo "$(PIP) install -q $(TORCH_SPEC)"; $(PIP) install -q $(TORCH_SPEC); \
	fi
	$(PY) -c "$$CONSTRAINTS_BESIDE_TORCH" $(LOCK) > $(VENV)/constraints.txt
	$(PIP) install -q -c $(VENV)/constraints.txt --build-constraint $(VENV)/build-constraints.txt setuptools -e ".[dev]"
	@echo "building DeepSpeed's CPU communication op (once per environment, under a minute on two cores; cached in ~/.cache/torch_extensions)"
	$(PY) -c "$$BUILD_DEEPSPEED_OPS" > $(VENV)/deepspeed-ops.log 2>&1 || echo "not built now ($(VENV)/deepspeed-ops.log); the first DeepSpeed run builds it"
	touch $(STAMP)

venv: $(STAMP)

# The suite's processes keep the package's and the tests' bytecode (__pycache__, ignored by git) even where
# the shell says not to write it (PYTHONDONTWRITEBYTECODE): its few hundred Python processes and its
# workers' collections would otherwise compile them from source each time (a third of a second a process,
# 3 of the 7 s a worker takes to collect).
SUITE_ENV = PYTHONDONTWRITEBYTECODE=

test: $(STAMP)
	$(SUITE_ENV) $(PY) -m pytest -x -q -n $(PYTEST_WORKERS) --dist worksteal --durations=25

# The quick lane: no DeepSpeed runs; a test file's module fixtures built once. Three workers: it waits
# less than the whole suite does, and each worker starts its own servers and forks (2026-12-06, 2 idle
# cores: two workers 4:06, three 2:52 and 4.3 CPU-minutes, four 3:07 and 5.4).
FAST_WORKERS ?= 3
test-fast: $(STAMP)
	$(SUITE_ENV) $(PY) -m pytest -x -q -n $(FAST_WORKERS) --dist loadfile -m "not slow"

# Each release of FLOOR_TORCH in .venv-torch<version> (the lock's other packages, torch's own pins), running
# the tests marked floor: compiled against eager on every model path, and a short compiled training
# (DSGPT2_FLOOR_LANE: what is speed, not correctness, such as how many graphs the model compiles into, is
# the lock's torch's to show). PyPI's Linux torch is a CUDA build: an environment takes about 6.5 GB, and
# its install needs FLOOR_DISK_GB free (the wheels unpacked beside it; pip's cache is left out); checked
# first, so a short disk is one line rather than pip's OSError half-way. FLOOR_KEEP=0 removes each
# environment once its tests pass (CI: one at a time on the disk, not both).
test-floor:
	@for v in $(FLOOR_TORCH); do \
	  if [ ! -e .venv-torch$$v/.installed ]; then \
	    free=$$(df -Pk . | awk 'NR == 2 { print int($$4 / 1048576) }'); \
	    if [ "$$free" -lt $(FLOOR_DISK_GB) ]; then \
	      echo "test-floor: installing torch $$v (PyPI's CUDA build) needs about $(FLOOR_DISK_GB) GB free here; $$free GB are"; exit 2; \
	    fi; \
	  fi; \
	  PIP_NO_CACHE_DIR=1 $(MAKE) --no-print-directory venv VENV=.venv-torch$$v TORCH_SPEC=torch==$$v || exit 1; \
	  echo "torch $$v: the floor tests"; \
	  DSGPT2_FLOOR_LANE=1 $(SUITE_ENV) .venv-torch$$v/bin/python -m pytest -x -q -n $(PYTEST_WORKERS) --dist loadfile -m floor -p no:cacheprovider || exit 1; \
	  if [ "$(FLOOR_KEEP)" = 0 ]; then rm -rf .venv-torch$$v; fi; \
	done

# New environments, nothing reused, no lock: what a `pip install dsgpt2` would get today.
latest:
	rm -rf $(LATEST_VENV)
	python3 -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip setuptools
	$(LATEST_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(LATEST_VENV)/bin/python -m pip install -q -e ".[dev]"

# The drift lane: the fast lane on the newest allowed versions (torch stays at TORCH_SPEC).
test-latest: latest
	$(LATEST_VENV)/bin/python -m pip list --format=freeze | grep -iE '^(deepspeed|transformers|tokenizers|pymongo|secantusdb|numpy|starlette|uvicorn)=='
	DSGPT2_UNLOCKED=1 $(LATEST_VENV)/bin/python -m pytest -x -q -n $(PYTEST_WORKERS) --dist loadfile -m "not slow"

# Move the lock forward to the newest allowed versions; then `make test` and commit the lock.
# (torch's local build label is dropped: torch==2.13.0 matches the CPU and the CUDA builds alike.)
FREEZE = python -m pip freeze --all --exclude-editable | grep -v '^dsgpt2==' | sed -E 's/^(torch==[^+]*)\+.*/\1/'
lock: latest
	{ echo "# Generated by make lock from pyproject.toml's ranges (CPython $$($(LATEST_VENV)/bin/python -c 'import platform; print(platform.python_version())'), $(TORCH_SPEC))."; \
	  $(LATEST_VENV)/bin/$(FREEZE); } > $(LOCK)
	@echo "wrote $(LOCK); now: make test, then commit it"

demo: $(STAMP)
	$(VENV)/bin/dsgpt2 demo --out runs/demo

# The benches' anchors that are no dependency of dsgpt2 (datatrove's n-gram decontamination and PII
# formatter): installed beside the environment at fixed versions (dill and multiprocess, which it also
# needs, are in the lock), on the benches' path only.
BENCH_ANCHORS := $(VENV)/bench-anchors
BENCH_ANCHOR_SPECS := datatrove==0.10.1 loguru==0.7.3 humanize==4.17.0
$(BENCH_ANCHORS)/.installed: $(STAMP)
	$(PIP) install -q --target $(BENCH_ANCHORS) --no-deps $(BENCH_ANCHOR_SPECS)
	touch $@

bench: $(STAMP) $(BENCH_ANCHORS)/.installed
	PYTHONPATH=$(BENCH_ANCHORS) $(PY) -m bench

# The image, with docker or podman; where no registry answers, on a Debian base made by debootstrap and
# from a wheelhouse of the lock (made with .venv's pip: docker/image.sh runs make venv for it).
image:
	bash docker/image.sh

# The built image run as a user runs it: the pipeline in a container, then the compose stack.
test-image: image
	bash docker/test-image.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/shellcheck pipelines/*.sh docker/*.sh .ci/run

# The documentation site (docs/, mkdocs.yml) into site/; strict: a warning (a broken link or anchor, a page
# outside the navigation) fails the build. The reference pages are written from the parsers as it builds.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The stored reference pages (docs/reference/) written afresh from the parsers: after a flag changes
# (a test says when they differ from the code).
reference: $(STAMP)
	$(PY) docs/gen_reference.py docs

clean:
	rm -rf runs .pytest_cache .ruff_cache
