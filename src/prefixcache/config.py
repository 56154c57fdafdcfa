"""Typed, validated configuration: one frozen dataclass per component.

A bad value is a ``ValueError`` raised at construction that says which field is wrong
and why, so that a misconfigured deployment fails at start, not on the first request.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit

from prefixcache.hashing import get_hash
from prefixcache.policies import check_policy
from prefixcache.strict import StrictIsolationError, strict_conflicts

ISOLATION_MODES = ("shared", "namespace", "partitioned")
DEFAULT_CAPACITY_TOKENS = 1 << 20
TIER_KINDS = ("device", "memory", "disk", "redis", "s3")
WRITE_MODES = ("back", "through", "selective")
WRITERS = ("background", "inline", "deferred")
LEVELS = {"device": "L0", "memory": "L1"}  # every other kind (disk, redis, s3) is L2
# NOTE: the KV dtypes a layout may name, and their bytes per value: the ones the frame
# codec writes (``storage/header.py`` WIRE_DTYPES; tests/test_layers.py holds the two
# alike). Written here, not read from storage, so that configuration sits below storage.
KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
# NOTE: the codecs a tier may store its frames in (``storage/codec.py`` CODECS, held
# alike by tests/test_layers.py): written here for the same reason as KV_DTYPES.
KV_CODECS = ("raw", "bf16", "int8", "int4")
GiB = 1 << 30
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket naming rules, in short


@dataclass(frozen=True, slots=True)
class Secret:
    """The mark of a setting that is a credential or may carry one (a URL with a password):
    ``Annotated[str, SECRET]``. An error about it never shows its value, and the settings'
    dump masks it (``prefixcache.settings``), so a new secret is safe by being marked."""


SECRET = Secret()


class FrozenMap(dict[str, int]):
    """A mapping a frozen configuration can hold: it refuses changes, hashes by its
    items, and ``dataclasses.asdict`` and settings libraries copy it like a dict."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a configuration's mapping is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[type[FrozenMap], tuple[dict[str, int]]]:
        return FrozenMap, (dict(self),)

    def __copy__(self) -> FrozenMap:
        return self

    def __deepcopy__(self, memo: object) -> FrozenMap:
        return self


def check_int(name: str, value: object, minimum: int) -> None:
    """A configuration integer: a bool is not one, and below ``minimum`` is an error
    that names the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """hot-prefix publication: a prefix sent by at least ``min_tenants`` distinct tenants,
    and at least ``min_tokens`` long, moves to the shared pool where every tenant can
    match it. Distinct tenants are counted, never hits, so that no tenant can publish
    (and so reveal) a prefix by itself. ``max_candidates`` bounds the memory of the
    counting table (least recently seen candidates are forgotten first)."""

    min_tenants: int = 3
    min_tokens: int = 256
    max_candidates: int = 100_000

    def __post_init__(self) -> None:
        check_int("publish.min_tenants", self.min_tenants, 2)
        check_int("publish.min_tokens", self.min_tokens, 1)
        check_int("publish.max_candidates", self.max_candidates, 1)


MAX_RETAIN_S = 7 * 24 * 3600  # the longest retention a client may ask (an API's longest is 24 h)


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """How much a tenant may keep retained (``cache/retention.py``): a share of each level
    (the cache's capacity, each tier's). ``share`` is split evenly among the tenants that
    retain now and have no share of their own in ``tenants``; a share there of 0 refuses
    that tenant's retention (served without it)."""

    share: float = 0.25
    tenants: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tenants, Mapping):
            raise ValueError("retention.tenants must be a mapping of tenant -> share")
        object.__setattr__(self, "tenants", FrozenMap(self.tenants))  # type: ignore[arg-type]
        for name, share in [
            ("retention.share", self.share),
            *((f"retention.tenants[{t!r}]", v) for t, v in self.tenants.items()),
        ]:
            if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {share!r}")
        total = self.share + sum(self.tenants.values())
        if total > 1:
            raise ValueError(
                f"retention shares add up to {total:g} (the default share and each tenant's own): "
                "above 1, retention could hold the whole cache; lower them"
            )

    def own_share(self, tenant: str) -> float | None:
        """``tenant``'s own share, or None when it shares the default one."""
        return self.tenants.get(tenant)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a model's KV cache: what one block's payload holds,
    ``[layers, 2 (K, V), kv_heads, block_tokens, head_dim]`` in ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        check_int("kv_layout.layers", self.layers, 1)
        check_int("kv_layout.kv_heads", self.kv_heads, 1)
        check_int("kv_layout.head_dim", self.head_dim, 1)
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv dtype {self.dtype!r}; valid: {', '.join(KV_DTYPES)}")

    def shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, tokens, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * KV_DTYPES[self.dtype]

    def stored_bytes(self, tokens: int, codec: str) -> int:
        """Payload bytes of a block of ``tokens`` stored in ``codec`` (the frame's header
        aside): what a tier's capacity counts. NOTE: the codec's sizes written again here
        so that configuration sits below storage; tests/test_layers.py holds them to
        ``codec.encoded_size``."""
        values = self.layers * 2 * self.kv_heads * tokens * self.head_dim
        if codec == "raw":
            return tokens * self.bytes_per_token
        if codec == "bf16":
            return values * 2
        rows = self.layers * self.kv_heads
        if codec == "int8":  # int8 values, fp16 scales: keys per channel, values per token
            return values + rows * (self.head_dim + tokens) * 2
        if codec == "int4":  # two values a byte, an fp16 scale and minimum per group
            group = 32 if self.head_dim % 32 == 0 else self.head_dim
            return (values + 1) // 2 + values // group * 4
        raise ValueError(f"unknown codec {codec!r}; valid: {', '.join(KV_CODECS)}")


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One storage tier, listed fast to slow in ``CacheConfig.tiers``.

    ``write`` says when a block reaches the next slower tier: ``"back"`` when this tier
    evicts it (demotion), ``"through"`` as soon as it is stored here, ``"selective"``
    once it has been loaded ``write_after_hits`` times (a colder block is dropped when
    evicted, never written). The copies are made by the cache's writer (``writer``).
    ``policy`` (default: the cache's) picks this tier's victims. ``path`` is the disk tier's directory;
    ``url`` and ``namespace`` (default: the cache's seed) the Redis tier's server and key
    prefix; ``device`` the torch device of a device tier (``"cpu"``, ``"cuda:0"``).
    ``cluster`` makes the Redis tier a Redis Cluster: ``url`` is then one node of it
    (``redis://host:port``, database 0) and ``startup_nodes`` (``"host:port"``) more
    nodes to discover the cluster from when that one is down (see docs/storage.md).
    ``bucket``, ``prefix``, ``endpoint`` (default: AWS), ``region`` and ``profile`` place an
    ``s3`` tier's objects (docs/storage.md); it has no credential setting: they come
    from the environment, the shared profile or a role, never from this configuration.
    ``concurrency`` bounds its parallel requests (and ``read_timeout`` each one, whole).
    ``verify_payload`` hashes every payload read from a memory or device tier too (disk,
    Redis and S3 always verify; see ``TierStore.private`` for why memory need not).
    ``codec`` is how this tier stores a block's KV (``KV_CODECS``; docs/codecs.md):
    ``"raw"`` as computed, or smaller and lossy (``"bf16"``, ``"int8"``, ``"int4"``),
    decoded into the engine's dtype on load; capacity counts stored bytes, so a tier of
    the same size holds more blocks. A block keeps its key whatever the codec. A device
    tier stays raw (its frames are copied to the host as they are).
    """

    kind: str
    capacity_bytes: int
    policy: str | None = None
    write: str = "back"
    write_after_hits: int = 2
    name: str | None = None
    path: str | None = None
    fsync: str = "data"
    url: Annotated[str | None, SECRET] = field(default=None, repr=False)  # redis://[user:password@]host:port/db
    namespace: str | None = None
    connect_timeout: float = 0.2
    read_timeout: float = 0.2
    cluster: bool = False
    startup_nodes: tuple[str, ...] = ()
    device: str = "cpu"
    verify_payload: bool = False
    codec: str = "raw"
    bucket: str | None = None
    prefix: str = ""
    endpoint: str | None = None  # http(s)://host[:port]; never credentials (refused)
    region: str | None = None
    profile: str | None = None
    concurrency: int = 16

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise ValueError(f"unknown tier kind {self.kind!r}; valid: {', '.join(TIER_KINDS)}")
        check_int(f"tiers[{self.kind}].capacity_bytes", self.capacity_bytes, 0)
        if self.policy is not None:
            check_policy(self.policy, "tier policy")
        if self.write not in WRITE_MODES:
            raise ValueError(f"unknown write mode {self.write!r}; valid: {', '.join(WRITE_MODES)}")
        check_int(f"tiers[{self.kind}].write_after_hits", self.write_after_hits, 1)
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError("a tier name must be a non-empty string")
        if self.kind == "disk" and not self.path:
            raise ValueError("a disk tier needs path (its directory)")
        if self.kind == "redis" and not self.url:
            raise ValueError("a redis tier needs url (e.g. redis://127.0.0.1:6379/0)")
        self._check_cluster()
        self._check_s3()
        if self.codec not in KV_CODECS:
            raise ValueError(f"unknown tier codec {self.codec!r}; valid: {', '.join(KV_CODECS)}")
        if self.kind == "device" and self.codec != "raw":
            raise ValueError(
                f"a device tier stores raw frames; codec {self.codec!r} applies to memory, disk, redis and s3"
            )
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    def _check_cluster(self) -> None:
        object.__setattr__(self, "startup_nodes", tuple(self.startup_nodes))
        if not isinstance(self.cluster, bool):
            raise ValueError(f"cluster must be true or false, got {self.cluster!r}")
        if self.startup_nodes and not self.cluster:
            raise ValueError("startup_nodes apply to a redis tier with cluster = true only")
        if not self.cluster:
            return
        if self.kind != "redis":
            raise ValueError(f"cluster applies to a redis tier only, not to {self.kind!r}")
        url = urlsplit(self.url or "")
        if url.scheme not in ("redis", "rediss") or not url.hostname:
            raise ValueError(
                f"a redis cluster's url is redis://host:port or rediss://host:port, got {url.scheme}://..."
            )
        if url.path.strip("/") not in ("", "0"):
            raise ValueError(f"a redis cluster has database 0 only, got url path {url.path!r}")
        for node in self.startup_nodes:
            host, _, port = node.rpartition(":") if isinstance(node, str) else ("", "", "")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"startup_nodes are 'host:port' strings, got {node!r}")
        if self.namespace is not None and ("{" in self.namespace or "}" in self.namespace):
            raise ValueError("a redis cluster's namespace may not hold { or } (they make the keys' hash tag)")

    def _check_s3(self) -> None:
        if self.kind != "s3":
            for name in ("bucket", "endpoint", "region", "profile"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to an s3 tier only, not to {self.kind!r}")
            if self.prefix:
                raise ValueError(f"prefix applies to an s3 tier only, not to {self.kind!r}")
            return
        if not self.bucket or not _BUCKET.fullmatch(self.bucket):
            raise ValueError(
                f"an s3 tier needs bucket, an S3 bucket name (3-63 characters: a-z, 0-9, '.', '-'), got {self.bucket!r}"
            )
        if not isinstance(self.prefix, str) or any(not part for part in self.prefix.strip("/").split("/")[1:]):
            raise ValueError(
                f"an s3 prefix is a key prefix like 'prefixcache/prod' (no empty parts), got {self.prefix!r}"
            )
        if self.endpoint is not None:
            url = urlsplit(self.endpoint) if isinstance(self.endpoint, str) else None
            if url is None or url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    "an s3 endpoint is an http:// or https:// URL of the service, e.g. https://s3.example.com"
                )
            if url.username or url.password or url.query:
                raise ValueError(
                    "an s3 endpoint may not carry credentials or a query: they come from the environment or a profile"
                )
        check_int(f"tiers[{self.kind}].concurrency", self.concurrency, 1)
        if self.namespace is not None and "/" in self.namespace:
            raise ValueError("an s3 tier's namespace is one part of the object key: no '/'")

    @property
    def label(self) -> str:
        return self.name if self.name is not None else self.kind

    @property
    def level(self) -> str:
        """What the alerts and runbook call it, from what it is made of: ``L0`` device
        memory, ``L1`` host RAM, ``L2`` disk and Redis (by kind, not position, so that a
        deployment without a device tier has no "L0" that is really host RAM)."""
        return LEVELS.get(self.kind, "L2")


def local_tiers(disk: str) -> tuple[TierConfig, ...]:
    """The tiers of one machine's cache that survives a restart: L1 host memory (2 GiB)
    writing every block through to an L2 disk (20 GiB) under ``disk``. What ``serve``'s
    ``[cache]`` and the vLLM connector default to, each with its own folder."""
    return (
        TierConfig(kind="memory", capacity_bytes=2 * GiB, write="through"),
        TierConfig(kind="disk", capacity_bytes=20 * GiB, path=disk, write="through"),
    )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Configuration of a ``PrefixCache``.

    Capacity is given either in tokens (``capacity_tokens``) or in bytes
    (``capacity_bytes`` with ``bytes_per_token``); partitioned ``quotas`` and
    ``shared_quota`` are in the same unit as the capacity.

    With ``tiers`` (fast to slow) the cache holds the blocks' KV bytes, laid out as
    ``kv_layout`` says; each tier's byte capacity bounds what it holds, and the capacity
    above (default: what all tiers hold together) bounds the blocks cached in any tier.
    ``io_threads`` load from several tiers at once. Writes to slower tiers (write-through
    copies, demotions, deletes) are queued in decision order, up to ``write_queue_bytes``
    of frames (a write beyond that is dropped and counted, never waited for), and run by
    ``writer``: ``"background"`` (a thread of their own), ``"inline"`` (by the thread that
    queued them, before its call returns) or ``"deferred"`` (only on ``flush``).

    ``strict_isolation`` forbids every reuse of KV across tenants (OWASP AISVS 5.5.5): it
    is refused beside any setting that allows one (``strict_conflicts``), and the cache
    then never reads the public namespace nor takes a prefix declared public.
    NOTE: a flag beside ``isolation``, not a fourth mode of it: it holds ``namespace``
    and ``partitioned`` alike (quotas stay), and it refuses what they would share rather
    than drop it silently.
    """

    block_size: int = 16
    capacity_tokens: int | None = None
    capacity_bytes: int | None = None
    bytes_per_token: int | None = None
    policy: str = "lru"  # chosen by benchmarks/eviction_table.py (README, "Eviction")
    isolation: str = "namespace"
    partial_blocks: bool = False
    hash: str = "xxh3_128"
    seed: str = "prefixcache"
    vocab_size: int | None = None
    ttl_seconds: float | None = None
    quotas: Mapping[str, int] = field(default_factory=dict)
    shared_quota: int | None = None
    publish: PublishConfig | None = None
    events_capacity: int = 65_536
    tiers: tuple[TierConfig, ...] = ()
    kv_layout: KVLayout | None = None
    io_threads: int = 4
    writer: str = "background"
    write_queue_bytes: int = 256 << 20
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    strict_isolation: bool = False

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1)
        if not isinstance(self.retention, RetentionConfig):
            raise ValueError(f"retention must be a RetentionConfig, got {type(self.retention).__name__}")
        self._check_tiers()
        self._check_capacity()
        check_policy(self.policy, "policy")
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"unknown isolation {self.isolation!r}; valid: {', '.join(ISOLATION_MODES)}")
        get_hash(self.hash)
        if not isinstance(self.seed, str) or not self.seed:
            raise ValueError("seed must be a non-empty string (the same on every server that shares keys)")
        if self.vocab_size is not None:
            check_int("vocab_size", self.vocab_size, 1)
        ttl = self.ttl_seconds
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0):
            raise ValueError(f"ttl_seconds must be a positive number or None, got {self.ttl_seconds!r}")
        check_int("events_capacity", self.events_capacity, 0)
        self._check_strict()
        self._check_tenancy()

    def _check_strict(self) -> None:
        if not isinstance(self.strict_isolation, bool):
            raise ValueError(f"strict_isolation must be true or false, got {self.strict_isolation!r}")
        conflicts = strict_conflicts(self)
        if conflicts:
            raise StrictIsolationError(conflicts)

    def _check_tiers(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        for tier in self.tiers:
            if not isinstance(tier, TierConfig):
                raise ValueError(f"tiers must be TierConfig objects, got {type(tier).__name__}")
        names = [t.label for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique (give each a name=), got {names}")
        if self.kv_layout is not None and not isinstance(self.kv_layout, KVLayout):
            raise ValueError(f"kv_layout must be a KVLayout, got {type(self.kv_layout).__name__}")
        check_int("io_threads", self.io_threads, 1)
        if self.writer not in WRITERS:
            raise ValueError(f"unknown writer {self.writer!r}; valid: {', '.join(WRITERS)}")
        check_int("write_queue_bytes", self.write_queue_bytes, 0)

    def _check_capacity(self) -> None:
        if self.capacity_tokens is not None and self.capacity_bytes is not None:
            raise ValueError("give capacity_tokens or capacity_bytes, not both")
        if self.capacity_bytes is not None:
            check_int("capacity_bytes", self.capacity_bytes, 0)
            if self.bytes_per_token is None:
                raise ValueError("capacity_bytes needs bytes_per_token (the KV size of one token)")
        elif self.capacity_tokens is not None:
            check_int("capacity_tokens", self.capacity_tokens, 0)
        if self.bytes_per_token is not None:
            check_int("bytes_per_token", self.bytes_per_token, 1)

    def _check_tenancy(self) -> None:
        if not isinstance(self.quotas, Mapping):
            raise ValueError("quotas must be a mapping of tenant -> quota")
        object.__setattr__(self, "quotas", FrozenMap(self.quotas))
        partitioned = self.isolation == "partitioned"
        if (self.quotas or self.shared_quota is not None) and not partitioned:
            raise ValueError("quotas and shared_quota apply to isolation='partitioned' only")
        for tenant, quota in self.quotas.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"quota tenant names must be non-empty strings, got {tenant!r}")
            check_int(f"quotas[{tenant!r}]", quota, 0)
        if self.shared_quota is not None:
            check_int("shared_quota", self.shared_quota, 0)
        total = sum(self.quotas.values()) + (self.shared_quota or 0)
        if total > self.capacity_units:
            raise ValueError(f"partitioned quotas add up to {total}, above the capacity of {self.capacity_units}")
        if self.publish is not None and self.isolation == "shared":
            raise ValueError("publish applies to 'namespace' and 'partitioned' isolation (shared shares all)")

    @property
    def capacity_units(self) -> int:
        """Capacity in the unit it was given in (bytes or tokens)."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        if self.capacity_tokens is not None:
            return self.capacity_tokens
        if self.tiers and self.kv_layout is not None:
            return sum(self.tier_tokens(t) for t in self.tiers)
        return DEFAULT_CAPACITY_TOKENS

    def tier_tokens(self, tier: TierConfig) -> int:
        """The tokens ``tier`` holds: its stored bytes in its codec's blocks (a raw tier of
        N bytes holds N // bytes_per_token)."""
        assert self.kv_layout is not None
        return tier.capacity_bytes * self.block_size // self.kv_layout.stored_bytes(self.block_size, tier.codec)

    @property
    def capacity(self) -> int:
        """Capacity in tokens."""
        return self.to_tokens(self.capacity_units)

    def to_tokens(self, units: int) -> int:
        """A capacity or quota in the configured unit, converted to tokens."""
        if self.capacity_bytes is not None and self.bytes_per_token is not None:
            return units // self.bytes_per_token
        return units


# NOTE: the configuration stays free of pydantic; the settings that validate these
# dataclasses with pydantic (the server's, the vLLM connector's) read this attribute and
# so refuse unknown keys in them.
for _cls in (CacheConfig, TierConfig, PublishConfig, KVLayout, RetentionConfig):
    setattr(_cls, "__pydantic_config__", {"extra": "forbid"})  # noqa: B010


def valid_names(root: type, path: Sequence[str]) -> list[str]:
    """The field names valid at ``path`` (nested field names) under ``root``, a dataclass
    or a pydantic model, for an error that names the valid ones."""
    kind: Any = root
    for name in path:
        kind = section_of(field_hint(kind, name))
    if isinstance(kind, type) and hasattr(kind, "model_fields"):
        return list(kind.model_fields)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return [f.name for f in dataclasses.fields(kind)]
    return []


def field_hint(kind: Any, name: str) -> Any:
    """The annotation of field ``name`` of ``kind`` (a dataclass or a pydantic model), its
    ``Annotated`` marks kept; None when there is no such field."""
    if not isinstance(kind, type) or not (dataclasses.is_dataclass(kind) or hasattr(kind, "model_fields")):
        return None
    return typing.get_type_hints(kind, include_extras=True).get(name)


def is_secret(hint: Any) -> bool:
    """Whether an annotation (``field_hint``) marks a secret."""
    return typing.get_origin(hint) is Annotated and any(isinstance(m, Secret) for m in hint.__metadata__)


def secret_depth(root: type, path: Sequence[str]) -> int | None:
    """How many names of ``path`` (nested field names under ``root``) lead to a secret
    field (what follows is inside it: a mapping's key may be a secret itself); None
    when the path names no secret."""
    kind: Any = root
    for depth, name in enumerate(path, 1):
        hint = field_hint(kind, name)
        if is_secret(hint):
            return depth
        kind = section_of(hint)
    return None


def section_of(hint: Any) -> Any:
    """The dataclass or pydantic model a field's annotation holds (inside ``Annotated``,
    an optional or a tuple of them), or the annotation itself."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    for arg in typing.get_args(hint) or (hint,):
        if isinstance(arg, type) and (dataclasses.is_dataclass(arg) or hasattr(arg, "model_fields")):
            return arg
    return hint
