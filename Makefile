# `make test` is what CI runs (.ci/run); it builds .venv on a fresh clone.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: venv lint test run bench-scheduler clean

$(VPY):
	$(PY) -m venv $(VENV)

# torch first, so pip takes the local CPU build instead of a CUDA one.
# --no-compile: pip byte-compiling every file of torch, ray and transformers
# costs ~45 s of one core; Python compiles the modules it imports on first use.
venv: $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile -e ".[test]"

# The gate: lint everything, type-check the engine side (config in pyproject.toml).
LINT := $(VPY) -m ruff check . && $(VPY) -m mypy engine executors workers parallel kernels
lint: venv
	$(LINT)

# Two xdist workers, one test file each at a time (module-scoped Ray instances
# and models stay shared): the suite alone keeps about one core busy.
# The CPU kernel (~30 s of compiling) builds on the second core while the
# single-threaded lint runs; the tests then find it built.
TEST_WORKERS ?= 2
test: venv
	$(VPY) -c "from kernels import cpu_attention as k; k.load_extension()" & build=$$!; \
	  $(LINT); lint=$$?; wait $$build; exit $$lint
	$(VPY) -m pytest tests/cpu tests/compat -q -n $(TEST_WORKERS) --dist loadfile

# `make run`: fresh clone -> local Ray, the demo model served at 127.0.0.1, one request answered.
run: venv
	$(VPY) -m cluster.demo

bench-scheduler: venv
	$(VPY) bench/scheduler.py

clean:
	rm -rf $(VENV)
