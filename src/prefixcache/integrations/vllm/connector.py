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
on, and reports the request in ``get_transfer_results`` once its load is done (with the
blocks it could not fill in ``get_block_ids_with_load_errors`` of the same step). A
request whose blocks sit in a slow tier waits alone.

Every hook vLLM calls runs behind one ``Wall`` (``wall.py``, design invariant 17): an
exception is a counted bypass, never an exception in vLLM. The hooks' bodies and what
each answers on failure are vLLM-free (``scheduler.py``, ``worker_hooks.py``); here each
override only converts between vLLM's types and theirs, inside the same wall. Only
``register_kv_caches`` may raise: it runs once at start, where a KV layout the connector
cannot read must stop vLLM with a clear error rather than serve without the cache.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from prefixcache.fleet import wire
from prefixcache.integrations.vllm.groups import KVGroups, LayerKind, describe, kv_groups
from prefixcache.integrations.vllm.lookup import LookupClient, LookupServer, socket_path
from prefixcache.integrations.vllm.metrics import PrefixCachePromMetrics, PrefixCacheStats
from prefixcache.integrations.vllm.paged import GroupedKV, PagedKV, StatePages
from prefixcache.integrations.vllm.scheduler import SchedulerState
from prefixcache.integrations.vllm.scope import Bypass, Fingerprints, scope_of
from prefixcache.integrations.vllm.settings import model_key, parse_settings, read_secret
from prefixcache.integrations.vllm.wall import Wall
from prefixcache.integrations.vllm.worker import ConnectorWorker, LoadSpec, SaveSpec, VoidLoad
from prefixcache.integrations.vllm.worker_hooks import WorkerHooks

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
    voids: list[VoidLoad] = field(default_factory=list)  # promised loads to report failed


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


class PrefixCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_settings(transfer.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.groups = kv_groups(kv_cache_config, self.block_size, self.settings.boundary_every_tokens)
        if isinstance(self.groups, KVGroups) and any(g.kind is LayerKind.STATE for g in self.groups.groups):
            lossy = [t.label for t in self.settings.cache.tiers if t.codec != "raw"]
            if lossy:  # NOTE: a state page is opaque bytes: a lossy codec would corrupt it
                raise ValueError(
                    f"a recurrent-state model's pages need lossless tiers: tiers {', '.join(lossy)} use a lossy codec"
                )
        if isinstance(self.groups, Bypass):
            log.warning("prefixcache: every request bypasses the cache: %s", self.groups.reason)
        elif self.groups.hybrid:
            self.block_size = self.groups.block_size
            log.info("prefixcache: %d KV cache groups: %s", len(self.groups.groups), describe(self.groups))
        # NOTE: vLLM takes block-level load errors from one group only: a hybrid loads async
        self.async_load = self.settings.async_load or (isinstance(self.groups, KVGroups) and self.groups.hybrid)
        self.socket = socket_path(transfer.engine_id or "engine", self.settings.socket_dir or None)
        self.wall = Wall()
        self._hooks: WorkerHooks | None = None
        self._server: LookupServer | None = None
        self._client: LookupClient | None = None
        self._state: SchedulerState | None = None
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

            groups = self.groups

            def scoper(request: Request) -> Any:
                if isinstance(groups, Bypass):
                    return groups
                return scope_of(
                    request,
                    secret=secret,
                    default_tenant=settings.default_tenant,
                    unverified=settings.unverified,
                    fingerprints=fingerprints,
                )

            self._state = SchedulerState(
                self.block_size, self._client.lookup, scoper, async_load=self.async_load, wall=self.wall
            )

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = self.groups
        if isinstance(groups, Bypass):
            return  # no hooks: every request bypasses (said at start)
        config = self._vllm_config
        model, parallel = config.model_config, config.parallel_config
        geometry = {
            "kv_heads": model.get_num_kv_heads(parallel),
            "head_dim": model.get_head_size(),
            "block_size": self.block_size,
        }
        if groups.hybrid:
            attention = {
                g.index: PagedKV({name: kv_caches[name] for name in g.layers}, **geometry)
                for g in groups.groups
                if g.kind is not LayerKind.STATE
            }
            layout = next(iter(attention.values())).kv_layout
            paged: GroupedKV | PagedKV = GroupedKV(
                [
                    attention.get(g.index)
                    or StatePages({name: kv_caches[name] for name in g.layers}, layout, self.block_size)
                    for g in groups.groups
                ]
            )
        else:
            paged = PagedKV(kv_caches, **geometry)
        # the model's key: only the worker matches (reading the model's files once, here)
        name = self.settings.model_id or str(model.served_model_name or model.model)
        self.model = model_key(name, model.model, str(model.dtype), model.revision)
        worker = ConnectorWorker(self.settings.cache, paged, self.model, groups if groups.hybrid else None)
        settings = self.settings
        self._hooks = WorkerHooks(
            worker, async_load=self.async_load, load_threads=settings.load_threads, wall=self.wall
        )
        self._server = LookupServer(self.socket, worker.lookup)
        atexit.register(self.shutdown)  # vLLM may end a worker without calling shutdown: flush anyway
        log.info(
            "prefixcache: %d layers in the %s layout, model key %s, lookups on %s",
            paged.layers if isinstance(paged, GroupedKV) else len(paged.views),
            paged.layout.value,
            self.model,
            self.socket,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        with self.wall.hold("start_load_kv"):
            meta = self._get_connector_metadata()
            if isinstance(meta, PrefixCacheMeta) and self._hooks is not None:
                self._hooks.start_loads(meta.loads, meta.voids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A sync load completes in ``start_load_kv``, an async one before its request is
        scheduled again: nothing to wait for in the forward pass."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The requests whose async loads are done (a voided one failed as a whole); their
        unfilled blocks go to ``get_block_ids_with_load_errors``, asked in the same step."""
        with self.wall.hold("get_finished"):
            done, failed = self._hooks.transfers() if self._hooks is not None else (set(), set())
            return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)
        return KVConnectorTransferResults()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.32 asks ``get_transfer_results``; this older form tells the same requests."""
        done = self.get_transfer_results(finished_req_ids).finished_recving
        return None, done or None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves read every layer at once in ``wait_for_save``, from the registered tensors."""

    def wait_for_save(self) -> None:
        with self.wall.hold("wait_for_save"):
            if not self.has_connector_metadata() or self._hooks is None:
                return
            meta = self._get_connector_metadata()
            if isinstance(meta, PrefixCacheMeta):
                self._hooks.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self.wall.hold("get_block_ids_with_load_errors"):
            return self._hooks.load_errors() if self._hooks is not None else set()
        return set()

    def get_kv_connector_stats(self) -> PrefixCacheStats | None:
        """The worker's counts, or (the scheduler's) its bypasses; with either, the hook
        failures of that side since the last call."""
        with self.wall.hold("get_kv_connector_stats"):
            if self._hooks is not None:
                tally = self._hooks.take_tally()
            else:
                tally = self._state.take_tally() if self._state is not None else None
            return PrefixCacheStats(tally.to_dict()) if tally is not None else None
        return None

    def get_kv_connector_kv_cache_events(self) -> PrefixCacheEvents | None:
        """The cache's tier moves since the last call, as vLLM events: one ``BlockStored``
        / ``BlockRemoved`` per tier kind (``medium``: device, memory, disk or redis), with
        the blocks' token ids and ``[namespace, model]`` per block (``fleet.translate``)."""
        with self.wall.hold("get_kv_connector_kv_cache_events"):
            events = [_vllm_event(e) for e in self._hooks.events()] if self._hooks is not None else []
            return PrefixCacheEvents(events) if events else None
        return None

    def shutdown(self) -> None:
        """Stop answering lookups and flush queued writes (bounded); a second call does nothing."""
        server, hooks, client = self._server, self._hooks, self._client
        self._server = self._client = None
        with self.wall.hold("shutdown"):
            if server is not None:
                server.close()
            if hooks is not None and not hooks.close(self.settings.flush_timeout_s):
                log.warning("prefixcache: writes still queued after %.0f s were dropped", self.settings.flush_timeout_s)
            if client is not None:
                client.close()

    # ================================================================ scheduler side

    def on_new_request(self, request: Request) -> None:
        with self.wall.hold("on_new_request"):
            if self._state is not None:
                self._state.seen(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        with self.wall.hold("get_num_new_matched_tokens"):
            tokens = self._state.matched(request, num_computed_tokens) if self._state is not None else 0
            return tokens, tokens > 0 and self.async_load
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        with self.wall.hold("update_state_after_alloc"):
            if self._state is not None:
                self._state.allocated(request, num_external_tokens, blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self.wall.hold("build_connector_meta"):
            if self._state is not None:
                plan = self._state.step(scheduler_output)
                return PrefixCacheMeta(plan.loads, plan.saves, plan.voids)
        return PrefixCacheMeta()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        with self.wall.hold("request_finished"):
            if self._state is not None:
                self._state.finished(request)
        return False, None  # saves copy out of vLLM's blocks during the step: they may be freed now

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished`` with the hybrid manager on (one id list a group)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def update_connector_output(self, connector_output: Any) -> None:
        with self.wall.hold("update_connector_output"):
            if self._state is not None:
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
