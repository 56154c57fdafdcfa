"""``BlendMetrics``: the ``prefixcache_blend_*`` series, on a registry the caller owns
(the server registers it next to ``ops.metrics.ServingMetrics``).

Two kinds of figures:

- per request of an opted-in tenant (tenant x model): requests by outcome (blended,
  no chunk found, gate off), candidate chunks by how they were found (exact hash,
  embedding fallback, missed), and for blended prefills the prompt tokens by what
  happened to them: ``reused`` (chunk KV kept, re-rotated), ``recomputed`` (chunk KV the
  plan ran again) and ``fresh`` (no cached KV, exact prefix hits excluded). Blended
  tokens are never exact cache hits: they are not in ``prefixcache_hit_tokens_total``.
  The tenant label is the one ``ServingMetrics.record_request`` returned, so the
  cardinality guard applies here too.
- per gate run (model x plan): the quality gate's figures and verdict, the bar they
  were judged against (the model's bfloat16 noise floor, KL mean and max), and per
  model whether the mode is on and with which plan.

Names follow ``ops.metrics``: ``prefixcache_`` prefix, base units (tokens, nats, ratios),
counters end in ``_total``. ``BLEND_METRICS`` lists them for dashboards and alert tests.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge

from prefixcache.blend.serve_types import BlendUsage
from prefixcache.quality.verdict import GateReport

BLEND_METRICS = {
    "prefixcache_blend_requests_total": "counter",
    "prefixcache_blend_chunk_lookups_total": "counter",
    "prefixcache_blend_prefills_total": "counter",
    "prefixcache_blend_reused_tokens_total": "counter",
    "prefixcache_blend_recomputed_tokens_total": "counter",
    "prefixcache_blend_fresh_tokens_total": "counter",
    "prefixcache_blend_gate_top1_agreement_ratio": "gauge",
    "prefixcache_blend_gate_greedy_exact_match_ratio": "gauge",
    "prefixcache_blend_gate_kl_mean_nats": "gauge",
    "prefixcache_blend_gate_kl_max_nats": "gauge",
    "prefixcache_blend_gate_floor_kl_mean_nats": "gauge",
    "prefixcache_blend_gate_floor_kl_max_nats": "gauge",
    "prefixcache_blend_gate_work_ratio": "gauge",
    "prefixcache_blend_gate_passed": "gauge",
    "prefixcache_blend_enabled": "gauge",
}

PREFILL_LABELS = ("tenant", "model")
OUTCOME_LABELS = ("tenant", "model", "outcome")
LOOKUP_LABELS = ("tenant", "model", "found")
GATE_LABELS = ("model", "plan")


class BlendMetrics:
    """Counters of blended prefills and gauges of the gate, on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self._lock = threading.Lock()
        self._enabled: dict[str, str] = {}  # model -> plan label of the series set to 1
        self.requests = Counter(
            "prefixcache_blend_requests",
            "Requests of opted-in tenants, by outcome: blended, no_reuse (no chunk found), gate_off.",
            OUTCOME_LABELS,
            registry=r,
        )
        self.lookups = Counter(
            "prefixcache_blend_chunk_lookups",
            "Candidate chunks of opted-in prompts, by how they were found: exact, similar, missed.",
            LOOKUP_LABELS,
            registry=r,
        )
        self.prefills = Counter("prefixcache_blend_prefills", "Blended prefills run.", PREFILL_LABELS, registry=r)
        self.reused = Counter(
            "prefixcache_blend_reused_tokens",
            "Prompt tokens whose cached chunk KV was kept (re-rotated), not recomputed.",
            PREFILL_LABELS,
            registry=r,
        )
        self.recomputed = Counter(
            "prefixcache_blend_recomputed_tokens",
            "Prompt tokens with cached chunk KV that the recompute plan ran through the model again.",
            PREFILL_LABELS,
            registry=r,
        )
        self.fresh = Counter(
            "prefixcache_blend_fresh_tokens",
            "Prompt tokens of blended prefills that had no cached KV.",
            PREFILL_LABELS,
            registry=r,
        )
        self.top1 = Gauge(
            "prefixcache_blend_gate_top1_agreement_ratio",
            "Gate: share of evaluation prompts whose next token agrees with full prefill.",
            GATE_LABELS,
            registry=r,
        )
        self.greedy_em = Gauge(
            "prefixcache_blend_gate_greedy_exact_match_ratio",
            "Gate: share of evaluation prompts whose greedy continuation equals full prefill's.",
            GATE_LABELS,
            registry=r,
        )
        self.kl_mean = Gauge(
            "prefixcache_blend_gate_kl_mean_nats",
            "Gate: mean KL(full || blended) of the next-token distribution.",
            GATE_LABELS,
            registry=r,
        )
        self.kl_max = Gauge(
            "prefixcache_blend_gate_kl_max_nats",
            "Gate: largest KL(full || blended) of the next-token distribution.",
            GATE_LABELS,
            registry=r,
        )
        self.floor_kl_mean = Gauge(
            "prefixcache_blend_gate_floor_kl_mean_nats",
            "Gate: mean KL(full float32 || full bfloat16) of the next token, the bar of kl_mean.",
            GATE_LABELS,
            registry=r,
        )
        self.floor_kl_max = Gauge(
            "prefixcache_blend_gate_floor_kl_max_nats",
            "Gate: largest KL(full float32 || full bfloat16) of the next token, the bar of kl_max.",
            GATE_LABELS,
            registry=r,
        )
        self.work = Gauge(
            "prefixcache_blend_gate_work_ratio",
            "Gate: (token, layer) pairs computed by the plan over those of full prefills.",
            GATE_LABELS,
            registry=r,
        )
        self.passed = Gauge(
            "prefixcache_blend_gate_passed", "Gate: 1 if the plan passed its thresholds.", GATE_LABELS, registry=r
        )
        self.enabled = Gauge(
            "prefixcache_blend_enabled",
            "1 on the plan the blend mode runs for the model; all 0 while the mode is off.",
            GATE_LABELS,
            registry=r,
        )

    def record_request(self, tenant: str, model: str, usage: BlendUsage, fresh: int) -> None:
        """Count one request of an opted-in tenant (``tenant``: the label ServingMetrics
        gave it; ``fresh``: its prompt tokens computed with no cached KV)."""
        labels = (tenant, model)
        with self._lock:
            self.requests.labels(*labels, usage.outcome.value).inc()
            self.lookups.labels(*labels, "exact").inc(usage.lookups_exact)
            self.lookups.labels(*labels, "similar").inc(usage.lookups_similar)
            self.lookups.labels(*labels, "missed").inc(usage.lookups_missed)
            if usage.blended:
                self.prefills.labels(*labels).inc()
                self.reused.labels(*labels).inc(usage.reused)
                self.recomputed.labels(*labels).inc(usage.recomputed)
                self.fresh.labels(*labels).inc(fresh)

    def record_gate(self, report: GateReport) -> None:
        """Export one plan's gate figures and verdict."""
        f = report.figures
        labels = (report.model, f.plan)
        with self._lock:
            self.top1.labels(*labels).set(f.top1)
            self.greedy_em.labels(*labels).set(f.greedy_em)
            self.kl_mean.labels(*labels).set(f.mean_kl)
            self.kl_max.labels(*labels).set(f.max_kl)
            self.work.labels(*labels).set(f.work)
            if f.floor is not None:  # figures from before the floor: no bar to export (and a failed gate)
                self.floor_kl_mean.labels(*labels).set(f.floor.mean_kl)
                self.floor_kl_max.labels(*labels).set(f.floor.max_kl)
            self.passed.labels(*labels).set(1.0 if report.passed else 0.0)

    def set_enabled(self, model: str, plan: str | None) -> None:
        """The plan ``choose_plan`` picked for ``model`` (None: the mode is off)."""
        with self._lock:
            previous = self._enabled.pop(model, None)
            if previous is not None:
                self.enabled.labels(model, previous).set(0.0)
            if plan is not None:
                self.enabled.labels(model, plan).set(1.0)
                self._enabled[model] = plan
