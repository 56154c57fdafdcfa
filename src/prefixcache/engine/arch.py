"""What the packed step serves of a model exactly, read from its config before its weights.

A packed step (``packed.py``) runs many sequences in one forward: one row of position
ids for all of them, attention split back by sequence, every other layer token by token.
A sequence's logits and KV are then those of its forward alone only when

  - a position's rotation depends on that position alone. transformers' RoPE does, for
    every rope type it ships but two whose frequencies follow the largest position in
    the forward (``modeling_rope_utils.dynamic_rope_update``): "dynamic" (NTK) past
    ``max_position_embeddings``, "longrope" (Phi-3, Phi-3.5, Phi-4-mini) past
    ``original_max_position_embeddings``. Below that bound both are static, so such a
    model is served up to it and no further: past it, another tenant's long prompt in the
    same step would change a short prompt's answer, and a prefix's KV would depend on the
    chunks it was prefilled in, which a prefix cache cannot live with.
  - every layer is attention over the prefix's KV: full attention, or a sliding window
    (the packed masks apply it, ``packed.py``). A recurrent layer (Mamba, linear
    attention, short convolutions: a hybrid model) carries a state that is no position's
    KV; it is refused, and so is a layer kind or a rope type this module does not know
    (design invariant 15: never a guess).

``serving`` reads this off a config: an ``Arch`` that the batch and the start log read,
or an ``ArchError`` naming the property that rules the model out.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers.cache_utils import get_layer_types_and_kwargs

__all__ = ["ROPE_BOUNDS", "Arch", "ArchError", "LayerKind", "RopeBound", "serving"]

_DEFAULT_CONTEXT = 2048  # a config that names no max_position_embeddings


class ArchError(ValueError):
    """A model the packed step cannot serve exactly; the message names the property."""


class LayerKind(enum.Enum):
    """The layer kinds served: attention whose KV is the prefix's, each position's own."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"


# Layer kinds (transformers' ``layer_types``) whose state is no position's KV: a hybrid model.
_RECURRENT = frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding"})

# Every rope type transformers ships (``ROPE_INIT_FUNCTIONS`` and "default") -> the config
# property below which its rotation of a position depends on that position alone, or
# None: at every position (its frequencies come from the config alone). A type not here
# is refused. NOTE: "dynamic" and "longrope" are the types ``dynamic_rope_update`` recomputes
# from the forward's largest position; "yarn" and "llama3" rescale once, from the config.
ROPE_BOUNDS: Mapping[str, str | None] = {
    "default": None,
    "linear": None,
    "yarn": None,
    "llama3": None,
    "proportional": None,
    "dynamic": "max_position_embeddings",
    "longrope": "original_max_position_embeddings",
}


@dataclass(frozen=True, slots=True)
class RopeBound:
    """A rope type static only below ``positions``, the value of the config's ``name``."""

    rope_type: str
    name: str
    positions: int


@dataclass(frozen=True, slots=True)
class Arch:
    """What the engine serves of one model: each layer's window, its positions."""

    windows: tuple[int | None, ...]  # per decoder layer: its sliding window, None for full attention
    rope_types: tuple[str, ...]  # its RoPE's types (one per layer type at most); () without RoPE
    max_positions: int  # the model's own context (``max_position_embeddings``)
    bound: RopeBound | None  # the RoPE's static bound, where it is within ``max_positions``

    @property
    def context_length(self) -> int:
        """Positions served exactly: the model's, cut at its RoPE's static bound."""
        return min(self.max_positions, self.bound.positions) if self.bound is not None else self.max_positions

    @property
    def limit(self) -> str:
        """Why the context served is below the model's own, for a client past it; "" when it is not."""
        if self.bound is None or self.bound.positions >= self.max_positions:
            return ""
        return (
            f"its {self.bound.rope_type!r} RoPE is computed exactly only up to its {self.bound.name} "
            f"of {self.bound.positions} positions, below its max_position_embeddings of {self.max_positions}"
        )

    def describe(self) -> str:
        """The start log's account of what is served, and what is not."""
        kinds = Counter("full attention" if w is None else f"sliding window {w}" for w in self.windows)
        layers = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
        rope = f"rope {'/'.join(self.rope_types)}" if self.rope_types else "no rope_parameters"
        text = f"layers: {layers}; {rope}; context {self.context_length} tokens"
        if self.bound is not None:
            text += (
                f" (max_position_embeddings {self.max_positions}): its {self.bound.rope_type!r} RoPE is static only"
                f" up to its {self.bound.name} of {self.bound.positions}; a longer context is not served"
            )
        return text


def serving(config: Any) -> Arch:
    """What the packed step serves of a model with ``config``; ``ArchError`` when it cannot
    serve it exactly at all."""
    text = config.get_text_config(decoder=True)
    windows = _windows(text)
    if getattr(text, "alibi", False):
        raise ArchError("its positions are ALiBi biases (config alibi=true), which the packed step does not give")
    max_positions = int(getattr(text, "max_position_embeddings", None) or _DEFAULT_CONTEXT)
    rope_types, bounds = _rope(text)
    bound = min(bounds, key=lambda b: b.positions, default=None)
    if bound is not None and bound.positions > max_positions:
        bound = None  # static over the whole context
    return Arch(windows, rope_types, max_positions, bound)


def _windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention), from transformers' own layer types,
    the ones its caches are built from."""
    kinds, extra = get_layer_types_and_kwargs(config)
    known = {kind.value for kind in LayerKind}
    found = Counter(kinds)
    if not found.keys() <= known:
        listed = ", ".join(f"{kind} x {n}" for kind, n in sorted(found.items()))
        recurrent = sorted(found.keys() & _RECURRENT)
        if recurrent:
            raise ArchError(
                f"a hybrid model (layers: {listed}): its {', '.join(recurrent)} layers carry a recurrent state,"
                " not a prefix's KV, which the packed step and the prefix cache do not serve; serve it with"
                " vLLM and the prefixcache connector: `prefixcache serve-vllm` (docs/vllm.md, hybrid models)"
            )
        unknown = sorted(found.keys() - known)
        raise ArchError(
            f"layer kinds {', '.join(unknown)} (layers: {listed}) are not ones the engine serves;"
            f" it serves {' and '.join(sorted(known))}"
        )
    windows: list[int | None] = []
    for index, (kind, kwargs) in enumerate(zip(kinds, extra, strict=True)):
        if kind == LayerKind.FULL.value:
            windows.append(None)
            continue
        window = kwargs.get("sliding_window")
        if not isinstance(window, int) or window < 1:
            raise ArchError(f"layer {index} is sliding_attention without a window (sliding_window={window!r})")
        # NOTE: transformers' own masks take the config's one window for every sliding layer
        if window != getattr(config, "sliding_window", None):
            raise ArchError(
                f"layer {index}'s sliding window {window} differs from the model's sliding_window"
                f" {getattr(config, 'sliding_window', None)!r}"
            )
        windows.append(window)
    return tuple(windows)


def _rope(config: Any) -> tuple[tuple[str, ...], list[RopeBound]]:
    """The model's rope types and the bounds below which they are static."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        return (), []  # NOTE: no RoPE parameters: learned or no positions, each token's own id
    if not isinstance(params, Mapping):
        raise ArchError(f"rope_parameters is not a mapping: {params!r}")
    # one set of parameters, or one per layer type (Gemma 3: sliding and full attention)
    sets = [params] if "rope_type" in params or "rope_theta" in params else list(params.values())
    types, bounds = [], []
    for one in sets:
        if not isinstance(one, Mapping):
            raise ArchError(f"rope_parameters are neither one set nor one per layer type: {params!r}")
        rope_type = str(one.get("rope_type", "default"))
        if rope_type not in ROPE_BOUNDS:
            raise ArchError(
                f"rope_type {rope_type!r} is not one whose rotation the engine knows to be each position's own;"
                f" known: {', '.join(ROPE_BOUNDS)}"
            )
        types.append(rope_type)
        name = ROPE_BOUNDS[rope_type]
        if name is not None:
            value = one.get(name, getattr(config, name, None))
            if not isinstance(value, int) or value < 1:
                raise ArchError(f"rope_type {rope_type!r} needs {name}, which the config does not give")
            bounds.append(RopeBound(rope_type, name, value))
    return tuple(dict.fromkeys(types)), bounds
