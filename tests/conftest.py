"""Shared fixtures, and hypothesis profiles: CI replays a fixed set of examples (a red
CI run is then a regression, never bad luck); a developer's run explores new random
examples."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from prefixcache.sim.traces import Request, read_trace
from redis_cluster import REDIS_CLI, LocalCluster
from redis_server import REDIS_SERVER, RedisServer
from support import CONVERSATION, SYNTHETIC

if os.environ.get("PYTEST_XDIST_WORKER"):
    # NOTE: one core's worth of torch per worker (and per server a test starts): two workers
    # on two cores, each with its own OpenMP team, would wake each other's teams on every op
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes a Redis server or cluster is marked ``redis`` (``make unit`` leaves those out)."""
    for item in items:
        if {"redis_server", "redis_cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real ``redis-server`` of the test's own, on a free loopback port."""
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed")
    srv = RedisServer(tmp_path).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def _local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if not Path(REDIS_SERVER).exists() or not Path(REDIS_CLI).exists():
        pytest.skip("redis-server or redis-cli is not installed")
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(_local_cluster: LocalCluster) -> LocalCluster:
    """A real Redis Cluster of 3 masters on loopback, shared by the session (it takes
    seconds to form): every node up and the cluster ok, emptied, for each test."""
    _local_cluster.revive()
    _local_cluster.flushall()
    return _local_cluster


@pytest.fixture(scope="session")
def synthetic() -> list[Request]:
    """The Mooncake synthetic trace, parsed once per session (read-only)."""
    return list(read_trace(SYNTHETIC))


@pytest.fixture(scope="session")
def conversation() -> list[Request]:
    """The Mooncake conversation trace, parsed once per session (read-only)."""
    return list(read_trace(CONVERSATION))
