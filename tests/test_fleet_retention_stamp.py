"""The retention a client asks for, as the router stamps it for a vLLM backend (issue 41):
OpenAI's ``prompt_cache_retention``, Anthropic's ``cache_control`` ttls, turned into
seconds the connector verifies with the tenant; a client's own claim never passes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.fleet.stamping import Stamper, retention_asked
from prefixcache.identity import PARAMS_KEY, RETAIN_KEY, RETAIN_PROOF_KEY, verify, verify_retention

SECRET = b"r" * 16
CC: dict[str, Any] = {"type": "ephemeral"}


@pytest.mark.parametrize(
    ("body", "seconds"),
    [
        ({"prompt_cache_retention": "24h"}, 24 * 3600),
        ({"prompt_cache_retention": "in_memory"}, None),
        ({}, None),
        ({"system": [{"type": "text", "text": "s", "cache_control": CC}]}, 300),
        ({"tools": [{"name": "t", "cache_control": CC | {"ttl": "1h"}}]}, 3600),
        (
            {
                "system": [{"type": "text", "text": "s", "cache_control": CC | {"ttl": "1h"}}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "u", "cache_control": CC}]}],
            },
            3600,
        ),
        ({"messages": [{"role": "user", "content": "no blocks"}]}, None),
        ({"messages": [{"role": "user", "content": [{"type": "text", "cache_control": {"type": "x"}}]}]}, None),
    ],
)
def test_the_retention_asked_in_either_api_in_seconds(body: dict[str, Any], seconds: int | None) -> None:
    assert retention_asked(body) == seconds


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["messages", "content", "cache_control", "ttl", "type", "system"]), inner)
    ),
    max_leaves=15,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["prompt_cache_retention", "messages", "system", "tools"]), _json))
def test_reading_the_retention_never_raises(body: dict[str, Any]) -> None:
    assert retention_asked(body) in (None, 300, 3600, 24 * 3600)


def test_a_vllm_body_carries_the_retention_bound_to_the_tenant_and_no_client_claim() -> None:
    stamper = Stamper(SECRET, ["acme"])
    forged = {PARAMS_KEY: "globex", RETAIN_KEY: 999_999, RETAIN_PROOF_KEY: "pcp1-00"}
    body = {"model": "m", "prompt_cache_retention": "24h", "kv_transfer_params": forged}
    raw, _ = stamper.body(json.dumps(body).encode(), body, "acme", vllm=True)
    sent = json.loads(raw)
    identity = verify(sent["kv_transfer_params"], sent["cache_salt"], SECRET, "default")
    assert identity.tenant == "acme"
    assert verify_retention(sent["kv_transfer_params"], "acme", SECRET) == 24 * 3600
    plain = {"model": "m"}
    raw, _ = stamper.body(json.dumps(plain).encode(), plain, "acme", vllm=True)
    assert verify_retention(json.loads(raw)["kv_transfer_params"], "acme", SECRET) == 0
