"""Seeded Gumbel-max sampling: the pruned argmax equals the definition, the noise is exact integer arithmetic,
tokens follow softmax(logits / T), and a validator re-derives them from the seed."""

from __future__ import annotations

import math

import pytest
import torch

from intellect_kernels.sampling import (
    G_MAX,
    gumbel,
    position_keys,
    sampling_gaps,
    seeded_sample,
    seeded_sample_full,
)


@pytest.mark.parametrize("scale", [0.0, 0.5, 3.0, 30.0])  # flat (every token a candidate) to very peaked
def test_pruned_argmax_is_the_full_argmax(scale: float) -> None:
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(64, 5000, generator=g) * scale
    keys = position_keys(list(range(64)), [3] * 64)
    for temperature in (1.0, 0.6):
        assert torch.equal(seeded_sample(logits, temperature, keys), seeded_sample_full(logits, temperature, keys))


def test_ties_go_to_the_lowest_index_as_argmax_does() -> None:
    logits = torch.zeros(4, 10)
    keys = torch.zeros(4, dtype=torch.int64)  # same key: the same noise in every row
    assert torch.equal(seeded_sample(logits, 1.0, keys), seeded_sample_full(logits, 1.0, keys))


def test_noise_is_bounded_and_does_not_overflow() -> None:
    keys = torch.tensor([0, 1, 2**32 - 1, 0xDEADBEEF], dtype=torch.int64).unsqueeze(1)
    tokens = torch.arange(0, 300_000, 7, dtype=torch.int64).unsqueeze(0)
    noise = gumbel(keys, tokens)
    assert bool(torch.isfinite(noise).all()) and float(noise.max()) < G_MAX
    # the same (key, token) gives the same value whatever else is in the tensor
    assert torch.equal(gumbel(keys[2:3], tokens[:, 5:6]), noise[2:3, 5:6])


def test_tokens_follow_the_tempered_softmax() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 20_000
    keys = position_keys(list(range(n)), [0] * n)
    for temperature in (1.0, 0.5):
        drawn = seeded_sample(logits.expand(n, 4), temperature, keys)
        freq = torch.bincount(drawn, minlength=4).double() / n
        expected = torch.softmax(logits.double() / temperature, dim=0)
        assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_gaps_are_zero_for_the_drawn_tokens_and_positive_otherwise() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(200, 1000, generator=g) * 2
    keys = position_keys([9] * 200, list(range(200)))
    drawn = seeded_sample(logits, 1.0, keys)
    assert float(sampling_gaps(logits, 1.0, keys, drawn).abs().max()) == 0.0
    greedy = logits.argmax(dim=-1)
    gaps = sampling_gaps(logits, 1.0, keys, greedy)
    differs = greedy != drawn
    assert bool(differs.any()) and bool((gaps[differs] > 0).all()) and bool((gaps[~differs] == 0).all())
    assert math.isfinite(float(gaps.max()))


@pytest.mark.integration
def test_the_compiled_pass_draws_what_the_definition_draws() -> None:
    """Large vocabularies take a compiled pass (kernels/sampling.py: COMPILE_MIN_VALUES): the same tokens and the
    same float64 scores as the eager definition, for any row count (one compilation, dynamic shapes)."""
    from intellect_kernels import sampling

    g = torch.Generator().manual_seed(11)
    for rows, temperature in ((64, 1.0), (23, 0.7)):
        logits = torch.randn(rows, 49_152, generator=g) * 4
        keys = position_keys(list(range(rows)), [rows] * rows)
        assert logits.numel() >= sampling.COMPILE_MIN_VALUES
        token, score = sampling.best_scores(logits, temperature, keys)
        assert torch.equal(token, seeded_sample_full(logits, temperature, keys))
        assert torch.equal(score, sampling.scores(logits, temperature, keys).max(dim=-1).values)
    assert not sampling._compile_failed, "the compiled pass fell back to eager here"


@pytest.mark.integration
def test_the_validators_own_draw_is_never_a_miss_on_a_large_vocabulary() -> None:
    """The compiled pass's best score and the eager score of the same token may differ in their last bit (a gap of
    3.6e-15 on a token the validator drew itself by a margin of 1.5 was counted as a miss: two such in a short
    completion rejected an honest rollout). Every drawn token has a gap of exactly 0, whatever the rounding."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(64, 49_152, generator=g) * 3
        keys = position_keys(list(range(trial * 64, trial * 64 + 64)), [0] * 64)
        drawn = seeded_sample(logits, 0.7, keys)
        assert torch.equal(sampling_gaps(logits, 0.7, keys, drawn), torch.zeros(64)), trial
        runner_up = scores_without(logits, 0.7, keys, drawn)
        assert bool((sampling_gaps(logits, 0.7, keys, runner_up) > 0).all())  # another token is still a miss


def scores_without(logits: torch.Tensor, temperature: float, keys: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """Each row's second-best token under the seeded scores."""
    from intellect_kernels.sampling import scores

    s = scores(logits, temperature, keys)
    s.scatter_(1, drawn.view(-1, 1), -math.inf)
    return s.argmax(dim=-1)
