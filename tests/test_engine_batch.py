"""Batched decoding: every row's logits are its sequence's alone, whatever joins, steps
and leaves around it, and a row that left keeps its KV readable until released; prompts'
chunks packed into the steps get the logits and KV of their forwards alone.

A hypothesis state machine drives ``Batch`` on a tiny random Llama (fast, no download)
against one ``Sequence`` per row stepped alone, with the layout constants made small so
that a few steps grow, shrink and relay the buffers out, and rows of a few tokens fall
on several shelves (length classes). A row's shelf never pays for a longer shelf's
columns, and an emptied shelf's memory goes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers import LlamaConfig, LlamaForCausalLM

from prefixcache.engine import batch as batch_module
from prefixcache.engine import shelf as shelf_module
from prefixcache.engine.batch import Batch, RowKV, shelf_class
from prefixcache.engine.kv import cut_cache
from prefixcache.engine.model import LoadedModel, kv_layout
from prefixcache.engine.runner import Chunk, Sequence

VOCAB = 96


def tiny_model() -> LoadedModel:
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config)
    model.train(False)
    return LoadedModel(model, None, kv_layout(config, "float32"), 512, torch.device("cpu"), "tiny", "tiny")  # type: ignore[arg-type]


TINY = tiny_model()


@dataclass
class Left:
    """A row that left: what its KV must read as until it is released."""

    row: int
    kv: RowKV
    expected: torch.Tensor  # [layers, 2, H, T, D], the sequence's KV computed alone


@dataclass
class Prompt:
    """A prompt being prefilled in chunks that ride the steps, and the same alone."""

    tokens: list[int]
    packed: Sequence
    alone: Sequence

    @property
    def left(self) -> int:
        return len(self.tokens) - self.packed.length


class BatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.batch = Batch(TINY)
        self.alone: dict[int, Sequence] = {}  # row -> its sequence, stepped alone
        self.left: list[Left] = []
        self.prompts: list[Prompt] = []
        self.joined: dict[int, int] = {}  # row -> its length when it joined

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), cached=st.integers(0, 30))
    def start(self, tokens: list[int], cached: int) -> None:
        """A prompt whose first ``cached`` tokens are already KV (a cache hit)."""
        cached = min(cached, len(tokens) - 1)
        packed, alone = Sequence(TINY), Sequence(TINY)
        if cached:
            packed.prefill(tokens[:cached])
            alone.prefill(tokens[:cached])
        self.prompts.append(Prompt(tokens, packed, alone))

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    def join(self, tokens: list[int]) -> None:
        seq = Sequence(TINY, chunk_tokens=16)
        seq.prefill(tokens)
        row = self.batch.join(seq.cache, len(tokens))
        assert row not in self.alone  # a row that left may be reused once laid out anew: its reads must hold
        self.alone[row] = seq
        self.joined[row] = len(tokens)

    @precondition(lambda self: self.alone or self.prompts)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        fed = {row: data.draw(st.integers(0, VOCAB - 1)) for row in self.alone}
        riding = [p for p in self.prompts if p.left and data.draw(st.booleans())]
        chunks = []
        for prompt in riding:
            size = data.draw(st.integers(1, prompt.left))
            tokens = prompt.tokens[prompt.packed.length :][:size]
            chunks.append(Chunk(prompt.packed, tokens, data.draw(st.integers(1, size))))
        logits, kept = self.batch.step(fed, chunks)
        assert set(logits) == set(self.alone)
        for row, seq in self.alone.items():
            expected = seq.step(fed[row])
            assert torch.isfinite(logits[row]).all()
            assert torch.allclose(logits[row], expected, atol=2e-5, rtol=1e-4), (
                row,
                (logits[row] - expected).abs().max(),
            )
        assert len(kept) == len(chunks)
        for prompt, chunk, out in zip(riding, chunks, kept, strict=True):
            expected = Chunk(prompt.alone, chunk.tokens, chunk.keep).run()
            assert out.shape == expected.shape == (chunk.keep, VOCAB)
            assert torch.allclose(out, expected, atol=2e-5, rtol=1e-4), (out - expected).abs().max()
            prompt.packed.length += len(chunk.tokens)
            prompt.alone.length += len(chunk.tokens)

    @precondition(lambda self: any(p.left == 0 for p in self.prompts))
    @rule()
    def prefilled(self) -> None:
        """A prompt whose last chunk ran joins: its KV is the one its chunks wrote."""
        prompt = next(p for p in self.prompts if p.left == 0)
        self.prompts.remove(prompt)
        assert torch.allclose(
            cut_cache(prompt.packed.cache, prompt.packed.length),
            cut_cache(prompt.alone.cache, prompt.alone.length),
            atol=1e-5,
        )
        row = self.batch.join(prompt.packed.cache, prompt.packed.length)
        assert row not in self.alone
        self.alone[row] = prompt.alone
        self.joined[row] = prompt.packed.length

    @precondition(lambda self: self.alone)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.alone)))
        seq = self.alone.pop(row)
        del self.joined[row]
        kv = self.batch.leave(row)
        assert kv.length == seq.length
        self.left.append(Left(row, kv, cut_cache(seq.cache, seq.length)))

    @precondition(lambda self: self.left)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        left = self.left.pop(data.draw(st.integers(0, len(self.left) - 1)))
        self._check(left, data.draw(st.integers(0, left.kv.length)))
        self.batch.release(left.kv)

    @invariant()
    def rows_left_read_what_they_held(self) -> None:
        for left in self.left:
            self._check(left, 0)

    @invariant()
    def counts(self) -> None:
        assert self.batch.rows == len(self.alone)
        for row, seq in self.alone.items():
            assert self.batch.length(row) == seq.length

    @invariant()
    def shelves_hold_their_own_rows_only(self) -> None:
        """Each row on the shelf of its length at join; no shelf without a row in use; a
        shelf's columns within twice its longest row's (and the room to decode in)."""
        shelves = self.batch._shelves
        for row, length in self.joined.items():
            kind, _ = self.batch._rows[row]
            assert kind == shelf_class(length)
        for shelf in shelves.values():
            assert shelf.live
            longest = max(n for n in shelf.lengths if n is not None)
            assert shelf.end - shelf.start <= 2 * longest + shelf_module._HEADROOM
        assert self.batch.nbytes == sum(s.nbytes for s in shelves.values())

    def _check(self, left: Left, begin: int) -> None:
        read = torch.from_numpy(left.kv.read(begin, left.kv.length))
        assert torch.allclose(read, left.expected[:, :, :, begin:], atol=1e-6)


@pytest.fixture(autouse=True)
def small_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shelf_module, "_GRAIN", 8)
    monkeypatch.setattr(shelf_module, "_HEADROOM", 4)
    monkeypatch.setattr(batch_module, "_SHELF_BASE", 8)


BatchMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBatch = BatchMachine.TestCase


def test_a_step_needs_a_token_for_each_row_in_use() -> None:
    batch = Batch(TINY)
    seq = Sequence(TINY)
    seq.prefill([1, 2, 3])
    row = batch.join(seq.cache, 3)
    with pytest.raises(ValueError, match="one token for each row"):
        batch.step({})
    with pytest.raises(ValueError, match="one token for each row"):
        batch.step({row: 1, row + 1: 2})
    with pytest.raises(ValueError, match="is free"):
        batch.length(row + 1)
    kv = batch.leave(row)
    with pytest.raises(ValueError, match="outside"):
        kv.read(0, 4)
    assert batch.step({}) == ({}, [])
    assert np.asarray(kv.read(1, 3)).shape[3] == 2


@pytest.mark.parametrize("cached", [0, 5])
def test_a_chunk_packed_alone_is_its_forward_alone_bit_for_bit(cached: int) -> None:
    """Packed with no rows and no other chunk, a chunk runs the same products with the
    same masks as alone: logits and KV equal to the last bit, with or without a prefix."""
    tokens = list(range(3, 30))
    packed, alone = Sequence(TINY), Sequence(TINY)
    if cached:
        packed.prefill(tokens[:cached])
        alone.prefill(tokens[:cached])
    rows, kept = Batch(TINY).step({}, [Chunk(packed, tokens[cached:], 3)])
    assert rows == {}
    assert torch.equal(kept[0], Chunk(alone, tokens[cached:], 3).run())
    assert torch.equal(cut_cache(packed.cache, len(tokens)), cut_cache(alone.cache, len(tokens)))


@pytest.mark.parametrize("base", [8, 512])
def test_shelf_classes_double(base: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_module, "_SHELF_BASE", base)
    assert [shelf_class(n) for n in (1, base, base + 1, 2 * base, 2 * base + 1, 4 * base, 4 * base + 1)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
    ]


def _rows(batch: Batch, lengths: list[int]) -> list[int]:
    out = []
    for i, length in enumerate(lengths):
        seq = Sequence(TINY, chunk_tokens=64)
        seq.prefill([(i + j) % VOCAB for j in range(length)])
        out.append(batch.join(seq.cache, length))
    return out


def test_one_long_row_does_not_widen_the_short_rows() -> None:
    """Seven short rows beside one long one hold about the memory of the seven alone plus
    the long one alone, not eight long rows; when the long row leaves, its memory goes."""
    short, long = [40] * 7, [400]

    def nbytes(lengths: list[int]) -> int:
        batch = Batch(TINY)
        _rows(batch, lengths)
        return batch.nbytes

    alone, one_long, eight_long = nbytes(short), nbytes(long), nbytes(long * 8)
    mixed = Batch(TINY)
    rows = _rows(mixed, short + long)
    assert mixed.nbytes == alone + one_long
    assert mixed.nbytes * 3 < eight_long
    mixed.step({row: 1 for row in rows})
    mixed.release(mixed.leave(rows[-1]))
    assert mixed.nbytes == alone
