"""Context roots, typed encoding, block keys, the hash registry and token validation
(design.md invariants 1 and 2, and the front door of invariant 3)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import CacheConfig, CacheContext, PrefixCache, Segment
from prefixcache.hashing import (
    HASHES,
    ROOT_TAG,
    KeyChain,
    Segments,
    encode,
    get_hash,
    root_encoding,
    root_hasher,
    token_bytes,
)

CTX = CacheContext(tenant="acme", model="m")
PROMPT = list(range(100, 148))  # three blocks of 16


def hit(cache: PrefixCache, tokens: Any, ctx: CacheContext, segments: list[Segment] | None = None) -> int:
    with cache.match(tokens, ctx, segments) as m:
        return m.cached_tokens


def keys_of(cache: PrefixCache, tokens: Any, ctx: CacheContext = CTX) -> tuple[bytes, ...]:
    with cache.match(tokens, ctx) as m:
        return m.block_keys


# ============================================================================ encode


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("org_1", "2345"), ("org_12345", "")),
        (("org_1", "2345"), ("org_", "12345")),
        (("a", "bc"), ("ab", "c")),
        ((b"org_1", b"2345"), (b"org_12345", b"")),
        ((12, 345), (1, 2345)),
        ((None,), ("",)),
        ((), ("",)),
        ((), (None,)),
        ((), ((),)),
        (1, "1"),
        (1, True),
        ("1", True),
        (0, False),
        (0, None),
        (False, None),
        (b"x", "x"),
        (b"", ""),
        (((1, 2),), (1, 2)),
        (((1,), 2), (1, (2,))),
        (1, 1.0),
        (0.0, -0.0),
        (-1, 1),
        ("", None),
    ],
)
def test_encode_separates_values_a_concatenation_would_alias(a: Any, b: Any) -> None:
    assert encode(a) != encode(b)
    assert encode(a) == encode(a)  # and it is a function


def test_encode_known_vectors() -> None:
    """The byte layout is a wire format (keys are shared through Redis): pin it."""
    assert encode(None) == b"N"
    assert encode(True) == b"?\x01"
    assert encode(False) == b"?\x00"
    assert encode(42) == b"I" + struct.pack("<Q", 2) + b"42"
    assert encode(-7) == b"I" + struct.pack("<Q", 2) + b"-7"
    assert encode("é") == b"S" + struct.pack("<Q", 2) + "é".encode()
    assert encode(b"\x00\x01") == b"B" + struct.pack("<Q", 2) + b"\x00\x01"
    assert encode(1.5) == b"F" + struct.pack("<d", 1.5)
    assert encode(("a", None)) == b"T" + struct.pack("<Q", 2) + encode("a") + encode(None)


@pytest.mark.parametrize("bad", [object(), {1: 2}, {1}, 1j, CTX])
def test_encode_rejects_unencodable_values(bad: Any) -> None:
    with pytest.raises(TypeError, match="cannot use"):
        encode(bad)
    with pytest.raises(TypeError):
        encode(("ok", (bad,)))


_scalars = (
    st.none() | st.booleans() | st.integers() | st.text(max_size=6) | st.binary(max_size=6) | st.floats(allow_nan=False)
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=10)


def _typed(value: Any) -> Any:
    """Equality that tells True from 1, 1 from 1.0 and 0.0 from -0.0."""
    if isinstance(value, tuple):
        return ("tuple", tuple(_typed(v) for v in value))
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    return (type(value).__name__, value)


@settings(max_examples=300, deadline=None)
@given(st.lists(_values, max_size=12), st.data())
def test_encode_is_injective_on_nested_tuples(values: list[Any], data: st.DataObject) -> None:
    # Many values at once, so that every pair is compared; plus a near miss of one of them.
    if values:
        values.append(data.draw(st.sampled_from(values)))
    encodings = {encode(v) for v in values}
    assert len(encodings) == len({_typed(v) for v in values})
    for a in values:
        for b in values:
            assert (encode(a) == encode(b)) == (_typed(a) == _typed(b)), (a, b)


@settings(max_examples=200, deadline=None)
@given(_values, _values)
def test_encode_equal_iff_typed_equal(a: Any, b: Any) -> None:
    assert (encode(a) == encode(b)) == (_typed(a) == _typed(b))


# ============================================================================ context roots


def _root(
    seed: str = "s",
    model: str = "m",
    model_epoch: int = 0,
    adapter: str | None = None,
    adapter_epoch: int = 0,
    tokenizer: str = "",
    namespace: str = "",
    extra: tuple[Any, ...] = (),
    generation: int = 0,
) -> bytes:
    ctx = CacheContext(tenant="t", model=model, adapter=adapter, extra=extra, tokenizer=tokenizer)
    return root_encoding(seed, ctx, namespace, model_epoch, adapter_epoch, generation)


def _digest(enc: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(enc)
    return h.digest()


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # a boundary that moves between two adjacent fields
        ({"seed": "a", "model": "bc"}, {"seed": "ab", "model": "c"}),
        ({"tokenizer": "org_1", "namespace": "2345"}, {"tokenizer": "org_12345", "namespace": ""}),
        ({"namespace": "org_1", "extra": ("2345",)}, {"namespace": "org_12345", "extra": ()}),
        ({"namespace": "org_1", "extra": ("2345",)}, {"namespace": "org_12345", "extra": ("",)}),
        ({"model": "org_1", "model_epoch": 2345}, {"model": "org_12345", "model_epoch": 0}),
        ({"model_epoch": 1, "adapter_epoch": 0}, {"model_epoch": 0, "adapter_epoch": 1}),
        ({"model_epoch": 12, "adapter_epoch": 3}, {"model_epoch": 1, "adapter_epoch": 23}),
        # typed: absent is not empty, an int is not a str nor a bool
        ({"adapter": None}, {"adapter": ""}),
        ({"extra": ()}, {"extra": ("",)}),
        ({"extra": ()}, {"extra": (None,)}),
        ({"extra": (1,)}, {"extra": ("1",)}),
        ({"extra": (1,)}, {"extra": (True,)}),
        ({"extra": ("1",)}, {"extra": (True,)}),
        ({"extra": (1,)}, {"extra": (1.0,)}),
        ({"extra": (b"x",)}, {"extra": ("x",)}),
        ({"extra": ((1, 2),)}, {"extra": (1, 2)}),
        ({"extra": ("a", "b")}, {"extra": ("ab",)}),
        # a namespace's generation: a field of its own from 1 on, absent at 0
        ({"generation": 1}, {}),
        ({"generation": 1, "extra": ()}, {"extra": (1,)}),
        ({"generation": 1, "extra": ()}, {"extra": (1, ())}),
        ({"namespace": "org_1", "generation": 2345}, {"namespace": "org_12345"}),
        ({"namespace": "org_1", "generation": 2345}, {"namespace": "org_1", "extra": (2345,)}),
        ({"generation": 12, "extra": (3,)}, {"generation": 1, "extra": (23,)}),
        ({"generation": 1, "model_epoch": 0}, {"generation": 0, "model_epoch": 1}),
        ({"generation": 1, "adapter_epoch": 0}, {"generation": 0, "adapter_epoch": 1}),
    ],
)
def test_root_separates_contexts_a_concatenation_would_alias(a: dict[str, Any], b: dict[str, Any]) -> None:
    ra, rb = _root(**a), _root(**b)
    assert ra.startswith(ROOT_TAG) and rb.startswith(ROOT_TAG)
    assert ra != rb
    assert _digest(ra) != _digest(rb)


def test_root_encoding_layout() -> None:
    ctx = CacheContext(tenant="t", model="m", adapter="lora", extra=("x",), tokenizer="tok")
    got = root_encoding("seed", ctx, "ns", 3, 4)
    assert got == ROOT_TAG + encode(("seed", "m", 3, "lora", 4, "tok", "ns", ("x",)))
    assert root_encoding("seed", ctx, "ns", 3, 4, 0) == got  # generation 0: the keys stored before generations
    assert root_encoding("seed", ctx, "ns", 3, 4, 5) == ROOT_TAG + encode(
        ("seed", "m", 3, "lora", 4, "tok", "ns", 5, ("x",))
    )


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_a_generation_is_an_integer_from_zero(bad: Any) -> None:
    with pytest.raises(ValueError, match="generation"):
        root_encoding("s", CTX, "ns", 0, 0, bad)


_root_fields = st.fixed_dictionaries(
    {
        "seed": st.sampled_from(["s", "s1"]),
        "model": st.sampled_from(["m", "m1"]),
        "model_epoch": st.integers(0, 2),
        "adapter": st.sampled_from([None, "", "1"]),
        "adapter_epoch": st.integers(0, 2),
        "namespace": st.sampled_from(["", "1", "org_1", "org_12"]),
        "generation": st.integers(0, 12),
        "extra": st.lists(st.sampled_from([0, 1, 2, 12, "", "1", None, ()]), max_size=2).map(tuple),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_root_fields, min_size=2, max_size=12))
def test_root_encoding_is_injective_with_generations(roots: list[dict[str, Any]]) -> None:
    """Invariant 1 with a namespace's generation: two contexts share a root encoding only
    when every field, typed, is the same (so 0 and an absent generation are one)."""
    for a in roots:
        for b in roots:
            same = {k: _typed(v) for k, v in a.items()} == {k: _typed(v) for k, v in b.items()}
            assert (_root(**a) == _root(**b)) == same, (a, b)


def test_root_ignores_tenant_name_only_namespace_counts() -> None:
    """The tenant enters the key only as the namespace the cache derives from it."""
    a = root_encoding("s", CacheContext(tenant="a", model="m"), "", 0, 0)
    b = root_encoding("s", CacheContext(tenant="b", model="m"), "", 0, 0)
    assert a == b


_FIELD_CHANGES: dict[str, dict[str, Any]] = {
    "seed": {"seed": "other-seed"},
    "model": {"model": "m2"},
    "model_epoch": {"model_epoch": 1},
    "adapter": {"adapter": "lora"},
    "adapter_epoch": {"adapter_epoch": 1},
    "tokenizer": {"tokenizer": "tok-v2"},
    "namespace": {"namespace": "acme"},
    "extra": {"extra": ("salt",)},
    "generation": {"generation": 1},
}


def test_every_context_field_changes_the_root() -> None:
    base = _root()
    roots = {"base": base} | {name: _root(**change) for name, change in _FIELD_CHANGES.items()}
    assert len(set(roots.values())) == len(roots), roots
    assert len({_digest(r) for r in roots.values()}) == len(roots)


@pytest.mark.parametrize(
    "other",
    [
        replace(CTX, model="m2"),
        replace(CTX, adapter="lora"),
        replace(CTX, adapter=""),
        replace(CTX, tokenizer="tok-v2"),
        replace(CTX, tenant="globex"),
        replace(CTX, extra=("salt",)),
        replace(CTX, extra=("",)),
    ],
    ids=["model", "adapter", "adapter-empty", "tokenizer", "namespace", "extra", "extra-empty-str"],
)
def test_every_context_field_separates_cached_blocks(other: CacheContext) -> None:
    cache = PrefixCache(CacheConfig(isolation="namespace"))
    cache.insert(PROMPT, CTX)
    assert hit(cache, PROMPT, CTX) == 48
    assert hit(cache, PROMPT, other) == 0
    assert set(keys_of(cache, PROMPT)).isdisjoint(_keys_after_insert(cache, other))


def _keys_after_insert(cache: PrefixCache, ctx: CacheContext) -> tuple[bytes, ...]:
    cache.insert(PROMPT, ctx)
    return keys_of(cache, PROMPT, ctx)


def test_epochs_and_seed_separate_cached_blocks() -> None:
    cache = PrefixCache(CacheConfig())
    lora = replace(CTX, adapter="lora")
    cache.insert(PROMPT, CTX)
    cache.insert(PROMPT, lora)
    before, before_lora = keys_of(cache, PROMPT), keys_of(cache, PROMPT, lora)

    cache.bump_epoch("m", "lora")  # adapter epoch: only the adapter's blocks go
    assert hit(cache, PROMPT, lora) == 0
    assert hit(cache, PROMPT, CTX) == 48
    cache.insert(PROMPT, lora)
    assert set(keys_of(cache, PROMPT, lora)).isdisjoint(before_lora)

    cache.bump_epoch("m")  # model epoch: everything of the model goes
    assert hit(cache, PROMPT, CTX) == 0
    assert hit(cache, PROMPT, lora) == 0
    cache.insert(PROMPT, CTX)
    assert set(keys_of(cache, PROMPT)).isdisjoint(before)

    a, b = PrefixCache(CacheConfig(seed="one")), PrefixCache(CacheConfig(seed="two"))
    a.insert(PROMPT, CTX)
    b.insert(PROMPT, CTX)
    assert set(keys_of(a, PROMPT)).isdisjoint(keys_of(b, PROMPT))


@pytest.mark.parametrize(
    ("extra_a", "extra_b"),
    [((1,), (True,)), ((0,), (False,)), ((1,), (1.0,)), (((1, True),), ((1, 1),))],
    ids=["1-vs-True", "0-vs-False", "1-vs-1.0", "nested"],
)
def test_contexts_with_distinct_encodings_never_share_blocks(
    extra_a: tuple[Any, ...], extra_b: tuple[Any, ...]
) -> None:
    """Invariant 1: the root encodes ``extra`` typed, so (1,) and (True,) are different
    contexts; the cache must not conflate them through Python's ``1 == True``."""
    assert _root(extra=extra_a) != _root(extra=extra_b)
    cache = PrefixCache(CacheConfig())
    cache.insert(PROMPT, replace(CTX, extra=extra_a))
    assert hit(cache, PROMPT, replace(CTX, extra=extra_a)) == 48
    assert hit(cache, PROMPT, replace(CTX, extra=extra_b)) == 0


def test_context_extra_accepted_at_construction_works_on_the_request_path() -> None:
    """CacheContext validates ``extra`` up front "not on the request path": whatever it
    accepts must then be usable by match and insert."""
    try:
        ctx = CacheContext(tenant="acme", model="m", extra=([1, 2],))
    except (TypeError, ValueError):
        return  # rejected at construction: the promise holds
    cache = PrefixCache(CacheConfig())
    cache.insert(PROMPT, ctx)
    assert hit(cache, PROMPT, ctx) == 48


# ============================================================================ context validation


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"tenant": ""}, ValueError),
        ({"tenant": 7}, ValueError),
        ({"tenant": None}, ValueError),
        ({"tenant": "t", "model": ""}, ValueError),
        ({"tenant": "t", "model": 3}, ValueError),
        ({"tenant": "t", "adapter": 1}, ValueError),
        # like model and adapter: a non-str tokenizer (1 vs True) would alias in the cache's roots
        ({"tenant": "t", "tokenizer": 1}, ValueError),
        ({"tenant": "t", "tokenizer": None}, ValueError),
        ({"tenant": "t", "extra": ["x"]}, ValueError),
        ({"tenant": "t", "extra": "x"}, ValueError),
        ({"tenant": "t", "extra": (object(),)}, TypeError),
        ({"tenant": "t", "extra": ("ok", ({1: 2},))}, TypeError),
    ],
)
def test_cache_context_validation(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        CacheContext(**kwargs)


def test_match_needs_a_cache_context() -> None:
    cache = PrefixCache(CacheConfig())
    with pytest.raises(TypeError, match="CacheContext"):
        cache.match(PROMPT, ("acme", "m"))  # type: ignore[arg-type]


# ============================================================================ hash registry


@pytest.mark.parametrize("name", ["xxh3_128", "sha256", "blake3"])
def test_every_registered_hash_gives_a_working_cache(name: str) -> None:
    factory = get_hash(name)
    h = factory()
    h.update(b"abc")
    c = h.copy()
    c.update(b"d")
    assert h.digest() != c.digest()
    assert len(h.digest()) >= 16

    cache = PrefixCache(CacheConfig(hash=name, block_size=16))
    assert cache.insert(PROMPT, CTX) == 48
    assert hit(cache, PROMPT, CTX) == 48
    assert hit(cache, PROMPT[:40], CTX) == 32
    assert hit(cache, [*PROMPT[:20], 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], CTX) == 16
    assert cache.stats().collisions == 0


def test_registered_hashes_give_different_keys() -> None:
    keys = []
    for name in sorted(HASHES):
        cache = PrefixCache(CacheConfig(hash=name))
        cache.insert(PROMPT, CTX)
        keys.append(keys_of(cache, PROMPT))
    assert len({k for ks in keys for k in ks}) == 3 * len(HASHES)


def test_unknown_hash_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="md5") as err:
        get_hash("md5")
    for name in ("xxh3_128", "sha256", "blake3"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="xxh3_128"):
        CacheConfig(hash="md5")


# ============================================================================ keys: layout and determinism


def _manual_key(root_enc: bytes, tokens: list[int], end: int, seg_enc: bytes = b"") -> bytes:
    """key(T) exactly as the hashing module's docstring lays it out."""
    h = xxhash.xxh3_128()
    h.update(root_enc)
    h.update(struct.pack(f"<{end}I", *tokens[:end]))
    h.update(seg_enc + struct.pack("<QQ", len(seg_enc), end))
    return h.digest()


def test_block_keys_follow_the_documented_layout() -> None:
    config = CacheConfig(seed="deploy-1", block_size=16, isolation="namespace")
    cache = PrefixCache(config)
    cache.insert(PROMPT, CTX)
    root = root_encoding("deploy-1", CTX, "acme", 0, 0)
    assert keys_of(cache, PROMPT) == tuple(_manual_key(root, PROMPT, end) for end in (16, 32, 48))

    # and with a segment: blocks that end after its start carry it
    seg = Segment(20, 30, b"img")
    cache.insert(PROMPT, CTX, [seg])
    with cache.match(PROMPT, CTX, [seg]) as m:
        got = m.block_keys
    enc = encode((20, 30, b"img"))
    assert got == (
        _manual_key(root, PROMPT, 16),
        _manual_key(root, PROMPT, 32, enc),
        _manual_key(root, PROMPT, 48, enc),
    )


_KEYS_SCRIPT = """
from prefixcache import CacheConfig, CacheContext, PrefixCache, Segment
out = []
for hash_name in ("xxh3_128", "sha256", "blake3"):
    cache = PrefixCache(CacheConfig(hash=hash_name, seed="deploy-1", block_size=8))
    ctx = CacheContext(tenant="acme", model="m", adapter="lora", extra=("x", 1, None), tokenizer="tok")
    tokens = list(range(1000, 1040))
    segs = [Segment(10, 20, b"img")]
    cache.insert(tokens, ctx, segs)
    with cache.match(tokens, ctx, segs) as m:
        out.append(",".join(k.hex() for k in m.block_keys))
RESULT = ";".join(out)
"""


def test_keys_are_deterministic_across_processes() -> None:
    namespace: dict[str, Any] = {}
    exec(_KEYS_SCRIPT, namespace)
    local = namespace["RESULT"]
    assert local.count(";") == 2 and all(part.count(",") == 4 for part in local.split(";"))
    for hash_seed in ("0", "1", "987654", "random"):
        proc = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT + "print(RESULT, end='')"],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == local, hash_seed


# ============================================================================ KeyChain


def _chain(tokens: list[int], segments: list[Segment] | None = None, namespace: str = "") -> KeyChain:
    data = token_bytes(tokens)
    enc = root_encoding("s", CTX, namespace, 0, 0)
    return KeyChain(root_hasher(get_hash("xxh3_128"), enc), data, Segments.of(segments, len(tokens)))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=60),
    st.data(),
)
def test_keychain_at_equals_many(tokens: list[int], data: st.DataObject) -> None:
    ends = sorted(set(data.draw(st.lists(st.integers(0, len(tokens)), min_size=1, max_size=8))))
    chain = _chain(tokens)
    many = chain.many(ends)
    assert many == [chain.at(e) for e in ends]
    assert chain.many(ends)[-1] == chain.at(ends[-1])  # many does not disturb the root
    assert len(set(many)) == len(many)  # different prefixes, different keys


def test_keychain_keys_of_all_prefixes_differ_and_depend_only_on_the_prefix() -> None:
    tokens = list(range(48))
    chain = _chain(tokens)
    keys = [chain.at(t) for t in range(len(tokens) + 1)]
    assert len(set(keys)) == len(keys)
    # the tail key of 20 tokens is neither the block key at 16 nor the one at 32
    assert chain.at(20) not in (chain.at(16), chain.at(32))
    # a key does not look past its end
    other = _chain([*tokens[:20], 999, 998, 997])
    assert other.at(20) == chain.at(20)
    assert other.at(21) != chain.at(21)
    # the same tokens in another namespace never share a key
    assert _chain(tokens, namespace="acme").at(16) != chain.at(16)
    # a zero token is data, not padding: [0] differs from []
    assert _chain([0]).at(1) != _chain([]).at(0)


def test_keychain_segments_enter_keys_from_their_start_on() -> None:
    tokens = list(range(96))
    plain = _chain(tokens)
    a = _chain(tokens, [Segment(40, 80, "img-a")])
    b = _chain(tokens, [Segment(40, 80, "img-b")])
    for end in (16, 32, 40):
        assert plain.at(end) == a.at(end) == b.at(end)
    for end in (41, 48, 80, 96):
        assert len({plain.at(end), a.at(end), b.at(end)}) == 3
    assert _chain(tokens, [Segment(40, 80, "k")]).at(48) != _chain(tokens, [Segment(40, 81, "k")]).at(48)
    assert _chain(tokens, [Segment(40, 80, "k")]).at(48) != _chain(tokens, [Segment(40, 80, b"k")]).at(48)


# ============================================================================ segments through the cache


SEG_PROMPT = [*range(1, 41), *([7] * 40), *range(500, 516)]  # 96 tokens, placeholders at [40, 80)


def test_segments_share_kv_only_before_the_segment() -> None:
    cache = PrefixCache(CacheConfig(block_size=16))
    img_a, img_b = [Segment(40, 80, b"hash-a")], [Segment(40, 80, b"hash-b")]
    assert cache.insert(SEG_PROMPT, CTX, img_a) == 96
    assert hit(cache, SEG_PROMPT, CTX, img_a) == 96
    assert hit(cache, SEG_PROMPT, CTX, img_b) == 32  # blocks 0 and 1 end before 40
    assert hit(cache, SEG_PROMPT, CTX) == 32  # no image at all is not image a either
    assert hit(cache, SEG_PROMPT, CTX, [Segment(40, 79, b"hash-a")]) == 32
    assert hit(cache, SEG_PROMPT, CTX, [Segment(40, 80, "hash-a")]) == 32  # str is not bytes
    assert hit(cache, SEG_PROMPT[:50], CTX, [Segment(40, 50, b"hash-a")]) == 32
    # order of the segment list does not matter
    two = [Segment(60, 70, b"y"), Segment(40, 50, b"x")]
    cache.insert(SEG_PROMPT, CTX, two)
    assert hit(cache, SEG_PROMPT, CTX, list(reversed(two))) == 96
    assert cache.stats().collisions == 0


def test_segment_without_segments_then_with() -> None:
    cache = PrefixCache(CacheConfig(block_size=16))
    cache.insert(SEG_PROMPT, CTX)
    assert hit(cache, SEG_PROMPT, CTX, [Segment(40, 80, b"a")]) == 32


@pytest.mark.parametrize(
    ("start", "end", "key"),
    [(5, 5, "k"), (6, 5, "k"), (-1, 3, "k"), (0, 3, ""), (0, 3, b""), (0, 3, None), (0, 3, 7), (0.0, 3, "k")],
)
def test_segment_validation(start: Any, end: Any, key: Any) -> None:
    with pytest.raises(ValueError):
        Segment(start, end, key)


def test_segment_past_the_prompt_is_rejected() -> None:
    cache = PrefixCache(CacheConfig(block_size=16))
    with pytest.raises(ValueError, match="past the prompt"):
        cache.match(SEG_PROMPT[:50], CTX, [Segment(40, 80, b"a")])
    with pytest.raises(ValueError, match="past the prompt"):
        cache.insert(SEG_PROMPT[:50], CTX, [Segment(40, 51, b"a")])
    assert len(cache) == 0
    assert hit(cache, SEG_PROMPT[:50], CTX, [Segment(40, 50, b"a")]) == 0  # ending at the end is fine


# ============================================================================ token validation


@pytest.fixture
def cache() -> PrefixCache:
    return PrefixCache(CacheConfig(block_size=4))


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, -1, 3], r"position 2 is out of range \[0, 2\*\*32\): -1"),
        ([1, 2**32], r"position 1 is out of range \[0, 2\*\*32\): 4294967296"),
        ([1, 2, 3, 2.0], "position 3 is not an integer: 2.0"),
        ([None, 1], "position 0 is not an integer: None"),
        ([1, "2"], "position 1 is not an integer"),
        ([1, 2, 3, 4, 5, 1.5], "position 5 is not an integer"),
        (np.array([1, -2, 3]), r"position 1 is out of range"),
        (np.array([1, 2**32], dtype=np.uint64), r"position 1 is out of range"),
        (np.array([1.0, 2.0]), "dtype float64"),
        (np.array([True, False]), "dtype bool"),
        (np.array([[1, 2], [3, 4]]), r"1-D.*shape \(2, 2\)"),
        (np.array(5), r"1-D"),
    ],
)
def test_bad_tokens_are_rejected_with_their_position(cache: PrefixCache, tokens: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cache.match(tokens, CTX)
    with pytest.raises(ValueError, match=message):
        cache.insert(tokens, CTX)
    assert len(cache) == 0


def test_bool_token_ids_pass_as_ints_in_a_list_but_not_as_a_bool_array(cache: PrefixCache) -> None:
    """Documented in ``token_bytes``: a Python bool is an int (0 or 1); a numpy array
    must have an integer dtype, so a bool array is rejected (see the table above)."""
    assert token_bytes([True, False, 7]) == token_bytes([1, 0, 7])
    assert cache.insert([True, False, 2, 3], CTX) == 4
    assert hit(cache, [1, 0, 2, 3], CTX) == 4
    # next to a bad id, the bad id is the one named
    with pytest.raises(ValueError, match=r"position 1 is out of range \[0, 2\*\*32\): -1"):
        cache.match([True, -1], CTX)


def test_vocab_size_bounds_token_ids() -> None:
    cache = PrefixCache(CacheConfig(block_size=4, vocab_size=100))
    for tokens in ([1, 2, 100], np.array([1, 2, 100]), [1, 2, 1000, 3]):
        with pytest.raises(ValueError, match=r"position 2 is out of range \[0, vocabulary size 100\)"):
            cache.match(tokens, CTX)
    assert cache.insert([99, 0, 1, 2], CTX) == 4
    assert hit(cache, np.array([99, 0, 1, 2]), CTX) == 4
    with pytest.raises(ValueError, match="vocab_size"):
        CacheConfig(vocab_size=0)
    with pytest.raises(ValueError):
        CacheConfig(vocab_size=True)


@pytest.mark.parametrize(
    "as_array",
    [
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.uint64),
        lambda t: np.array(t, dtype=">i8"),
        lambda t: np.array([0, *t], dtype=np.int64)[1:],
        lambda t: np.array(t + t, dtype=np.int64)[: len(t)],
        lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],
        tuple,
        lambda t: [np.int64(x) for x in t],
    ],
    ids=[
        "int64",
        "int32",
        "uint32",
        "uint64",
        "big-endian",
        "offset",
        "slice",
        "strided",
        "tuple",
        "np-scalars",
    ],
)
def test_arrays_and_lists_give_identical_keys(as_array: Any) -> None:
    tokens = [0, 1, 2**31 - 1, 65_536, *range(1000, 1028)]  # 32 tokens, 8 blocks of 4
    a, b = PrefixCache(CacheConfig(block_size=4)), PrefixCache(CacheConfig(block_size=4))
    assert a.insert(tokens, CTX) == 32
    assert b.insert(as_array(tokens), CTX) == 32
    assert keys_of(a, tokens) == keys_of(b, tokens) == keys_of(a, as_array(tokens))
    assert token_bytes(as_array(tokens)) == token_bytes(tokens) == struct.pack("<32I", *tokens)


def test_uint32_max_is_a_valid_id(cache: PrefixCache) -> None:
    top = 2**32 - 1
    assert cache.insert([top, top, 0, top], CTX) == 4
    assert hit(cache, np.array([top, top, 0, top], dtype=np.uint32), CTX) == 4


@pytest.mark.parametrize("empty", [[], (), np.array([], dtype=np.int64), np.array([], dtype=np.uint32)])
def test_empty_prompt(cache: PrefixCache, empty: Any) -> None:
    assert cache.insert(empty, CTX) == 0
    assert len(cache) == 0
    m = cache.match(empty, CTX)
    assert (m.cached_tokens, m.num_blocks, m.partial_tokens, m.block_keys) == (0, 0, 0, ())
    m.release()
    assert cache.stats().lookups == 1


@pytest.mark.parametrize("raw", [b"abcd", bytearray(b"abcd"), "abcd", memoryview(b"abcd")])
def test_raw_bytes_or_text_are_not_token_ids(raw: object) -> None:
    """``array("I", b"abcd")`` would read the bytes as one machine word: refuse it."""
    cache = PrefixCache(CacheConfig(block_size=4))
    with pytest.raises(ValueError, match="sequence of integers"):
        cache.insert(raw, CacheContext(tenant="t"))  # type: ignore[arg-type]
    assert cache.insert(list(b"abcd"), CacheContext(tenant="t")) == 4
