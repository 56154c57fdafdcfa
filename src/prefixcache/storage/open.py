"""The store a tier's configuration names."""

from __future__ import annotations

from prefixcache.config import TierConfig
from prefixcache.storage.base import TierStore
from prefixcache.storage.disk import DiskStore
from prefixcache.storage.memory import MemoryStore

__all__ = ["open_store"]


def open_store(config: TierConfig, frame_bytes: int, seed: str) -> TierStore:
    """The store of ``config``, for frames of up to ``frame_bytes`` (a stored tier reads no
    more than that of any key: what another writer put there is bounded too); Redis keys
    and S3 object paths are prefixed by the tier's namespace (default: the deployment seed)."""
    slot = MemoryStore.slot_for(frame_bytes)
    if config.kind == "memory":
        return MemoryStore(config.capacity_bytes, slot)
    if config.kind == "device":
        from prefixcache.storage.device import DeviceStore  # torch only when asked for

        return DeviceStore(config.capacity_bytes, slot, config.device)
    if config.kind == "disk":
        assert config.path is not None
        return DiskStore(config.path, config.capacity_bytes, config.fsync, max_frame_bytes=frame_bytes)
    if config.kind == "s3":
        from prefixcache.storage.s3 import S3Store  # obstore and boto3 are optional dependencies

        assert config.bucket is not None
        return S3Store(
            config.bucket,
            config.capacity_bytes,
            config.namespace or seed,
            prefix=config.prefix,
            endpoint=config.endpoint,
            region=config.region,
            profile=config.profile,
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            concurrency=config.concurrency,
            max_frame_bytes=frame_bytes,
        )
    assert config.url is not None
    if config.cluster:
        from prefixcache.storage.redis_cluster import RedisClusterStore  # redis-py is an optional dependency

        return RedisClusterStore(
            config.url,
            config.capacity_bytes,
            config.namespace or seed,
            startup_nodes=config.startup_nodes,
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            max_frame_bytes=frame_bytes,
        )
    from prefixcache.storage.redis import RedisStore

    return RedisStore(
        config.url,
        config.capacity_bytes,
        config.namespace or seed,
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        max_frame_bytes=frame_bytes,
    )
