"""Residency as events: what ``Books.set`` records when a block gains or loses a tier
kind, and the whole residency as the events that would rebuild it (``drain``).

Kept apart from the books so that they stay about deciding moves; both run under the
cache's lock, and an event only holds references (the block's own key and token bytes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefixcache.cache.tree import Block
from prefixcache.events import EventLog, TierEntered, TierLeft

__all__ = ["entered", "record_change", "resident"]


def entered(block: Block, kind: str) -> TierEntered:
    """``block`` entering the tiers of ``kind``, with its context (a root's ``ctx_name``
    is (namespace, model, adapter, tokenizer, extra))."""
    root, parent = block.root, block.parent
    name = root.ctx_name
    model, adapter = (name[1], name[2]) if len(name) >= 3 else ("", None)
    return TierEntered(
        block.key,
        None if parent.is_root else parent.key,
        block.tokens,
        root.owner,
        str(model),
        None if adapter is None else str(adapter),
        kind,
        block.end,
    )


def record_change(events: EventLog, kinds: Sequence[tuple[str, int]], block: Block, old: int, new: int) -> None:
    """Record what a change of ``block``'s tier mask from ``old`` to ``new`` did to each
    kind (``kinds``: (kind, mask of its tiers))."""
    for kind, mask in kinds:
        had, has = old & mask, new & mask
        if has and not had:
            events.record(entered(block, kind))
        elif had and not has:
            events.record(TierLeft(block.key, block.num_tokens, kind))


def resident(blocks: Iterable[Block], kinds: Sequence[tuple[str, int]]) -> list[TierEntered]:
    """The residency of ``blocks`` as events: one per block and kind that holds its
    bytes (a queued write is not announced until it lands), parents before children (a
    parent's ``end`` is below its children's)."""
    out: list[TierEntered] = []
    for block in sorted(blocks, key=_end):
        held = block.res.held if block.res is not None else 0
        out.extend(entered(block, kind) for kind, mask in kinds if held & mask)
    return out


def _end(block: Block) -> int:
    return block.end
