"""Object-store tier (S3 API, L2, shared): one object per block frame, behind a circuit breaker.

The bottom of the pyramid: terabytes, cheap, shared by every server of every zone, and
outliving any one of them. Block keys are deterministic across processes (design.md
invariant 2), so a server pointed at a bucket finds what any other server (or the
server before a restart) wrote there, with no shared index::

    server A --PUT (writer thread)-->  +-------------------------------------------+
                                       | s3://bucket/<prefix>/<namespace>/<key hex> |
    server B --HEAD k0..k15 (chunked)->|   one object per block frame               |
             --GET  k0..kN (parallel)->|   (a lifecycle rule expires the forgotten) |
                                       +-------------------------------------------+

Key layout. ``<prefix>/<namespace>/<block key in hex>``; the namespace is the tier's
``namespace``, by default the deployment seed, as in Redis. The block key already
covers the model id and epoch, adapter, tokenizer, tenant namespace and extra keys
(``hashing.py``), so the path needs no model id to keep models apart. NOTE: the model id
is not added to the path: the store sees only ``key -> frame`` (design: storage decides
nothing), and passing a model through every put would add a second naming of what the
key already names. An operator who wants to drop one model's objects by prefix gives
that model's deployment its own ``namespace`` (``aws s3 rm --recursive
s3://bucket/<prefix>/<namespace>/``); otherwise an epoch bump or purge deletes them
through the cache, and the bucket's lifecycle rule expires what no server deletes.
Random hex after the namespace spreads keys over S3's per-prefix request partitions.

The index is read lazily, on a miss: a request's own chain beyond what the local tree
holds is probed with HEADs, ``concurrency`` in parallel per chunk, stopping at the first
hole (``contains_prefix``); nothing lists the bucket at start. A bucket may hold millions
of objects from many servers, and a listing is O(objects) before the first request,
while a probe is O(the request's chain) and only for the requests that need it.

Client: obstore (Rust ``object_store``) over boto3, by measured throughput: parallel GETs
of block-sized objects from a real S3 API server on loopback (``benchmarks/
bench_s3_client.py``; figures in docs/storage.md) gave obstore more throughput for less
client CPU per GET than boto3, CPU a serving process needs for its model. Its
``timeout`` is a deadline on the whole request (boto3's read timeout is per socket read,
so a slowly dripping reply could outlast it). Credentials come from boto3's chain
(``obstore.auth.boto3``): environment, shared profile (``profile``), SSO, instance or
task role, the places an AWS user expects; never from this tier's settings.

Every read is verified (``codec.verify(frame, key=key)``): an object that is not a
frame, is truncated, or is another block's is a counted miss and deleted (best effort).
Every failure of the endpoint is a counted miss for reads and a ``TierError`` for
writes, and a ``CircuitBreaker`` turns a dead or stalled endpoint into immediate misses.
Writes come only from the cache's writer thread (the store is not ``sync``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, ClassVar, Final, TypeVar

import obstore
from obstore import Bytes
from obstore.store import S3Store as ObjectStore

from prefixcache.storage import codec
from prefixcache.storage.base import (
    EPOCH_NAME,
    EPOCH_RECORD_BYTES,
    EPOCH_RECORDS,
    MAX_FRAME_BYTES,
    Frame,
    TierError,
    TierFull,
    TierStore,
    epoch_book,
)
from prefixcache.storage.breaker import CircuitBreaker

if TYPE_CHECKING:
    from obstore import ObjectMeta

__all__ = ["S3StartError", "S3Store"]

T = TypeVar("T")

START_TIMEOUT: Final = 10.0  # seconds the start-up check may take (a cold TLS handshake, a far region)
_CODE = re.compile(r"<Code>(\w{1,64})</Code>")
_STATUS = re.compile(r"status code: (\d{3})")


class S3StartError(TierError, ValueError):
    """The bucket cannot be used (missing, wrong region, refused, bad credentials): raised
    when the tier opens, naming bucket and endpoint, never a credential.

    NOTE: both a ``TierError`` and a ``ValueError``, so that a caller that reports bad
    settings at start (``ValueError``) and one that handles tier failures both catch it."""


def _cause(exc: BaseException) -> tuple[str, str]:
    """``(kind, what)`` of an obstore failure: the error kind counted in ``stats.errors``
    and a short cause (an S3 error code or HTTP status). NOTE: obstore's message may
    quote a server's reply (a signature error's echoes the access key id), so only these
    extracted words ever reach a log line or an error."""
    text = str(exc)
    if isinstance(exc, FileNotFoundError):
        return "missing", "NoSuchKey"
    code = _CODE.search(text)
    status = _STATUS.search(text)
    if code or status:
        return "s3", code.group(1) if code else f"HTTP {status.group(1) if status else '?'}"
    if "Timeout" in text or "timed out" in text:
        return "timeout", "timed out"
    return "connection", "unreachable (connection refused or reset)"


def _hint(what: str) -> str:
    """What an operator should check for a start-up failure ``what``."""
    if what in ("NoSuchBucket",):
        return "the bucket does not exist: create it, or fix `bucket`"
    if what in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException", "HTTP 301"):
        return "the bucket lives in another region: fix `region`"
    if what in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "HTTP 403"):
        return "the credentials were refused: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, `profile` or the role"
    if what in ("AccessDenied",):
        return "access denied: the credentials need s3:ListBucket, GetObject, PutObject and DeleteObject"
    return "check `endpoint` and that the service is up"


class S3Store(TierStore):
    """Frames as objects ``<prefix>/<namespace>/<key hex>``; reads verified and parallel, failures misses.

    ``capacity_bytes`` is a soft budget, as for Redis: the bytes of frames *this process*
    wrote and has not deleted (``TierFull`` past it, so the cache evicts its own first);
    the bucket has no cap. ``len()`` counts the keys this process put and has not deleted
    or seen missing; the bucket holds more (other servers', earlier runs').

    ``get_many`` and ``contains_prefix`` run at most ``concurrency`` requests at once, on
    a thread pool the store owns; ``read_timeout`` bounds each request whole (connect to
    last byte, beyond ``connect_timeout``). Error kinds: ``connection``, ``timeout``,
    ``s3`` (the endpoint refused: 403, 5xx...), ``breaker_open``, ``checksum`` (an object
    that is not this block's intact frame; deleted, best effort) and ``missing``.
    """

    kind: ClassVar[str] = "s3"
    verifies_reads: ClassVar[bool] = True  # get_many verifies every frame it returns

    def __init__(
        self,
        bucket: str,
        capacity_bytes: int,
        namespace: str,
        *,
        prefix: str = "",
        endpoint: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        connect_timeout: float = 0.2,
        read_timeout: float = 0.2,
        concurrency: int = 16,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        super().__init__(capacity_bytes)
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes  # an object longer is no frame of this tier (never read)
        if not isinstance(namespace, str) or not namespace or "/" in namespace:
            raise ValueError("namespace (the deployment seed) must be a non-empty string without '/'")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.bucket, self.namespace, self.concurrency = bucket, namespace, concurrency
        self.read_width = concurrency  # the loader asks for this many frames per get_many (transfer.py)
        self.endpoint = endpoint or "AWS"
        where = f"s3://{bucket}/{prefix.strip('/')} at {self.endpoint}"
        self.stats.where = f"s3:{where}"
        self._root = "/".join(p for p in (prefix.strip("/"), namespace) if p) + "/"
        self.breaker = breaker if breaker is not None else CircuitBreaker(clock=clock, name=where)
        self._sizes: dict[bytes, int] = {}  # key -> frame bytes, for what this process put
        self._used = 0
        self._books = threading.Lock()  # _sizes and _used; never held over a network call
        self._closed = False
        # NOTE: the records read last, by path: (ETag, size, modified) -> bytes, so that a sync
        # GETs only what changed since (a LIST a second, not a GET a record a second)
        self._records: dict[str, tuple[tuple[object, ...], bytes]] = {}
        self._client = self._connect(region, profile, connect_timeout, read_timeout)
        self._check_bucket(self._connect(region, profile, connect_timeout, START_TIMEOUT))
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="prefixcache-s3")

    # ------------------------------------------------------------------ start

    def _connect(self, region: str | None, profile: str | None, connect: float, total: float) -> ObjectStore:
        """An obstore client with no retries (the breaker is the retry policy) and
        credentials from boto3's chain; a missing credential is an error now."""
        import boto3  # NOTE: for its credential chain only; imported when an s3 tier opens
        import botocore.exceptions
        from obstore.auth.boto3 import Boto3CredentialProvider

        try:
            session = boto3.Session(profile_name=profile, region_name=region)
            found = session.get_credentials() is not None
        except botocore.exceptions.BotoCoreError as exc:  # an unknown profile, a broken config file
            raise S3StartError(f"{self._named()}: {type(exc).__name__} in the AWS configuration") from None
        if not found:
            raise S3StartError(
                f"{self._named()}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a profile, or run with an instance or task role)"
            )
        options: dict[str, object] = {
            "connect_timeout": timedelta(seconds=connect),
            "timeout": timedelta(seconds=connect + total),
            "allow_http": bool(self.endpoint.startswith("http://")),
        }
        return ObjectStore(
            self.bucket,
            endpoint=None if self.endpoint == "AWS" else self.endpoint,
            region=region or session.region_name or "us-east-1",
            credential_provider=Boto3CredentialProvider(session),
            client_options=options,  # type: ignore[arg-type]
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=connect + total)},
        )

    def _named(self) -> str:
        return f"s3 tier: bucket {self.bucket!r} at {self.endpoint}"

    def _check_bucket(self, client: ObjectStore) -> None:
        """One LIST of at most one key under this tier's path: a bucket that does not
        exist, a wrong region, an endpoint that refuses and credentials refused all fail
        here, at start, rather than as a tier that misses forever."""
        try:
            next(iter(obstore.list(client, self._root, chunk_size=1)), None)
        except Exception as exc:
            _, what = _cause(exc)
            raise S3StartError(f"{self._named()}: {what}; {_hint(what)}") from None

    # ------------------------------------------------------------------ the door to the network

    def _path(self, key: bytes) -> str:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        return self._root + key.hex()

    def _guarded(self, op: Callable[[], T]) -> T:
        """Run ``op`` through the breaker; a failure is counted and raised as ``TierError``
        (``FileNotFoundError`` passes through: the endpoint answered, the object is absent).

        NOTE: an S3 error reply (403, 5xx) means the endpoint answered, so it counts as a
        success for the breaker, as a Redis ``ResponseError`` does: only an unreachable or
        silent endpoint opens it."""
        if self._closed:
            raise TierError("s3 store is closed")
        if not self.breaker.allow():
            self.stats.error("breaker_open")
            raise TierError(f"s3 skipped: circuit breaker of {self.breaker.name} open")
        try:
            result = op()
        except FileNotFoundError:
            self.breaker.record_success()
            raise
        except Exception as exc:
            kind, what = _cause(exc)
            self.stats.error(kind, what)
            if kind == "s3":
                self.breaker.record_success()
            else:
                self.breaker.record_failure()
            raise TierError(f"s3 {kind}: {what}") from None
        self.breaker.record_success()
        return result

    def _forget(self, key: bytes) -> None:
        with self._books:
            self._used -= self._sizes.pop(key, 0)

    @property
    def used_bytes(self) -> int:
        """Bytes of the frames this process put and has not deleted (or seen gone)."""
        return self._used

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, frame: Frame) -> None:
        """PUT the frame as one object (atomic: a reader sees all of it or none).
        ``TierFull`` past the budget before anything is sent; ``TierError`` on failure."""
        path, view = self._path(key), memoryview(frame).cast("B")
        with self._books:
            grow = view.nbytes - self._sizes.get(key, 0)
            if self._used + grow > self.capacity_bytes:
                raise TierFull(f"{self._used} + {grow} bytes would pass the {self.capacity_bytes}-byte budget")
        self._guarded(lambda: obstore.put(self._client, path, view, use_multipart=False))
        with self._books:
            self._used += view.nbytes - self._sizes.get(key, 0)
            self._sizes[key] = view.nbytes
            self.stats.puts += 1
            self.stats.bytes_written += view.nbytes

    def delete(self, key: bytes) -> bool:
        """DELETE the object; ``True`` once the endpoint accepted it (S3 does not say
        whether it was there), ``False`` when it failed (counted)."""
        path = self._path(key)
        self._forget(key)  # NOTE: even on failure: an undeletable object must not hold the budget forever
        try:
            self._guarded(lambda: obstore.delete(self._client, path))
        except (TierError, FileNotFoundError):
            return False
        self.stats.deletes += 1
        return True

    # ------------------------------------------------------------------ reads

    def get_many(self, keys: Sequence[bytes]) -> list[Frame | None]:
        """The frames of ``keys``, fetched ``concurrency`` at a time, each verified; ``None`` for any miss."""
        if not keys:
            return []
        futures = [self._submit(self._get_one, key) for key in keys]
        out: list[Frame | None] = []
        for key, future in zip(keys, futures, strict=True):
            frame = future.result() if future is not None else None
            if frame is None:
                self.stats.misses += 1
                self._forget(key)
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(frame)
            out.append(frame)
        return out

    def _submit(self, fn: Callable[[bytes], T], key: bytes) -> Future[T] | None:
        try:
            return self._pool.submit(fn, key)
        except RuntimeError:  # closed meanwhile
            return None

    def _get_one(self, key: bytes) -> memoryview | None:
        path = self._path(key)
        try:
            got = self._guarded(lambda: self._bounded_get(path))
        except (TierError, FileNotFoundError):
            return None
        frame = memoryview(got) if got is not None else None
        try:
            if frame is None or frame.nbytes > self.max_frame_bytes:
                raise codec.CorruptFrame(f"{path}: longer than a frame of this tier ({self.max_frame_bytes} bytes)")
            codec.verify(frame, key=key)
        except codec.FrameError:
            self.stats.error("checksum")
            self._discard(path)
            return None
        return frame

    def _bounded_get(self, path: str) -> Bytes | None:
        """The object's bytes, or None, unread, when its size says it is longer than a frame."""
        result = obstore.get(self._client, path)
        if result.meta["size"] > self.max_frame_bytes:
            return None  # NOTE: the body is left unread (the response is dropped)
        return result.bytes()

    def _discard(self, path: str) -> None:
        """DELETE a bad object, best effort: a failure is counted and the next read finds it bad again."""
        try:
            self._guarded(lambda: obstore.delete(self._client, path))
        except (TierError, FileNotFoundError):
            return
        self.stats.deletes += 1

    def _exists(self, key: bytes) -> bool:
        path = self._path(key)
        try:
            self._guarded(lambda: obstore.head(self._client, path))
        except (TierError, FileNotFoundError):
            return False
        return True

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` exist: HEADs, ``concurrency`` in parallel per chunk,
        stopping at the first chunk with a hole.

        NOTE: counting leading hits, not the base class's binary search: a lifecycle rule
        or another server's delete may drop a parent and keep its child, so a chain in a
        bucket is not prefix-closed. A membership test is not a read: the frame is
        verified only by ``get_many``."""
        held = 0
        for start in range(0, len(keys), self.concurrency):
            chunk = keys[start : start + self.concurrency]
            futures = [self._submit(self._exists, key) for key in chunk]
            for key, future in zip(chunk, futures, strict=True):
                if future is None or not future.result():
                    self._forget(key)
                    return held
                held += 1
        return held

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.contains_prefix([key]) == 1

    def __len__(self) -> int:
        """Keys this process put and has not deleted or seen missing (the bucket holds more)."""
        return len(self._sizes)

    def close(self) -> None:
        """Stop the pool; later reads are misses and later writes raise ``TierError``."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ epoch records

    epoch_sync: ClassVar[bool] = True  # other servers write the bucket too: re-read while the cache runs

    def read_epochs(self, book: str = "epochs") -> list[tuple[str, bytes]]:
        """The objects under ``<prefix>/<namespace>/~<book>/`` (``base.EpochKeeper``): one
        LIST, then a GET of each object named for a record whose size is at most
        ``EPOCH_RECORD_BYTES`` (the rest are counted ``epoch`` and left unread).
        ``TierError`` when any call fails: a partial view must not pass for the whole.
        An object whose ETag, size and modification time are those of the last read is
        not fetched again. Called by one thread at a time (the cache's epoch book).
        NOTE: ``~`` is no hex digit, so no block's object is under this folder."""
        folder = f"{self._root}~{epoch_book(book)}/"
        found: list[tuple[str, bytes]] = []
        listed: set[str] = set()
        for meta in self._guarded(lambda: self._list_epochs(folder)):
            path, size = meta["path"], meta["size"]
            name = path.removeprefix(folder)
            if not EPOCH_NAME.fullmatch(name) or size > EPOCH_RECORD_BYTES:
                self.stats.error("epoch", f"{path}: not a record ({size} bytes)")
                continue
            listed.add(path)
            seen = (meta.get("e_tag"), size, meta.get("last_modified"))
            held = self._records.get(path)
            if held is not None and held[0] == seen and seen[0] is not None:
                found.append((name, held[1]))
                continue
            try:
                got = self._guarded(partial(self._bounded_record, path))
            except FileNotFoundError:
                continue  # deleted since the LIST
            if got is None:
                self.stats.error("epoch", f"{path}: grew past {EPOCH_RECORD_BYTES} bytes")
                continue
            self._records[path] = (seen, bytes(got))  # NOTE: a GET newer than its LIST costs one more GET
            found.append((name, bytes(got)))
        for path in [p for p in self._records if p.startswith(folder) and p not in listed]:
            del self._records[path]
        return found

    def _list_epochs(self, folder: str) -> list[ObjectMeta]:
        metas: list[ObjectMeta] = []
        for chunk in obstore.list(self._client, folder, chunk_size=100):
            metas.extend(chunk)
            if len(metas) >= EPOCH_RECORDS:
                break
        return metas[:EPOCH_RECORDS]

    def _bounded_record(self, path: str) -> Bytes | None:
        result = obstore.get(self._client, path)
        if result.meta["size"] > EPOCH_RECORD_BYTES:
            return None  # NOTE: the body is left unread
        return result.bytes()

    def write_epoch(self, name: str, record: bytes, book: str = "epochs") -> None:
        """PUT the record as one object (a reader sees all of it or none)."""
        if not EPOCH_NAME.fullmatch(name):
            raise ValueError(f"not an epoch record's name: {name!r}")
        path = f"{self._root}~{epoch_book(book)}/{name}"
        self._guarded(lambda: obstore.put(self._client, path, record, use_multipart=False))
