"""Candidate eviction policies (registered in policies.REGISTRY)."""
