"""The connector's saves are stamped per request: a purge or an epoch bump its cache learns
of while a request computes voids that request's later saves (issue 39, finding 9);
requests that start after it store as before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from prefixcache.cache import PrefixCache
from prefixcache.integrations.vllm.scope import Scope
from prefixcache.integrations.vllm.worker import SaveSpec
from prefixcache.integrations.vllm.worker_hooks import WorkerHooks
from test_vllm_parts import N, cpu_caches, worker

T = Scope("t")
TOKENS = tuple(range(100, 100 + 3 * N))

INVALIDATIONS: dict[str, Callable[[PrefixCache], object]] = {
    "purge": lambda cache: cache.purge("t"),
    "bump_epoch": lambda cache: cache.bump_epoch("m@1"),
}


@pytest.mark.parametrize("how", sorted(INVALIDATIONS))
def test_a_request_saving_across_an_invalidation_stores_nothing_after_it(tmp_path: Path, how: str) -> None:
    w = worker(tmp_path, cpu_caches(5))
    hooks = WorkerHooks(w, async_load=False)
    hooks.start_loads([])  # step 1: the request's first block is computed and saved
    hooks.save([SaveSpec("r", T, TOKENS[:N], ((1,),))])
    assert w.lookup(list(TOKENS), T).tokens == N
    INVALIDATIONS[how](w.cache)
    hooks.start_loads([])  # step 2: its next blocks, and the first ones of a request new in this step
    hooks.save([SaveSpec("r", T, TOKENS, ((1, 2, 3),)), SaveSpec("q", T, TOKENS[: 2 * N], ((4, 5),))])
    assert w.lookup(list(TOKENS), T).tokens == 2 * N  # q's (a request of step 2) only: r's third block is not
    assert w.cache.stats().voided_tokens == 3 * N
    hooks.close(5)
