"""One sequence through the model: prefill the part of the prompt the cache did not
have, then decode token by token. No threads, no queue: the worker drives this."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from prefixcache.engine.kv import fill_cache
from prefixcache.engine.model import LoadedModel, dtype_of


class Sequence:
    """The model's KV for one sequence and the logits of its last position."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self.cache = DynamicCache(config=loaded.model.config)
        self.length = 0

    def prefill(
        self, tokens: list[int], cached: np.ndarray[Any, Any] | torch.Tensor | None = None, keep: int = 1
    ) -> torch.Tensor:
        """Run ``tokens`` (the whole prompt) through the model; the first ``cached.shape[3]``
        positions come from ``cached`` ([layers, 2, H, T, D]) instead of compute.
        Returns the logits of the last ``keep`` prompt positions ([keep, vocab], float32)."""
        done = 0
        if cached is not None and cached.shape[3] > 0:
            done = int(cached.shape[3])
            if done >= len(tokens):
                raise ValueError("at least one prompt token must be prefilled (its logits start decoding)")
            self.cache = fill_cache(
                cached, self._loaded.model.config, self._loaded.device, dtype_of(self._loaded.kv.dtype)
            )
        self.length = done
        return self._forward(tokens[done:], keep)

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
