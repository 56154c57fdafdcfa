"""One sequence through the model: prefill the part of the prompt the cache did not
have, in chunks, then decode token by token. No threads, no queue: the worker drives this.

    prefill_steps(tokens, cached)      a generator of the chunks to run, each run by its driver
      │  cached KV copied in ─ yield chunk 0 <─ send its logits ─ yield chunk 1 <─ ... ─ return logits
      └─ the driver runs a chunk alone (``Chunk.run``) or in one forward with others
         (``batch.Batch.step``), checks deadlines between chunks, or runs another sequence

``prefill`` runs every chunk at once, for callers that need no stop between them.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from prefixcache.engine.kv import fill_cache
from prefixcache.engine.model import LoadedModel, dtype_of

__all__ = ["Chunk", "Prefill", "Sequence", "advance", "full_cache", "full_logits", "run_prefill"]


@dataclass(frozen=True, eq=False)
class Chunk:
    """Prompt tokens to append to ``seq``'s KV in one forward, at positions from
    ``seq.length`` on; the logits of its last ``keep`` positions go back to the prefill."""

    seq: Sequence
    tokens: list[int]
    keep: int

    def run(self) -> torch.Tensor:
        """Run it alone: the logits of its last ``keep`` positions ([keep, vocab], float32)."""
        return self.seq._forward(self.tokens, self.keep)


# The work of one prefill, a step at a time: each step yields the chunk its driver runs
# and sends the logits of back (or None: the step did its own work, nothing to run);
# its value (StopIteration's) is the logits of the prompt's last positions.
Prefill = Generator[Chunk | None, torch.Tensor | None, torch.Tensor]


def advance(steps: Prefill, logits: torch.Tensor | None = None) -> Chunk | torch.Tensor | None:
    """The next step of ``steps`` (its first: no ``logits``), after the logits of the chunk
    it yielded last: the next chunk to run (None: a step that ran on its own), or, once
    done, its logits."""
    try:
        return steps.send(logits)
    except StopIteration as stop:
        value: torch.Tensor = stop.value
        return value


def run_prefill(steps: Prefill) -> torch.Tensor:
    """Run every step of ``steps``, each chunk alone; its logits."""
    step = advance(steps)
    while not isinstance(step, torch.Tensor):
        step = advance(steps, step.run() if step is not None else None)
    return step


class Sequence:
    """The model's KV for one sequence and the logits of its last position.

    ``chunk_tokens`` bounds the tokens of one prefill forward (None: the whole suffix
    in one); the KV and the logits are the same either way, within float rounding."""

    def __init__(self, loaded: LoadedModel, chunk_tokens: int | None = None) -> None:
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self._loaded = loaded
        self.chunk_tokens = chunk_tokens
        self.cache = full_cache()
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
        """``prefill`` as steps: each yields a ``Chunk`` of at most ``chunk_tokens`` to run.

        NOTE: ``cached`` is copied into the model's cache before the first step ends (it
        may sit in a buffer the caller reuses, or in a tier's memory pinned only until
        then); nothing reads it after that."""
        done = 0
        if cached is not None and cached.shape[3] > 0:
            done = int(cached.shape[3])
            if done >= len(tokens):
                raise ValueError("at least one prompt token must be prefilled (its logits start decoding)")
            # NOTE: no model config: a cache with one gives a sliding layer only its window (see full_cache)
            self.cache = fill_cache(cached, None, self._loaded.device, dtype_of(self._loaded.kv.dtype))
        self.length = done
        rest = tokens[done:]
        size = self.chunk_tokens or len(rest)
        kept: list[torch.Tensor] = []
        for begin in range(0, len(rest), size):
            chunk = rest[begin : begin + size]
            # the positions of this chunk among the last ``keep``; logits_to_keep=0 would mean all
            wanted = min(len(chunk), keep - (len(rest) - begin - len(chunk)))
            logits = yield Chunk(self, chunk, max(wanted, 1))
            if logits is None:
                raise RuntimeError("a prefill chunk's driver sent no logits back")
            self.length += len(chunk)
            if wanted > 0:
                kept.append(logits)
        return kept[0] if len(kept) == 1 else torch.cat(kept)

    def drop_kv(self) -> None:
        """Free the KV (a batch row holds a copy of it now); ``length`` stays."""
        self.cache = full_cache()

    def step(self, token: int) -> torch.Tensor:
        """Append one generated token; the logits for the next one."""
        logits = self._forward([token], 1)[0]
        self.length += 1
        return logits

    @torch.inference_mode()
    def _forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        """Append ``tokens`` to the KV (``length`` is the caller's to move)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self._loaded.device)
        out = self._loaded.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep)
        logits: torch.Tensor = out.logits[0].float().cpu()
        return logits


def full_cache() -> DynamicCache:
    """An empty cache that keeps every position of every layer.

    NOTE: not ``DynamicCache(config=...)``, which keeps a sliding layer's last window only:
    a batch row and the prefix cache take a sequence's every position, and the window is
    the masks' to apply (transformers' alone, the packed ones in ``packed.py``), which see
    the same keys either way. Storing only the window is issue #40's."""
    return DynamicCache()


@torch.inference_mode()
def full_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of ``tokens`` in one uncached pass ([T, vocab]); for tests and benchmarks."""
    ids = torch.tensor([tokens], dtype=torch.long, device=loaded.device)
    logits: torch.Tensor = loaded.model(input_ids=ids).logits[0].float().cpu()
    return logits
