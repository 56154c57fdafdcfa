"""One sequence through the model: prefill the part of the prompt the cache did not
have, in chunks, then decode token by token. No threads, no queue: the worker drives this.

    prefill_steps(tokens, cached)      a generator: each ``next`` runs one chunk
      │  cached KV copied in ─ chunk 0 ─ yield ─ chunk 1 ─ yield ─ ... ─ last chunk ─ return logits
      └─ the caller checks its deadline between chunks, or runs another sequence

``prefill`` runs every chunk at once, for callers that need no stop between them.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from prefixcache.engine.kv import fill_cache
from prefixcache.engine.model import LoadedModel, dtype_of

__all__ = ["Prefill", "Sequence", "full_logits", "run_prefill"]

# The work of one prefill, a chunk per step; its value (StopIteration's) is the logits.
Prefill = Generator[None, None, torch.Tensor]


def run_prefill(steps: Prefill) -> torch.Tensor:
    """Run every step of ``steps``; its logits."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            logits: torch.Tensor = stop.value
            return logits


class Sequence:
    """The model's KV for one sequence and the logits of its last position.

    ``chunk_tokens`` bounds the tokens of one prefill forward (None: the whole suffix
    in one); the KV and the logits are the same either way, within float rounding."""

    def __init__(self, loaded: LoadedModel, chunk_tokens: int | None = None) -> None:
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self._loaded = loaded
        self.chunk_tokens = chunk_tokens
        self.cache = DynamicCache(config=loaded.model.config)
        self.length = 0

    def prefill(
        self, tokens: list[int], cached: np.ndarray[Any, Any] | torch.Tensor | None = None, keep: int = 1
    ) -> torch.Tensor:
        """Run ``tokens`` (the whole prompt) through the model; the first ``cached.shape[3]``
        positions come from ``cached`` ([layers, 2, H, T, D]) instead of compute.
        Returns the logits of the last ``keep`` prompt positions ([keep, vocab], float32)."""
        return run_prefill(self.prefill_steps(tokens, cached, keep))

    def prefill_steps(
        self, tokens: list[int], cached: np.ndarray[Any, Any] | torch.Tensor | None = None, keep: int = 1
    ) -> Prefill:
        """``prefill`` as steps: each ``next`` runs one chunk of at most ``chunk_tokens``.

        NOTE: ``cached`` is copied into the model's cache before the first step ends (it
        may sit in a buffer the caller reuses, or in a tier's memory pinned only until
        then); nothing reads it after that."""
        done = 0
        if cached is not None and cached.shape[3] > 0:
            done = int(cached.shape[3])
            if done >= len(tokens):
                raise ValueError("at least one prompt token must be prefilled (its logits start decoding)")
            self.cache = fill_cache(
                cached, self._loaded.model.config, self._loaded.device, dtype_of(self._loaded.kv.dtype)
            )
        self.length = done
        rest = tokens[done:]
        size = self.chunk_tokens or len(rest)
        kept: list[torch.Tensor] = []
        for begin in range(0, len(rest), size):
            chunk = rest[begin : begin + size]
            # the positions of this chunk among the last ``keep``; logits_to_keep=0 would mean all
            wanted = min(len(chunk), keep - (len(rest) - begin - len(chunk)))
            logits = self._forward(chunk, max(wanted, 1))
            if wanted > 0:
                kept.append(logits)
            if begin + size < len(rest):
                yield
        return kept[0] if len(kept) == 1 else torch.cat(kept)

    def drop_kv(self) -> None:
        """Free the KV (a batch row holds a copy of it now); ``length`` stays."""
        self.cache = DynamicCache(config=self._loaded.model.config)

    def step(self, token: int) -> torch.Tensor:
        """Append one generated token; the logits for the next one."""
        return self._forward([token], 1)[0]

    @torch.inference_mode()
    def _forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self._loaded.device)
        out = self._loaded.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep)
        self.length += len(tokens)
        logits: torch.Tensor = out.logits[0].float().cpu()
        return logits


@torch.inference_mode()
def full_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of ``tokens`` in one uncached pass ([T, vocab]); for tests and benchmarks."""
    ids = torch.tensor([tokens], dtype=torch.long, device=loaded.device)
    logits: torch.Tensor = loaded.model(input_ids=ids).logits[0].float().cpu()
    return logits
