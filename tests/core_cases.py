"""Hypothesis-drawn float64 inputs for the core-maths agreement tests (verl, TRL, OpenRLHF).

Shapes, masks, groups and rewards are drawn by hypothesis; the log-prob values come from a drawn
seed, spread so that ratios land on both sides of every clip range. Rewards sit on a grid of
quarters: a zero-variance group then has an exactly representable mean, so every framework gives
it exactly 0 (a non-dyadic reward would leave verl's ``(r - mean) / eps`` at 1e-11 instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

F64 = torch.float64
#: float64 agreement bound for every loss, gradient and advantage (absolute)
TOL = 1e-12


@dataclass(frozen=True)
class Case:
    logps: torch.Tensor  # [N, T] current policy
    old: torch.Tensor  # [N, T] trainer's old policy (ratios e^[-0.8, 0.8] against logps)
    ref: torch.Tensor  # [N, T] reference policy
    rollout: torch.Tensor  # [N, T] sampler's log-probs (mismatch e^[-0.6, 0.6] against old)
    entropy: torch.Tensor  # [N, T] positive
    mask: torch.Tensor  # [N, T] int64, right-padded, rows may be empty or of length 1
    adv: torch.Tensor  # [N] random advantages
    rewards: torch.Tensor  # [N] on a grid of quarters
    group: torch.Tensor  # [N] int64, groups contiguous, sizes as drawn

    @property
    def index(self) -> np.ndarray:
        return np.array(self.group.tolist())

    def adv_tokens(self) -> torch.Tensor:
        """``adv`` tiled over tokens and masked, as verl's advantage estimators return it."""
        return self.adv[:, None] * self.mask.to(F64)


@st.composite
def cases(
    draw: st.DrawFn,
    max_groups: int = 4,
    max_group_size: int = 4,
    min_group_size: int = 1,
    max_t: int = 6,
    empty_rows: bool = True,
    fixed_group_size: bool = False,
) -> Case:
    sizes = draw(st.lists(st.integers(min_group_size, max_group_size), min_size=1, max_size=max_groups))
    if fixed_group_size:
        sizes = [sizes[0]] * len(sizes)
    n = sum(sizes)
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0 if empty_rows else 1, t), min_size=n, max_size=n))
    if max(lengths) == 0:
        lengths[0] = 1  # every framework needs one token in the batch
    quarters = draw(st.lists(st.integers(-6, 6), min_size=n, max_size=n))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def u(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, t, generator=gen, dtype=F64)

    logps = u(-2.5, -0.05)
    old = logps + u(-0.8, 0.8)
    return Case(
        logps=logps,
        old=old,
        ref=logps + 0.6 * torch.randn(n, t, generator=gen, dtype=F64),
        rollout=old + u(-0.6, 0.6),
        entropy=u(0.1, 2.0),
        mask=(torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long(),
        adv=torch.randn(n, generator=gen, dtype=F64),
        rewards=torch.tensor(quarters, dtype=F64) / 4,
        group=torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)]),
    )


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL, what: str = "") -> None:
    """Max abs difference <= ``tol`` (NaN anywhere fails)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got - want).abs()
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite values"
    assert bool((diff <= tol).all()), f"{what}: max abs diff {float(diff.max()):.3g} > {tol:.0e}"


def loss_and_grads(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(*leaves)`` and its gradient w.r.t. each input (fresh leaves, float64)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    return (out.detach(), *[torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)])


def grpo_loss_and_grads(c: Case, cfg, with_ref: bool) -> tuple[torch.Tensor, ...]:
    """grpo_parts' loss on ``c`` (its reference log-probs only ``with_ref``, an entropy term if
    ``cfg`` has one) and its gradients w.r.t. the log-probs and the entropy."""
    from grpo_parts.core import grpo_loss

    return loss_and_grads(
        lambda x, h: grpo_loss(x, c.old, c.adv, c.mask, cfg, c.ref if with_ref else None, entropy=h).loss,
        c.logps,
        c.entropy,
    )
