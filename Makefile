# `make test` is what CI runs (.ci/run); it builds .venv on a fresh clone.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Every install goes through the lock (pip constraints; `make lock` refreshes it).
# `make test-latest` empties it to run against the newest releases.
CONSTRAINTS ?= constraints.txt
EXTRAS ?= test
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
export CONVEYOR_CONSTRAINTS := $(abspath $(CONSTRAINTS))

.PHONY: venv lint test test-fast test-latest lock run bench-scheduler clean

# A current pip first: the one a Python 3.11 venv ships (23.x) parses every
# requirement with pyparsing and spent ~25 CPU-s more resolving the test extra
# (~62 against ~38 CPU-s, 2 cores). Pinned, like everything else.
$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q pip==26.3

# torch first, so pip takes the local CPU build instead of a CUDA one.
# pip byte-compiles at install on purpose: with PYTHONDONTWRITEBYTECODE set (as
# on the CI machines) Python would otherwise compile torch in every process
# (+1 s an import, in hundreds of test processes).
venv: $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(PIP) install -q $(PIN) torch==2.13.0
	$(PIP) install -q $(PIN) -e ".[$(EXTRAS)]"

# The gate: lint everything, type-check the engine side (config in pyproject.toml),
# and the code's shape (files <= 500 lines, functions <= 60, no import cycle).
LINT := $(VPY) -m ruff check . && $(VPY) tools/check_shape.py && \
	$(VPY) -m mypy conveyor/engine conveyor/executors conveyor/workers conveyor/parallel conveyor/kernels
lint: venv
	$(LINT)

# Two xdist workers, one test file each at a time (module-scoped Ray instances
# and models stay shared): the suite alone keeps about one core busy.
# The CPU kernel (~30 s of compiling) builds on the second core while the
# single-threaded lint runs; the tests then find it built.
TEST_WORKERS ?= 2
test: venv
	$(VPY) -c "from conveyor.kernels import cpu_attention as k; k.load_extension()" & build=$$!; \
	  $(LINT); lint=$$?; wait $$build; exit $$lint
	$(VPY) -m pytest tests/cpu tests/compat -q -n $(TEST_WORKERS) --dist loadfile --durations=10

# The contributor's loop, not CI's: tests/cpu less integration/ (unit/ and the checks beside
# it), without the tests marked ray or slow (markers: pyproject.toml). Under a minute on
# 2 cores. Needs a built venv (`make venv` once); `make test` still runs everything.
test-fast: $(VPY)
	$(VPY) -m pytest tests/cpu --ignore=tests/cpu/integration -m "not ray and not slow" -q -n $(TEST_WORKERS) --dist loadfile

# Not in CI: the whole suite on the newest release of every dependency, in a venv of
# its own, so the next upstream break reaches us before it reaches a user.
test-latest:
	rm -rf .venv-latest
	$(MAKE) test VENV=.venv-latest CONSTRAINTS=

# Refresh the lock: resolve the project's dependencies (test and bench extras too)
# afresh in a scratch venv and pin what pip chose. Run `make test` after it.
lock:
	rm -rf .venv-lock
	$(MAKE) venv VENV=.venv-lock CONSTRAINTS= EXTRAS=test,bench
	{ echo "# The lock: every dependency pinned (pip constraints). Written by \`make lock\`;"; \
	  echo "# Python $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version(), platform.machine())'), $$(date -u +%Y-%m-%d)."; \
	  .venv-lock/bin/pip freeze --exclude-editable | sed "s/^torch==\(.*\)+cpu$$/torch==\1/"; } > constraints.txt
	rm -rf .venv-lock

# `make run`: fresh clone -> local Ray, the demo model served at 127.0.0.1, one request answered.
run: venv
	$(VPY) -m conveyor.cluster.demo

bench-scheduler: venv
	$(VPY) bench/scheduler.py

clean:
	rm -rf $(VENV) .venv-latest .venv-lock
