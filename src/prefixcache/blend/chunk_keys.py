"""Content keys of chunks: a chunk's KV computed alone (positions from 0), named by what
it is, wherever it appears in a prompt::

    chunk_key(T) = H( CHUNK_TAG | enc(seed, model, model_epoch, adapter, adapter_epoch,
                                      tokenizer, namespace, extra)     <- the chunk root
                    | tokens as little-endian uint32                   <- the whole chunk
                    | u64 len(tokens) )                                <- trailer

The chunk root covers every field a block's root covers (``hashing.root_encoding``),
in the same typed, length-prefixed encoding, so two contexts (or two tenants' namespaces,
or two epochs) never share a chunk key. What it leaves out is the chunk's position: the
same document at offset 0 or 900 has one key.

NOTE: the tag differs from ``hashing.ROOT_TAG`` in its first bytes, so no hash input of a
chunk is ever the hash input of a block: a chunk key never equals a block key (short of a
collision of the hash), even in one Redis or one disk directory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from prefixcache.hashing import ROOT_TAG, CacheContext, HashFactory, root_encoding

__all__ = ["CHUNK_TAG", "ChunkKeys", "Epochs", "chunk_root_encoding"]

CHUNK_TAG = b"prefixcache/chunk/v1\x00"
_U64 = struct.Struct("<Q")


def chunk_root_encoding(seed: str, ctx: CacheContext, namespace: str, model_epoch: int, adapter_epoch: int) -> bytes:
    """The bytes every chunk key of this context starts with: a block's root under the chunk tag."""
    return CHUNK_TAG + root_encoding(seed, ctx, namespace, model_epoch, adapter_epoch)[len(ROOT_TAG) :]


@dataclass(frozen=True, slots=True)
class Epochs:
    """The epochs a key was computed at: a put whose key is older than the current
    epochs (a bump ran in between) is refused, never stored as stale."""

    model: int
    adapter: int


class ChunkKeys:
    """The epoch table and the key function. Not locked: the store reads and bumps it
    under its own lock (``snapshot`` is a dict read, the hashing happens outside)."""

    def __init__(self, seed: str, hash_factory: HashFactory) -> None:
        self._seed = seed
        self._hash = hash_factory
        self._epochs: dict[tuple[str, str | None], int] = {}

    def epochs(self, ctx: CacheContext) -> Epochs:
        return self.current(ctx.model, ctx.adapter)

    def current(self, model: str, adapter: str | None) -> Epochs:
        adapter_epoch = self._epochs.get((model, adapter), 0) if adapter is not None else 0
        return Epochs(self._epochs.get((model, None), 0), adapter_epoch)

    def bump(self, model: str, adapter: str | None) -> int:
        epoch = self._epochs.get((model, adapter), 0) + 1
        self._epochs[(model, adapter)] = epoch
        return epoch

    def key(self, ctx: CacheContext, data: bytes, namespace: str, epochs: Epochs) -> bytes:
        """The key of the chunk of token bytes ``data`` in ``namespace`` at ``epochs``."""
        hasher = self._hash()
        hasher.update(chunk_root_encoding(self._seed, ctx, namespace, epochs.model, epochs.adapter))
        hasher.update(data)
        hasher.update(_U64.pack(len(data) // 4))
        return hasher.digest()
