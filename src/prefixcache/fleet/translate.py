"""The cache's tier events in vLLM's event schema: what a publisher sends and what the
vLLM connector hands to vLLM's own publisher.

Only ``TierEntered`` and ``TierLeft`` are translated (the residency a router routes
on); ``BlocksStored`` and the rest say when blocks join or leave the tree, which the
tier events already tell per medium. Partial tail blocks (fewer tokens than
``block_size``) are left out both ways: a router keys whole blocks only.

Order: one cache call records the tier entries of a chain in whatever order its commit
makes them (deepest first into a policy, say). A maximal run of consecutive entries
is therefore sorted by (the speed rank of the tier kind, the block's depth), which
puts every parent before its children: by invariant 4 a new child's parent enters a
tier at least as fast in the same run, or was stored before. Consecutive entries that
chain (same kind and context, each the child of the one before) become one
``BlockStored``. A run of removals is grouped by kind (each kind's keeping its order,
children first), one ``BlockRemoved`` per group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefixcache.events import Event, TierEntered, TierLeft, token_ids
from prefixcache.fleet.wire import BlockRemoved, BlockStored

__all__ = ["stored", "stored_whole", "wire_events"]

WireEvent = BlockStored | BlockRemoved


def wire_events(events: Iterable[Event], block_size: int, kinds: Sequence[str]) -> list[WireEvent]:
    """``events`` as vLLM events; ``kinds`` are the cache's tier kinds, fast to slow."""
    out: list[WireEvent] = []
    run: list[TierEntered | TierLeft] = []  # consecutive events of one sort: they commute
    for event in events:
        if isinstance(event, TierEntered) and len(event.tokens) == 4 * block_size:
            pass
        elif not (isinstance(event, TierLeft) and event.num_tokens == block_size):
            continue
        if run and type(run[0]) is not type(event):
            out += _translate(run, block_size, kinds)
            run = []
        run.append(event)
    out += _translate(run, block_size, kinds)
    return out


def _translate(run: list[TierEntered | TierLeft], block_size: int, kinds: Sequence[str]) -> list[WireEvent]:
    entries = [e for e in run if isinstance(e, TierEntered)]
    if entries:
        return list(stored_whole(entries, block_size, kinds))
    out: list[WireEvent] = []
    rank = _ranks(kinds)
    for left in sorted(run, key=lambda e: rank.get(e.kind, len(rank))):  # stable: children stay first
        last = out[-1] if out else None
        if isinstance(last, BlockRemoved) and last.medium == left.kind:
            last.block_hashes.append(left.key)
        else:
            out.append(BlockRemoved([left.key], left.kind))
    return out


def _ranks(kinds: Sequence[str]) -> dict[str, int]:
    rank: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        rank.setdefault(kind, i)
    return rank


def stored_whole(entries: Iterable[TierEntered], block_size: int, kinds: Sequence[str]) -> list[BlockStored]:
    """Tier entries (a run of them, or a whole residency) as ``BlockStored`` events,
    parents first: whole blocks only, sorted by (the rank of their kind, their depth)."""
    rank = _ranks(kinds)
    whole = [e for e in entries if len(e.tokens) == 4 * block_size]
    return stored(sorted(whole, key=lambda e: (rank.get(e.kind, len(rank)), e.end)), block_size)


def stored(entries: Iterable[TierEntered], block_size: int) -> list[BlockStored]:
    """Entries (in an order where parents come first) as ``BlockStored`` events, the
    consecutive ones that chain joined into one."""
    out: list[BlockStored] = []
    last: TierEntered | None = None
    tokens: list[bytes] = []
    for entry in entries:
        chained = (
            last is not None
            and entry.parent == last.key
            and (entry.kind, entry.namespace, entry.model, entry.adapter)
            == (last.kind, last.namespace, last.model, last.adapter)
        )
        if chained:
            out[-1].block_hashes.append(entry.key)
            tokens.append(entry.tokens)
            assert out[-1].extra_keys is not None
            out[-1].extra_keys.append((entry.namespace, entry.model))
        else:
            _close(out, tokens)
            tokens = [entry.tokens]
            out.append(
                BlockStored(
                    block_hashes=[entry.key],
                    parent_block_hash=entry.parent,
                    token_ids=[],
                    block_size=block_size,
                    lora_id=None,
                    medium=entry.kind,
                    lora_name=entry.adapter,
                    extra_keys=[(entry.namespace, entry.model)],
                )
            )
        last = entry
    _close(out, tokens)
    return out


def _close(out: list[BlockStored], tokens: list[bytes]) -> None:
    """Fill the token ids of the last event from its blocks' token bytes."""
    if out and tokens:
        out[-1].token_ids = token_ids(b"".join(tokens))
