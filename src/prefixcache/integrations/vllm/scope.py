"""Everything besides the token ids that decides a vLLM request's KV (design invariant 12).

vLLM keys its own blocks on the LoRA, the multimodal items with their positions, the
cache salt and prompt embeddings; a connector that keys on tenant + tokens hands one
adapter's (or one image's) KV to another request with the same placeholder ids. The
scheduler reads those from vLLM's own ``Request`` fields (``lora_request``,
``mm_features``, ``prompt_embeds``, ``cache_salt``, ``kv_transfer_params``) into a
``Scope``; the worker turns a scope into the cache's context and segments:

- the tenant, verified (``identity.verify``): the gateway's claim, proven by its salt;
- the adapter as ``name@fingerprint``, the fingerprint a hash of the adapter's files'
  contents, so a replaced adapter under the same name is a new key space;
- each media item as a ``Segment`` at its placeholder offset, keyed by vLLM's content
  hash and the placeholder length: every block from the item's first one on carries it.

Requests this cannot key are not cached at all (``scope_of`` returns a ``Bypass``): prompt
embeddings (their KV is not a function of token ids), an adapter whose files cannot
be read, a tenant that does not verify under the configured policy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from prefixcache.config import MAX_RETAIN_S
from prefixcache.hashing import CacheContext, Segment
from prefixcache.identity import Unverified, verify, verify_retention
from prefixcache.weights import files_fingerprint

__all__ = ["Bypass", "Fingerprints", "Media", "Scope", "decode_scope", "encode_scope", "scope_of"]


class Media(msgspec.Struct, frozen=True, array_like=True):
    """A multimodal item: its placeholder tokens ``[offset, offset + length)`` and vLLM's
    hash of its content."""

    offset: int
    length: int
    key: str


class Scope(msgspec.Struct, frozen=True, array_like=True):
    """What keys a request's KV besides its tokens (crosses the lookup socket as msgpack),
    and the one thing that does not: ``retain_s``, the retention the gateway stamped
    (verified with the tenant, ``identity.verify_retention``; 0: none), which the worker
    asks of the cache after storing the prompt."""

    tenant: str
    adapter: str | None = None
    media: tuple[Media, ...] = ()
    retain_s: int = 0

    def context(self, model: str) -> CacheContext:
        return CacheContext(tenant=self.tenant, model=model, adapter=self.adapter)

    def segments(self, num_tokens: int) -> list[Segment]:
        """The media items that start within the first ``num_tokens`` tokens, each as a
        one-token segment at its offset (its length goes into the key): a prefix cut
        inside an item keys the same as the whole prompt does."""
        return [Segment(m.offset, m.offset + 1, f"{m.key}:{m.length}") for m in self.media if m.offset < num_tokens]


def encode_scope(scope: Scope) -> bytes:
    return msgspec.msgpack.encode(scope)


def decode_scope(data: bytes) -> Scope:
    """A scope from the socket; raises ``ValueError`` on anything else."""
    try:
        scope = msgspec.msgpack.decode(data, type=Scope)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a scope: {exc}") from None
    if not scope.tenant or any(m.offset < 0 or m.length < 1 or not m.key for m in scope.media):
        raise ValueError("not a scope: empty tenant or a malformed media item")
    if not 0 <= scope.retain_s <= MAX_RETAIN_S:
        raise ValueError("not a scope: a retention out of range")
    return scope


@dataclass(frozen=True, slots=True)
class Bypass:
    """Why a request is served without the cache (counted, logged once per reason)."""

    reason: str


class Fingerprints:
    """Adapter fingerprints, computed once per adapter folder and again whenever a file
    in it changes: the memo is keyed by each file's inode, size, mtime and ctime (ctime
    moves on every write and no user tool sets it back)."""

    def __init__(self, fingerprint: Callable[[Path], str] | None = None) -> None:
        self._fingerprint = fingerprint or (lambda p: files_fingerprint(p, extra=("adapter_config.json",)))
        self._memo: dict[str, tuple[tuple[Any, ...], str]] = {}
        self._lock = threading.Lock()

    def __call__(self, folder: str) -> str | None:
        path = Path(folder)
        if not folder or not path.is_dir():
            return None
        try:
            stamp = tuple(
                (p.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                for p in sorted(path.iterdir())
                if p.is_file() and (st := os.stat(p))
            )
        except OSError:
            return None
        with self._lock:
            known = self._memo.get(folder)
            if known is not None and known[0] == stamp:
                return known[1]
        try:
            value = self._fingerprint(path)
        except OSError:
            return None
        with self._lock:
            self._memo[folder] = (stamp, value)
        return value


def scope_of(
    request: Any,
    *,
    secret: bytes | None,
    default_tenant: str,
    unverified: Unverified,
    fingerprints: Fingerprints,
) -> Scope | Bypass:
    """The scope of a vLLM ``Request`` (read by field name: no vLLM class is imported)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return Bypass("prompt_embeds")
    identity = verify(
        getattr(request, "kv_transfer_params", None),
        getattr(request, "cache_salt", None),
        secret,
        default_tenant,
        unverified,
    )
    if identity.tenant is None:
        return Bypass("unverified_tenant")
    adapter = None
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        fingerprint = fingerprints(str(getattr(lora, "lora_path", "") or ""))
        if fingerprint is None:
            return Bypass("adapter_unreadable")
        adapter = f"{lora.lora_name}@{fingerprint}"
    media = []
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        key = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        if not key:
            return Bypass("media_unhashed")
        media.append(Media(int(position.offset), int(position.length), str(key)))
    media_items = tuple(sorted(media, key=lambda m: (m.offset, m.length, m.key)))
    params = getattr(request, "kv_transfer_params", None)
    return Scope(identity.tenant, adapter, media_items, verify_retention(params, identity.tenant, secret))
