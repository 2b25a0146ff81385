"""AdamW with its two moments kept in bfloat16 (``train.optimizer_state_dtype = "bfloat16"``).

AdamW's moments are 8 of the ~16 bytes a trained parameter costs (weights 4, gradient 4); in bf16 they are 4:
~270 MB less for SmolLM2-135M. Plain rounding to bf16 would stall them: with ``beta2 = 0.999`` the second moment
moves by 0.1% a step, below bf16's half-ulp (0.2%), so it would never decay (nor grow by small gradients).
Each moment is therefore updated in fp32, a piece at a time, and stored with stochastic rounding (up with the
probability of the dropped fraction), which is unbiased: its expected value is the fp32 moment. The rounding
noise comes from a generator seeded by the optimizer's ``seed`` and the step, so a resumed run repeats it.
The weights stay fp32 and the update is AdamW's (decoupled weight decay, bias correction).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

CHUNK = 1 << 22
"""Elements updated at once: fp32 temporaries of a few 16 MB pieces, never a copy of the largest weight."""


def round_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) to bf16, rounded up or down at random with the probabilities that keep the mean: random low
    16 bits are added to the fp32 bit pattern (sign and magnitude, so negatives round symmetrically) and cut."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


class AdamWBf16State(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("AdamWBf16State takes no closure")
        generator: torch.Generator | None = None
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, dtype=torch.bfloat16, memory_format=torch.contiguous_format
                    )
                state["step"] += 1
                step = int(state["step"])
                if generator is None:
                    generator = torch.Generator(device=p.device).manual_seed(self.seed * 1_000_003 + step)
                if decay:
                    p.mul_(1.0 - lr * decay)
                correction2 = math.sqrt(1.0 - beta2**step)
                size = -lr / (1.0 - beta1**step)
                weight, grad = p.view(-1), p.grad.reshape(-1)
                m16, v16 = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                for start in range(0, weight.numel(), CHUNK):
                    part = slice(start, start + CHUNK)
                    g = grad[part].float()
                    m = m16[part].float().lerp_(g, 1.0 - beta1)
                    v = v16[part].float().mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                    weight[part].addcdiv_(m, v.sqrt().div_(correction2).add_(eps), value=size)
                    m16[part] = round_stochastic(m, generator)
                    v16[part] = round_stochastic(v, generator)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every floating state tensor to its parameter's dtype on load: the moments go back to bf16."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)
