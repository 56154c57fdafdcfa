"""prefixcache inside other engines (``vllm``: a KV connector for vLLM v1)."""
