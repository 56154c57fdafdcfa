"""Trace readers: every format round-trips, the published samples give their published
counts, and every malformed line is a TraceError naming file, line and field."""

from __future__ import annotations

import gzip
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from prefixcache.sim.tokenizers import ByteTokenizer, load_tokenizer
from prefixcache.sim.tracefile import TraceError
from prefixcache.sim.traces import FORMATS, Request, detect_format, native_block_size, read_trace
from support import TRACES

REPO_TRACES = TRACES
SHARED_TRACES = Path("/work/shared/traces")


def write_lines(path: Path, lines: list[Any]) -> Path:
    """One line per item: dicts as JSON, strings as they are."""
    text = "\n".join(item if isinstance(item, str) else json.dumps(item) for item in lines) + "\n"
    path.write_text(text)
    return path


def mooncake(ts: float = 0, n: int = 600, out: int = 5, ids: list[int] | None = None) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids if ids is not None else [0, 1]}


def bailian(ts: float = 0.5, chat_id: Any = 7, **extra: Any) -> dict[str, Any]:
    row = {
        "chat_id": chat_id,
        "parent_chat_id": -1,
        "timestamp": ts,
        "input_length": 20,
        "output_length": 3,
        "type": "text",
        "turn": 1,
        "hash_ids": [4, 5],
    }
    row.update(extra)
    return row


def ours(ts: float = 0.0, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"timestamp": ts, "tenant": "acme", "model": "m"}
    row.update(fields)
    if not {"tokens", "text", "hash_ids"} & row.keys():
        row["tokens"] = [1, 2, 3]
    return {k: v for k, v in row.items() if v is not DROP}


DROP = object()  # a field value meaning "leave the field out"
HUGE = "__1e400__"  # written as the JSON number 1e400, which Python reads as inf


# ---------------------------------------------------------------------------- the shared samples


@pytest.fixture(scope="module")
def trace_dir() -> Path:
    """The Mooncake samples: the repo's copy first, then the shared folder."""
    for folder in (REPO_TRACES, SHARED_TRACES):
        if (folder / "mooncake_conversation_trace.jsonl").is_file():
            return folder
    pytest.skip("Mooncake sample traces not found in tests/data/traces/ or /work/shared/traces/")


@pytest.mark.parametrize(
    ("name", "rows", "total", "unique", "last_s"),
    [
        ("mooncake_conversation_trace.jsonl", 12_031, 288_500, 182_790, 3536.999),
        ("mooncake_synthetic_trace.jsonl", 3_993, 121_877, 43_924, 1022.025),
    ],
)
def test_mooncake_samples_match_published_counts(
    trace_dir: Path, name: str, rows: int, total: int, unique: int, last_s: float
) -> None:
    count = blocks = 0
    seen: set[int] = set()
    last: Request | None = None
    for req in read_trace(trace_dir / name):
        count += 1
        assert req.hash_ids is not None
        blocks += len(req.hash_ids)
        seen.update(req.hash_ids)
        last = req
    assert (count, blocks, len(seen)) == (rows, total, unique)
    assert last is not None
    assert last.timestamp == pytest.approx(last_s)  # ms became seconds
    assert (last.block_size, last.tenant, last.model, last.endpoint) == (512, "default", "default", "")
    assert detect_format(trace_dir / name) == "mooncake"


# ---------------------------------------------------------------------------- round trips


def test_mooncake_round_trip(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "m.jsonl", [mooncake(0, 600, 5, [0, 1]), mooncake(1500, 512, 0, [0])])
    assert list(read_trace(path, "mooncake")) == [
        Request(0.0, "default", "default", "", 600, 5, hash_ids=(0, 1), block_size=512),
        Request(1.5, "default", "default", "", 512, 0, hash_ids=(0,), block_size=512),
    ]


def test_bailian_round_trip(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "b.jsonl", [bailian(0.5, 7), bailian(2.25, "x9", type="search")])
    first, second = read_trace(path, "bailian")
    assert first == Request(0.5, "default", "default", "text", 20, 3, hash_ids=(4, 5), block_size=16, session="7")
    assert (second.timestamp, second.endpoint, second.session) == (2.25, "search", "x9")


def test_ours_round_trip_every_prompt_form(tmp_path: Path) -> None:
    rows = [
        ours(0.0, endpoint="chat", session="s1", tokens=[5, 6, 7], output_tokens=[8, 9]),
        ours(0.0, text="hé", output_length=4),
        ours(1.0, hash_ids=[3, 4], block_size=16, input_length=17, output_length=2),
        ours(2.0, tokens=[], model="other", tenant="t2"),
    ]
    path = write_lines(tmp_path / "o.jsonl", rows)
    a, b, c, d = read_trace(path, "jsonl", ByteTokenizer())
    assert a == Request(0.0, "acme", "m", "chat", 3, 2, tokens=(5, 6, 7), output_tokens=(8, 9), session="s1")
    assert b == Request(0.0, "acme", "m", "", 3, 4, tokens=tuple("hé".encode()))
    assert c == Request(1.0, "acme", "m", "", 17, 2, hash_ids=(3, 4), block_size=16)
    assert d == Request(2.0, "t2", "other", "", 0, 0, tokens=())


def test_gzip_is_read_transparently_whatever_the_name(tmp_path: Path) -> None:
    rows = [ours(float(i), tokens=[i, i + 1]) for i in range(5)]
    plain = write_lines(tmp_path / "o.jsonl", rows)
    for name in ("o.jsonl.gz", "o-compressed.jsonl"):
        packed = tmp_path / name
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        assert list(read_trace(packed)) == list(read_trace(plain))
        assert detect_format(packed) == "jsonl"


def test_truncated_gzip_is_a_trace_error(tmp_path: Path) -> None:
    rows = [ours(float(i), tokens=list(range(200))) for i in range(50)]
    data = gzip.compress(write_lines(tmp_path / "o.jsonl", rows).read_bytes())
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(broken))}:\d+: invalid gzip data"):
        list(read_trace(broken, "jsonl"))


def test_blank_lines_are_skipped_but_counted(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "o.jsonl", ["", json.dumps(ours()), "   ", "", json.dumps(ours(1, tenant=""))])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:5: field 'tenant'"):
        list(read_trace(path))
    assert len(list(read_trace(write_lines(tmp_path / "p.jsonl", ["", json.dumps(ours()), ""])))) == 1


def test_reading_is_lazy_and_never_skips(tmp_path: Path) -> None:
    """Rows before a bad one come out; the bad one stops the iteration, it is not skipped."""
    path = write_lines(tmp_path / "o.jsonl", [ours(0), ours(1), "{broken", ours(3)])
    it = read_trace(path)
    assert next(it).timestamp == 0.0 and next(it).timestamp == 1.0
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:3: invalid JSON"):
        next(it)


# ---------------------------------------------------------------------------- malformed lines


BAD_LINES: list[tuple[str, dict[str, Any], str]] = [
    # Mooncake
    ("mooncake", {"timestamp": DROP}, "timestamp"),
    ("mooncake", {"timestamp": -1}, "timestamp"),
    ("mooncake", {"timestamp": "5"}, "timestamp"),
    ("mooncake", {"timestamp": True}, "timestamp"),
    ("mooncake", {"input_length": DROP}, "input_length"),
    ("mooncake", {"input_length": 600.0}, "input_length"),
    ("mooncake", {"input_length": True}, "input_length"),
    ("mooncake", {"output_length": -5}, "output_length"),
    ("mooncake", {"output_length": None}, "output_length"),
    ("mooncake", {"hash_ids": DROP}, "hash_ids"),
    ("mooncake", {"hash_ids": "0,1"}, "hash_ids"),
    ("mooncake", {"hash_ids": [0, -1]}, "hash_ids"),
    ("mooncake", {"hash_ids": [0, False]}, "hash_ids"),
    ("mooncake", {"hash_ids": [0, 1.0]}, "hash_ids"),
    ("mooncake", {"hash_ids": [0]}, "hash_ids"),  # 600 tokens need 2 blocks of 512
    ("mooncake", {"hash_ids": [0, 1, 2]}, "hash_ids"),
    # Bailian
    ("bailian", {"chat_id": DROP}, "chat_id"),
    ("bailian", {"chat_id": [1]}, "chat_id"),
    ("bailian", {"timestamp": HUGE}, "timestamp"),  # parses as inf
    ("bailian", {"input_length": -1}, "input_length"),
    ("bailian", {"output_length": DROP}, "output_length"),
    ("bailian", {"type": 3}, "type"),
    ("bailian", {"turn": [2]}, "turn"),
    ("bailian", {"hash_ids": {"0": 1}}, "hash_ids"),
    # ours
    ("jsonl", {"timestamp": DROP}, "timestamp"),
    ("jsonl", {"tenant": DROP}, "tenant"),
    ("jsonl", {"tenant": ""}, "tenant"),
    ("jsonl", {"tenant": 3}, "tenant"),
    ("jsonl", {"model": DROP}, "model"),
    ("jsonl", {"model": None}, "model"),
    ("jsonl", {"endpoint": 1}, "endpoint"),
    ("jsonl", {"session": ""}, "session"),
    ("jsonl", {"endpont": "chat"}, "endpont"),  # unknown fields are typos, not extensions
    ("jsonl", {"tokens": [1, -2]}, "tokens"),
    ("jsonl", {"tokens": [1, 2**32]}, "tokens"),
    ("jsonl", {"tokens": [1, True]}, "tokens"),
    ("jsonl", {"tokens": "1 2 3"}, "tokens"),
    ("jsonl", {"tokens": [1], "text": "a"}, "text"),
    ("jsonl", {"tokens": [1], "hash_ids": [1], "block_size": 16, "input_length": 1}, "hash_ids"),
    ("jsonl", {"tokens": [1], "block_size": 16}, "block_size"),
    ("jsonl", {"tokens": [1, 2], "input_length": 3}, "input_length"),
    ("jsonl", {"text": 5}, "text"),
    ("jsonl", {"hash_ids": [1, 2], "input_length": 20}, "block_size"),
    ("jsonl", {"hash_ids": [1, 2], "block_size": 0, "input_length": 20}, "block_size"),
    ("jsonl", {"hash_ids": [1, 2], "block_size": 16}, "input_length"),
    ("jsonl", {"hash_ids": [1, 2], "block_size": 16, "input_length": 16}, "input_length"),  # 1 block
    ("jsonl", {"hash_ids": [1, 2], "block_size": 16, "input_length": 49}, "input_length"),  # 3 full blocks + tail
    ("jsonl", {"hash_ids": [], "block_size": 16, "input_length": 16}, "input_length"),  # 1 block either way
    ("jsonl", {"hash_ids": [1, -2], "block_size": 16, "input_length": 20}, "hash_ids"),
    ("jsonl", {"output_length": -1}, "output_length"),
    ("jsonl", {"output_length": 2.5}, "output_length"),
    ("jsonl", {"output_tokens": [1, 2], "output_length": 3}, "output_length"),
    ("jsonl", {"output_tokens": [1, None]}, "output_tokens"),
]


def _row(fmt: str, changes: dict[str, Any]) -> dict[str, Any]:
    base = {"mooncake": mooncake(), "bailian": bailian(), "jsonl": ours()}[fmt]
    if "tokens" not in changes and ({"text", "hash_ids"} & changes.keys()):
        base.pop("tokens", None)
    base.update(changes)
    return {k: v for k, v in base.items() if v is not DROP}


@pytest.mark.parametrize(("fmt", "changes", "field"), BAD_LINES)
def test_malformed_field_names_file_line_and_field(
    tmp_path: Path, fmt: str, changes: dict[str, Any], field: str
) -> None:
    good = _row(fmt, {})
    bad = _row(fmt, changes)
    text = json.dumps(good) + "\n\n" + json.dumps(bad).replace(f'"{HUGE}"', "1e400") + "\n"
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        list(read_trace(path, fmt, ByteTokenizer()))
    assert str(info.value).startswith(f"{path}:3: field '{field}': "), str(info.value)


@pytest.mark.parametrize(
    "line",
    ["{not json", '{"timestamp": NaN, "input_length": 1}', "[1, 2]", "42", '"text"', "\xff\xfe", "[" * 100_000],
)
def test_invalid_json_names_file_and_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(mooncake()).encode() + b"\n" + line.encode("latin-1") + b"\n")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:2: invalid JSON: "):
        list(read_trace(path, "mooncake"))


@pytest.mark.parametrize(
    ("fmt", "first", "second", "shown"),
    [
        ("mooncake", mooncake(2000), mooncake(1999), "1999"),
        ("bailian", bailian(3.5), bailian(3.25), "3.25"),
        ("jsonl", ours(10.0), ours(9.0), "9.0"),
    ],
)
def test_decreasing_timestamp_names_the_line(
    tmp_path: Path, fmt: str, first: dict[str, Any], second: dict[str, Any], shown: str
) -> None:
    path = write_lines(tmp_path / "t.jsonl", [first, first, second])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:3: field 'timestamp': {shown} is earlier"):
        list(read_trace(path, fmt))


def test_equal_timestamps_are_fine(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [ours(1.0), ours(1.0), ours(1)])
    assert [r.timestamp for r in read_trace(path)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(("length", "blocks"), [(0, 0), (1, 1), (16, 1), (17, 2), (32, 2)])
def test_hash_ids_length_bounds_that_hold(tmp_path: Path, length: int, blocks: int) -> None:
    row = ours(hash_ids=list(range(blocks)), block_size=16, input_length=length)
    (req,) = read_trace(write_lines(tmp_path / "t.jsonl", [row]))
    assert (req.input_length, req.block_size, req.tokens) == (length, 16, None)


def test_mooncake_empty_prompt(tmp_path: Path) -> None:
    (req,) = read_trace(write_lines(tmp_path / "t.jsonl", [mooncake(0, 0, 1, [])]), "mooncake")
    assert req.hash_ids == () and req.input_length == 0


# ---------------------------------------------------------------------------- traces that hash only full blocks


# NOTE: Mooncake names every block, the partial last one too (ceil(input_length / 512)
# ids); some trace sets name only the full blocks (input_length // block_size ids). A
# prompt whose length is a multiple of the block size fits both and decides nothing.
FULL_ONLY_MOONCAKE = [mooncake(0, 600, ids=[0]), mooncake(1, 1024, ids=[0, 1]), mooncake(2, 511, ids=[])]
EVERY_BLOCK_MOONCAKE = [mooncake(0, 600, ids=[0, 1]), mooncake(1, 1024, ids=[0, 1]), mooncake(2, 511, ids=[2])]


@pytest.mark.parametrize("hashed_blocks", ["auto", "full"])
def test_a_trace_hashing_only_full_blocks_is_read(tmp_path: Path, hashed_blocks: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", FULL_ONLY_MOONCAKE)
    got = [(r.input_length, r.hash_ids) for r in read_trace(path, "mooncake", hashed_blocks=hashed_blocks)]
    assert got == [(600, (0,)), (1024, (0, 1)), (511, ())]


@pytest.mark.parametrize("hashed_blocks", ["auto", "all"])
def test_a_trace_hashing_every_block_is_read(tmp_path: Path, hashed_blocks: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", EVERY_BLOCK_MOONCAKE)
    got = [(r.input_length, r.hash_ids) for r in read_trace(path, "mooncake", hashed_blocks=hashed_blocks)]
    assert got == [(600, (0, 1)), (1024, (0, 1)), (511, (2,))]


def ours_hashed(ts: float, ids: list[int], input_length: int) -> dict[str, Any]:
    return ours(ts, hash_ids=ids, block_size=16, input_length=input_length)


@pytest.mark.parametrize(("hashed_blocks", "length", "ids"), [("auto", 20, [1]), ("full", 20, [1]), ("auto", 5, [])])
def test_ours_hashing_only_full_blocks_is_read(tmp_path: Path, hashed_blocks: str, length: int, ids: list[int]) -> None:
    path = write_lines(tmp_path / "t.jsonl", [ours_hashed(0.0, ids, length), ours_hashed(1.0, [1, 2], 32)])
    got = [(r.input_length, r.hash_ids) for r in read_trace(path, hashed_blocks=hashed_blocks)]
    assert got == [(length, tuple(ids)), (32, (1, 2))]


@pytest.mark.parametrize(
    ("rows", "first", "second"),
    [
        ([mooncake(0, 600, ids=[0, 1]), mooncake(1, 600, ids=[0])], "every block", "only the full blocks"),
        ([mooncake(0, 600, ids=[0]), mooncake(1, 600, ids=[0, 1])], "only the full blocks", "every block"),
        # a length that fits both decides nothing: the second line decides, the third breaks it
        ([mooncake(0, 1024, ids=[0, 1]), mooncake(1, 600, ids=[0]), mooncake(2, 700, ids=[0, 1])], None, None),
    ],
)
def test_a_trace_mixing_the_conventions_is_an_error_naming_both_lines(
    tmp_path: Path, rows: list[dict[str, Any]], first: str | None, second: str | None
) -> None:
    path = write_lines(tmp_path / "t.jsonl", rows)
    deciding, breaking = (1, 2) if first else (2, 3)
    with pytest.raises(TraceError) as info:
        list(read_trace(path, "mooncake"))
    message = str(info.value)
    assert message.startswith(f"{path}:{breaking}: field 'hash_ids': ")
    assert f"since {path}:{deciding}" in message and "one trace must keep one convention" in message
    if first and second:
        assert message.index(second) < message.index(first)  # "it hashes <second>, but the trace ... <first>"


def test_a_mixed_jsonl_trace_blames_input_length(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [ours_hashed(0.0, [1], 20), ours_hashed(1.0, [1, 2], 20)])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:2: field 'input_length': .*since .*:1 "):
        list(read_trace(path))


@pytest.mark.parametrize(
    ("hashed_blocks", "row", "needs"),
    [
        ("all", mooncake(0, 600, ids=[0]), "hashed blocks 'all' needs ceil(600/512) = 2"),
        ("full", mooncake(0, 600, ids=[0, 1]), "hashed blocks 'full' needs 600//512 = 1"),
    ],
)
def test_a_convention_asked_for_is_enforced(
    tmp_path: Path, hashed_blocks: str, row: dict[str, Any], needs: str
) -> None:
    path = write_lines(tmp_path / "t.jsonl", [mooncake(0, 1024, ids=[0, 1]), row])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:2: field 'hash_ids': .*{re.escape(needs)}$"):
        list(read_trace(path, "mooncake", hashed_blocks=hashed_blocks))


def test_a_count_that_fits_no_convention_names_both(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [mooncake(0, 1600, ids=[0])])
    with pytest.raises(TraceError) as info:
        list(read_trace(path, "mooncake"))
    message = str(info.value)
    assert "has 1 ids for input_length 1600 in blocks of 512" in message
    assert "ceil(1600/512) = 4 if it hashes every block" in message and "1600//512 = 3 if it hashes only" in message


def test_bailian_rows_are_not_counted_under_any_convention(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [bailian(1.0, input_length=20, hash_ids=[1]), bailian(2.0)])
    for hashed_blocks in ("auto", "all", "full"):
        assert len(list(read_trace(path, "bailian", hashed_blocks=hashed_blocks))) == 2


def test_unknown_hashed_blocks_fails_at_the_call_listing_the_valid_ones(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [mooncake()])
    with pytest.raises(ValueError, match="unknown hashed_blocks 'tail'; valid: auto, all, full"):
        read_trace(path, "mooncake", hashed_blocks="tail")


def test_unknown_keys_are_ignored_in_third_party_formats(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{**mooncake(), "extra": 1}])
    assert len(list(read_trace(path, "mooncake"))) == 1


# ---------------------------------------------------------------------------- formats and detection


@pytest.mark.parametrize(("row", "fmt"), [(mooncake(), "mooncake"), (bailian(), "bailian"), (ours(), "jsonl")])
def test_auto_detection(tmp_path: Path, row: dict[str, Any], fmt: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", ["", row])
    assert detect_format(path) == fmt
    assert list(read_trace(path)) == list(read_trace(path, fmt))


def test_ours_with_hash_ids_is_not_mistaken_for_mooncake(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [ours(hash_ids=[1], block_size=16, input_length=3)])
    assert detect_format(path) == "jsonl"


def test_undetectable_format_is_a_clear_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{"prompt": "hi"}])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:1: cannot detect .*mooncake, bailian, jsonl"):
        read_trace(path)


def test_empty_trace(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", ["", ""])
    assert list(read_trace(path)) == []
    assert list(read_trace(path, "mooncake")) == []
    with pytest.raises(TraceError, match="empty"):
        detect_format(path)


def test_unknown_format_lists_the_valid_ones(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [ours()])
    with pytest.raises(ValueError, match="'csv'") as info:
        read_trace(path, "csv")
    assert all(fmt in str(info.value) for fmt in (*FORMATS, "auto"))
    with pytest.raises(ValueError, match="mooncake, bailian, jsonl"):
        native_block_size("csv")


def test_missing_file_fails_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "nope.jsonl", "jsonl")


def test_native_block_sizes() -> None:
    assert [native_block_size(f) for f in FORMATS] == [512, 16, None]


# ---------------------------------------------------------------------------- tokenizers


def test_text_without_a_tokenizer_names_the_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [ours(text="hello")])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:1: field 'text': needs a tokenizer"):
        list(read_trace(path))


def test_utf8_tokenizer() -> None:
    tok = load_tokenizer("utf8")
    assert tok.name == "utf8"
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.encode("\ud800") == [0xED, 0xA0, 0x80]  # a lone surrogate still tokenizes


def test_unknown_tokenizer_name_lists_what_is_accepted() -> None:
    with pytest.raises(ValueError, match=r"unknown tokenizer 'gpt2'.*'utf8'.*tokenizer\.json"):
        load_tokenizer("gpt2")


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_missing_tokenizers_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes the import fail
    with pytest.raises(ValueError, match="pip install tokenizers"):
        load_tokenizer(str(path))


def test_huggingface_tokenizer_is_used_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for the ``tokenizers`` package: the wiring, not the Rust library."""

    class FakeTokenizer:
        def __init__(self, path: str) -> None:
            self.path = path

        @classmethod
        def from_file(cls, path: str) -> FakeTokenizer:
            if "bad" in path:
                raise Exception("not a tokenizer")  # what the binding raises
            return cls(path)

        def encode(self, text: str) -> Any:
            return types.SimpleNamespace(ids=[len(w) for w in text.split()])

    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=FakeTokenizer))
    (tmp_path / "tokenizer.json").write_text("{}")
    tok = load_tokenizer(str(tmp_path))  # a folder holding tokenizer.json
    assert tok.encode("ab cde") == [2, 3]
    trace = write_lines(tmp_path / "t.jsonl", [ours(text="x yy zzz")])
    assert next(read_trace(trace, tokenizer=tok)).tokens == (1, 2, 3)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_a_failing_tokenizer_names_the_line(tmp_path: Path) -> None:
    class Strict:
        name = "strict"

        def encode(self, text: str) -> list[int]:
            raise ValueError("no")

    path = write_lines(tmp_path / "t.jsonl", [ours(text="x")])
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:1: field 'text': tokenizer 'strict' failed"):
        list(read_trace(path, tokenizer=Strict()))
