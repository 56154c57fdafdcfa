"""The sampler's penalties (engine/sampling.py), as OpenAI and vLLM define them, on crafted
logits where each one's effect is known exactly; their ranges; and, on the real model,
that a large frequency_penalty changes a greedy answer and makes repeats rarer."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import DynamicCache

from prefixcache.engine.sampling import SamplingParams, TokenCounts, penalize, sample

GREEDY = {"temperature": 0.0}
LOGITS = torch.tensor([5.0, 4.0, 3.0, -1.0, -2.0, 0.0])


def greedy(**penalties: float) -> SamplingParams:
    return SamplingParams(temperature=0.0, **penalties)


def history(prompt: list[int], generated: list[int]) -> TokenCounts:
    counts = TokenCounts(prompt)
    for token in generated:
        counts.add(token)
    return counts


def test_frequency_penalty_subtracts_per_occurrence_in_the_answer() -> None:
    seen = history([1, 2], [0, 0, 3])  # the prompt does not count
    got = penalize(LOGITS, greedy(frequency_penalty=0.6), seen)
    assert torch.allclose(got, torch.tensor([5.0 - 1.2, 4.0, 3.0, -1.0 - 0.6, -2.0, 0.0]))
    assert sample(LOGITS, greedy(frequency_penalty=0.6), torch.Generator(), history([], [0, 0])) == 1
    assert sample(LOGITS, greedy(frequency_penalty=0.4), torch.Generator(), history([], [0, 0])) == 0


def test_presence_penalty_subtracts_once_whatever_the_count() -> None:
    got = penalize(LOGITS, greedy(presence_penalty=1.5), history([2], [0, 0, 0, 4]))
    assert torch.allclose(got, torch.tensor([3.5, 4.0, 3.0, -1.0, -3.5, 0.0]))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_answer() -> None:
    seen = history([0, 3, 5], [1])
    got = penalize(LOGITS, greedy(repetition_penalty=1.25), seen)
    assert torch.allclose(got, torch.tensor([4.0, 3.2, 3.0, -1.25, -2.0, 0.0]))
    below_one = penalize(LOGITS, greedy(repetition_penalty=0.5), seen)  # < 1 favours repeats
    assert torch.allclose(below_one, torch.tensor([10.0, 8.0, 3.0, -0.5, -2.0, 0.0]))


def test_the_penalties_combine_in_vllms_order() -> None:
    """Repetition first (scaling), then frequency and presence (subtracting)."""
    got = penalize(
        LOGITS, greedy(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), history([], [0, 0])
    )
    assert got[0].item() == pytest.approx(5.0 / 2 - 2 * 0.5 - 0.25)
    assert torch.equal(got[1:], LOGITS[1:])


def test_negative_penalties_encourage_repeats() -> None:
    got = penalize(LOGITS, greedy(frequency_penalty=-2.0, presence_penalty=-2.0), history([], [2]))
    assert got[2].item() == pytest.approx(3.0 + 4.0)
    assert (
        sample(LOGITS, greedy(frequency_penalty=-2.0, presence_penalty=-2.0), torch.Generator(), history([], [2])) == 2
    )


def test_sample_adds_its_token_and_defaults_change_nothing() -> None:
    seen = history([0], [])
    picks = [sample(LOGITS, greedy(frequency_penalty=2.0), torch.Generator(), seen) for _ in range(3)]
    assert picks == [0, 1, 0] and dict(seen.generated) == {0: 2, 1: 1}  # 5 - 2 < 4; then 4 - 2 < 5 - 2
    rng = torch.Generator().manual_seed(3)
    plain = [sample(LOGITS, SamplingParams(seed=3), rng) for _ in range(20)]
    rng = torch.Generator().manual_seed(3)
    counted = TokenCounts([0, 1, 2])
    assert [sample(LOGITS, SamplingParams(seed=3), rng, counted) for _ in range(20)] == plain
    assert sum(counted.generated.values()) == 20


def test_a_penalty_lowers_the_sampled_frequency_of_a_token() -> None:
    params = SamplingParams(temperature=1.0, presence_penalty=2.0)
    rng = torch.Generator().manual_seed(0)
    flat = torch.zeros(4)
    picks = Counter(sample(flat, params, rng, history([], [0])) for _ in range(2000))
    # token 0 has e^-2 the weight of each other: about 4 % of the picks, against 25 % unpenalized
    assert picks[0] / 2000 == pytest.approx(math.exp(-2) / (math.exp(-2) + 3), abs=0.02)


def test_ids_outside_the_logits_and_half_precision() -> None:
    seen = history([-1, 0, 99], [0, 1000])
    got = penalize(LOGITS.half(), greedy(repetition_penalty=2.0, frequency_penalty=1.0), seen)
    assert got.dtype == torch.float16 and got[0].item() == pytest.approx(1.5)


def test_the_old_call_still_works() -> None:
    assert sample(LOGITS, greedy(), torch.Generator()) == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.01},
        {"presence_penalty": -2.5},
        {"frequency_penalty": 1e308},
        {"frequency_penalty": math.nan},
        {"presence_penalty": math.inf},
        {"frequency_penalty": -math.inf},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": math.inf},
        {"repetition_penalty": math.nan},
    ],
)
def test_penalties_out_of_range_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_penalties_at_their_bounds_are_taken() -> None:
    assert SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-6).penalized
    assert SamplingParams(repetition_penalty=100.0).penalized  # vLLM bounds it below only
    assert not SamplingParams().penalized


@pytest.mark.model
def test_a_large_frequency_penalty_changes_the_greedy_answer_and_repeats_less() -> None:
    from engine_support import model

    lm = model()
    prompt = list(lm.tokenizer.encode("apple, apple, apple, apple, apple,", add_special_tokens=False))

    def answer(penalty: float) -> list[int]:
        params = SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=penalty)
        seen, fed, out = TokenCounts(prompt), list(prompt), []
        cache = DynamicCache()  # each step feeds its one new token over the KV of those before
        with torch.no_grad():
            for _ in range(params.max_tokens):
                step = lm.model(torch.tensor([fed], device=lm.device), cache=cache, use_cache=True)
                token = sample(step.logits[0, -1].float(), params, torch.Generator(), seen)
                if token in lm.eos_ids:
                    break
                out.append(token)
                fed = [token]
        return out

    plain, penalized = answer(0.0), answer(2.0)
    assert plain != penalized

    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))  # tokens that were already in the answer

    top = Counter(plain).most_common(1)[0][1]
    assert top >= 10, lm.tokenizer.decode(plain)  # unpenalized, the model goes on repeating the prompt
    assert repeats(penalized) < repeats(plain) and Counter(penalized).most_common(1)[0][1] < top


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e308])
@pytest.mark.parametrize("temperature", [0.0, 1e-9, 1.0])
def test_an_extreme_repetition_penalty_still_samples_a_token(penalty: float, temperature: float) -> None:
    params = SamplingParams(max_tokens=1, temperature=temperature, repetition_penalty=penalty)
    logits = torch.tensor([3.0, -2.0, 1.0, 0.5, -7.0])
    got = penalize(logits, params, history([0, 1, 4], []))
    assert got.dtype == logits.dtype and bool(torch.isfinite(got).all())
    token = sample(logits, params, torch.Generator().manual_seed(0), history([0, 1, 4], []))
    assert 0 <= token < 5
    if penalty < 1 and temperature < 1:  # the prompt's positive logit, divided by almost 0, wins
        assert token == 0
