"""The router's view of each backend, as Prometheus series (collected at scrape time).

``prefixcache_route_backend_up{backend}`` 1 while a backend takes requests;
``prefixcache_route_backend_blocks{backend}`` the blocks the index holds for it;
``prefixcache_route_backend_load{backend}`` its load in blocks (``Scorer.load``);
``prefixcache_route_event_batches_total{backend}`` batches applied from its events;
``prefixcache_route_event_gaps_total{backend,closed_by}`` gaps in its events, by how
they were closed (``replay`` from the stream, ``snapshot`` (the first load counts too), or ``resync`` for a restart
or an event the index could not place). A steady rise of ``snapshot`` means the stream's
buffer (``[fleet] maxlen``) is too short for how far the router falls behind, or that
the backend cannot reach Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.fleet.backends import Backend
from prefixcache.fleet.index import GlobalIndex
from prefixcache.fleet.scoring import Scorer

__all__ = ["ROUTE_METRICS", "RouteCollector"]

ROUTE_METRICS = frozenset(  # every sample name a router exports (alert rules may use only these)
    {
        "prefixcache_route_requests_total",
        "prefixcache_route_retries_total",
        "prefixcache_route_overlap_blocks_total",
        "prefixcache_route_backends_up",
        "prefixcache_route_index_blocks",
        "prefixcache_route_backend_up",
        "prefixcache_route_backend_blocks",
        "prefixcache_route_backend_load",
        "prefixcache_route_event_batches_total",
        "prefixcache_route_event_gaps_total",
    }
)


class RouteCollector(Collector):
    def __init__(self, backends: Callable[[], Sequence[Backend]], index: GlobalIndex, scorer: Scorer) -> None:
        self._backends, self._index, self._scorer = backends, index, scorer

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("prefixcache_route_backend_up", "1 while the backend takes requests", labels=["backend"])
        blocks = GaugeMetricFamily(
            "prefixcache_route_backend_blocks", "Blocks the router's index holds for the backend", labels=["backend"]
        )
        load = GaugeMetricFamily(
            "prefixcache_route_backend_load", "The backend's load in blocks of prefill", labels=["backend"]
        )
        applied = CounterMetricFamily(
            "prefixcache_route_event_batches", "Event batches applied from the backend", labels=["backend"]
        )
        gaps = CounterMetricFamily(
            "prefixcache_route_event_gaps",
            "Gaps in the backend's events, by how they were closed",
            labels=["backend", "closed_by"],
        )
        for b in self._backends():
            name = b.name
            up.add_metric([name], 1.0 if b.up else 0.0)
            blocks.add_metric([name], float(self._index.held(name)))
            load.add_metric([name], self._scorer.load(b.pending, b.generating))
            if b.follower is not None:
                stats = b.follower.stats
                applied.add_metric([name], float(stats.applied))
                gaps.add_metric([name, "replay"], float(stats.replays))
                gaps.add_metric([name, "snapshot"], float(stats.snapshots))
                gaps.add_metric([name, "resync"], float(stats.resyncs))
        yield from (up, blocks, load, applied, gaps)
