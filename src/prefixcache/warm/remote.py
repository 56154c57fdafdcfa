"""Warming through a server: each prompt sent with ``max_tokens=1`` to an OpenAI-compatible
endpoint whose cache stores its KV (vLLM with the prefixcache connector behind
``prefixcache route``, or ``prefixcache serve``).

NOTE: warm sends an API key and nothing that names a tenant. The tenant is the one the
gateway stamps for that key (``identity.py``): the backend believes only a stamp made
with the gateway's secret, and warm holding that secret would let whoever runs warm
warm any tenant's cache. With a key, a warm can fill only the cache of the tenant the
key belongs to, which the gateway already lets its holder do.

Skipping is the server's: a prompt already cached is prefilled only past its cached
prefix there (its last token at least), and the answer's ``cached_tokens`` counts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import httpx

from prefixcache.warm.inputs import BadLine, WarmInputError, WarmItem
from prefixcache.warm.progress import Tally

__all__ = ["WarmServerError", "served_model", "warm_server"]

Report = Callable[[Tally, int, str], None]


class WarmServerError(RuntimeError):
    """The server cannot be warmed through (unreachable, the key refused, a server error)."""


def _client(url: str, api_key: str | None, timeout_s: float) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/") + "/", headers=headers, timeout=timeout_s)


def _fail(response: httpx.Response, what: str) -> WarmServerError:
    if response.status_code in (401, 403):
        return WarmServerError(f"{what}: the server refused the API key ({response.status_code}); pass --api-key")
    return WarmServerError(f"{what}: {response.status_code} {response.text[:300]}")


def served_model(url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The model the server serves (the first of ``GET /models``)."""
    with _client(url, api_key, timeout_s) as client:
        try:
            response = client.get("models")
        except httpx.HTTPError as exc:
            raise WarmServerError(f"{url}: cannot reach the server: {exc}") from None
        if response.status_code != 200:
            raise _fail(response, f"{url}/models")
        models = response.json().get("data") or []
        if not models:
            raise WarmServerError(f"{url}/models lists no model; pass --model")
        return str(models[0]["id"])


def warm_server(
    url: str,
    api_key: str | None,
    model: str,
    items: Iterable[WarmItem | BadLine],
    tally: Tally,
    report: Report,
    *,
    skip_bad: bool = False,
    timeout_s: float = 600.0,
) -> None:
    """Send every prompt of ``items`` to ``url``, adding to ``tally``. A prompt the server
    refuses as a bad request (400, 422: too long, a bad message) is a ``WarmInputError``
    naming its line, or counted with ``skip_bad``; anything else stops the warm."""
    with _client(url, api_key, timeout_s) as client:
        for item in items:
            if isinstance(item, BadLine):
                tally.bad += 1
                report(tally, item.line, f"bad line skipped: {item.error}")
                continue
            route = "chat/completions" if item.chat else "completions"
            try:
                response = client.post(route, json=item.payload(model))
            except httpx.HTTPError as exc:
                raise WarmServerError(f"{url}/{route}: line {item.line}: {exc}") from None
            if response.status_code in (400, 422):
                error = WarmInputError(f"line {item.line}: the server refused it: {response.text[:300]}")
                if not skip_bad:
                    raise error
                tally.bad += 1
                report(tally, item.line, f"bad line skipped: {error}")
                continue
            if response.status_code != 200:
                raise _fail(response, f"{url}/{route}: line {item.line}")
            report(tally, item.line, _count(tally, response.json()))


def _count(tally: Tally, answer: dict[str, Any]) -> str:
    usage = answer.get("usage") or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    tally.prompts += 1
    if prompt and cached >= prompt - 1:  # NOTE: a server prefills the last token whatever it holds
        tally.skipped += 1
    else:
        tally.warmed += 1
    tally.cached_tokens += cached
    tally.prefilled_tokens += prompt - cached
    return f"{prompt} tokens: prefilled {prompt - cached}, cached {cached}"
