"""Context roots, epochs and generations: which root a request's blocks hang under, and
the key chains its search follows.

A root names one context (namespace, model, adapter, tokenizer, extra key) at its
current epochs and its namespace's generation; its encoding seeds every block key below
it (``hashing``). Bumping an epoch takes the roots of that model (or adapter) out of the
table, and raising a generation (a tenant purge) the roots of that namespace: no request
can reach them again, and the ledger reclaims their blocks, children first.

Generations are kept by the name of the namespace's record (``generation_name``), not by
the namespace: a generation read from a tier another server wrote names no tenant, and
is applied to whichever namespace hashes to it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import numpy as np

from prefixcache.cache.tree import Lookup, Root
from prefixcache.hashing import (
    CacheContext,
    Hasher,
    HashFactory,
    KeyChain,
    Segment,
    Segments,
    encode,
    root_encoding,
    token_bytes,
)
from prefixcache.tenancy import PUBLIC

__all__ = ["MAX_GENERATION", "Contexts", "context_name", "generation_name"]

Tokens = Sequence[int] | np.ndarray

MAX_GENERATION: Final = (1 << 31) - 1  # as ``epochbook.MAX_EPOCH``: far past any real count of purges
_PERSON: Final = b"pc/generation/1"  # blake2b's personalization: these names are no other digest


def generation_name(seed: str, namespace: str) -> str:
    """The name a namespace's generation is kept under, in this cache and in every tier:
    blake2b-128 of the namespace keyed by the deployment seed, in hex. A tier shows this,
    never the tenant's name; whoever knows the seed can still test a guessed name
    against it (docs/storage.md says what an observer of a tier learns)."""
    return hashlib.blake2b(encode(namespace), key=_seed_key(seed), person=_PERSON, digest_size=16).hexdigest()


@functools.lru_cache(maxsize=8)
def _seed_key(seed: str) -> bytes:
    """blake2b's key (at most 64 bytes) from a seed of any length."""
    return hashlib.blake2b(seed.encode("utf-8", "surrogatepass"), digest_size=32).digest()


def context_name(ctx: CacheContext) -> tuple[object, ...]:
    """A context without its namespace: what an operator declares a prefix public for."""
    return (ctx.model, ctx.adapter, ctx.tokenizer, ctx.extra_key)


class Contexts:
    """The root table and the epochs of every model and adapter."""

    def __init__(
        self, seed: str, hash_factory: HashFactory, oneshot: Callable[[bytes], bytes] | None, vocab_size: int | None
    ) -> None:
        self._seed = seed
        self._hash = hash_factory
        self._oneshot = oneshot  # the same hash in one call, for short prefixes (``hashing.ONESHOT``)
        self._vocab = vocab_size
        self._epochs: dict[tuple[str, str | None], int] = {}
        self._generations: dict[str, int] = {}  # by ``generation_name``: every one above 0
        self._roots: dict[tuple[object, ...], tuple[Root, Hasher]] = {}

    def __len__(self) -> int:
        return len(self._roots)

    def roots(self) -> Iterator[Root]:
        return (root for root, _ in self._roots.values())

    def root(self, ctx: CacheContext, namespace: str, create: bool = True) -> tuple[Root, Hasher] | None:
        name = (namespace, ctx.model, ctx.adapter, ctx.tokenizer, ctx.extra_key)
        entry = self._roots.get(name)
        if entry is None and create:
            model_epoch, adapter_epoch = self.epochs(ctx)
            enc = root_encoding(self._seed, ctx, namespace, model_epoch, adapter_epoch, self.generation(namespace))
            hasher = self._hash()
            hasher.update(enc)
            root = Root(hasher.copy().digest(), namespace, namespace == PUBLIC, name, enc)
            entry = self._roots[name] = (root, hasher)
        return entry

    def epochs(self, ctx: CacheContext) -> tuple[int, int]:
        """The model's and the adapter's epochs now: a caller that let go of the lock
        compares them to know whether the roots it looked up went stale meanwhile."""
        model = self._epochs.get((ctx.model, None), 0)
        adapter = self._epochs.get((ctx.model, ctx.adapter), 0) if ctx.adapter is not None else 0
        return model, adapter

    def generation(self, namespace: str) -> int:
        """The namespace's generation now (0 until its first purge)."""
        if not self._generations:  # NOTE: the common case, no purge ever: no digest per new root
            return 0
        return self._generations.get(generation_name(self._seed, namespace), 0)

    def version(self, ctx: CacheContext, namespace: str) -> tuple[int, int, int]:
        """Everything that, changed, makes the roots of ``ctx`` in ``namespace`` stale: a
        caller that let go of the lock compares it before and after."""
        return (*self.epochs(ctx), self.generation(namespace))

    def drop_empty(self, lookup: Lookup) -> None:
        """``drop_if_empty`` for each root of ``lookup`` (its own, and a public one it made)."""
        for root in lookup.roots:
            self.drop_if_empty(root)

    def drop_if_empty(self, root: Root) -> None:
        """Forget a root that no block belongs to, so that contexts seen once (a tenant
        that never inserts, a one-off ``extra``) do not accumulate."""
        if not root.members and not root.pins and self._roots.get(root.ctx_name, (None,))[0] is root:
            del self._roots[root.ctx_name]

    def lookup(
        self,
        tokens: Tokens,
        ctx: CacheContext,
        segments: Sequence[Segment] | None,
        namespace: str,
        public: bool,
        probe_public: bool = False,
    ) -> Lookup:
        """The request's own chain (in ``namespace``), then, with ``public``, the public
        one when anything hangs there, or always with ``probe_public`` (a tier may hold
        public blocks no tree here knows: a restart, another server's Redis). A root made
        only for that is dropped again by ``drop_empty`` when nothing was adopted."""
        if not isinstance(ctx, CacheContext):
            raise TypeError(f"ctx must be a CacheContext, got {type(ctx).__name__}")
        data = token_bytes(tokens, self._vocab)
        segs = Segments.of(segments, len(data) // 4)
        own = self.root(ctx, namespace)
        assert own is not None
        entries = [own]
        if public:
            shared = self.root(ctx, PUBLIC, create=probe_public)
            if shared is not None and (shared[0].children or probe_public):
                entries.append(shared)
        chains = [KeyChain(hasher, data, segs, root.ctx_enc, self._oneshot) for root, hasher in entries]
        return Lookup(data, segs, chains, [root for root, _ in entries])

    def chain(self, entry: tuple[Root, Hasher], lookup: Lookup) -> KeyChain:
        """Another root's chain over the same tokens (the public copy of a prefix)."""
        root, hasher = entry
        return KeyChain(hasher, lookup.data, lookup.segments, root.ctx_enc, self._oneshot)

    def known(self) -> dict[tuple[str, str | None], int]:
        """Every epoch above 0, by (model, adapter): what the durable tiers must keep."""
        return dict(self._epochs)

    def epoch(self, model: str, adapter: str | None) -> int:
        return self._epochs.get((model, adapter), 0)

    def bump(self, model: str, adapter: str | None, to: int | None = None) -> tuple[int, list[Root]]:
        """A new epoch for ``model`` (or one adapter of it), the next or ``to`` (which must
        be above it: an epoch only goes up): returns it and the roots it made stale, now
        out of the table."""
        now = self._epochs.get((model, adapter), 0)
        epoch = now + 1 if to is None else to
        if epoch <= now:
            raise ValueError(f"an epoch only goes up: {model!r}/{adapter!r} is at {now}, not above {epoch}")
        self._epochs[(model, adapter)] = epoch
        stale = []
        for name, (root, _) in list(self._roots.items()):
            _, root_model, root_adapter = name[:3]
            if root_model == model and (adapter is None or root_adapter == adapter):
                del self._roots[name]
                root.stale = True
                stale.append(root)
        return epoch, stale

    def generations(self) -> dict[str, int]:
        """Every generation above 0, by record name: what the durable tiers must keep."""
        return dict(self._generations)

    def generation_of(self, name: str) -> int:
        return self._generations.get(name, 0)

    def next_generation(self, namespace: str) -> tuple[str, int, list[Root]] | None:
        """A tenant purge: ``namespace``'s next generation. Returns its record name, the
        generation and the roots it made stale (now out of the table); None when the
        namespace is at ``MAX_GENERATION`` (nothing changes)."""
        name = generation_name(self._seed, namespace)
        now = self._generations.get(name, 0)
        if now >= MAX_GENERATION:
            return None
        return name, now + 1, self.raise_generation(name, now + 1)

    def raise_generation(self, name: str, to: int) -> list[Root]:
        """The namespace named ``name`` goes to generation ``to``, above its own (only up);
        returns the roots of that namespace made stale, now out of the table."""
        now = self._generations.get(name, 0)
        if to <= now:
            raise ValueError(f"a generation only goes up: {name} is at {now}, not above {to}")
        self._generations[name] = to
        names: dict[str, str] = {}  # namespace -> its name, once per namespace in the table
        stale = []
        for ctx_name, (root, _) in list(self._roots.items()):
            digest = names.get(root.owner)
            if digest is None:
                digest = names[root.owner] = generation_name(self._seed, root.owner)
            if digest == name:
                del self._roots[ctx_name]
                root.stale = True
                stale.append(root)
        return stale

    def tokens(self, tokens: Tokens) -> bytes:
        return token_bytes(tokens, self._vocab)
