"""Retention: blocks a client asked to keep (OpenAI's ``prompt_cache_retention``,
Anthropic's ``cache_control``), until a deadline each later hit pushes on, within a cap
of the tenant's own.

::

    retain(span, tenant, seconds)          each block of the span: deadline = now + seconds
        |                                  (a hit later: deadline = max(deadline, now + seconds))
        v
    the tenant's book, per level           level 0: the cache (its capacity in tokens);
    ("cache", then each tier)              level 1 + k: tier k (what it holds of the block)
        |  past the tenant's cap in the cache or the last tier (where retention holds room):
        |  its own oldest retention there expires first
        v
    eviction                               a retained block is never a victim of the cache's
                                           pools, never leaves the last tier, and goes down a
                                           tier (never out) from a faster one

A retained block still goes for the reasons that are not pressure: an epoch bump, a
purge, a TTL, a lost frame. Retention never moves bytes and runs, as the rest of the
ledger, under the cache's lock.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.config import MAX_RETAIN_S

if TYPE_CHECKING:
    from prefixcache.cache.tree import Block
    from prefixcache.config import RetentionConfig

__all__ = ["MAX_RETAIN_S", "Keeper", "Level", "RetainOutcome", "RetainSpan", "Retained", "TenantRetention"]


@dataclass(frozen=True, slots=True)
class RetainSpan:
    """Keep a prompt's first ``tokens`` tokens cached for ``seconds`` (whole blocks of it:
    a span ending inside a block keeps the blocks before it)."""

    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"a retained span's tokens must be an integer >= 0, got {self.tokens!r}")
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or not 0 < s <= MAX_RETAIN_S:
            raise ValueError(f"a retained span's seconds must be in (0, {MAX_RETAIN_S:g}], got {s!r}")


class RetainOutcome(enum.StrEnum):
    """What a request's retention got (the server says it in a response header)."""

    NONE = "none"  # nothing asked
    RETAINED = "retained"  # every cached block of every span
    REQUESTED = "requested"  # asked; not applied yet when the answer went out (the prompt's store runs apart)
    CAPPED = "capped"  # the tenant's cap cut a span (its own older retention expired first)
    FAILED = "failed"  # the cache failed to retain (logged); served without retention
    REFUSED = "refused"  # the tenant's cap is zero (or no cache): served without retention


@dataclass(frozen=True, slots=True)
class Retained:
    """What one ``retain`` call did: the tokens now retained (of whole blocks) and how."""

    tokens: int
    outcome: RetainOutcome


@dataclass(frozen=True, slots=True)
class Level:
    """One place retention is counted: the cache (in tokens) or a tier (in frames)."""

    name: str
    capacity: int  # tokens of the cache, frames of a tier
    per_token: bool  # a block costs its tokens here (the cache), else one frame
    # Whether retention holds room here, so the cap binds: the cache, and the last tier
    # (from a faster tier a retained block goes down under pressure, as any other would)
    binding: bool = True

    def units(self, tokens: int) -> int:
        """What a block of ``tokens`` counts here."""
        return tokens if self.per_token else 1


@dataclass(frozen=True, slots=True)
class TenantRetention:
    """One tenant's retention now, for ``/metrics`` and ``diagnose``."""

    tenant: str
    held: tuple[int, ...]  # per level: tokens (the cache) or frames (a tier) retained
    caps: tuple[int, ...]  # per level: its cap now
    expired_tokens: int  # tokens whose retention ran out (deadline passed)
    capped_tokens: int  # tokens whose retention the cap ended or refused
    cap_hits: int  # times the cap bound: a span it cut, or an older retention it ended
    refused: int  # retain calls refused (a zero cap)


@dataclass(slots=True)
class _Counts:
    expired_tokens: int = 0
    capped_tokens: int = 0
    cap_hits: int = 0
    refused: int = 0


class Keeper:
    """Every retained block, by tenant and level, with the deadlines and the caps.

    Per block (``tree.Block``): ``retainer`` (the tenant charged, None when not retained),
    ``retain_until`` (the deadline), ``retain_s`` (how long each hit extends it) and
    ``retain_mask`` (the levels it is counted in: bit 0 the cache, bit 1 + k tier k).
    A tenant's blocks are ordered least recently retained first; a span is entered
    deepest block first, so the cap takes an old span's deepest blocks before its
    shared start (a deeper block kept would hold its ancestors anyway)."""

    def __init__(self, config: RetentionConfig, levels: Sequence[Level], clock: Callable[[], float]) -> None:
        self.config = config
        self.levels = tuple(levels)
        self._clock = clock
        self.held: dict[str, list[int]] = {}  # tenant -> units retained per level
        self.order: dict[str, OrderedDict[Block, None]] = {}  # tenant -> its retained blocks, oldest first
        # NOTE: one live heap entry per retained block (``_entry``: block -> its entry's
        # number), at a deadline no later than its own: a hit moves the deadline, not the
        # entry, which is pushed again when it comes up early. So the heap does not grow
        # with hits; a released block's entry is skipped when it comes up.
        self.deadlines: list[tuple[float, int, Block]] = []
        self._entry: dict[Block, int] = {}
        self.counts: dict[str, _Counts] = {}
        self._seq = 0

    @property
    def active(self) -> bool:
        return bool(self.order)

    # ------------------------------------------------------------------ caps

    def share(self, tenant: str, joining: bool = False) -> float:
        """``tenant``'s share of each level: its own, or the default one split among the
        tenants on it that retain now (and ``tenant``, when it is ``joining``)."""
        own = self.config.own_share(tenant)
        if own is not None:
            return own
        sharing = sum(1 for t in self.order if self.config.own_share(t) is None)
        if joining and tenant not in self.order:
            sharing += 1
        return self.config.share / max(sharing, 1)

    def may_retain(self, tenant: str) -> bool:
        return self.share(tenant, joining=True) > 0

    def cap(self, tenant: str, level: int, joining: bool = False) -> int:
        return int(self.share(tenant, joining) * self.levels[level].capacity)

    def caps(self, tenant: str, joining: bool = False) -> tuple[int, ...]:
        """``tenant``'s cap in each level (``joining``: were it to retain now)."""
        return tuple(self.cap(tenant, i, joining) for i in range(len(self.levels)))

    # ------------------------------------------------------------------ retaining

    def retain(self, tenant: str, path: Sequence[Block], seconds: float, mask_of: Callable[[Block], int]) -> Retained:
        """Retain ``path`` (a chain, root side first) for ``tenant`` until ``seconds`` from
        now. Past the tenant's cap its own oldest retention expires first; what still does
        not fit is not retained, and the span is cut there (its start stays retained)."""
        now = self._clock()
        self.sweep(now)
        counts = self.counts.setdefault(tenant, _Counts())
        if not self.may_retain(tenant):
            counts.refused += 1
            return Retained(0, RetainOutcome.REFUSED)
        joining = tenant not in self.order
        until = now + seconds
        kept: list[Block] = []
        cut = False
        for block in path:
            if block.retainer != tenant:
                mask = mask_of(block)
                if not self._make_room(tenant, mask, block.num_tokens, kept):
                    cut = True  # NOTE: another tenant's retention of it stays as it was
                    break
                if block.retainer is not None:
                    self.release(block)  # another tenant's: this one is charged from now on
                self._enter(tenant, block, mask)
            kept.append(block)
            block.retain_s = max(block.retain_s, seconds)
            self._deadline(block, max(block.retain_until, until))
        order = self.order.get(tenant)
        if order is not None:
            for block in reversed(kept):
                order.move_to_end(block)
        if joining and kept:
            self._enforce_all()  # the default share is split one way more: the others' caps shrank
        if cut:
            counts.cap_hits += 1
            counts.capped_tokens += path[-1].end - (kept[-1].end if kept else path[0].parent.end)
        retained = kept[-1].end if kept else 0
        if cut:
            return Retained(retained, RetainOutcome.CAPPED)
        return Retained(retained, RetainOutcome.RETAINED)

    def extend(self, path: Sequence[Block]) -> None:
        """A hit on ``path`` (root side first): each retained block's deadline moves to
        now plus its own retention, and it counts as just retained."""
        now = self._clock()
        self.sweep(now)
        for block in reversed(path):
            tenant = block.retainer
            if tenant is None:
                continue
            until = now + block.retain_s
            if until > block.retain_until:
                self._deadline(block, until)
            self.order[tenant].move_to_end(block)

    def holds(self, block: Block) -> bool:
        """Whether ``block`` is retained now (its deadline has not passed)."""
        return block.retainer is not None and block.retain_until > self._clock()

    def sweep(self, now: float | None = None) -> int:
        """End the retentions whose deadline passed; returns how many blocks."""
        now = self._clock() if now is None else now
        heap, done = self.deadlines, 0
        while heap and heap[0][0] <= now:
            _, seq, block = heapq.heappop(heap)
            if block.retainer is None or self._entry.get(block) != seq:
                continue  # released since
            if block.retain_until > now:
                self._push(block)  # extended by a hit since: its entry goes to the new deadline
                continue
            self.counts[block.retainer].expired_tokens += block.num_tokens
            self.release(block)
            done += 1
        return done

    # ------------------------------------------------------------------ the books

    def moved(self, block: Block, mask: int) -> None:
        """``block`` (retained) is now in the levels of ``mask``: count it there; a level
        where that puts its tenant past its cap ends the tenant's oldest retention there."""
        tenant, old = block.retainer, block.retain_mask
        assert tenant is not None
        if mask == old:
            return
        held = self.held[tenant]
        self._add(held, block.num_tokens, mask & ~old, 1)
        self._add(held, block.num_tokens, old & ~mask, -1)
        block.retain_mask = mask
        for i in range(len(self.levels)):
            if mask & ~old & (1 << i):
                self._enforce(tenant, i, ())

    def leave(self, block: Block) -> None:
        """``block`` leaves the cache: its retention ends with it (counted as expired when
        its deadline had passed, as it would have been)."""
        if block.retainer is not None:
            if block.retain_until <= self._clock():
                self.counts[block.retainer].expired_tokens += block.num_tokens
            self.release(block)

    def release(self, block: Block) -> None:
        """``block`` is retained no more (expired, capped, or leaving the cache)."""
        tenant = block.retainer
        if tenant is None:
            return
        self._add(self.held[tenant], block.num_tokens, block.retain_mask, -1)
        order = self.order[tenant]
        del order[block]
        del self._entry[block]
        if not order:
            del self.order[tenant], self.held[tenant]
        block.retainer, block.retain_until, block.retain_s, block.retain_mask = None, 0.0, 0.0, 0

    def _enter(self, tenant: str, block: Block, mask: int) -> None:
        self._add(self.held.setdefault(tenant, [0] * len(self.levels)), block.num_tokens, mask, 1)
        self.order.setdefault(tenant, OrderedDict())[block] = None
        block.retainer, block.retain_mask = tenant, mask

    def _add(self, held: list[int], tokens: int, mask: int, sign: int) -> None:
        """Count a block of ``tokens`` in (``sign`` 1) or out of (-1) the levels of ``mask``."""
        for i, level in enumerate(self.levels):
            if mask >> i & 1:
                held[i] += sign * level.units(tokens)

    def _deadline(self, block: Block, until: float) -> None:
        block.retain_until = until
        if block not in self._entry:
            self._push(block)

    def _push(self, block: Block) -> None:
        self._seq += 1
        self._entry[block] = self._seq
        heapq.heappush(self.deadlines, (block.retain_until, self._seq, block))

    def _make_room(self, tenant: str, mask: int, tokens: int, keep: Sequence[Block]) -> bool:
        """Room under ``tenant``'s caps for a block of ``tokens`` in the levels of ``mask``,
        made by ending its own oldest retentions there (never one of ``keep``)."""
        held = self.held.get(tenant)
        for i, level in enumerate(self.levels):
            if not mask & (1 << i) or not level.binding:
                continue
            units = level.units(tokens)
            cap = self.cap(tenant, i, joining=True)
            if units > cap:
                return False
            while held is not None and held[i] + units > cap:
                if not self._expire_oldest(tenant, i, keep):
                    return False
                held = self.held.get(tenant)
        return True

    def _enforce(self, tenant: str, level: int, keep: Sequence[Block]) -> None:
        if not self.levels[level].binding:
            return
        held = self.held.get(tenant)
        cap = self.cap(tenant, level)
        while held is not None and held[level] > cap and self._expire_oldest(tenant, level, keep):
            held = self.held.get(tenant)

    def _enforce_all(self) -> None:
        for tenant in list(self.order):
            for level in range(len(self.levels)):
                self._enforce(tenant, level, ())

    def _expire_oldest(self, tenant: str, level: int, keep: Sequence[Block]) -> bool:
        order = self.order.get(tenant)
        if order is None:
            return False
        bit, spare = 1 << level, set(map(id, keep))
        for block in order:
            if block.retain_mask & bit and id(block) not in spare:
                counts = self.counts[tenant]
                counts.capped_tokens += block.num_tokens
                counts.cap_hits += 1
                self.release(block)
                return True
        return False

    # ------------------------------------------------------------------ reading

    def snapshot(self) -> list[TenantRetention]:
        self.sweep()
        out = []
        for tenant in sorted(set(self.counts) | set(self.order)):
            held = self.held.get(tenant, [0] * len(self.levels))
            c = self.counts.get(tenant, _Counts())
            out.append(
                TenantRetention(
                    tenant, tuple(held), self.caps(tenant), c.expired_tokens, c.capped_tokens, c.cap_hits, c.refused
                )
            )
        return out
