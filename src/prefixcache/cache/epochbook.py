"""Epochs and generations kept where the blocks they invalidate are kept.

An epoch bump makes every block of a model (or of one adapter) unreachable by changing
the context root its keys hang under (``contexts.py``); a tenant purge does the same to
every block of the tenant's key namespace by raising the namespace's generation. Kept in
process memory only, a restart would begin again at 0 and hit on yesterday's blocks on
disk, and another server on the same Redis or bucket would never learn of the bump or
the purge. So every tier that outlives the process keeps a record per (model, adapter)
and per purged namespace, each kind in a book of its own (so that many purges never
crowd an epoch out of a read)::

    disk     <dir>/<book>/<name>.epoch              one file, published with one rename
    redis    "<namespace>:~<book>"  field <name>    one hash ("<namespace>:{~<book>}" in a cluster)
    s3       <prefix>/<namespace>/~<book>/<name>    one object

    book "epochs"
    record   {"adapter":null,"epoch":3,"format":"prefixcache.epoch","model":"m","version":1}
    name     blake2b-128 of the JSON [model, adapter], in hex

    book "generations"
    record   {"format":"prefixcache.generation","generation":2,"namespace":"<name>","version":1}
    name     blake2b-128 of the namespace keyed by the deployment seed, in hex
             (``contexts.generation_name``): the tier never shows the tenant's name

    open     every such tier is read; per record the highest value any tier knows wins,
             and a tier that knows less is written up to it
    bump,    the shared tiers are read first (so the new value passes what they know),
    purge    the value goes up under the lock, and the record is written through to
             every tier (outside the lock). A tier that fails to take it is an
             ``EpochNotKept`` for the operator; the change holds here meanwhile, and
             every sync writes it again until the tier has it
    sync     every ``sync_s`` seconds a thread of the cache reads the shared tiers
             (Redis, S3) again and applies what is higher, then writes what they lack

The bound: a bump or purge on another server is applied here at most ``sync_s`` seconds
(plus one read of the tier) after its record landed in a tier both share; until then
this server may still hit on the old blocks. A tier that cannot be read is read again at
the next sync: while it is down it serves no frames either, and once it answers again
the bound holds from then.

What a shared tier hands back is not trusted (design: what comes back from a tier
another process can write is checked before it is believed): a record that is not one
(more than ``EPOCH_RECORD_BYTES``, not JSON, a field missing, extra or of another type,
a name that is not its own, a value below 1 or above ``MAX_EPOCH``) is logged once and
ignored, never raises, and is written over when this cache knows that record's value.
A value only ever goes up: nothing read lowers one, so the worst a writer of the tier
can do through a record is invalidate (misses), never bring stale blocks back.

A store returns at most ``EPOCH_RECORDS`` records of a book, so a book holding more
would hide some from every reader. A record this cache does not see in a book already
that full is not written (``EpochNotKept``, and written again at each sync): a purge
past the bound holds on this server only, loudly, instead of hiding an older one.

Concurrent bumps on two servers may land on one epoch (both read 3, both write 4): each
still invalidates everything before it. A tier written down by a race (4 over 5) is
written up again by the next sync of any server that knows 5. Purges likewise.
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

from prefixcache.cache.contexts import MAX_GENERATION
from prefixcache.storage.base import EPOCH_BOOKS, EPOCH_NAME, EPOCH_RECORD_BYTES, EPOCH_RECORDS, EpochKeeper, TierError

if TYPE_CHECKING:
    from prefixcache.cache.owner import Owner

__all__ = [
    "MAX_EPOCH",
    "SYNC_S",
    "EpochKeeping",
    "EpochNotKept",
    "EpochRecord",
    "GenerationRecord",
    "decode",
    "decode_generation",
    "encode",
    "record_name",
]

log = logging.getLogger("prefixcache.epochs")

FORMAT: Final = "prefixcache.epoch"
GENERATION_FORMAT: Final = "prefixcache.generation"
VERSION: Final = 1
MAX_EPOCH: Final = (1 << 31) - 1  # far past any real count of bumps; a larger one is a forgery
MAX_NAME: Final = 1024  # characters of a model or adapter id in a record
SYNC_S: Final = 1.0  # how often the shared tiers' records are read again
_REFUSED_KEPT: Final = 1024  # refused records remembered, so that each is logged once
assert MAX_GENERATION == MAX_EPOCH

Name = tuple[str, str | None]  # (model, adapter): None is the model's own epoch
Ref = tuple[str, str]  # (book, record name): one record, wherever it is kept
Place = tuple[str, str]  # (tier label, book)


class BadRecord(ValueError):
    """Bytes a tier holds under a record's name that are no such record."""


class BookFull(TierError):
    """A tier's book holds as many records as a cache reads: one more would hide one."""


class EpochNotKept(RuntimeError):
    """A bump or a purge holds in this process, but a tier that keeps epochs and
    generations did not take its record (every sync writes it again until it does)."""


@dataclass(frozen=True, slots=True)
class EpochRecord:
    model: str
    adapter: str | None
    epoch: int

    @property
    def ref(self) -> Ref:
        return "epochs", record_name(self.model, self.adapter)

    @property
    def value(self) -> int:
        return self.epoch

    def __str__(self) -> str:
        return f"epoch {self.epoch} of {self.model!r}{f' adapter {self.adapter!r}' if self.adapter else ''}"


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    namespace: str  # the namespace's record name (``contexts.generation_name``), never the namespace
    generation: int

    @property
    def ref(self) -> Ref:
        return "generations", self.namespace

    @property
    def value(self) -> int:
        return self.generation

    def __str__(self) -> str:
        return f"generation {self.generation} of namespace {self.namespace}"


Record = EpochRecord | GenerationRecord
Seen = dict[Place, dict[str, Record] | None]  # per tier and book: its valid records by name, None when unread


def record_name(model: str, adapter: str | None) -> str:
    """The name a (model, adapter) record is kept under: a digest, so that any id fits
    a file, a hash field or an object name."""
    return hashlib.blake2b(json.dumps([model, adapter]).encode(), digest_size=16).hexdigest()


def encode(record: Record) -> bytes:
    fields: dict[str, object]
    if isinstance(record, GenerationRecord):
        _check_generation(record.namespace, record.generation)
        fields = {"format": GENERATION_FORMAT, "namespace": record.namespace, "generation": record.generation}
    else:
        _check(record.model, record.adapter, record.epoch)
        fields = {"format": FORMAT, "model": record.model, "adapter": record.adapter, "epoch": record.epoch}
    data = json.dumps(fields | {"version": VERSION}, sort_keys=True, separators=(",", ":")).encode()
    if len(data) > EPOCH_RECORD_BYTES:
        raise ValueError(f"an epoch record of {len(data)} bytes; at most {EPOCH_RECORD_BYTES}")
    return data


def decode(name: str, data: bytes) -> EpochRecord:
    """The epoch record ``data`` is, under ``name``; ``BadRecord`` for anything else."""
    fields = _fields(data, FORMAT, {"model", "adapter", "epoch"})
    model, adapter, epoch = fields["model"], fields["adapter"], fields["epoch"]
    try:
        _check(model, adapter, epoch)
    except ValueError as exc:
        raise BadRecord(str(exc)) from None
    if record_name(model, adapter) != name:
        raise BadRecord("kept under another record's name")
    return EpochRecord(model, adapter, epoch)


def decode_generation(name: str, data: bytes) -> GenerationRecord:
    """The generation record ``data`` is, under ``name``; ``BadRecord`` for anything else."""
    fields = _fields(data, GENERATION_FORMAT, {"namespace", "generation"})
    namespace, generation = fields["namespace"], fields["generation"]
    try:
        _check_generation(namespace, generation)
    except ValueError as exc:
        raise BadRecord(str(exc)) from None
    if namespace != name:
        raise BadRecord("kept under another record's name")
    return GenerationRecord(namespace, generation)


def _decode(book: str, name: str, data: bytes) -> Record:
    return decode_generation(name, data) if book == "generations" else decode(name, data)


def _fields(data: bytes, form: str, own: set[str]) -> dict[str, Any]:
    """The JSON object ``data`` is, with exactly ``own`` besides its format and version."""
    if len(data) > EPOCH_RECORD_BYTES:
        raise BadRecord(f"{len(data)} bytes, more than a record's {EPOCH_RECORD_BYTES}")
    try:
        fields: Any = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # NOTE: 4 KB of "[" nests past the parser's depth
        raise BadRecord(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(fields, dict) or set(fields) != {"format", "version", *own}:
        raise BadRecord(f"not an object with exactly format, version, {', '.join(sorted(own))}")
    if fields["format"] != form or type(fields["version"]) is not int or fields["version"] != VERSION:
        raise BadRecord(f"format {fields['format']!r} version {fields['version']!r}, not {form!r} {VERSION}"[:200])
    return fields


def _check(model: object, adapter: object, epoch: object) -> None:
    if not isinstance(model, str) or not 1 <= len(model) <= MAX_NAME:
        raise ValueError(f"a model id of 1 to {MAX_NAME} characters, not {type(model).__name__}")
    if adapter is not None and (not isinstance(adapter, str) or not 1 <= len(adapter) <= MAX_NAME):
        raise ValueError(f"an adapter id of 1 to {MAX_NAME} characters or null, not {type(adapter).__name__}")
    _check_value("an epoch", epoch)


def _check_generation(namespace: object, generation: object) -> None:
    if not isinstance(namespace, str) or not EPOCH_NAME.fullmatch(namespace):
        raise ValueError(f"a namespace's record name is 32 hex digits, not {type(namespace).__name__}")
    _check_value("a generation", generation)


def _check_value(what: str, value: object) -> None:
    if type(value) is not int or not 1 <= value <= MAX_EPOCH:
        raise ValueError(f"{what} is an integer from 1 to {MAX_EPOCH}, not {value!r}"[:200])


def highest(seen: Seen) -> dict[Ref, Record]:
    """Per record, the one with the highest value any tier read knows."""
    top: dict[Ref, Record] = {}
    for records in seen.values():
        for record in (records or {}).values():
            held = top.get(record.ref)
            if held is None or record.value > held.value:
                top[record.ref] = record
    return top


class EpochKeeping:
    """One cache's epochs and generations in its durable tiers: read at open, written
    through on a bump or a purge, the shared tiers read again by ``sync`` (on a thread of
    its own every ``sync_s`` seconds, when ``sync_s`` is set and a shared tier is there).

    Every read and write runs outside the cache's lock (invariant 9), one at a time
    (``_io``); the lock is taken only to apply what was read (``Owner.raise_epochs``,
    ``Owner.raise_generations``) and to bump or purge."""

    def __init__(self, owner: Owner, tiers: Sequence[tuple[str, EpochKeeper]], sync_s: float | None = SYNC_S) -> None:
        self._owner = owner
        self._tiers = list(tiers)
        self._io = threading.Lock()
        self._refused: dict[tuple[str, str, str, bytes], None] = {}
        self._owed: set[tuple[str, Ref]] = set()  # (tier, record) a write failed to keep: retried at each sync
        self._held: dict[Place, set[str]] = {}  # the names each book holds: as last read, and written since
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
        """Read the shared tiers now, apply what is higher; the (model, adapter) raised
        (generations raised are applied too, unlisted: their names name no tenant)."""
        return [(r.model, r.adapter) for r in self._sync(shared=True) if isinstance(r, EpochRecord)]

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
            record = EpochRecord(model, adapter, self._owner.bump_epoch(model, adapter))
            failed = self._write(record, [label for label, _ in self._tiers])
        if failed:
            raise EpochNotKept(_not_kept(str(record), failed, "bump"))
        return record.epoch

    def purge(self, tenant: str) -> int:
        """``Owner.purge``, past the generation the shared tiers know, and the namespace's
        new generation written through to every tier. Returns the tokens removed here.
        ``EpochNotKept`` when a tier did not take it, or the namespace is at its last
        generation (the purge holds here all the same: what this cache knew is gone)."""
        with self._io:
            self._sync_locked(shared=True)
            purged = self._owner.purge(tenant)
            if purged.generation is None:
                if purged.last:
                    raise EpochNotKept(
                        f"the purge of {tenant!r} removed what this server held, but its namespace is at the last "
                        f"generation, {MAX_EPOCH}: a tier's blocks of it are not made unreachable"
                    )
                return purged.removed  # shared isolation: the tenant has no namespace of its own
            record = GenerationRecord(*purged.generation)
            failed = self._write(record, [label for label, _ in self._tiers])
        if failed:
            raise EpochNotKept(_not_kept(f"the purge of {tenant!r} ({record})", failed, "purge"))
        return purged.removed

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ------------------------------------------------------------------ inside

    def _sync(self, shared: bool) -> list[Record]:
        with self._io:
            return self._sync_locked(shared)

    def _sync_locked(self, shared: bool) -> list[Record]:
        seen = self._read(shared)
        top = highest(seen)
        epochs = {(r.model, r.adapter): r.epoch for r in top.values() if isinstance(r, EpochRecord)}
        generations = {r.namespace: r.generation for r in top.values() if isinstance(r, GenerationRecord)}
        raised: list[Ref] = [("epochs", record_name(m, a)) for m, a in self._owner.raise_epochs(epochs)]
        raised += [("generations", name) for name in self._owner.raise_generations(generations)]
        known = self._known()
        for (label, book), records in seen.items():
            if records is None:
                continue
            for (of, name), record in known.items():
                held = records.get(name)
                if of == book and (held is None or held.value < record.value):
                    self._write(record, [label])  # NOTE: a failure is counted; the next sync tries again
        read = {label for label, _ in seen}
        unread = [label for label, _ in self._tiers if label not in read]  # a disk, at a sync: told what is news
        for ref in raised:
            self._write(known[ref], unread)
        for label, ref in sorted(self._owed):  # what a tier failed to keep, wherever it was read or not
            if (label, ref) in self._owed:
                self._write(known[ref], [label])
        if shared:
            with self._synced:
                self.syncs += 1
                self._synced.notify_all()
        return [known[ref] for ref in raised]

    def _known(self) -> dict[Ref, Record]:
        """Every epoch and generation above 0 this cache holds: what the tiers must keep."""
        records: list[Record] = [EpochRecord(m, a, epoch) for (m, a), epoch in self._owner.epochs().items()]
        records += [GenerationRecord(name, g) for name, g in self._owner.generations().items()]
        return {record.ref: record for record in records}

    def _read(self, shared: bool) -> Seen:
        seen: Seen = {}
        for label, keeper in self._tiers:
            if shared and not keeper.epoch_sync:
                continue
            down = False
            for book in EPOCH_BOOKS:
                # NOTE: a tier that failed one read is not asked again this time: one failure
                # per sync on its breaker, and one wait on a tier that does not answer
                seen[(label, book)] = None if down else self._read_book(label, keeper, book)
                down = seen[(label, book)] is None
        return seen

    def _read_book(self, label: str, keeper: EpochKeeper, book: str) -> dict[str, Record] | None:
        try:
            held = keeper.read_epochs(book)
        except (TierError, OSError) as exc:
            log.warning("event=epochs_unread tier=%s book=%s error=%s (read again at the next sync)", label, book, exc)
            return None
        except Exception:  # NOTE: a store's bug must not keep a cache from opening, nor end the syncs
            log.exception("event=epochs_unread tier=%s book=%s (read again at the next sync)", label, book)
            return None
        self._held[(label, book)] = {name for name, _ in held}
        records: dict[str, Record] = {}
        for name, data in held:
            try:
                records[name] = _decode(book, name, data)
            except BadRecord as exc:
                self._refuse(label, book, name, data, str(exc))
        return records

    def _write(self, record: Record, labels: list[str]) -> list[str]:
        book, name = record.ref
        data = encode(record)
        failed = []
        for label, keeper in self._tiers:
            if label not in labels:
                continue
            held = self._held.setdefault((label, book), set())
            try:
                if name not in held and len(held) >= EPOCH_RECORDS:
                    # NOTE: a reader takes this many of a book: one more would hide one of them
                    raise BookFull(f"its {book} hold {len(held)} records, the most a cache reads")
                keeper.write_epoch(name, data, book)
            except (TierError, OSError) as exc:
                line = "event=epoch_not_kept tier=%s record=%r error=%s (written again at each sync)"
                # NOTE: once per record until it is kept: a tier that refuses writes is tried every sync
                level = logging.DEBUG if (label, record.ref) in self._owed else logging.WARNING
                log.log(level, line, label, str(record), exc)
                self._owed.add((label, record.ref))
                failed.append(f"{label} ({exc})" if isinstance(exc, BookFull) else label)
            else:
                held.add(name)
                self._owed.discard((label, record.ref))
        return failed

    def _refuse(self, label: str, book: str, name: str, data: bytes, why: str) -> None:
        seen = (label, book, name, hashlib.blake2b(data, digest_size=16).digest())
        if seen in self._refused:
            return
        if len(self._refused) >= _REFUSED_KEPT:
            self._refused.pop(next(iter(self._refused)))
        self._refused[seen] = None
        log.warning("event=epoch_record_refused tier=%s book=%s name=%s why=%s (ignored)", label, book, name[:64], why)


def _not_kept(what: str, failed: list[str], change: str) -> str:
    return (
        f"{what} holds on this server, but tier {', '.join(failed)} did not keep it (see the tier's errors); it is "
        f"written again at every sync, and a server that restarts or shares that tier misses the {change} until then"
    )


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
