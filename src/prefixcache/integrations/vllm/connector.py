"""``PrefixCacheConnector``: vLLM v1's ``KVConnectorBase_V1``, backed by prefixcache.

vLLM builds one instance in its scheduler (``role`` SCHEDULER) and one in each worker
(WORKER), in different processes. The worker's owns the ``PrefixCache`` (ledger and
tiers, beside the KV it fills); the scheduler's decides each step from vLLM's
scheduler output and asks the worker, over a Unix socket, what it holds. Bytes never
cross that socket: vLLM ships the step's ``PrefixCacheMeta`` (load and save specs),
and the worker moves KV between vLLM's blocks and its tiers outside the cache's lock.

vLLM's own prefix cache stays in front: prefixcache is asked only for the tokens
beyond vLLM's hit. A block the worker cannot load (evicted since the lookup, corrupt,
a tier down) is reported to vLLM, which recomputes it: the connector switches vLLM's
``kv_load_failure_policy`` to ``recompute`` for that reason, since a cache miss is not
a failed request.

Loads are asynchronous by default (``async_load``): the scheduler tells vLLM the tokens
load asynchronously, vLLM parks the request (``WAITING_FOR_REMOTE_KVS``) with its blocks
allocated, the worker reads and places them on I/O threads while the batch's steps go
on, and reports the request in ``get_finished`` once its load is done (with the blocks
it could not fill in ``get_block_ids_with_load_errors`` of the same step). A request
whose blocks sit in a slow tier waits alone.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from prefixcache.fleet import wire
from prefixcache.fleet.translate import wire_events
from prefixcache.integrations.vllm.lookup import LookupClient, LookupServer, socket_path
from prefixcache.integrations.vllm.metrics import PrefixCachePromMetrics, PrefixCacheStats
from prefixcache.integrations.vllm.paged import PagedKV
from prefixcache.integrations.vllm.scheduler import SchedulerState
from prefixcache.integrations.vllm.scope import Fingerprints, scope_of
from prefixcache.integrations.vllm.settings import model_key, parse_settings, read_secret
from prefixcache.integrations.vllm.worker import ConnectorWorker, Loaded, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["PrefixCacheConnector", "PrefixCacheMeta"]

log = logging.getLogger("prefixcache.vllm")


@dataclass
class PrefixCacheMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class PrefixCacheEvents(KVConnectorKVEvents):
    """The worker's KV events on their way to vLLM's publisher (one worker: no voting)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self._events = list(events or ())
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> PrefixCacheEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


class PrefixCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_settings(transfer.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.socket = socket_path(transfer.engine_id or "engine", self.settings.socket_dir or None)
        self._worker: ConnectorWorker | None = None
        self._server: LookupServer | None = None
        self._client: LookupClient | None = None
        self._load_errors: set[int] = set()
        self._loading: dict[str, Future[Loaded]] = {}  # async loads in flight, by request
        self._loader: ThreadPoolExecutor | None = None
        self._events: list[KVCacheEvent] = []
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                log.info(
                    "prefixcache: kv_load_failure_policy set to 'recompute' (a block the cache lost is recomputed)"
                )
                transfer.kv_load_failure_policy = "recompute"
            self._client = LookupClient(self.socket, self.settings.lookup_timeout_s)
            settings, secret, fingerprints = self.settings, read_secret(self.settings), Fingerprints()
            log.info(
                "prefixcache: tenants %s",
                f"verified with the gateway's secret (${settings.tenant_secret_env}); unverified: "
                f"{settings.unverified.value}"
                if secret is not None
                else "by cache_salt (no gateway secret)",
            )

            def scoper(request: Request) -> Any:
                return scope_of(
                    request,
                    secret=secret,
                    default_tenant=settings.default_tenant,
                    unverified=settings.unverified,
                    fingerprints=fingerprints,
                )

            self._state = SchedulerState(self.block_size, self._client.lookup, scoper, async_load=settings.async_load)

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self._vllm_config
        model, parallel = config.model_config, config.parallel_config
        paged = PagedKV(
            kv_caches,
            kv_heads=model.get_num_kv_heads(parallel),
            head_dim=model.get_head_size(),
            block_size=self.block_size,
        )
        # the model's key: only the worker matches (reading the model's files once, here)
        name = self.settings.model_id or str(model.served_model_name or model.model)
        self.model = model_key(name, model.model, str(model.dtype), model.revision)
        self._worker = ConnectorWorker(self.settings.cache, paged, self.model)
        self._server = LookupServer(self.socket, self._worker.lookup)
        atexit.register(self.shutdown)  # vLLM may end a worker without calling shutdown: flush anyway
        log.info(
            "prefixcache: %d layers in the %s layout, model key %s, lookups on %s",
            len(paged.views),
            paged.layout.value,
            self.model,
            self.socket,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        worker = self._worker
        assert isinstance(meta, PrefixCacheMeta) and worker is not None
        for spec in meta.loads:
            if not self.settings.async_load:
                self._load_errors.update(worker.load(spec))
                continue
            if self._loader is None:
                self._loader = ThreadPoolExecutor(self.settings.load_threads, thread_name_prefix="prefixcache-load")
            self._loading[spec.req_id] = self._loader.submit(worker.fetch, spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A sync load completes in ``start_load_kv``, an async one before its request is
        scheduled again: nothing to wait for in the forward pass."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose async loads are done; their unfilled blocks go to
        ``get_block_ids_with_load_errors``, which vLLM asks in the same step."""
        worker = self._worker
        done = {req_id for req_id, future in self._loading.items() if future.done()}
        for req_id in done:
            loaded = self._loading.pop(req_id).result()  # fetch never raises: a failure is a miss
            if worker is not None:
                self._load_errors.update(worker.commit(loaded))
        return None, done or None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves read every layer at once in ``wait_for_save``, from the registered tensors."""

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixCacheMeta) and self._worker is not None
        for spec in meta.saves:
            self._worker.save(spec)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> PrefixCacheStats | None:
        tally = self._worker.take_tally() if self._worker is not None else None
        return PrefixCacheStats(tally.to_dict()) if tally is not None else None

    def get_kv_connector_kv_cache_events(self) -> PrefixCacheEvents | None:
        """The cache's tier moves since the last call, as vLLM events: one ``BlockStored``
        / ``BlockRemoved`` per tier kind (``medium``: device, memory, disk or redis), with
        the blocks' token ids and ``[namespace, model]`` per block (``fleet.translate``)."""
        if self._worker is None:
            return None
        cache = self._worker.cache
        kinds = [tier.kind for tier in cache.config.tiers]
        events = [_vllm_event(e) for e in wire_events(cache.take_events(), cache.config.block_size, kinds)]
        return PrefixCacheEvents(events) if events else None

    def shutdown(self) -> None:
        """Stop answering lookups and flush queued writes (bounded); a second call does nothing."""
        server, worker, client = self._server, self._worker, self._client
        self._server = self._client = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if server is not None:
            server.close()
        if worker is not None and not worker.closed and not worker.close(self.settings.flush_timeout_s):
            log.warning("prefixcache: writes still queued after %.0f s were dropped", self.settings.flush_timeout_s)
        if client is not None:
            client.close()

    # ================================================================ scheduler side

    def on_new_request(self, request: Request) -> None:
        self._state.seen(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self._state.matched(request, num_computed_tokens)
        return tokens, tokens > 0 and self.settings.async_load

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 and self.settings.async_load else ()
        self._state.allocated(request, num_external_tokens, ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan = self._state.step(scheduler_output)
        return PrefixCacheMeta(plan.loads, plan.saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._state.finished(request)
        return False, None  # saves copy out of vLLM's blocks during the step: they may be freed now

    def update_connector_output(self, connector_output: Any) -> None:
        self._state.load_failed(getattr(connector_output, "invalid_block_ids", None) or set())
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, PrefixCacheEvents):
            self._events.extend(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    # ================================================================ metrics

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixCacheStats:
        return PrefixCacheStats(data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PrefixCachePromMetrics:
        return PrefixCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _vllm_event(event: wire.BlockStored | wire.BlockRemoved) -> KVCacheEvent:
    """Our copy of vLLM's struct as vLLM's own (the same fields, ``fleet/wire.py``)."""
    if isinstance(event, wire.BlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
        )
    return BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
