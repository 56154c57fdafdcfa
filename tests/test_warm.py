"""``prefixcache warm``: its input (no model), then, on the model, what a server started
afterwards hits on: a warmed prompt at its first request, a warmed chat under a new turn,
nothing of another tenant's; a rerun that stores nothing twice; bad lines."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from engine_support import MODEL_ID, MODELS_DIR, LiveServer
from prefixcache.api.schemas import ChatRequest, CompletionRequest
from prefixcache.server.main import build_service
from prefixcache.settings import load_settings
from prefixcache.warm.inputs import BadLine, WarmInputError, WarmItem, read_items
from prefixcache.warm.setup import WarmSetupError, check_public, warm_tenant
from support import CONVERSATION, run_cli

SYSTEM = (
    "You are the help desk of a company that rents out snow ploughs. Answer in one sentence. "
    "Rentals start at nine in the morning and end at five; a late return costs one extra day; "
    "fuel is included; the deposit is refunded within three working days. "
) * 2
KEYS = {"sk-a": "a", "sk-b": "b"}


def write_lines(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def config(tmp: Path, isolation: str = "namespace", keys: dict[str, str] | None = None, extra: str = "") -> Path:
    auth = ", ".join(f'"{k}" = "{t}"' for k, t in (keys or {}).items())
    text = f"""
[model]
models_dir = "{MODELS_DIR}"
[cache]
isolation = "{isolation}"
block_size = 16
partial_blocks = true
{extra}
[[cache.tiers]]
kind = "memory"
capacity_bytes = 268435456
[[cache.tiers]]
kind = "disk"
capacity_bytes = 1073741824
path = "{tmp / "disk"}"
[auth]
api_keys = {{ {auth} }}
"""
    path = tmp / "prefixcache.toml"
    path.write_text(text)
    return path


# ====================================================================== input, no model


def test_each_format_becomes_the_body_the_server_would_get(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            {"prompt": "hello"},
            "",
            {"messages": [{"role": "user", "content": "hi"}]},
            {"timestamp": 0, "tenant": "t", "model": "m", "tokens": [1, 2, 3]},
            {"timestamp": 1, "tenant": "t", "model": "m", "text": "plain"},
        ],
    )
    items = list(read_items(path))
    assert [i.line for i in items if isinstance(i, WarmItem)] == [1, 3, 4, 5]  # a blank line still counts
    bodies = [i.body for i in items if isinstance(i, WarmItem)]
    assert isinstance(bodies[0], CompletionRequest) and bodies[0].prompt == "hello"
    assert isinstance(bodies[1], ChatRequest) and bodies[1].chat() == [{"role": "user", "content": "hi"}]
    assert isinstance(bodies[2], CompletionRequest) and bodies[2].prompt == [1, 2, 3]
    assert isinstance(bodies[3], CompletionRequest) and bodies[3].prompt == "plain"
    chat = items[1]
    assert isinstance(chat, WarmItem)
    payload = chat.payload("served")
    assert payload["model"] == "served" and payload["max_tokens"] == 1 and payload["messages"][0]["content"] == "hi"


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected an object"),
        ('{"text_of": "x"}', "no prompt in this line"),
        ('{"prompt": "a", "messages": []}', "not both"),
        ('{"messages": [{"content": "no role"}]}', "field 'messages.0"),
        ('{"prompt": ""}', "field 'prompt'"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "no text to prefill"),
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path: Path, line: str, says: str) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(WarmInputError, match=rf"p\.jsonl:2: .*{re.escape(says)}"):
        list(read_items(path))
    items = list(read_items(path, skip_bad=True))
    assert isinstance(items[0], WarmItem) and isinstance(items[1], BadLine) and items[1].line == 2


def test_a_mooncake_trace_is_refused_naming_the_formats_warm_reads() -> None:
    with pytest.raises(WarmInputError, match=r":1: .*hash ids.*\{\"prompt\": \"\.\.\.\"\}"):
        next(read_items(CONVERSATION))


def test_a_file_that_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    code, _, err = run_cli(["warm", str(tmp_path / "nope.jsonl")])
    assert code == 2 and "nope.jsonl: no such file" in err


def test_the_vllm_path_takes_the_tenant_from_the_key_only(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "x"}])
    code, _, err = run_cli(["warm", "--vllm-url", "http://127.0.0.1:9/v1", "--tenant", "a", str(path)])
    assert code == 2 and "the tenant is the one the gateway stamps for --api-key" in err


def test_public_needs_a_mode_with_public_prefixes(tmp_path: Path) -> None:
    check_public(load_settings(config(tmp_path, "namespace")))
    check_public(load_settings(config(tmp_path, "partitioned", extra="shared_quota = 1000")))
    with pytest.raises(WarmSetupError, match="'shared' has no public pool"):
        check_public(load_settings(config(tmp_path, "shared")))
    with pytest.raises(WarmSetupError, match="set \\[cache\\] shared_quota"):
        check_public(load_settings(config(tmp_path, "partitioned")))
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "x"}])
    code, _, err = run_cli(["warm", "--config", str(config(tmp_path, "shared")), "--public", str(path)])
    assert code == 2 and "no public pool" in err  # refused before the model loads


def test_the_tenant_must_be_one_the_server_serves(tmp_path: Path) -> None:
    assert warm_tenant(load_settings(config(tmp_path)), None) == "local"
    keyed = load_settings(config(tmp_path, keys=KEYS))
    assert warm_tenant(keyed, "a") == "a"
    with pytest.raises(WarmSetupError, match="name the tenant"):
        warm_tenant(keyed, None)
    with pytest.raises(WarmSetupError, match="serves no such tenant"):
        warm_tenant(keyed, "c")


# ====================================================================== on the model


def warm(cfg: Path, prompts: Path, *flags: str) -> tuple[int, str, str]:
    return run_cli(["warm", "--config", str(cfg), *flags, str(prompts)])


def disk_bytes(tmp: Path) -> int:
    return sum(p.stat().st_size for p in (tmp / "disk").rglob("*") if p.is_file())


@contextmanager
def serving(cfg: Path) -> Iterator[str]:
    """A server built from ``cfg`` as ``serve`` builds it, started after the warm: its URL."""
    service = build_service(load_settings(cfg))
    live = LiveServer(service.app, service.engine).start()
    try:
        yield live.url + "/v1"
    finally:
        live.stop()
        service.close()


def cached(reply: Any) -> tuple[int, int]:
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.model
def test_a_server_started_after_a_warm_hits_at_its_first_request(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is fuel included?"}]
    prompts = write_lines(
        tmp_path / "p.jsonl", [{"prompt": SYSTEM + "Question: when do rentals end?"}, {"messages": chat}]
    )
    code, out, err = warm(config(tmp_path), prompts)
    assert code == 0, err
    assert "warm done: 2 prompts" in out and re.search(r"tier disk: \+\d+ blocks", out)
    with serving(config(tmp_path)) as url:
        client = OpenAI(base_url=url, api_key="local")
        reply = client.completions.create(
            model=MODEL_ID, prompt=SYSTEM + "Question: when do rentals end?", max_tokens=2, temperature=0
        )
        prompt, hit = cached(reply)
        assert hit >= prompt // 16 * 16 - 16 and hit > prompt // 2  # the warmed blocks, from the disk tier
        # the warmed chat, then a turn more: the server renders both with its template; the warmed part hits
        longer = [*chat, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And the deposit?"}]
        prompt, hit = cached(client.chat.completions.create(model=MODEL_ID, messages=longer, max_tokens=2))  # type: ignore[arg-type]
        assert hit > len(SYSTEM) // 8  # most of the system prompt and the first turn (~4 characters a token)


@pytest.mark.model
def test_a_rerun_skips_what_is_stored_and_a_shared_prefix_is_prefilled_once(tmp_path: Path) -> None:
    rows = [{"prompt": SYSTEM + f"Question {i}: what happens on day {i} of a rental? " * 4} for i in range(3)]
    prompts = write_lines(tmp_path / "p.jsonl", rows)
    cfg = config(tmp_path)
    code, out, err = warm(cfg, prompts, "--limit", "2")  # interrupted after two prompts
    assert code == 0 and "warm done: 2 prompts" in out, err
    second = re.search(r"line 2 (\d+) tokens: prefilled (\d+), cached (\d+)", err)
    assert second is not None and int(second[3]) > int(second[1]) // 2  # the shared system prompt, not again
    after_two = disk_bytes(tmp_path)
    code, out, err = warm(cfg, prompts)
    assert code == 0, err
    assert "line 1" in err and re.search(r"line 1 \d+ tokens: already cached, skipped", err)
    assert re.search(r"line 2 \d+ tokens: already cached, skipped", err)
    assert "1 prefilled, 2 already cached (skipped)" in out
    grown = disk_bytes(tmp_path) - after_two
    code, out, _ = warm(cfg, prompts)
    assert code == 0 and "0 prefilled, 3 already cached" in out and disk_bytes(tmp_path) == after_two + grown
    assert grown < after_two  # the third prompt's own blocks only, not the first two's again


@pytest.mark.model
def test_a_warm_for_one_tenant_is_not_another_tenants(tmp_path: Path) -> None:
    prompt = SYSTEM + "Question: is the deposit refunded?"
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": prompt}])
    cfg = config(tmp_path, keys=KEYS)
    code, _, err = warm(cfg, prompts, "--tenant", "a")
    assert code == 0, err
    with serving(cfg) as url:
        ask = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        assert cached(OpenAI(base_url=url, api_key="sk-b").completions.create(**ask))[1] == 0
        assert cached(OpenAI(base_url=url, api_key="sk-a").completions.create(**ask))[1] > 0


@pytest.mark.model
def test_bad_lines_stop_the_warm_or_are_counted(tmp_path: Path) -> None:
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": SYSTEM}, "{broken", {"prompt": SYSTEM + " More."}])
    cfg = config(tmp_path)
    code, out, err = warm(cfg, prompts)
    assert code == 1 and "p.jsonl:2: invalid JSON" in err and "warm done: 1 prompts" in out
    code, out, err = warm(cfg, prompts, "--skip-bad")
    assert code == 0 and "2 prompts" in out and "1 bad lines skipped" in out, err


@pytest.mark.model
def test_warm_through_a_server_with_an_api_key(tmp_path: Path) -> None:
    """The --vllm-url path against our own server: the key's tenant is the one warmed."""
    prompt = SYSTEM + "Question: may I return it late?"
    prompts = write_lines(
        tmp_path / "p.jsonl", [{"prompt": prompt}, {"messages": [{"role": "user", "content": SYSTEM}]}]
    )
    cfg = config(tmp_path, keys=KEYS)
    with serving(cfg) as url:
        code, out, err = run_cli(["warm", "--vllm-url", url, "--api-key", "sk-a", str(prompts)])
        assert code == 0 and "2 prefilled, 0 already cached" in out, err
        code, out, err = run_cli(["warm", "--vllm-url", url, "--api-key", "sk-a", str(prompts)])
        assert code == 0 and "0 prefilled, 2 already cached" in out, err
        ask = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        assert cached(OpenAI(base_url=url, api_key="sk-b").completions.create(**ask))[1] == 0
        assert cached(OpenAI(base_url=url, api_key="sk-a").completions.create(**ask))[1] > 0
        code, _, err = run_cli(["warm", "--vllm-url", url, "--api-key", "wrong", str(prompts)])
        assert code == 1 and "refused the API key" in err


@pytest.mark.model
def test_a_public_warm_is_every_tenants_after_a_restart(tmp_path: Path) -> None:
    prompt = SYSTEM + "Question: is the deposit refunded?"
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": prompt}])
    cfg = config(tmp_path, keys=KEYS)
    code, _, err = warm(cfg, prompts, "--public", "--tenant", "a")
    assert code == 0, err
    with serving(cfg) as url:
        ask = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        assert cached(OpenAI(base_url=url, api_key="sk-b").completions.create(**ask))[1] > 0
