"""The simulator replays retention (issue 41, point 5): a trace line's ``retention``,
``--retention off | trace | auto:P`` (the P-th percentile of a session's own gaps so
far), sessions derived from the prefix chain where a trace names none, and only the
Python engine (the real ``PrefixCache``) replays it: the compiled kernel does not model
retention, and the output says which engine ran."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import prefixcache.sim.engines as engines
from prefixcache.cache import retention as cache_retention
from prefixcache.config import CacheConfig, RetentionConfig
from prefixcache.sim.engines import CacheStepper, make_stepper, native_unsupported
from prefixcache.sim.replay import replay
from prefixcache.sim.results import ReplayConfig
from prefixcache.sim.retention import (
    DEFAULT_FIRST_S,
    MAX_RETAIN_S,
    RetentionMode,
    RetentionSpec,
    parse_retention,
)
from prefixcache.sim.sessions import PrefixChains, RetentionPlan, nearest_rank
from prefixcache.sim.summary import summarize
from prefixcache.sim.tracefile import TraceError
from prefixcache.sim.traces import Request, read_trace
from support import run_cli

BS = 16


def line(t: float, tenant: str, ids: list[int], session: str | None = None, **extra: Any) -> str:
    row: dict[str, Any] = {"timestamp": t, "tenant": tenant, "model": "m", "hash_ids": ids, "block_size": BS}
    row["input_length"] = len(ids) * BS
    if session is not None:
        row["session"] = session
    return json.dumps({**row, **extra})


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- the trace's field


@pytest.mark.parametrize(
    ("field", "value", "seconds"),
    [
        ("retention", 90, 90.0),
        ("retention", 2.5, 2.5),
        ("retention", "5m", 300.0),
        ("retention", "1h", 3600.0),
        ("retention", "24h", 86400.0),
        ("retention", 0, None),
        ("retention", None, None),
        ("prompt_cache_retention", "24h", 86400.0),
        ("prompt_cache_retention", "in_memory", None),
    ],
)
def test_a_trace_line_carries_its_retention(tmp_path: Path, field: str, value: Any, seconds: float | None) -> None:
    trace = write(tmp_path / "t.jsonl", line(0, "a", [1, 2], **{field: value}))
    (req,) = read_trace(trace)
    assert req.retention == seconds


def test_mooncake_lines_may_carry_a_retention_too(tmp_path: Path) -> None:
    row = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1], "retention": "1h"}
    trace = write(tmp_path / "m.jsonl", json.dumps(row))
    (req,) = read_trace(trace, "mooncake")
    assert req.retention == 3600.0


@pytest.mark.parametrize(
    ("extra", "field", "says"),
    [
        ({"retention": -1}, "retention", "from 0 to"),
        ({"retention": MAX_RETAIN_S + 1}, "retention", "from 0 to"),
        ({"retention": "5x"}, "retention", "duration"),
        ({"retention": True}, "retention", "seconds"),
        ({"retention": [60]}, "retention", "seconds"),
        ({"prompt_cache_retention": "1h"}, "prompt_cache_retention", "'in_memory', '24h'"),
        ({"retention": 60, "prompt_cache_retention": "24h"}, "prompt_cache_retention", "conflicts"),
    ],
)
def test_a_bad_retention_names_its_line_and_field(tmp_path: Path, extra: dict[str, Any], field: str, says: str) -> None:
    trace = write(tmp_path / "t.jsonl", line(0, "a", [1]), line(1, "a", [1, 2], **extra))
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: field '{field}': .*{says}"):
        list(read_trace(trace))


def test_the_sims_bound_is_the_caches() -> None:
    assert MAX_RETAIN_S == cache_retention.MAX_RETAIN_S


# ---------------------------------------------------------------------------- --retention's forms


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("off", RetentionSpec()),
        ("trace", RetentionSpec(RetentionMode.TRACE)),
        ("auto:90", RetentionSpec(RetentionMode.AUTO, 90)),
        ("AUTO:99.5", RetentionSpec(RetentionMode.AUTO, 99.5)),
        ("auto:1", RetentionSpec(RetentionMode.AUTO, 1)),
        ("auto:100", RetentionSpec(RetentionMode.AUTO, 100)),
        ("auto:75:4", RetentionSpec(RetentionMode.AUTO, 75, 4)),
        ("auto:50:1", RetentionSpec(RetentionMode.AUTO, 50)),
    ],
)
def test_retention_forms(text: str, spec: RetentionSpec) -> None:
    assert parse_retention(text) == spec
    assert parse_retention(spec.label) == spec


@pytest.mark.parametrize(
    "text",
    [
        "on",
        "auto",
        "auto:",
        "auto:0",
        "auto:101",
        "auto:x",
        "auto:nan",
        "trace:5",
        "",
        "auto:50:",
        "auto:50:0",
        "auto:50:1.5",
        "auto:50:x",
        "auto:50:-2",
        "auto:50:4:1",
    ],
)
def test_a_bad_retention_is_an_error_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match="off, trace, auto:P"):
        parse_retention(text)


def test_the_cli_refuses_a_bad_retention_naming_the_forms(tmp_path: Path) -> None:
    trace = write(tmp_path / "t.jsonl", line(0, "a", [1]))
    code, _, err = run_cli(["replay", str(trace), "--retention", "auto:200"])
    assert code == 2 and "--retention" in err and "off, trace, auto:P" in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--retention", "trace"], "no line of"),  # the trace carries none
        (["--retention-share", "0.5"], "--retention-share caps retention"),
        (["--retention", "auto:50", "--mode", "flat"], "tree mode only"),
        (["--retention", "auto:50", "--engine", "native"], "does not model retention"),
        (["--retention", "auto:50", "--backends", "2"], "not a fleet"),
        (["--retention", "auto:50", "--retention-share", "2"], "from 0 to 1"),
    ],
)
def test_flags_that_cannot_apply_are_usage_errors(tmp_path: Path, flags: list[str], says: str) -> None:
    trace = write(tmp_path / "t.jsonl", line(0, "a", [1]), line(1, "a", [1, 2]))
    code, _, err = run_cli(["replay", str(trace), "--model", "none", *flags])
    assert code == 2 and says in err, err


# ---------------------------------------------------------------------------- auto:P


def request(t: float, session: str | None, ids: tuple[int, ...] = (1,), tenant: str = "a") -> Request:
    return Request(t, tenant, "m", "", len(ids) * BS, 0, hash_ids=ids, block_size=BS, session=session)


def test_nearest_rank() -> None:
    assert nearest_rank([10.0], 50) == 10.0
    assert nearest_rank([10.0, 30.0], 50) == 10.0
    assert nearest_rank([10.0, 30.0], 51) == 30.0
    assert nearest_rank([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == 9.0
    assert nearest_rank([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 100) == 10.0
    assert nearest_rank([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 1) == 1.0


def test_auto_asks_the_percentile_of_the_sessions_own_gaps_so_far() -> None:
    """Session s: requests at 0, 10, 40, 60, 100 (gaps 10, 30, 20, 40); session u's
    requests fall between them and never count in s's gaps."""
    trace = [
        request(0, "s"),
        request(5, "u"),
        request(10, "s"),
        request(11, "u"),
        request(40, "s"),
        request(60, "s"),
        request(100, "s"),
    ]
    asked = {}
    for p in (50, 90):
        plan = RetentionPlan(RetentionSpec(RetentionMode.AUTO, p), BS)
        asked[p] = [(r.session, plan.seconds(r)) for r in trace]
    first = DEFAULT_FIRST_S
    # s's gaps so far: -, [10], [10 30], [10 20 30], [10 20 30 40]; u's: -, [6]
    assert asked[50] == [("s", first), ("u", first), ("s", 10), ("u", 6), ("s", 10), ("s", 20), ("s", 20)]
    assert asked[90] == [("s", first), ("u", first), ("s", 10), ("u", 6), ("s", 30), ("s", 30), ("s", 40)]


def test_auto_from_a_turn_asks_nothing_before_it_and_counts_every_gap() -> None:
    """auto:50:3: session s's first two turns ask nothing; its third asks the median of
    both gaps so far (those turns' gaps count though they retained nothing)."""
    plan = RetentionPlan(RetentionSpec(RetentionMode.AUTO, 50, 3), BS)
    asked = [plan.seconds(request(t, "s")) for t in (0, 10, 40, 60)]
    assert asked == [None, None, 10, 20]  # gaps [10], [10 30], [10 20 30]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (dict(mode=RetentionMode.AUTO, percentile=50, from_turn=0), "first turn N >= 1"),
        (dict(mode=RetentionMode.AUTO, percentile=50, from_turn=True), "first turn N >= 1"),
        (dict(mode=RetentionMode.TRACE, from_turn=2), "takes no percentile nor first turn"),
    ],
)
def test_a_bad_first_turn_is_an_error(spec: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        RetentionSpec(**spec)


def test_the_same_session_name_in_two_tenants_is_two_sessions() -> None:
    plan = RetentionPlan(RetentionSpec(RetentionMode.AUTO, 50), BS)
    assert plan.seconds(request(0, "s", tenant="a")) == DEFAULT_FIRST_S
    assert plan.seconds(request(7, "s", tenant="b")) == DEFAULT_FIRST_S
    assert plan.seconds(request(10, "s", tenant="a")) == 10


def test_trace_mode_asks_each_lines_own_retention() -> None:
    plan = RetentionPlan(RetentionSpec(RetentionMode.TRACE), BS)
    with_field = Request(0, "a", "m", "", BS, 0, hash_ids=(1,), block_size=BS, retention=42.0)
    assert plan.seconds(with_field) == 42.0
    assert plan.seconds(request(1, "s")) is None


def test_conversations_follow_the_prefix_chain_past_the_shared_system_prompt() -> None:
    """Mooncake-style: every prompt starts with block 0 (a system prompt); a turn starts
    with all of its previous turn's full blocks (the partial last one is rewritten)."""
    chains = PrefixChains(BS)

    def conv(ids: tuple[int, ...], tokens: int) -> int:
        found: int = chains.conversation(Request(0, "default", "m", "", tokens, 0, hash_ids=ids, block_size=BS))
        return found

    a1 = conv((0, 1, 2), 2 * BS + 5)  # full blocks 0, 1
    b1 = conv((0, 7, 8), 2 * BS + 5)  # shares only the system prompt: a conversation of its own
    a2 = conv((0, 1, 3, 4), 3 * BS + 5)  # starts with a1's full blocks: a1's next turn
    b2 = conv((0, 7, 9), 3 * BS)
    a3 = conv((0, 1, 3, 5, 6), 5 * BS)
    c1 = conv((0, 11), 2 * BS)  # only the system prompt in common with anything
    assert a1 == a2 == a3 and b1 == b2
    assert len({a1, b1, c1}) == 3


def test_auto_derives_sessions_where_the_trace_names_none() -> None:
    plan = RetentionPlan(RetentionSpec(RetentionMode.AUTO, 50), BS)

    def ask(t: float, ids: tuple[int, ...]) -> float | None:
        seconds: float | None = plan.seconds(
            Request(t, "default", "m", "", len(ids) * BS + 1, 0, hash_ids=ids, block_size=BS)
        )
        return seconds

    assert ask(0, (0, 1, 2)) == DEFAULT_FIRST_S
    assert ask(3, (0, 7, 8)) == DEFAULT_FIRST_S
    assert ask(50, (0, 1, 2, 3)) == 50  # a's second turn: its gap 50
    assert ask(54, (0, 7, 8, 9)) == 51  # b's: 51


# ---------------------------------------------------------------------------- the replay


def pressure_trace(path: Path) -> Path:
    """Tenant a's 3-block prompt, then two other tenants' prompts that (LRU, 4 blocks of
    room) evict it, then a's next turn. Retention (a's line asks 60 s) keeps it."""
    return write(
        path,
        line(0, "a", [1, 2, 3], "a/1", retention=60),
        line(1, "b", [10, 11, 12], "b/1"),
        line(2, "c", [20, 21, 22], "c/1"),
        line(3, "a", [1, 2, 3, 4], "a/1"),
    )


def config(retention: RetentionSpec, share: float = 1.0) -> ReplayConfig:
    cache = CacheConfig(capacity_tokens=4 * BS, block_size=BS, retention=RetentionConfig(share=share))
    return ReplayConfig(cache, retention=retention)


def test_retention_turns_a_known_miss_into_a_hit_under_lru_pressure(tmp_path: Path) -> None:
    trace = pressure_trace(tmp_path / "t.jsonl")
    off, kept = replay(lambda: read_trace(trace), [config(RetentionSpec()), config(RetentionSpec(RetentionMode.TRACE))])
    assert off.hit_tokens == 0  # LRU evicted a's prompt before its next turn
    assert kept.hit_tokens == 3 * BS  # retained: the next turn hits all of it
    assert kept.engine == "python"
    assert kept.retention is not None and kept.retention.calls == 1 and kept.retention.retained_tokens == 3 * BS
    assert off.retention is None
    assert off.optimal_hit_tokens == kept.optimal_hit_tokens == 3 * BS


def test_the_cli_names_the_python_engine_and_the_retention(tmp_path: Path) -> None:
    trace = pressure_trace(tmp_path / "t.jsonl")
    args = ["replay", str(trace), "--capacity-tokens", str(4 * BS), "--model", "none", "--retention-share", "1"]
    code, out, err = run_cli([*args, "--retention", "off,trace", "--json"])
    assert code == 0, err
    off, kept = json.loads(out)["results"]
    assert (off["retention"], off["retention_share"], off["hit_tokens"]) == ("off", None, 0)
    assert (kept["retention"], kept["retention_share"], kept["hit_tokens"]) == ("trace", 1.0, 3 * BS)
    assert kept["engine"] == "python" and kept["retention_counts"]["calls"] == 1
    code, out, err = run_cli([*args, "--retention", "trace"])
    assert code == 0, err
    assert "tree (python)" in out and "trace @1" in out and "replayed by the python engine" in out


def test_the_compiled_engine_never_replays_retention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(RetentionSpec(RetentionMode.AUTO, 90))
    assert "retention" in native_unsupported(cfg)
    trace = pressure_trace(tmp_path / "t.jsonl")
    summary = summarize(lambda: read_trace(trace))
    assert isinstance(make_stepper(cfg, summary, False, "auto"), CacheStepper)
    with pytest.raises(ValueError, match=r"--engine native cannot replay .*retention"):
        make_stepper(cfg, summary, False, "native")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the compiled kernel was asked to replay retention")

    monkeypatch.setattr(engines, "KernelStepper", refuse)
    (result,) = replay(lambda: read_trace(trace), [cfg])
    assert result.engine == "python"
