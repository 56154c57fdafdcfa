"""Tests that run inside ``.venv-vllm`` (vLLM for CPU and prefixcache), from ``make test``."""
