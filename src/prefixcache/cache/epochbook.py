"""Epochs kept where the blocks they invalidate are kept.

An epoch bump makes every block of a model (or of one adapter) unreachable by changing
the context root its keys hang under (``contexts.py``). Kept in process memory only, a
restart would begin again at epoch 0 and hit on yesterday's blocks on disk, and another
server on the same Redis or bucket would never learn of the bump. So every tier that
outlives the process keeps an epoch record per (model, adapter)::

    disk     <dir>/epochs/<name>.epoch              one file, published with one rename
    redis    "<namespace>:~epochs"  field <name>    one hash ("<namespace>:{~epochs}" in a cluster)
    s3       <prefix>/<namespace>/~epochs/<name>    one object
    record   {"adapter":null,"epoch":3,"format":"prefixcache.epoch","model":"m","version":1}
    name     blake2b-128 of the JSON [model, adapter], in hex

    open     every such tier is read; per (model, adapter) the highest epoch any tier
             knows wins, and a tier that knows less is written up to it
    bump     the shared tiers are read first (so the new epoch passes what they know),
             the epoch goes up under the lock, and the record is written through to
             every tier (outside the lock). A tier that fails to take it is an
             ``EpochNotKept`` for the operator; the bump holds here meanwhile, and every
             sync writes it again until the tier has it
    sync     every ``sync_s`` seconds a thread of the cache reads the shared tiers
             (Redis, S3) again and applies what is higher, then writes what they lack

The bound: a bump on another server is applied here at most ``sync_s`` seconds (plus
one read of the tier) after its record landed in a tier both share; until then this
server may still hit on the old blocks. A tier that cannot be read is read again at the
next sync: while it is down it serves no frames either, and once it answers again the
bound holds from then.

What a shared tier hands back is not trusted (design: what comes back from a tier
another process can write is checked before it is believed): a record that is not one
(more than ``EPOCH_RECORD_BYTES``, not JSON, a field missing, extra or of another type,
a name that is not its own, an epoch below 1 or above ``MAX_EPOCH``) is logged once and
ignored, never raises, and is written over when this cache knows that record's epoch.
An epoch only ever goes up: nothing read lowers one, so the worst a writer of the tier
can do through a record is invalidate (misses), never bring stale blocks back.

Concurrent bumps on two servers may land on one epoch (both read 3, both write 4): each
still invalidates everything before it. A tier written down by a race (4 over 5) is
written up again by the next sync of any server that knows 5.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from prefixcache.storage.base import EPOCH_RECORD_BYTES, EpochKeeper, TierError

if TYPE_CHECKING:
    from prefixcache.cache.owner import Owner

__all__ = ["MAX_EPOCH", "SYNC_S", "EpochKeeping", "EpochNotKept", "EpochRecord", "decode", "encode", "record_name"]

log = logging.getLogger("prefixcache.epochs")

FORMAT: Final = "prefixcache.epoch"
VERSION: Final = 1
MAX_EPOCH: Final = (1 << 31) - 1  # far past any real count of bumps; a larger one is a forgery
MAX_NAME: Final = 1024  # characters of a model or adapter id in a record
SYNC_S: Final = 1.0  # how often the shared tiers' records are read again
_REFUSED_KEPT: Final = 1024  # refused records remembered, so that each is logged once

Name = tuple[str, str | None]  # (model, adapter): None is the model's own epoch
Seen = dict[str, dict[Name, int] | None]  # per tier: its valid records, None when it could not be read


class BadRecord(ValueError):
    """Bytes a tier holds under an epoch record's name that are no such record."""


class EpochNotKept(RuntimeError):
    """A bump holds in this process, but a tier that keeps epochs did not take its record
    (every sync writes it again until it does)."""


@dataclass(frozen=True, slots=True)
class EpochRecord:
    model: str
    adapter: str | None
    epoch: int


def record_name(model: str, adapter: str | None) -> str:
    """The name a (model, adapter) record is kept under: a digest, so that any id fits
    a file, a hash field or an object name."""
    return hashlib.blake2b(json.dumps([model, adapter]).encode(), digest_size=16).hexdigest()


def encode(record: EpochRecord) -> bytes:
    data = json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "model": record.model,
            "adapter": record.adapter,
            "epoch": record.epoch,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    _check(record.model, record.adapter, record.epoch)
    if len(data) > EPOCH_RECORD_BYTES:
        raise ValueError(f"an epoch record of {len(data)} bytes; at most {EPOCH_RECORD_BYTES}")
    return data


def decode(name: str, data: bytes) -> EpochRecord:
    """The record ``data`` is, under ``name``; ``BadRecord`` for anything else."""
    if len(data) > EPOCH_RECORD_BYTES:
        raise BadRecord(f"{len(data)} bytes, more than a record's {EPOCH_RECORD_BYTES}")
    try:
        fields: Any = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # NOTE: 4 KB of "[" nests past the parser's depth
        raise BadRecord(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(fields, dict) or set(fields) != {"format", "version", "model", "adapter", "epoch"}:
        raise BadRecord("not an object with exactly format, version, model, adapter and epoch")
    if fields["format"] != FORMAT or type(fields["version"]) is not int or fields["version"] != VERSION:
        raise BadRecord(f"format {fields['format']!r} version {fields['version']!r}, not {FORMAT!r} {VERSION}")
    model, adapter, epoch = fields["model"], fields["adapter"], fields["epoch"]
    try:
        _check(model, adapter, epoch)
    except ValueError as exc:
        raise BadRecord(str(exc)) from None
    if record_name(model, adapter) != name:
        raise BadRecord("kept under another record's name")
    return EpochRecord(model, adapter, epoch)


def _check(model: object, adapter: object, epoch: object) -> None:
    if not isinstance(model, str) or not 1 <= len(model) <= MAX_NAME:
        raise ValueError(f"a model id of 1 to {MAX_NAME} characters, not {type(model).__name__}")
    if adapter is not None and (not isinstance(adapter, str) or not 1 <= len(adapter) <= MAX_NAME):
        raise ValueError(f"an adapter id of 1 to {MAX_NAME} characters or null, not {type(adapter).__name__}")
    if type(epoch) is not int or not 1 <= epoch <= MAX_EPOCH:
        raise ValueError(f"an epoch is an integer from 1 to {MAX_EPOCH}, not {epoch!r}"[:200])


def highest(seen: Seen) -> dict[Name, int]:
    """Per (model, adapter), the highest epoch any tier read knows."""
    top: dict[Name, int] = {}
    for records in seen.values():
        for name, epoch in (records or {}).items():
            top[name] = max(top.get(name, 0), epoch)
    return top


class EpochKeeping:
    """One cache's epochs in its durable tiers: read at open, written through on a bump,
    the shared tiers read again by ``sync`` (on a thread of its own every ``sync_s``
    seconds, when ``sync_s`` is set and a shared tier is there).

    Every read and write runs outside the cache's lock (invariant 9), one at a time
    (``_io``); the lock is taken only to apply what was read (``Owner.raise_epochs``)."""

    def __init__(self, owner: Owner, tiers: Sequence[tuple[str, EpochKeeper]], sync_s: float | None = SYNC_S) -> None:
        self._owner = owner
        self._tiers = list(tiers)
        self._io = threading.Lock()
        self._refused: dict[tuple[str, str, bytes], None] = {}
        self._owed: set[tuple[str, Name]] = set()  # (tier, record) a write failed to keep: retried at each sync
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.syncs = 0  # shared reads applied, for a test to wait on
        self._synced = threading.Condition()
        self._sync(shared=False)
        if sync_s and any(keeper.epoch_sync for _, keeper in self._tiers):
            self._thread = threading.Thread(
                target=_sync_loop, args=(weakref.ref(self), self._stop, sync_s), name="prefixcache-epochs", daemon=True
            )
            self._thread.start()

    def sync(self) -> list[Name]:
        """Read the shared tiers now, apply what is higher; the (model, adapter) raised."""
        return self._sync(shared=True)

    def wait_synced(self, after: int, timeout: float | None = None) -> bool:
        """Wait until more than ``after`` syncs ran (the background thread's)."""
        with self._synced:
            return self._synced.wait_for(lambda: self.syncs > after, timeout)

    def bump(self, model: str, adapter: str | None) -> int:
        """A new epoch, past what the shared tiers know, written through to every tier.
        ``EpochNotKept`` when a tier did not take it (the bump holds here all the same)."""
        name = (model, adapter)
        with self._io:
            self._sync_locked(shared=True)
            if self._owner.epochs().get(name, 0) >= MAX_EPOCH:
                raise ValueError(f"{model!r}/{adapter!r} is at the last epoch, {MAX_EPOCH}")
            epoch = self._owner.bump_epoch(model, adapter)
            failed = self._write(name, epoch, [label for label, _ in self._tiers])
        if failed:
            raise EpochNotKept(
                f"epoch {epoch} of {model!r}{f' adapter {adapter!r}' if adapter else ''} holds on this server, but "
                f"tier {', '.join(failed)} did not keep it (see the tier's errors); it is written again at every sync, "
                "and a server that restarts or shares that tier misses it until then"
            )
        return epoch

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ inside

    def _sync(self, shared: bool) -> list[Name]:
        with self._io:
            return self._sync_locked(shared)

    def _sync_locked(self, shared: bool) -> list[Name]:
        seen = self._read(shared)
        raised = self._owner.raise_epochs(highest(seen))
        known = self._owner.epochs()
        for label, records in seen.items():
            if records is None:
                continue
            for name, epoch in known.items():
                if records.get(name, 0) < epoch:
                    self._write(name, epoch, [label])  # NOTE: a failure is counted; the next sync tries again
        unread = [label for label, _ in self._tiers if label not in seen]  # a disk, at a sync: told what is news
        for name in raised:
            self._write(name, known[name], unread)
        for label, name in sorted(self._owed, key=repr):  # what a tier failed to keep, wherever it was read or not
            if (label, name) in self._owed:
                self._write(name, known[name], [label])
        if shared:
            with self._synced:
                self.syncs += 1
                self._synced.notify_all()
        return raised

    def _read(self, shared: bool) -> Seen:
        seen: Seen = {}
        for label, keeper in self._tiers:
            if shared and not keeper.epoch_sync:
                continue
            try:
                held = keeper.read_epochs()
            except (TierError, OSError) as exc:
                log.warning("event=epochs_unread tier=%s error=%s (read again at the next sync)", label, exc)
                seen[label] = None
                continue
            except Exception:  # NOTE: a store's bug must not keep a cache from opening, nor end the syncs
                log.exception("event=epochs_unread tier=%s (read again at the next sync)", label)
                seen[label] = None
                continue
            records: dict[Name, int] = {}
            for name, data in held:
                try:
                    record = decode(name, data)
                except BadRecord as exc:
                    self._refuse(label, name, data, str(exc))
                    continue
                key = (record.model, record.adapter)
                records[key] = max(records.get(key, 0), record.epoch)
            seen[label] = records
        return seen

    def _write(self, name: Name, epoch: int, labels: list[str]) -> list[str]:
        data = encode(EpochRecord(name[0], name[1], epoch))
        failed = []
        for label, keeper in self._tiers:
            if label not in labels:
                continue
            try:
                keeper.write_epoch(record_name(*name), data)
            except (TierError, OSError) as exc:
                line = "event=epoch_not_kept tier=%s model=%r adapter=%r epoch=%d error=%s (written again at each sync)"
                # NOTE: once per record until it is kept: a tier that refuses writes is tried every sync
                level = logging.DEBUG if (label, name) in self._owed else logging.WARNING
                log.log(level, line, label, name[0], name[1], epoch, exc)
                self._owed.add((label, name))
                failed.append(label)
            else:
                self._owed.discard((label, name))
        return failed

    def _refuse(self, label: str, name: str, data: bytes, why: str) -> None:
        seen = (label, name, hashlib.blake2b(data, digest_size=16).digest())
        if seen in self._refused:
            return
        if len(self._refused) >= _REFUSED_KEPT:
            self._refused.pop(next(iter(self._refused)))
        self._refused[seen] = None
        log.warning("event=epoch_record_refused tier=%s name=%s why=%s (ignored)", label, name[:64], why)


def _sync_loop(ref: weakref.ref[EpochKeeping], stop: threading.Event, every: float) -> None:
    """The background sync; ends with the cache (closed, or collected unclosed)."""
    while not stop.wait(every):
        keeping = ref()
        if keeping is None:
            return
        try:
            keeping.sync()
        except Exception:  # NOTE: a bug must not end the syncs: a later bump elsewhere would go unseen
            log.exception("the epoch sync failed")
        del keeping
