"""A router follows a real cache's publisher through a Redis restart: the batches sent
while Redis was down are in no stream, so the router loads a snapshot and its index
equals the cache's residency again."""

from __future__ import annotations

import time
from pathlib import Path

import redis

from prefixcache.fleet.follow import Follower
from prefixcache.fleet.index import GlobalIndex
from prefixcache.fleet.keys import chain_keys, root_key
from prefixcache.fleet.streams import StreamReader
from redis_server import RedisServer
from support import wait_for
from test_fleet_publisher import ACME, BS, MODEL, insert, make_cache, publisher, truth


def held(index: GlobalIndex, tokens: list[int]) -> int:
    return len(index.matched([chain_keys(root_key(ACME.tenant, MODEL), tokens, BS)], ["b1"])["b1"])


def test_the_router_resynchronizes_after_a_redis_restart(tmp_path: Path, redis_server: RedisServer) -> None:
    cache = make_cache(tmp_path / "disk")
    pub = publisher(cache, redis_server, retry_s=0.05)
    index = GlobalIndex()
    follower = Follower("b1", index, MODEL)
    client = redis.Redis.from_url(redis_server.url, socket_timeout=1.0)
    reader = StreamReader(follower, client, pub.config.stream, pub.snapshot).start()
    try:
        a, b, c = list(range(12)), list(range(100, 112)), list(range(200, 212))
        insert(cache, a)
        pub.publish_pending()
        wait_for(lambda: held(index, a) == 3)
        redis_server.kill()
        insert(cache, b)
        pub.publish_pending()  # dropped: Redis is down
        redis_server.start()
        time.sleep(0.1)  # past the publisher's retry pause
        insert(cache, c)
        pub.publish_pending()
        # a snapshot's blocks reach the index before its seq is taken: wait for both
        wait_for(lambda: held(index, c) == 3 and held(index, b) == 3 and follower.seq == pub.seq)
        assert follower.stats.snapshots >= 2  # the start, and the gap no stream held
        assert follower.seq == pub.seq
        assert held(index, a) == 3 and len(truth(cache)) == 9  # nothing lost, nothing invented
    finally:
        reader.stop()
        pub.stop()
        cache.close()
