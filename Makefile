# The two commands of the quick start: `make serve` and `make test`.
# Both create .venv on first use and reuse it afterwards.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-test

.PHONY: test serve lint bench setup clean system-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall when the dependencies change.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# The tests start a real redis-server and run Prometheus's promtool (Debian's redis-server and
# prometheus packages); install them when they are missing.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else \
	    echo "redis-server is missing and cannot be installed without root: apt-get install redis-server" >&2; exit 1; fi; \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else \
	    echo "promtool is missing and cannot be installed without root: apt-get install prometheus" >&2; exit 1; fi; \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }

test: lint system-deps
	$(BIN)/python -m pytest

# Until the OpenAI-compatible server lands, `make serve` runs the built-in demo.
serve: $(STAMP)
	$(BIN)/prefixcache demo

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_match.py
	$(BIN)/python benchmarks/bench_replay.py
	$(BIN)/python benchmarks/bench_tiers.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
