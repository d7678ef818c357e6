# `make test` is what CI runs (.ci/run); it builds .venv on a fresh clone.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: venv lint test run bench-scheduler clean

# A current pip first: the one a Python 3.11 venv ships (23.x) parses every
# requirement with pyparsing and spent ~25 CPU-s more resolving the test extra
# (~62 against ~38 CPU-s, 2 cores). Pinned, like ruff and mypy.
$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q pip==26.3

# torch first, so pip takes the local CPU build instead of a CUDA one.
# pip byte-compiles at install on purpose: with PYTHONDONTWRITEBYTECODE set (as
# on the CI machines) Python would otherwise compile torch in every process
# (+1 s an import, in hundreds of test processes).
venv: $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"

# The gate: lint everything, type-check the engine side (config in pyproject.toml),
# and the code's shape (files <= 500 lines, functions <= 60, no import cycle).
LINT := $(VPY) -m ruff check . && $(VPY) tools/check_shape.py && $(VPY) -m mypy engine executors workers parallel kernels
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
	$(VPY) -m pytest tests/cpu tests/compat -q -n $(TEST_WORKERS) --dist loadfile --durations=10

# `make run`: fresh clone -> local Ray, the demo model served at 127.0.0.1, one request answered.
run: venv
	$(VPY) -m cluster.demo

bench-scheduler: venv
	$(VPY) bench/scheduler.py

clean:
	rm -rf $(VENV)
