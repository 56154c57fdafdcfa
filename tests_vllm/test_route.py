"""The production path, tried as an attacker would: ``prefixcache route`` with two API
keys in front of ``vllm serve`` with the connector (vLLM's own prefix cache on, its KV
events published), the gateway's secret shared by both.

- the victim's repeat hits (the same tenant sees its cache);
- the attacker's plain request for the victim's prompt, and one naming the victim in
  ``cache_salt`` and ``kv_transfer_params``, get 0 cached tokens through the router;
- a request sent to vLLM directly (what a client must never be able to do) cannot
  claim the victim either: the connector verifies the claim against the salt;
- ``prefixcache audit-timing`` through the router finds no leak, and its same-tenant
  control finds the cache (p < 0.001), on a clock that counts the prompt tokens vLLM
  computed for each answer (its usage): no load moves the verdict.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_support import gateway
from openai import OpenAI
from test_connector import BLOCK, PROMPTS
from test_serve import metric

from prefixcache.identity import PARAMS_KEY
from prefixcache.ops.audit import AuditConfig, audit
from prefixcache.ops.audit_cli import to_json

SECRET = "route-test-secret-0123456789"
KEYS = {"sk-victim-0123456789": "victim", "sk-attacker-0123456789": "attacker"}
VICTIM, ATTACKER = list(KEYS)
ADMIN = "route-admin-0123456789"


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("route")
    cache = {
        "isolation": "namespace",
        "tiers": [
            {"kind": "memory", "capacity_bytes": 1 << 30, "write": "through"},
            {"kind": "disk", "capacity_bytes": 4 << 30, "path": str(tmp / "disk")},
        ],
    }
    with gateway(
        tmp,
        keys=KEYS,
        secret=SECRET,
        cache=cache,
        vllm_flags=("--gpu-memory-utilization", "0.3"),
        route_settings=f'admin_key = "{ADMIN}"\n',
    ) as g:
        yield {"route": g.route, "vllm": g.vllm, "tmp": str(g.tmp)}


def cached(base: str, key: str, prompt: str, **extra: object) -> int:
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    reply = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra or None
    )
    details = reply.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def test_another_tenant_gets_nothing_through_the_router_however_it_asks(topology: dict[str, str]) -> None:
    """Each attack on a prompt of its own (an attacker's first try would warm its own cache)."""
    route = topology["route"]
    claims = {PARAMS_KEY: "victim", "tenant": "victim"}
    attacks: list[dict[str, object]] = [
        {},
        {"cache_salt": "victim", "kv_transfer_params": claims},
        {"kv_transfer_params": claims},
    ]
    for name, attack in zip(("p1", "p2", "p3"), attacks, strict=True):
        assert cached(route, VICTIM, PROMPTS[name]) == 0
        assert cached(route, VICTIM, PROMPTS[name]) > 0  # the same tenant hits
        assert cached(route, ATTACKER, PROMPTS[name], **attack) == 0, attack


def test_the_router_credits_vllm_with_each_tenants_salted_blocks(topology: dict[str, str]) -> None:
    """Routing follows tenants on vLLM: vLLM's and the connector's KV events of a salted
    request count in its tenant's namespace, so the tenant's next request for the prompt
    is scored against blocks vLLM holds (the router's overlap counter), and another
    tenant's is not."""
    route, prompt = topology["route"], PROMPTS["p6"]

    def overlap() -> float:
        text = httpx.get(f"{route}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
        return sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("prefixcache_route_overlap")
        )

    cached(route, VICTIM, prompt)
    before, deadline = overlap(), time.monotonic() + 30
    while True:  # the events travel over ZMQ: ask again until the router has read them
        cached(route, VICTIM, prompt)
        if overlap() > before or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert overlap() > before
    held = overlap()
    cached(route, ATTACKER, prompt)  # the victim's blocks never count for another tenant
    assert overlap() == held


def test_a_request_to_vllm_directly_cannot_claim_a_tenant(topology: dict[str, str]) -> None:
    """What the connector does with a claim it cannot verify (vLLM's port is reachable
    here for the test: docs/vllm.md says it must not be for clients)."""
    route, vllm = topology["route"], topology["vllm"]
    claims = {PARAMS_KEY: "victim", "tenant": "victim"}
    for name, salt in (("p4", "victim"), ("p5", "attacker")):
        cached(route, VICTIM, PROMPTS[name])
        assert cached(vllm, "none", PROMPTS[name], cache_salt=salt, kv_transfer_params=claims) == 0


class UsageClock(httpx.BaseTransport):
    """The audit's transport and clock: each answer is read whole, and before the audit
    sees its first byte the clock moves by the prompt tokens vLLM computed for it (its
    usage: prompt tokens less cached ones, 1/1024 s each). The audit's time to first token
    is then the prefill the answer cost, whatever else the machine runs."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        try:
            body = response.read()
        finally:
            response.close()
        for line in body.decode(errors="replace").splitlines():
            usage = json.loads(line[5:]).get("usage") if line.startswith("data: {") else None
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                self.now += (usage["prompt_tokens"] - cached) / 1024
        headers = [(k, v) for k, v in response.headers.items() if k not in ("content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=body, request=request)

    def close(self) -> None:
        self.inner.close()


def test_audit_timing_through_the_router_finds_no_leak_and_the_control_sees_the_cache(
    topology: dict[str, str],
) -> None:
    clock = UsageClock()
    config = AuditConfig(
        topology["route"], ATTACKER, (VICTIM,), samples=12, prompt_words=400, endpoint="completions", warmup=2
    )
    result = audit(config, transport=clock, clock=clock)
    (Path(topology["tmp"]) / "audit.json").write_text(json.dumps(to_json(result)))
    assert result.verdict == "no leak", to_json(result)
    assert all(run.test.p_value < 0.001 for run in result.control.runs), to_json(result)["control"]
    assert not result.cross.detected
    assert result.control.runs[0].median_cached("hit") >= BLOCK  # what the control found: whole vLLM blocks


# Straight to vLLM's port, as a client that got past the network never should: salts and
# claims of every JSON type. json.dumps writes "\ud800" as its escape, so a lone surrogate
# reaches vLLM as one. vLLM may refuse a body (4xx); its engine must live through each.
LONG = "v" * 10240
HOSTILE_SALTS: list[object] = ["pc1-\u00e9", "\ud800", "pc1-\udfff\ud800", LONG, None, 1, 1.5, True, [], ["victim"], {}]
HOSTILE_PARAMS: list[object] = [
    None,
    1,
    True,
    "victim",
    [],
    [{PARAMS_KEY: "victim"}],
    {PARAMS_KEY: {"x": 1}},
    {PARAMS_KEY: ["victim"]},
    {PARAMS_KEY: 7},
    {PARAMS_KEY: "\ud800"},
    {PARAMS_KEY: "\u00e9"},
    {PARAMS_KEY: LONG},
    {PARAMS_KEY: "victim", "nested": {"a": [1, {"b": None}]}},
]


def hostile_bodies(prompt: str) -> list[tuple[str, bool]]:
    """Every salt beside a claim of the victim, every claim beside a non-ASCII salt; each
    with whether vLLM's own front end answers it 500 (below)."""
    pairs = [(salt, {PARAMS_KEY: "victim"}) for salt in HOSTILE_SALTS] + [("pc1-\u00e9", p) for p in HOSTILE_PARAMS]
    base = {"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return [
        (json.dumps(base | {"cache_salt": salt, "kv_transfer_params": params}), "\\ud800" in json.dumps(params))
        for salt, params in pairs
    ]


def test_nothing_sent_to_vllm_directly_kills_its_engine(topology: dict[str, str]) -> None:
    """Issue #39: a non-ASCII salt beside a claim raised inside vLLM's engine core
    (``identity.verify``), which killed vLLM for every tenant. After each hostile body
    vLLM's ``/health`` is 200 and another tenant's repeat, through the router, still hits.

    NOTE: a lone surrogate inside ``kv_transfer_params`` is answered 500 by vLLM 0.32's
    own front end, with or without a connector: it cannot msgpack-encode the request for
    its engine (``UnicodeEncodeError``), so the request never reaches the engine core or
    the connector, and the engine lives. That 500 is vLLM's; every other body must get
    less than 500 (vLLM refuses a lone surrogate in ``cache_salt`` itself, 400)."""
    route, vllm = topology["route"], topology["vllm"]
    cached(route, VICTIM, PROMPTS["p2"])
    for body, vllms_own_500 in hostile_bodies(PROMPTS["p4"]):
        reply = httpx.post(
            f"{vllm}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=120
        )
        assert reply.status_code < 500 or vllms_own_500, (body[-160:], reply.status_code, reply.text[:400])
        assert httpx.get(f"{vllm}/health", timeout=10).status_code == 200, body[-160:]
        assert cached(route, VICTIM, PROMPTS["p2"]) > 0, body[-160:]
    text = httpx.get(f"{vllm}/metrics").text  # each body vLLM took was refused, counted, not failed
    assert metric(text, "prefixcache_vllm_bypassed_requests_total", reason="unverified_tenant") > 0
    assert metric(text, "prefixcache_vllm_hook_failures_total") == 0
