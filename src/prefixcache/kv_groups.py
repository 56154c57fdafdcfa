"""Layer groups: the KV cache of a model whose layers are not all alike.

``KVLayout`` (``config``) describes the frames of one uniform group of attention layers:
every layer keeps K and V of every token. Most models of 2025-26 mix layer kinds, and
vLLM's hybrid KV cache manager (HMA) keeps one KV cache group per kind. A
``GroupedLayout`` lists them as ``LayerGroup``s, each of one ``LayerKind``:

- ``full``: full attention; K and V of every token (a ``KVLayout``'s frames, exactly).
- ``sliding``: sliding-window attention over the last ``window`` tokens; a position
  never reads K or V further back than that.
- ``state``: a recurrent state (Mamba, Gated DeltaNet / linear attention, short
  convolutions) of ``state_bytes`` per layer: no per-token KV, one state per block
  boundary where the cache can resume.

Two sizes follow, for a block of ``B`` tokens and a group of ``n`` layers whose
attention frames take ``b`` bytes a token (``KVLayout.bytes_per_token``) or whose state
takes ``s`` bytes a layer::

    per block (what a cache that can hit at every block boundary stores):
        full     B * b
        sliding  min(B, window) * b          # a hit at the block's end reads only the
                                             # window before it: bounded by the window
        state    n * s                       # the state at the block's end, whatever B

    per prefix of L tokens (what resuming at its end alone needs: vLLM's HMA on the GPU):
        full     L * b
        sliding  min(L, window) * b
        state    n * s                       # one state, at L (0 for L = 0)

A cache whose every block boundary can be a hit (the simulator's and the planner's:
every replayed hit lands on one) must keep the per-block figure; for ``B <= window`` a
sliding group then keeps every token, as a full one does: the window saves bytes in
blocks larger than the window, or where only the ends of prompts are resumed (the
per-prefix figure). A uniform model is one ``full`` group and every figure is its
``KVLayout``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from prefixcache.config import KV_DTYPES, KVLayout, check_int


class LayerKind(StrEnum):
    """What a layer keeps for the tokens before it."""

    FULL = "full"  # K and V of every token
    SLIDING = "sliding"  # K and V of the last ``window`` tokens
    STATE = "state"  # a recurrent state of fixed size (Mamba, linear attention)


KINDS = tuple(k.value for k in LayerKind)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """One KV cache group: ``layers`` layers of one kind. An attention group (full,
    sliding) has ``kv_heads``, ``head_dim`` and ``dtype`` (a ``KVLayout``'s, default
    float16 as there), a sliding one its ``window`` in tokens; a state group has
    ``state_bytes``, the bytes of one layer's state at one boundary (all its parts:
    e.g. a Gated DeltaNet's recurrent state and its convolution's last inputs)."""

    kind: LayerKind
    layers: int
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None
    window: int | None = None
    state_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LayerKind):
            if self.kind not in KINDS:
                raise ValueError(f"unknown layer kind {self.kind!r}; valid: {', '.join(KINDS)}")
            object.__setattr__(self, "kind", LayerKind(self.kind))
        where = f"{self.kind.value} group"
        check_int(f"{where}.layers", self.layers, 1)
        if self.kind is LayerKind.STATE:
            given = [n for n in ("kv_heads", "head_dim", "dtype", "window") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"a state group has state_bytes, not {', '.join(given)} (attention's)")
            check_int(f"{where}.state_bytes (per layer)", self.state_bytes, 1)
            return
        if self.state_bytes is not None:
            raise ValueError(f"a {where} has no state_bytes (a state group's)")
        check_int(f"{where}.kv_heads", self.kv_heads, 1)
        check_int(f"{where}.head_dim", self.head_dim, 1)
        if self.dtype is None:
            object.__setattr__(self, "dtype", "float16")  # KVLayout's default
        elif self.dtype not in KV_DTYPES:
            raise ValueError(f"{where}: unknown kv dtype {self.dtype!r}; valid: {', '.join(KV_DTYPES)}")
        if self.kind is LayerKind.SLIDING:
            check_int(f"{where}.window (tokens)", self.window, 1)
        elif self.window is not None:
            raise ValueError(f"a full group has no window (give kind 'sliding' for one), got {self.window!r}")

    @classmethod
    def full(cls, kv: KVLayout) -> LayerGroup:
        """The one group of a uniform model."""
        return cls(LayerKind.FULL, kv.layers, kv.kv_heads, kv.head_dim, kv.dtype)

    @property
    def kv(self) -> KVLayout | None:
        """The frames of an attention group (``None`` for a state group): its shape and
        bytes per token mean what they mean for a uniform model."""
        if self.kind is LayerKind.STATE:
            return None
        assert self.kv_heads is not None and self.head_dim is not None and self.dtype is not None
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes a token's K and V take in this group's layers were they all kept (0 for a state)."""
        kv = self.kv
        return 0 if kv is None else kv.bytes_per_token

    def tokens_kept(self, block_tokens: int) -> int:
        """Tokens of a block whose K and V the group keeps: all (full), the last
        ``min(B, window)`` (sliding), none (state)."""
        if self.kind is LayerKind.FULL:
            return block_tokens
        if self.kind is LayerKind.SLIDING:
            assert self.window is not None
            return min(block_tokens, self.window)
        return 0

    def bytes_per_block(self, block_tokens: int) -> int:
        """What a cache that can hit at every block boundary stores per block (module doc)."""
        check_int("block_tokens", block_tokens, 1)
        if self.kind is LayerKind.STATE:
            assert self.state_bytes is not None
            return self.layers * self.state_bytes
        return self.tokens_kept(block_tokens) * self.full_bytes_per_token

    def prefix_bytes(self, tokens: int) -> int:
        """What resuming a prefix of ``tokens`` at its end needs (module doc)."""
        check_int("tokens", tokens, 0)
        if self.kind is LayerKind.STATE:
            assert self.state_bytes is not None
            return self.layers * self.state_bytes if tokens else 0
        kept = tokens if self.kind is LayerKind.FULL else min(tokens, self.window or 0)
        return kept * self.full_bytes_per_token

    def label(self) -> str:
        """``52 sliding (window 1,024) x 2 (K, V) x 16 KV heads x 128 dims x bfloat16``."""
        if self.kind is LayerKind.STATE:
            return f"{self.layers} state: {self.state_bytes:,} bytes a layer per block boundary"
        window = f" (window {self.window:,})" if self.kind is LayerKind.SLIDING else ""
        heads = f"{self.kv_heads} KV heads x {self.head_dim} dims x {self.dtype}"
        return f"{self.layers} {self.kind.value}{window} x 2 (K, V) x {heads}"

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], where: str = "layer group") -> LayerGroup:
        """A group from a table of its field names (a TOML ``[[group]]``): unknown keys
        and missing ones are errors that name them."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(names)}")
        missing = [n for n in ("kind", "layers") if n not in table]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        try:
            return cls(**table)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True)
class GroupedLayout:
    """A model's KV cache as its layer groups (at least one), in the model's order of
    first appearance. A uniform model is one full group (``uniform``)."""

    groups: tuple[LayerGroup, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise ValueError("a grouped layout needs at least one layer group")
        for group in self.groups:
            if not isinstance(group, LayerGroup):
                raise ValueError(f"groups must be LayerGroup objects, got {type(group).__name__}")

    @classmethod
    def of(cls, kv: KVLayout) -> GroupedLayout:
        return cls((LayerGroup.full(kv),))

    @property
    def layers(self) -> int:
        return sum(g.layers for g in self.groups)

    @property
    def uniform(self) -> KVLayout | None:
        """The ``KVLayout`` of a model of one full group, else ``None``."""
        if len(self.groups) == 1 and self.groups[0].kind is LayerKind.FULL:
            return self.groups[0].kv
        return None

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes a token takes were every attention layer to keep every token's K and V
        (a sliding layer as a full one: vLLM without HMA; state layers have no per-token KV)."""
        return sum(g.full_bytes_per_token for g in self.groups)

    def bytes_per_block(self, block_tokens: int) -> int:
        """Bytes a block of ``block_tokens`` stores, every group together (module doc)."""
        return sum(g.bytes_per_block(block_tokens) for g in self.groups)

    def stored_bytes_per_token(self, block_tokens: int) -> float:
        """``bytes_per_block(B) / B``: what a cached token costs at that block size (a
        uniform model: its ``bytes_per_token``, exactly)."""
        return self.bytes_per_block(block_tokens) / block_tokens

    def prefix_bytes(self, tokens: int) -> int:
        """Bytes resuming one prefix of ``tokens`` at its end needs (module doc)."""
        return sum(g.prefix_bytes(tokens) for g in self.groups)

    def label(self) -> str:
        return "; ".join(g.label() for g in self.groups)

    @classmethod
    def from_tables(cls, tables: object, where: str = "layout") -> GroupedLayout:
        """A layout from a list of ``LayerGroup.from_mapping`` tables (TOML ``[[group]]``)."""
        if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
            raise ValueError(f"{where}: expected one or more [[group]] tables")
        return cls(tuple(LayerGroup.from_mapping(t, f"{where}: group {i}") for i, t in enumerate(tables, 1)))


for _cls in (LayerGroup, GroupedLayout):
    setattr(_cls, "__pydantic_config__", {"extra": "forbid"})  # noqa: B010  (as config's dataclasses)

AnyLayout = KVLayout | GroupedLayout
"""What the planner sizes with: a uniform model's ``KVLayout`` (every figure as it always
was), or the ``GroupedLayout`` of a model whose layers differ."""


def grouped(layout: AnyLayout) -> GroupedLayout:
    """``layout`` as groups (a ``KVLayout`` is one full group)."""
    return layout if isinstance(layout, GroupedLayout) else GroupedLayout.of(layout)
