"""AdamW with bf16 moments (train.optimizer_state_dtype = "bfloat16"): unbiased rounding, AdamW's steps, half the
state, and a resume that continues exactly."""

from __future__ import annotations

import copy

import torch

from intellect_node.policy.optim import AdamWBf16State, round_stochastic


def test_stochastic_rounding_lands_on_the_two_neighbours_and_keeps_the_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    for value in (1.0 + 2**-10, -3.0 - 2**-9, 0.001234):
        x = torch.full((200_000,), value)
        r = round_stochastic(x, gen)
        assert r.dtype == torch.bfloat16
        assert len(torch.unique(r)) == 2  # the bf16 values either side
        assert abs(r.float().mean().item() - value) < abs(value) * 2e-4  # nearest rounding is off by up to 2e-3
    exact = torch.tensor([1.0, -2.5, 0.0])
    assert torch.equal(round_stochastic(exact, gen).float(), exact)


def _problem(seed: int, steps: int = 300) -> tuple[torch.nn.Parameter, list[torch.Tensor]]:
    """A weight and its gradients: large for half the steps, then ten times smaller (the moments must decay)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(64, 48, generator=gen))
    grads = [torch.randn(64, 48, generator=gen) * (0.1 if i < steps // 2 else 0.01) for i in range(steps)]
    return weight, grads


def test_the_steps_follow_torch_adamw_where_nearest_rounding_stalls() -> None:
    ours, grads = _problem(0)
    theirs = torch.nn.Parameter(ours.detach().clone())
    a = AdamWBf16State([ours], lr=1e-2, weight_decay=0.01, seed=3)
    b = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.01)
    nearest = torch.zeros(64, 48, dtype=torch.bfloat16)  # the second moment kept in bf16 by plain rounding
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        a.step()
        b.step()
        nearest = (nearest.float() * 0.999 + 0.001 * g * g).to(torch.bfloat16)
    moved = (theirs - _problem(0)[0]).abs().mean()
    assert (ours - theirs).abs().mean() < 0.05 * moved
    state = a.state[ours]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    second = b.state[theirs]["exp_avg_sq"]
    assert ((state["exp_avg_sq"].float() - second).abs() / second).mean() < 0.05  # it decayed as AdamW's did
    assert ((nearest.float() - second).abs() / second).mean() > 0.1  # plain rounding stalls: it did not


def test_a_resumed_optimizer_continues_exactly() -> None:
    weight, grads = _problem(1)
    opt = AdamWBf16State([weight], lr=1e-3, seed=5)
    for g in grads[:10]:
        weight.grad = g.clone()
        opt.step()
    saved_weight, saved = weight.detach().clone(), copy.deepcopy(opt.state_dict())  # as a checkpoint holds it
    again = torch.nn.Parameter(saved_weight.clone())
    resumed = AdamWBf16State([again], lr=1e-3, seed=5)
    resumed.load_state_dict(saved)
    assert resumed.state[again]["exp_avg"].dtype == torch.bfloat16
    for g in grads[10:20]:
        weight.grad, again.grad = g.clone(), g.clone()
        opt.step()
        resumed.step()
    assert torch.equal(weight, again)
