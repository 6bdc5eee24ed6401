"""Proof by exhaustive enumeration: skipping prompts before rollout with the ``history`` skipper and
weighting the kept prompts' completions by ``1 / p`` leaves the expected loss and gradient equal to
the drawn batch's, for every allowed aggregation and every per-group advantage estimator in core.

For 2-4 drawn prompts (each with a zero-variance history drawn by hypothesis, fed to the skipper
through ``observe``), the skipper reports every prompt's inclusion probability (``decide``); every
outcome of its sampling design is listed with its exact probability (tests/skip_outcomes.py,
independent of the sampler); each outcome is trained the trainer's way -- the kept prompts' rollout
alone, its own advantages, rows weighted ``1 / p``, ``num_seqs`` = drawn prompts x G -- and
``sum_S P(S) * grad_S`` is compared with the drawn batch's gradient at 1e-10 (float64). GRESO-style
skipping (no weights) must fail the same check, and so must the estimators that whiten over the batch
(refused by ``prompt_skip_reasons``) and a draw that stops at the n-th kept prompt.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from skip_outcomes import marginals, systematic_outcomes

from grpo_parts.core import AdvantageConfig, CorrectionConfig, LossConfig, compute_advantages, grpo_loss
from grpo_parts.skip.history import HistorySkipper
from grpo_parts.skip.protocol import prompt_skip_reasons

ALLOWED = {
    "grpo": AdvantageConfig(),
    "dr_grpo": AdvantageConfig(norm="none"),
    "rloo": AdvantageConfig(estimator="rloo"),
    "grpo_kl_in_reward": AdvantageConfig(kl_coef=0.1),
    "rloo_kl_per_token": AdvantageConfig(estimator="rloo", kl_coef=0.1, kl_placement="token"),
}
REFUSED = {
    "grpo_batch_norm": AdvantageConfig(norm="batch"),
    "reinforce_pp_verl": AdvantageConfig(estimator="reinforce_plus_plus_baseline"),
    "reinforce_pp_openrlhf": AdvantageConfig(estimator="reinforce_plus_plus_baseline", whiten="openrlhf"),
}
AGGS = ["seq-mean-token-mean", "seq-mean-token-sum-norm"]
EXACT = 1e-10
SETTINGS = settings(max_examples=6, derandomize=True, deadline=None)


@dataclass(frozen=True)
class Case:
    """``n`` prompts x ``g`` completions, ``t`` tokens at most: row tensors ``[n * g, t]``."""

    g: int
    rewards: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    roll: torch.Tensor
    logps: torch.Tensor  # leaf
    ent: torch.Tensor  # leaf

    @property
    def n(self) -> int:
        return int(self.rewards.numel()) // self.g

    def group_index(self) -> torch.Tensor:
        return torch.arange(self.n).repeat_interleave(self.g)


def make_case(n: int, g: int, t: int, seed: int, zero: list[bool]) -> Case:
    """Rewards in {0, 0.5, 1}; the prompts flagged in ``zero`` get a zero-variance group."""
    gen = torch.Generator().manual_seed(seed)
    rows = n * g
    # length 0: a completion the loss masks out entirely (TRL's mask_truncated_completions)
    mask = (torch.arange(t) < torch.randint(0, t + 1, (rows,), generator=gen)[:, None]).long()
    rand = lambda: torch.rand(rows, t, generator=gen, dtype=torch.float64)  # noqa: E731
    rewards = torch.randint(0, 3, (rows,), generator=gen).double() / 2
    for i, z in enumerate(zero):
        if z:
            rewards[i * g : (i + 1) * g] = rewards[i * g]
    old, ref = -rand() * mask, -rand() * mask
    logps = (old + 0.4 * (rand() - 0.5)).requires_grad_(True)
    return Case(g, rewards, mask, old, ref, old + 0.1 * (rand() - 0.5), logps, rand().requires_grad_(True))


@st.composite
def cases(draw) -> Case:  # type: ignore[no-untyped-def]
    n = draw(st.integers(2, 4), "prompts")
    zero = draw(st.lists(st.booleans(), min_size=n, max_size=n), "zero-variance now")
    return make_case(n, draw(st.integers(2, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 2**16)), zero)


@st.composite
def loss_configs(draw, agg: str) -> LossConfig:  # type: ignore[no-untyped-def]
    """The losses prompt skipping allows where rows may be empty: no token-mean term, a fixed sum-norm
    constant, every row counted (``seq_count="all"``: the drawn prompts' rows)."""
    policy = draw(st.sampled_from(["clip", "gspo", "gspo_token", "cispo", "sapo"]))
    kw: dict = {"agg": agg, "policy": policy, "seq_count": "all"}
    if agg == "seq-mean-token-sum-norm":
        kw["norm_constant"] = draw(st.sampled_from([1.0, 3.0]))
    if agg == "seq-mean-token-mean" and draw(st.booleans()):
        kw["seq_len_eps"] = 1e-8
    if draw(st.booleans()):
        kw["kl_coef"] = 0.05
    if draw(st.booleans()):
        kw["entropy_coef"] = 0.01
    kw["correction"] = draw(
        st.sampled_from([CorrectionConfig(), CorrectionConfig(level="token", low=0.5, high=1.5)])
    )
    return LossConfig(**kw)


@st.composite
def primed_skippers(draw, n: int) -> tuple[HistorySkipper, list[int]]:  # type: ignore[no-untyped-def]
    """A skipper that has observed each of ``n`` prompts 0-4 times (zero-variance or not, drawn)."""
    skipper = HistorySkipper(
        min_keep_prob=draw(st.sampled_from([0.05, 0.2, 0.5])),
        keep_base=draw(st.sampled_from([0.3, 0.5, 0.9])),
        min_streak=draw(st.sampled_from([1, 2])),
    )
    ids = [1000 + i for i in range(n)]
    for i in ids:
        for zero in draw(st.lists(st.booleans(), max_size=4), f"history of {i}"):
            skipper.observe([i], torch.tensor([1.0, 1.0 if zero else 0.0]), torch.zeros(2, dtype=torch.long))
    return skipper, ids


def advantages(case: Case, kept: list[int], est: AdvantageConfig) -> torch.Tensor:
    """The advantages of the kept prompts' rows, computed on their rollout alone (as the trainer does)."""
    rows = rows_of(case, kept)
    gi = torch.arange(len(kept)).repeat_interleave(case.g)
    return compute_advantages(
        case.rewards[rows], gi, case.mask[rows], est, old_logps=case.old[rows], ref_logps=case.ref[rows]
    )


def rows_of(case: Case, kept: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(i * case.g, (i + 1) * case.g) for i in kept])


def loss_and_grads(
    case: Case,
    cfg: LossConfig,
    est: AdvantageConfig,
    kept: list[int],
    weights: torch.Tensor | None,
    num_seqs: float | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One outcome: the kept prompts' rows, ``weights`` per prompt (None: unweighted), ``num_seqs``."""
    zero = [torch.zeros_like(case.logps), torch.zeros_like(case.ent)]
    if not kept:
        return torch.zeros((), dtype=torch.float64), zero
    r = rows_of(case, kept)
    w = None if weights is None else weights.repeat_interleave(case.g)
    out = grpo_loss(
        case.logps[r], case.old[r], advantages(case, kept, est), case.mask[r], cfg, case.ref[r],
        entropy=case.ent[r], rollout_logps=case.roll[r], num_seqs=num_seqs, seq_weights=w,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss, [case.logps, case.ent], allow_unused=True)
    return out.loss.detach(), [z if x is None else x for z, x in zip(zero, grads)]


def deviation(
    case: Case, cfg: LossConfig, est: AdvantageConfig, p: torch.Tensor, mode: str = "weighted"
) -> float:
    """Largest ``|E[loss_S] - loss|``, ``|E[grad_S] - grad|`` over the skip outcomes of ``p``.
    ``mode``: ``weighted`` (1/p, drawn x G), ``greso`` (no weights, the kept rows' own count),
    ``greso_fixed`` (no weights, drawn x G)."""
    e_loss = torch.zeros((), dtype=torch.float64)
    e_grads = [torch.zeros_like(case.logps), torch.zeros_like(case.ent)]
    for s, prob in systematic_outcomes(p.tolist()).items():
        kept = sorted(s)
        w = 1.0 / p[kept] if mode == "weighted" else None
        loss, grads = loss_and_grads(
            case, cfg, est, kept, w, None if mode == "greso" else float(case.n * case.g)
        )
        e_loss = e_loss + prob * loss
        e_grads = [a + prob * b for a, b in zip(e_grads, grads)]
    f_loss, f_grads = loss_and_grads(case, cfg, est, list(range(case.n)), None, None)
    return max(
        [float((e_loss - f_loss).abs())] + [float((a - b).abs().max()) for a, b in zip(e_grads, f_grads)]
    )


def reported(skipper: HistorySkipper, ids: list[int], target: int | None) -> torch.Tensor:
    return skipper.decide(ids, target=target).probabilities


@pytest.mark.parametrize("estimator", sorted(ALLOWED))
@pytest.mark.parametrize("agg", AGGS)
@SETTINGS
@given(data=st.data())
def test_skipping_with_weights_keeps_the_expected_gradient(
    agg: str, estimator: str, data: st.DataObject
) -> None:
    case = data.draw(cases(), "case")
    cfg = data.draw(loss_configs(agg), "loss")
    assert prompt_skip_reasons(ALLOWED[estimator], cfg) == []
    skipper, ids = data.draw(primed_skippers(case.n), "skipper")
    target = data.draw(st.sampled_from([None, *range(1, case.n + 1)]), "target")
    p = reported(skipper, ids, target)
    floor = skipper.min_keep_prob if target is None else min(skipper.min_keep_prob, target / case.n)
    assert bool((p >= floor - 1e-12).all() & (p <= 1).all())  # (PromptDraw never asks below the floor)
    if target is not None:
        assert float(p.sum()) == pytest.approx(target, abs=1e-12)
    outcomes = systematic_outcomes(p.tolist())
    torch.testing.assert_close(
        torch.tensor(marginals(outcomes, case.n), dtype=torch.float64), p, rtol=0, atol=1e-12
    )
    assert deviation(case, cfg, ALLOWED[estimator], p) < EXACT


@pytest.mark.parametrize("agg", AGGS)
@SETTINGS
@given(data=st.data())
def test_greso_style_skipping_without_weights_fails_the_same_check(agg: str, data: st.DataObject) -> None:
    """The broken control: the same draws, no ``1 / p`` (the kept rows' own count, or drawn x G)."""
    case = data.draw(cases(), "case")
    cfg = data.draw(loss_configs(agg), "loss")
    est = ALLOWED[data.draw(st.sampled_from(sorted(ALLOWED)), "estimator")]
    skipper, ids = data.draw(primed_skippers(case.n), "skipper")
    p = reported(skipper, ids, None)
    _, grads = loss_and_grads(case, cfg, est, list(range(case.n)), None, None)
    # a prompt that may be skipped carries gradient: dropping it without correction shows. (With
    # equal probabilities and a fixed kept count, the kept rows' own mean is unbiased: simple random
    # sampling; GRESO's probabilities differ between prompts.)
    assume(float(p.max() - p.min()) > 0.05)
    assume(
        any(
            float(p[i]) < 0.99 and float(grads[0][rows_of(case, [i])].abs().max()) > 1e-3
            for i in range(case.n)
        )
    )
    assert deviation(case, cfg, est, p) < EXACT
    assert deviation(case, cfg, est, p, mode="greso") > 1e-6
    assert deviation(case, cfg, est, p, mode="greso_fixed") > 1e-6


def fixed_case() -> Case:
    case = make_case(3, 3, 3, seed=11, zero=[False, False, False])
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.5, 1.0, 1.0], dtype=torch.float64)
    return Case(case.g, rewards, case.mask, case.old, case.ref, case.roll, case.logps, case.ent)


@pytest.mark.parametrize("estimator", sorted(REFUSED))
def test_batch_whitened_estimators_are_biased_and_refused(estimator: str) -> None:
    """Their advantages depend on which other prompts were kept: no weights repair that."""
    cfg = LossConfig(agg="seq-mean-token-mean", seq_count="all")
    reasons = prompt_skip_reasons(REFUSED[estimator], cfg)
    assert len(reasons) == 1 and "statistics of the whole batch" in reasons[0]
    p = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    assert deviation(fixed_case(), cfg, REFUSED[estimator], p) > 1e-6
    assert deviation(fixed_case(), cfg, ALLOWED["grpo"], p) < EXACT


def test_token_mean_is_refused_and_would_be_biased() -> None:
    """The drawn batch's token count is unknown (skipped prompts are never generated); the rolled-out
    rows' own count, the only one there is, depends on the draw."""
    for cfg, field in (
        (LossConfig(), "loss.agg='token-mean'"),
        (
            LossConfig(agg="seq-mean-token-mean", seq_count="all", kl_coef=0.1, kl_agg="token-mean"),
            "loss.kl_agg='token-mean'",
        ),
        (
            LossConfig(agg="seq-mean-token-sum-norm", seq_count="all"),
            "loss.agg='seq-mean-token-sum-norm' without loss.norm_constant",
        ),
    ):
        reasons = prompt_skip_reasons(AdvantageConfig(), cfg)
        assert len(reasons) == 1 and reasons[0].startswith(field), reasons
    case, cfg, est = fixed_case(), LossConfig(), ALLOWED["grpo"]
    p = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    e_grad = torch.zeros_like(case.logps)
    for s, prob in systematic_outcomes(p.tolist()).items():
        kept = sorted(s)
        out = grpo_loss(
            case.logps[rows_of(case, kept)], case.old[rows_of(case, kept)], advantages(case, kept, est),
            case.mask[rows_of(case, kept)], cfg, num_tokens=float(case.mask[rows_of(case, kept)].sum()),
            seq_weights=(1.0 / p[kept]).repeat_interleave(case.g),
        )  # fmt: skip
        e_grad = e_grad + prob * torch.autograd.grad(out.loss, case.logps)[0]
    _, full = loss_and_grads(case, cfg, est, [0, 1, 2], None, None)
    assert float((e_grad - full[0]).abs().max()) > 1e-6


@pytest.mark.parametrize("agg", AGGS)
def test_nonempty_seq_count_with_an_empty_row_is_refused_and_would_be_biased(agg: str) -> None:
    """The fixed normaliser is the drawn prompts' rows (drawn x G), empty rows included; a loss that
    counts only non-empty rows divides the drawn batch by a count unknown for skipped prompts, so the
    estimate is (non-empty / all) of the full value. Refused where empty rows can occur; a trainer
    whose sampler always emits a token says so (``empty_rows=False``) and is accepted."""
    base = fixed_case()
    mask = base.mask.clone()
    mask[4] = 0  # one completion without a token
    case = Case(base.g, base.rewards, mask, base.old, base.ref, base.roll, base.logps, base.ent)
    nonempty = LossConfig(agg=agg, norm_constant=3.0 if agg == "seq-mean-token-sum-norm" else None)
    reasons = prompt_skip_reasons(ALLOWED["grpo"], nonempty)
    assert len(reasons) == 1 and reasons[0].startswith("loss.seq_count='nonempty': the loss counts only rows")
    assert prompt_skip_reasons(ALLOWED["grpo"], nonempty, empty_rows=False) == []
    p = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    e_loss = torch.zeros((), dtype=torch.float64)
    for s, prob in systematic_outcomes(p.tolist()).items():
        loss, _ = loss_and_grads(
            case, nonempty, ALLOWED["grpo"], sorted(s), 1.0 / p[sorted(s)], float(case.n * case.g)
        )
        e_loss = e_loss + prob * loss
    f_loss, _ = loss_and_grads(case, nonempty, ALLOWED["grpo"], [0, 1, 2], None, None)
    share = float((mask.sum(-1) > 0).sum()) / mask.shape[0]  # non-empty / all rows
    assert (
        share < 1 and float(f_loss) != 0.0 and float(e_loss) == pytest.approx(float(f_loss) * share, rel=1e-9)
    )
    every = LossConfig(agg=agg, seq_count="all", norm_constant=nonempty.norm_constant)
    assert (
        prompt_skip_reasons(ALLOWED["grpo"], every) == []
        and deviation(case, every, ALLOWED["grpo"], p) < EXACT
    )


def test_stopping_at_the_nth_kept_prompt_is_biased() -> None:
    """Why a round's drawn set is fixed before the draw: deciding prompt by prompt and stopping at the
    first kept one (n = 1) with the drawn count as normaliser misses the drawn batch's gradient. Two
    prompts, the first kept with p = 0.5, the second always: outcome {0} (drawn 1) or {1} (drawn 2)."""
    case, cfg, est = (
        make_case(2, 2, 2, seed=3, zero=[False, False]),
        LossConfig(agg="seq-mean-token-mean"),
        ALLOWED["rloo"],
    )
    p0 = 0.5
    _, g_first = loss_and_grads(
        case, cfg, est, [0], torch.tensor([1 / p0], dtype=torch.float64), float(case.g)
    )
    _, g_second = loss_and_grads(case, cfg, est, [1], torch.ones(1, dtype=torch.float64), float(2 * case.g))
    estimate = p0 * g_first[0] + (1 - p0) * g_second[0]
    _, drawn_first = loss_and_grads(case, cfg, est, [0], None, None)
    _, drawn_both = loss_and_grads(case, cfg, est, [0, 1], None, None)
    target = p0 * drawn_first[0] + (1 - p0) * drawn_both[0]  # E[gradient of the prompts drawn]
    assert float((estimate - target).abs().max()) > 1e-6


def test_empirical_skip_frequencies_match_the_reported_probabilities() -> None:
    """Chi-square over every joint outcome, and a binomial test per prompt, of 4000 ``decide`` draws."""
    from scipy import stats

    skipper = HistorySkipper(min_keep_prob=0.1, keep_base=0.5, seed=3)
    ids = [1, 2, 3, 4, 5]
    for pid, zeros in zip(ids, [0, 1, 2, 3, 1]):
        for _ in range(zeros):
            skipper.observe([pid], torch.tensor([0.0, 0.0]), torch.zeros(2, dtype=torch.long))
    p = skipper.decide(ids, target=3).probabilities
    assert float(p.sum()) == pytest.approx(3.0, abs=1e-12) and bool((p < 1).sum() >= 3)
    exact = systematic_outcomes(p.tolist())
    m = 4000
    seen = Counter(frozenset(skipper.decide(ids, target=3).kept.tolist()) for _ in range(m))
    assert set(seen) <= set(exact) and all(len(s) == 3 for s in seen)
    keys = sorted(exact, key=sorted)
    chi = stats.chisquare([seen.get(k, 0) for k in keys], [m * exact[k] for k in keys])
    assert chi.pvalue > 1e-3, chi
    for i in range(len(ids)):
        hits = sum(n for s, n in seen.items() if i in s)
        assert stats.binomtest(hits, m, float(p[i])).pvalue > 1e-3, (i, hits, float(p[i]))
