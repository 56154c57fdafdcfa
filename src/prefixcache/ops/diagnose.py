"""``prefixcache diagnose``: read /metrics (or saved scrapes), say what is wrong and what to do.

The runbook of docs/operations.md, as code. Two scrapes some seconds apart
give rates (what is happening now); one scrape gives the counters since the server
started (what has happened on average), which still tells pressure, dead tiers and
low hit rates apart, only not how fast.

Checks, each a small function over a ``Window`` of counter deltas:

- tier pressure: a full L0 (device / HBM) or L1 (host RAM) tier that evicts fast;
- a dead or slow L2 tier (disk or Redis), and any tier's error ratio;
- an invalidation storm: epoch bumps followed by a miss ratio above 90 %;
- one tenant crowding the others out: most of the new (computed) tokens while the cache evicts;
- writes dropped or failing: a tier slower than the traffic written to it (what is not
  written is lost to a restart and to the other servers sharing the tier);
- a low hit rate with none of the above: block size, hashing, epochs;
- inside vLLM, why requests hit less than the cache held (hybrid models' boundaries, prompts
  shorter than a block) and models whose layer kinds the connector does not store;
- a tenant at its retention cap (``diagnose_retention.py``): its own retention is cut, no
  one else's (info: the cap doing its work).

Exit status: 0 nothing needs action, 1 something does, 2 the input could not be read.
"""

from __future__ import annotations

import argparse
import math
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixcache.ops.diagnose_retention import check_retention
from prefixcache.ops.findings import SEVERITY_ORDER, Finding, Thresholds
from prefixcache.ops.scrape import Scrape, Window, tiers, token_counts

__all__ = ["CHECKS", "Finding", "Thresholds", "add_diagnose_parser", "diagnose", "report", "run_diagnose", "summary"]

DEAD_ERRORS = ("connection", "timeout", "breaker_open")


# ============================================================================ checks


PRESSURE_ACTION = {
    "L0": "give the cache more device memory, add or enlarge an L1 host-RAM tier so evicted blocks are demoted "
    "instead of dropped, or use a scan-resistant policy (s3fifo, sieve) if one-off prompts flush reused ones",
    "L1": "enlarge the host-RAM tier (TierConfig(kind='memory', capacity_bytes=...)), add an L2 disk or Redis "
    "tier behind it, or give a crowding tenant a quota (isolation='partitioned')",
}
PRESSURE_PROBLEM = {"L0": "HBM (L0) pressure", "L1": "host RAM (L1) pressure"}


def check_pressure(w: Window, t: Thresholds) -> list[Finding]:
    out = []
    for tier in tiers(w):
        level = tier.labels.get("level", "")
        if level not in PRESSURE_PROBLEM or tier.occupancy < t.full or tier.evictions <= 0:
            continue
        rate = w.rate(tier.evictions)
        churn = tier.evictions / tier.asked if tier.asked else math.inf
        fast = rate > t.evictions_per_s[level] if rate is not None else churn >= t.churn
        if not fast:
            continue
        speed = f"{rate:,.0f} evictions/s" if rate is not None else f"{churn:.2f} evictions per block asked"
        out.append(
            Finding(
                "warning",
                f"{PRESSURE_PROBLEM[level]}: {tier.name} is full and evicting",
                f"{tier.occupancy:.0%} full, {tier.evictions:,.0f} blocks evicted {w.span()} ({speed})",
                PRESSURE_ACTION[level],
            )
        )
    return out


def _p95(w: Window, match: dict[str, str]) -> float | None:
    buckets = sorted(
        ((float(dict(k)["le"]), v) for k, v in w.delta_series("prefixcache_tier_load_seconds_bucket", **match).items()),
    )
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = 0.95 * buckets[-1][1]
    return next(le for le, count in buckets if count >= target)


def check_tier_health(w: Window, t: Thresholds) -> list[Finding]:
    out = []
    for tier in tiers(w):
        match: dict[str, str] = {k: tier.labels[k] for k in ("tier", "kind", "level") if k in tier.labels}
        errors = w.delta_by("prefixcache_tier_errors_total", "error", **match)
        hits = w.delta("prefixcache_tier_hits_total", **match)
        dead = sum(errors.get(kind, 0.0) for kind in DEAD_ERRORS)
        listed = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(errors.items()) if v)
        slow_tier = match.get("kind") in ("redis", "s3", "disk") or match.get("level", "L0") not in ("L0", "L1")
        if dead > 0 and hits == 0:
            what = {"redis": "Redis", "s3": "the object store"}.get(match.get("kind", ""), "the medium")
            out.append(
                Finding(
                    "critical",
                    f"dead tier: {tier.name} fails every call and serves nothing",
                    f"errors {w.span()}: {listed}; 0 hits",
                    f"check that {what} is up and reachable from the server (redis-cli -u URL ping; disk mounted and "
                    "writable); the cache keeps serving from its faster tiers, and the breaker retries by itself",
                )
            )
            continue
        total = sum(errors.values())
        if total and total / max(tier.asked, 1.0) > t.error_ratio:
            out.append(
                Finding(
                    "warning",
                    f"failing tier: {tier.name} fails {total / max(tier.asked, 1.0):.1%} of its operations",
                    f"errors {w.span()}: {listed}; {tier.asked:,.0f} blocks asked",
                    "failed reads are served as misses: checksum errors mean a bad disk or a second writer, io a "
                    "full or read-only file system, timeout a slow Redis (raise read_timeout or move it closer)",
                )
            )
        p95 = _p95(w, match)
        if slow_tier and p95 is not None and p95 > t.slow_load_seconds:
            out.append(
                Finding(
                    "warning",
                    f"slow tier: {tier.name} takes up to {p95 * 1000:,.0f} ms to load (p95)",
                    f"p95 load time {w.span()} above {t.slow_load_seconds * 1000:g} ms",
                    "a slow L2 can cost more than it saves: check the network to Redis or the disk's latency, "
                    "and enlarge L1 so fewer loads reach L2",
                )
            )
    return out


def check_writes(w: Window, t: Thresholds) -> list[Finding]:
    out = []
    for tier in tiers(w):
        match: dict[str, str] = {k: tier.labels[k] for k in ("tier", "kind", "level") if k in tier.labels}
        dropped = w.delta("prefixcache_tier_writes_dropped_total", **match)
        failed = w.delta("prefixcache_tier_writes_failed_total", **match)
        if dropped <= 0 and failed <= 0:
            continue
        rate = w.rate(dropped + failed)
        speed = f" ({rate:,.1f}/s)" if rate is not None else ""
        out.append(
            Finding(
                "warning",
                f"writes lost: {tier.name} does not take what is written to it",
                f"{dropped:,.0f} writes dropped by the full write queue and {failed:,.0f} failed {w.span()}{speed}; "
                f"{w.gauge('prefixcache_write_queue_bytes'):,.0f} of "
                f"{w.gauge('prefixcache_write_queue_limit_bytes'):,.0f} queue bytes in use",
                "the tier is slower than the traffic written to it, so a restart and the other servers sharing it "
                "miss those blocks: make it faster (fsync = 'data' or 'none', a faster disk, Redis closer), raise "
                "write_queue_bytes if the bursts are short, or write only reused blocks (write = 'selective'); "
                "failed writes: see the tier's errors",
            )
        )
    return out


def check_invalidation(w: Window, t: Thresholds) -> list[Finding]:
    bumps = w.delta("prefixcache_epoch_bumps_total")
    if bumps <= 0:
        return []
    looked, hit = token_counts(w)
    miss = 1 - hit / looked if looked else 0.0
    rate = w.rate(bumps)
    per_minute = rate * 60 if rate is not None else None
    stale = w.delta("prefixcache_evictions_total", reason="stale")
    evidence = f"{bumps:,.0f} epoch bumps {w.span()}, miss ratio {miss:.0%}, {stale:,.0f} stale blocks reclaimed"
    action = (
        "find who bumps (deploys, adapter reloads, an admin script) and stop repeated bumps; bump only the "
        "adapter that changed (bump_epoch(model, adapter)) rather than the whole model"
    )
    if per_minute is not None and per_minute > t.bumps_per_minute:
        return [Finding("critical", f"invalidation storm: {per_minute:.1f} epoch bumps a minute", evidence, action)]
    if looked >= t.min_lookup_tokens and miss > t.storm_miss_ratio:
        return [Finding("critical", "invalidation storm: epoch bumps left the cache cold", evidence, action)]
    return []


def check_crowding(w: Window, t: Thresholds) -> list[Finding]:
    prompt = w.delta_by("prefixcache_prompt_tokens_total", "tenant")
    hits = w.delta_by("prefixcache_hit_tokens_total", "tenant")
    computed = {tenant: prompt[tenant] - hits.get(tenant, 0.0) for tenant in prompt}
    total = sum(computed.values())
    evicted = sum(tier.evictions for tier in tiers(w))
    if len(computed) < 2 or total <= 0 or evicted <= 0:
        return []
    tenant, top = max(((k, v) for k, v in computed.items() if k != "other"), key=lambda kv: kv[1], default=("", 0.0))
    if top / total < t.crowding_share:
        return []
    rest_prompt = sum(v for k, v in prompt.items() if k != tenant)
    rest_hit = sum(v for k, v in hits.items() if k != tenant)
    rest = f"; the other tenants hit {rest_hit / rest_prompt:.0%} of their tokens" if rest_prompt else ""
    return [
        Finding(
            "warning",
            f"tenant {tenant!r} crowds the others out",
            f"it brings {top / total:.0%} of the new (computed) tokens {w.span()} while the cache evicted "
            f"{evicted:,.0f} blocks{rest}",
            f"give {tenant!r} a quota (isolation='partitioned', quotas={{{tenant!r}: ...}}) so its burst evicts "
            "only its own blocks, or rate-limit it at the gateway",
        )
    ]


def check_hit_rate(w: Window, t: Thresholds, found: list[Finding]) -> list[Finding]:
    looked, hit = token_counts(w)
    if looked < t.min_lookup_tokens or hit / looked >= t.low_hit_rate or found:
        return []
    collisions = w.delta("prefixcache_hash_collisions_total")
    bumps = w.delta("prefixcache_epoch_bumps_total")
    return [
        Finding(
            "warning",
            f"low hit rate ({hit / looked:.0%} of tokens) with no capacity pressure",
            f"{looked:,.0f} tokens looked up {w.span()}, {hit:,.0f} hit; {bumps:,.0f} epoch bumps, "
            f"{collisions:,.0f} hash collisions, no tier under pressure",
            "check the block size against prompt lengths (partial_blocks=True for short prompts); check hashing: the "
            "same seed, hash and tokenizer id on every server, and no per-request text (a timestamp, a request id) "
            "at the start of prompts; check epochs (bumps or adapters reloaded); check isolation (namespace mode "
            "keeps tenants from sharing a common prompt: hot-prefix publication wins it back)",
        )
    ]


# Why requests in vLLM hit less than the cache held (the connector's miss reasons, and the
# bypass of a model whose layer kinds it does not store): the finding a user reads for each.
VLLM_REASONS: dict[str, tuple[str, str, str]] = {
    "shorter_than_a_block": (
        "info",
        "prompts shorter than one vLLM block (and a token) cannot hit",
        "vLLM's block size decides the smallest prefix that can hit; hybrid models get large blocks (vLLM sizes "
        "them to hold a Mamba state): a smaller --block-size, or accept that short prompts are computed",
    ),
    "window_not_kept": (
        "info",
        "a hybrid's sliding-window blocks were not kept at the boundary a shared prefix ends",
        "the connector keeps each sliding window at save ends and every kv_connector_extra_config "
        "boundary_every_tokens: lower it to hit shared prefixes more finely (more bytes: docs/vllm.md)",
    ),
    "state_not_kept": (
        "info",
        "a hybrid's recurrent state was not kept at the boundary a shared prefix ends",
        "a Mamba or linear-attention state exists only where a step of vLLM ended on a block boundary: "
        "shared prefixes hit at the last such boundary (docs/vllm.md, hybrid models)",
    ),
}


def check_vllm(w: Window, t: Thresholds) -> list[Finding]:
    """The connector's miss reasons and unsupported models, from vLLM's ``/metrics``."""
    found = []
    for reason, n in sorted(w.delta_by("prefixcache_vllm_miss_reasons_total", "reason").items()):
        if n <= 0:
            continue
        severity, problem, action = VLLM_REASONS.get(reason, ("info", f"requests hit less ({reason})", "docs/vllm.md"))
        found.append(Finding(severity, problem, f"{n:,.0f} requests {w.span()} (reason {reason})", action))
    bypassed = w.delta_by("prefixcache_vllm_bypassed_requests_total", "reason")
    for reason, n in sorted(bypassed.items()):
        if n > 0 and reason.startswith("unsupported_layers"):
            found.append(
                Finding(
                    "warning",
                    f"the connector does not store this model's layers ({reason.split(':', 1)[-1]}): no request hits",
                    f"{n:,.0f} requests bypassed the cache {w.span()}",
                    "docs/vllm.md lists the layer kinds stored (full attention, sliding windows, Mamba states); "
                    "run without the connector or open an issue with the model's config",
                )
            )
    return found


CHECKS: tuple[Callable[[Window, Thresholds], list[Finding]], ...] = (
    check_vllm,
    check_pressure,
    check_tier_health,
    check_invalidation,
    check_crowding,
    check_writes,
)


def diagnose(w: Window, t: Thresholds | None = None) -> list[Finding]:
    """Every finding, most severe first."""
    t = t or Thresholds()
    found = [f for check in CHECKS for f in check(w, t)]
    found += check_hit_rate(w, t, found)
    found += check_retention(w, t)  # NOTE: after, so that it never hides a low hit rate's finding
    return sorted(found, key=lambda f: SEVERITY_ORDER[f.severity])


def summary(w: Window) -> list[str]:
    looked, hit = token_counts(w)
    lines = [f"window: {w.span()}"]
    if looked:
        lines.append(f"token hit rate {hit / looked:.1%} ({hit:,.0f} of {looked:,.0f} tokens)")
    saved = w.delta("prefixcache_prefill_seconds_saved_total")
    spent = w.delta("prefixcache_prefill_seconds_total")
    if w.gauge("prefixcache_prefill_seconds_per_token") <= 0:  # as the dashboard says: no rate, no estimate
        lines.append("prefill time saved: not measured (the engine has not timed a prefill yet)")
    elif saved + spent > 0:
        lines.append(f"prefill time saved {saved / (saved + spent):.1%} ({saved:,.1f} s saved, {spent:,.1f} s spent)")
    for tier in tiers(w):
        lines.append(f"{tier.name}: {tier.occupancy:.0%} full, {tier.evictions:,.0f} evictions")
    return lines


def report(w: Window, findings: Sequence[Finding]) -> str:
    lines = ["prefixcache diagnose", *(f"  {line}" for line in summary(w)), ""]
    if not findings:
        lines.append("OK: nothing needs action.")
    for f in findings:
        lines += [f"{f.severity.upper()}: {f.problem}", f"  evidence: {f.evidence}", f"  next: {f.action}", ""]
    return "\n".join(lines).rstrip() + "\n"


# ============================================================================ command


def fetch(source: str, token: str | None, timeout: float = 10.0) -> str:
    if source.startswith(("http://", "https://")):
        request = urllib.request.Request(source, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body: bytes = response.read()
            return body.decode()
    return Path(source).read_text()


def add_diagnose_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diagnose",
        help="read /metrics (a URL or saved scrapes) and print a diagnosis with the next action",
        description="Exit status: 0 nothing needs action, 1 something does, 2 the input could not be read.",
    )
    p.add_argument("source", help="a /metrics URL or a saved scrape (Prometheus text format)")
    p.add_argument("later", nargs="?", help="a second saved scrape taken --interval seconds after the first")
    p.add_argument(
        "--interval",
        type=float,
        default=None,
        help="URL: seconds between the two scrapes taken (default 10; 0 for one scrape); "
        "two files: the seconds between them (required)",
    )
    p.add_argument("--token", default=None, help="bearer token (the admin key) for a protected /metrics")


def run_diagnose(args: argparse.Namespace, sleep: Callable[[float], None] = time.sleep) -> int:
    try:
        if args.later is not None:
            if not args.interval:
                print("diagnose: two scrapes need --interval (the seconds between them)")
                return 2
            first, second = fetch(args.source, args.token), fetch(args.later, args.token)
            window = Window(Scrape.parse(second), Scrape.parse(first), args.interval)
        elif args.source.startswith(("http://", "https://")) and (args.interval is None or args.interval > 0):
            interval = 10.0 if args.interval is None else args.interval
            first = fetch(args.source, args.token)
            sleep(interval)
            window = Window(Scrape.parse(fetch(args.source, args.token)), Scrape.parse(first), interval)
        else:
            window = Window(Scrape.parse(fetch(args.source, args.token)))
    except (OSError, ValueError) as exc:
        print(f"diagnose: cannot read {args.source}: {exc}")
        return 2
    findings = diagnose(window)
    print(report(window, findings), end="")
    return 1 if any(f.needs_action for f in findings) else 0
