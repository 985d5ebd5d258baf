# Two commands on a fresh clone:
#   make run    set up, then train specs/default.yaml on 2 CPU workers (embedded Prefect API, file:// storage)
#   make test   set up, then run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SPEC ?= specs/default.yaml
# torch is installed first, pinned: a plain `torch` requirement on a machine without one pulls a
# multi-GB CUDA build. Without a GPU the pin takes the CPU wheel; override with TORCH_SPEC=... .
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test lint bench serve clean

setup: $(VENV)/.setup-stamp

$(VENV)/.setup-stamp: pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# An old pip (23.x) backtracks for many minutes over boto3/botocore pins; a current one does not.
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	@# The torch chosen above is named again: otherwise the resolver may replace it with a newer (CUDA) build.
	$(BIN)/pip install -q -e '.[test]' "$(TORCH_SPEC)"
	@# The UI test drives Debian's Chromium through Playwright (no browser download); installed
	@# where apt can, else that test is skipped.
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || echo "no Chromium here: the UI test will be skipped"
	@$(BIN)/python -c "import torch, importlib.metadata as md; \
	cuda = sorted(d.metadata['Name'] for d in md.distributions() if d.metadata['Name'].lower().startswith('nvidia-')); \
	print(f'parashift uses torch {torch.__version__} (CUDA {torch.version.cuda or \"none\"}; {len(cuda)} CUDA packages)')"
	@touch $@

run: setup
	$(BIN)/parashift run $(SPEC)

# Three pytest-xdist workers on 2 cores, a file at a time (tests/conftest.py says why and in which
# order): two left a core idle ~12% of the time while tests waited on servers and processes,
# three keep both busy (BENCHMARKS.md, forty-seventh session). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3

# Bytecode caches are written for the run (under __pycache__, ignored by git) even where the
# environment sets PYTHONDONTWRITEBYTECODE: the suite's ~200 Python processes import the
# checkout's modules, and each would compile them again (~0.2 s of CPU for the flow's and the
# trainer's; BENCHMARKS.md, forty-ninth session).
test: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# A local Prefect server + the `parashift` process pool + every deployment + a worker (Ctrl-C stops them).
serve: setup
	$(BIN)/parashift serve

lint: setup
	$(BIN)/ruff check .

bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.train_throughput
	$(BIN)/python -m bench.planner

clean:
	rm -rf $(VENV) parashift-store .pytest_cache
