"""Choosing the next token, and turning tokens into text that never has to be taken back.

The penalties change the last position's logits before temperature and top_p, as vLLM
applies them (OpenAI defines the first two the same way)::

    repetition_penalty   r   a token of the prompt or the answer so far: logit / r if > 0, else logit * r
    frequency_penalty    f   logit -= f * (times the answer so far has the token)
    presence_penalty     p   logit -= p * (1 if the answer so far has the token)

They need the request's tokens: the worker keeps a ``TokenCounts`` per request and passes
it to every ``sample`` call, which adds the token it picks.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a torch generator takes


PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's and vLLM's)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``seed`` makes a sampled answer reproducible; the
    penalties' defaults change nothing."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be between -2**63 and 2**64 - 1, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop) or len(self.stop) > 4:
            raise ValueError("stop must be at most 4 non-empty strings")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not low <= getattr(self, name) <= high:  # NaN fails too
                raise ValueError(f"{name} must be between {low:g} and {high:g}, got {getattr(self, name)!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class TokenCounts:
    """One request's tokens as the penalties see them: the prompt's (repetition) and how
    many times each token was generated (all three). ``sample`` adds what it picks."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self._prompt = sorted(set(prompt))
        self._generated: Counter[int] = Counter()
        self._prompt_ids: torch.Tensor | None = None  # on the logits' device, made once

    def add(self, token: int) -> None:
        self._generated[token] += 1

    @property
    def generated(self) -> Mapping[int, int]:
        return self._generated

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        if self._prompt_ids is None or self._prompt_ids.device != device:
            self._prompt_ids = torch.tensor(self._prompt, dtype=torch.long, device=device)
        return self._prompt_ids


def penalize(logits: torch.Tensor, params: SamplingParams, history: TokenCounts) -> torch.Tensor:
    """``logits`` ([vocab]) with the penalties applied (a new tensor, of their dtype).

    NOTE: an extreme repetition penalty (5e-324 divides a logit past any float) would
    give inf and then NaN probabilities; computed in float64 and held to the dtype's
    finite range, the favoured tokens tie at its top instead."""
    scores = logits.double()
    vocab, device = scores.shape[-1], scores.device
    pairs = [(t, n) for t, n in history.generated.items() if 0 <= t < vocab]
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
    if params.repetition_penalty != 1.0:
        prompt = history.prompt_ids(device)
        seen = torch.cat([prompt[(prompt >= 0) & (prompt < vocab)], ids])  # a repeat writes the same value
        picked = scores[seen]
        scores[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if pairs:
        counts = torch.tensor([n for _, n in pairs], dtype=scores.dtype, device=device)
        scores[ids] -= params.frequency_penalty * counts + params.presence_penalty
    bound = torch.finfo(logits.dtype).max
    return torch.nan_to_num(scores, nan=-bound, posinf=bound, neginf=-bound).clamp(-bound, bound).to(logits.dtype)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, history: TokenCounts | None = None
) -> int:
    """The next token from the last position's ``logits`` ([vocab]). ``history``, the
    request's ``TokenCounts``, gets the token added; the penalties need it (a caller that
    keeps no counts may sample only without penalties: never one silently dropped)."""
    if params.penalized:
        if history is None:
            raise ValueError("penalties need the request's TokenCounts")
        logits = penalize(logits, params, history)
    token = _pick(logits, params, generator)
    if history is not None:
        history.add(token)
    return token


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scores = logits.double()
    # NOTE: in float64 (which holds a temperature as small as 5e-324) and with the max taken
    # out before dividing, a tiny temperature gives 0 for the top token and -inf for the
    # rest (greedy, its limit), never inf - inf.
    probs = torch.softmax((scores - scores.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set of tokens whose mass reaches top_p, and the top token always
        # (a top_p below float32's smallest number would otherwise keep none).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        outside[0] = False
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """Incremental detokenization with stop sequences.

    Text goes out only once it is final: not while the last bytes are an unfinished
    UTF-8 character, and not while the tail could still become a stop sequence.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._sent = 0
        self.text = ""  # everything sent so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the text that became final (maybe ""). Sets ``stopped``."""
        self._ids.append(token)
        text = self._decode()
        if text.endswith("\ufffd"):
            return ""
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(text[:cut])
        hold = max((n for s in self._stop for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)
        return self._emit(text[: len(text) - hold])

    def flush(self) -> str:
        """The held-back tail, at the end of generation (without a stop sequence)."""
        if self.stopped:
            return ""
        text = self._decode()
        return self._emit(text.rstrip("\ufffd") if text.endswith("\ufffd") else text)

    def _decode(self) -> str:
        return str(self._tokenizer.decode(self._ids, skip_special_tokens=True))

    def _emit(self, final: str) -> str:
        delta = final[self._sent :]
        self._sent = max(self._sent, len(final))
        self.text += delta
        return delta
