"""GRPO advantages and the two-sided clipped loss against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from intellect_kernels.grpo import group_advantages, grpo_loss, lr_factor
from intellect_kernels.logprobs import token_entropy, token_logprobs


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2], [1.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards)
    # group 0: mean 0.5, population std 0.5 -> +-1 (up to the 1e-6 in the denominator)
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    # identical rewards carry no signal
    assert adv[1].tolist() == pytest.approx([0.0] * 4, abs=1e-6)
    # group 2: mean 0.25, std sqrt(0.1875)
    std = math.sqrt(0.1875)
    assert adv[2].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)


@pytest.mark.parametrize("value", [0.2, 0.1, 1.0 / 3.0, 0.7])
def test_identical_rewards_give_no_advantage_despite_rounding(value: float) -> None:
    # In float32 the mean of eight copies of 0.2 is off by ~1e-8, which ``/ (std + 1e-6)`` would turn into ~1%.
    adv = group_advantages(torch.full((3, 8), value, dtype=torch.float32))
    assert float(adv.abs().max()) < 1e-7


def test_group_advantages_needs_groups() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4))


def _loss(logp: list[float], logp_old: list[float], adv: float, mask: list[float] | None = None) -> float:
    lp = torch.tensor([logp])
    old = torch.tensor([logp_old])
    m = torch.tensor([mask if mask is not None else [1.0] * len(logp)])
    loss, _ = grpo_loss(lp, old, torch.tensor([adv]), m, delta=4.0, eps=0.2)
    return float(loss)


@pytest.mark.parametrize(
    "ratio, adv, expected",
    [
        (1.0, 1.0, -1.0),  # on-policy: -A
        (1.1, 1.0, -1.1),  # inside the clip range
        (1.5, 1.0, -1.2),  # A > 0: min(1.5, 1.2) * A
        (0.5, 1.0, -0.5),  # A > 0, ratio below 1 - eps: the unclipped term is smaller
        (0.5, -1.0, 0.8),  # A < 0: -min(-0.5, -0.8) = 0.8 (clipped to 1 - eps)
        (3.0, -1.0, 3.0),  # A < 0, large ratio: -min(-3.0, -1.2) = 3.0
        (10.0, -1.0, 4.0),  # A < 0, ratio beyond delta: capped at delta = 4
        (10.0, 1.0, -1.2),  # A > 0, ratio beyond delta: c1 = 4, c2 = 1.2
    ],
)
def test_loss_single_token_by_hand(ratio: float, adv: float, expected: float) -> None:
    assert _loss([math.log(ratio)], [0.0], adv) == pytest.approx(expected, rel=1e-5)


def test_loss_is_averaged_over_unmasked_tokens() -> None:
    # tokens with ratios 1.0 and 1.5 (A = 1) -> (-1.0 + -1.2) / 2; the masked third token must not count
    got = _loss([0.0, math.log(1.5), 5.0], [0.0, 0.0, 0.0], 1.0, mask=[1.0, 1.0, 0.0])
    assert got == pytest.approx(-1.1, rel=1e-5)


def test_loss_gradient_vanishes_when_clipped() -> None:
    logp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, stats = grpo_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert logp.grad is not None and float(logp.grad.abs().sum()) == 0.0
    assert stats.clipped_fraction == 1.0


def test_token_logprobs_match_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    for temp in (1.0, 0.7):
        ref = torch.log_softmax(logits / temp, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(token_logprobs(logits, targets, temp), ref, atol=1e-6)


def test_extreme_logprob_old_cannot_poison_the_gradient() -> None:
    """A peer may send logp_old = -100: exp(100) overflows float32, which must not turn gradients into NaN."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.5]])
    for adv in (1.0, -1.0):
        loss, _ = grpo_loss(logp, old, torch.tensor([adv]), torch.ones(1, 2))
        loss.backward()
        assert torch.isfinite(loss) and logp.grad is not None and torch.isfinite(logp.grad).all()
        logp.grad = None


def test_asymmetric_clip_entropy_bonus_and_k3_kl() -> None:
    lp, old, mask = torch.tensor([[math.log(1.5)]]), torch.zeros(1, 1), torch.ones(1, 1)
    # ratio 1.5, A = 1: clipped at 1 + eps_high
    loss, _ = grpo_loss(lp, old, torch.tensor([1.0]), mask, eps=0.2, eps_high=0.28)
    assert float(loss) == pytest.approx(-1.28, abs=1e-6)
    # ratio 0.5, A = -1: the lower clip (1 - eps) bounds it
    loss, _ = grpo_loss(torch.tensor([[math.log(0.5)]]), old, torch.tensor([-1.0]), mask, eps=0.2, eps_high=0.28)
    assert float(loss) == pytest.approx(0.8, abs=1e-6)
    # entropy bonus lowers the loss by coef * H; k3 at logp_ref = logp is 0 and positive elsewhere
    h = torch.tensor([[2.0]])
    base, _ = grpo_loss(old, old, torch.tensor([0.0]), mask)
    bonus, stats = grpo_loss(old, old, torch.tensor([0.0]), mask, entropy=h, entropy_coef=0.01)
    assert float(bonus) == pytest.approx(float(base) - 0.02) and stats.entropy == pytest.approx(2.0)
    _, same = grpo_loss(old, old, torch.tensor([0.0]), mask, logp_ref=old, kl_coef=0.1)
    assert same.kl == pytest.approx(0.0, abs=1e-7)
    ref = torch.tensor([[math.log(0.5)]])
    kl_loss, far = grpo_loss(old, old, torch.tensor([0.0]), mask, logp_ref=ref, kl_coef=0.1)
    assert far.kl == pytest.approx(0.5 - math.log(0.5) - 1.0, rel=1e-5) and far.kl > 0
    assert float(kl_loss) == pytest.approx(0.1 * far.kl, rel=1e-5)


def test_token_entropy_matches_the_definition() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, -10.0, -10.0, -10.0]])
    h = token_entropy(logits)
    assert float(h[0]) == pytest.approx(math.log(4), rel=1e-6) and float(h[1]) < 1e-6


def test_learning_rate_warms_up_then_decays_by_cosine() -> None:
    f = [lr_factor(s, warmup_steps=4, decay_steps=14, min_ratio=0.1) for s in range(20)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4] == pytest.approx(1.0) and f[9] == pytest.approx(0.55) and f[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False)) and f[19] == pytest.approx(0.1)
    assert lr_factor(100, 0, 0, 0.1) == 1.0
