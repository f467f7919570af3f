# The two commands of the README:
#   make demo   set up everything from nothing (.venv, torch CPU, deepspeed, pipedialect), then
#               run the main job
#   make test   lint, type-check, the whole test suite and the docs build
# and, for the edit-test loop, `make quick`: lint and every test that stays in the test process.
#
# torch is installed first and pinned: anything that lets pip pick torch itself downloads a
# multi-GB CUDA build. deepspeed's setup.py imports torch, hence --no-build-isolation.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION     ?= 2.13.0
DEEPSPEED_VERSION ?= 0.19.8
STAMP  := $(VENV)/.pipedialect-installed
STRICT := --config-settings editable_mode=strict
# The environment's commands first, as for a user who activated it: DeepSpeed builds its C++ ops
# with the first ninja on PATH, and a different ninja than the tests' rebuilds the cached ops.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo setup develop test quick lint typecheck unit docs clean compat

demo: setup
	$(BIN)/pipedialect demo

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet --no-build-isolation deepspeed==$(DEEPSPEED_VERSION)
	$(BIN)/python -m pip install --quiet $(STRICT) -e '.[deepspeed,demo,dev,docs,hf,testing]'
	touch $(STAMP)

# The strict editable install links files one by one: relink after adding a module.
develop: setup
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation $(STRICT) -e .

# The checks that run in one process each (ruff, mypy, sphinx) share the two cores first, then
# the suite runs; make stops at the first that fails.
test: develop
	$(MAKE) --no-print-directory -j2 --output-sync=target lint typecheck docs
	$(MAKE) --no-print-directory unit

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck:
	$(BIN)/mypy --strict -p pipedialect

# The whole suite, in two runs: the tests that stay in one process (one intra-op thread each) on
# two workers, then the ones that start processes on three: one such test alone keeps about one
# core busy (its ranks wait on each other and on the test), three keep two cores busy.
# Files are not split between workers (--dist loadfile): module fixtures run once.
QUICK := -m "not distributed and not packaging"
# Both runs always run; unit fails if either failed.
# The suite starts hundreds of interpreters (ranks, `pipedialect check`, examples): with
# PYTHONDONTWRITEBYTECODE set, each compiled pipedialect's modules and pytest's rewritten test
# modules again. The test runs write their bytecode (into tests/ and build/, both ignored).
unit quick: export PYTHONDONTWRITEBYTECODE :=
unit:
	$(BIN)/pytest -n 2 --dist loadfile $(QUICK); one=$$?; \
	$(BIN)/pytest -n 3 --dist loadfile -m "(distributed or packaging) and not compat"; two=$$?; \
	test $$one -eq 0 -a $$two -eq 0

# The quick loop (a few minutes): ruff and the tests that start no process and run no pip (the
# `distributed` and `packaging` markers; tests/conftest.py fails a test that starts a process
# without one). `make test` still runs everything.
quick: develop lint
	$(BIN)/pytest -q -n 2 --dist loadfile $(QUICK)

# The Hugging Face tests against the oldest transformers and accelerate the hf extra admits, in
# a venv of their own beside .venv (tests/integrations/test_hf_versions.py; not in make test).
compat: develop
	$(BIN)/pytest -q -m compat

docs:
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf build dist docs/_build .mypy_cache .ruff_cache .pytest_cache
