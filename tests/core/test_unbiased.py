"""Proof by exhaustive enumeration: with the dppo filter, the expected loss and gradient over every
keep/prune outcome equal the full batch's, for every aggregation and every advantage estimator.

For a small batch (2 groups x 2-3 completions, 1-3 tokens each) every outcome of the filter's
sampling design is listed with its exact probability (tests/dppo_outcomes.py, independent
of the filter's sampler), each outcome goes the trainer's way (``FilterResult`` ->
``apply_filter`` -> ``grpo_loss(..., seq_weights=)``), and ``sum_S P(S) * grad_S`` is compared with
the full batch's gradient at 1e-10 (float64; the gradient w.r.t. the log-probs and the entropy,
which any policy's parameter gradient is a linear map of). The same check on CPPO (top-k, one
outcome of probability 1, no weights) must fail, and so must dppo with a piece left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from dppo_outcomes import expected, marginals, outcomes_for
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpo_parts.core import AdvantageConfig, CorrectionConfig, LossConfig, compute_advantages, grpo_loss
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.apply import apply_filter, loss_denominators
from grpo_parts.filter.cppo import TopKAbsAdvantage
from grpo_parts.filter.dppo import DPPOFilter
from grpo_parts.types import FilterResult, Rollout, ScoredBatch

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ESTIMATORS = {
    "grpo": AdvantageConfig(),
    "grpo_batch_norm": AdvantageConfig(norm="batch"),
    "dr_grpo": AdvantageConfig(norm="none"),
    "rloo": AdvantageConfig(estimator="rloo"),
    "reinforce_pp_verl": AdvantageConfig(estimator="reinforce_plus_plus_baseline"),
    "reinforce_pp_openrlhf": AdvantageConfig(estimator="reinforce_plus_plus_baseline", whiten="openrlhf"),
    "grpo_kl_in_reward": AdvantageConfig(kl_coef=0.1),
    "rloo_kl_per_token": AdvantageConfig(estimator="rloo", kl_coef=0.1, kl_placement="token"),
}
EXACT = 1e-10
SETTINGS = settings(max_examples=6, derandomize=True, deadline=None)


@dataclass(frozen=True)
class Case:
    rollout: Rollout
    rewards: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    roll: torch.Tensor  # the sampler's log-probs (rollout correction)
    logps: torch.Tensor  # leaf
    ent: torch.Tensor  # leaf

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.completion_mask


def make_case(sizes: list[int], t: int, seed: int, discrete: bool, empty_rows: bool = False) -> Case:
    """``empty_rows``: rows may have length 0, a completion the loss masks out entirely (TRL's
    ``mask_truncated_completions``)."""
    gen = torch.Generator().manual_seed(seed)
    gi = torch.cat([torch.full((s,), g, dtype=torch.long) for g, s in enumerate(sizes)])
    n = int(gi.numel())
    lengths = torch.randint(0 if empty_rows else 1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t) < lengths[:, None]).long()
    ones = torch.ones(n, 2, dtype=torch.long)
    rand = lambda: torch.rand(n, t, generator=gen, dtype=torch.float64)  # noqa: E731
    old, ref = -rand() * mask, -rand() * mask
    rollout = Rollout(ones, ones, mask.clone(), mask, old, gi, len(sizes))
    if discrete:
        rewards = torch.randint(0, 3, (n,), generator=gen).double() / 2
    else:
        rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    logps = (old + 0.4 * (rand() - 0.5)).requires_grad_(True)
    return Case(rollout, rewards, old, ref, old + 0.1 * (rand() - 0.5), logps, rand().requires_grad_(True))


#: make_case's sizes, length, seed and discrete flag
_DRAWS = (
    st.lists(st.integers(2, 3), min_size=2, max_size=2),
    st.integers(1, 3),
    st.integers(0, 2**16),
    st.booleans(),
)
cases = st.builds(make_case, *_DRAWS, st.booleans())
nonempty_cases = st.builds(make_case, *_DRAWS)


@st.composite
def loss_configs(draw, agg: str) -> LossConfig:
    policy = draw(st.sampled_from(["clip", "gspo", "gspo_token", "cispo", "sapo"]))
    kw: dict = {"agg": agg, "policy": policy, "log_ratio_clamp": draw(st.sampled_from([None, 20.0]))}
    if agg == "seq-mean-token-sum-norm":
        kw["norm_constant"] = draw(st.sampled_from([1.0, 3.0]))
    if agg == "seq-mean-token-mean" and draw(st.booleans()):
        kw["seq_len_eps"] = 1e-8
    if agg != "token-mean" and draw(st.booleans()):
        kw["seq_count"] = "all"
    if policy in ("clip", "gspo") and draw(st.booleans()):
        kw["dual_clip"] = 3.0
    if draw(st.booleans()):
        kw.update(kl_coef=0.05, kl_agg=draw(st.sampled_from(["loss", "token-mean"])))
    if draw(st.booleans()):
        kw.update(entropy_coef=0.01, entropy_agg=draw(st.sampled_from(["loss", "token-mean"])))
    kw["correction"] = draw(
        st.sampled_from(
            [
                CorrectionConfig(),
                CorrectionConfig(level="token", low=0.5, high=1.5),
                CorrectionConfig(level="sequence", mode="mask", low=0.9, high=1.1),
            ]
        )
    )
    return LossConfig(**kw)


@st.composite
def dppo_filters(draw, cfg: LossConfig) -> DPPOFilter:
    exact_zero = cfg.kl_coef == 0 and cfg.entropy_coef == 0  # rows with A = 0 contribute exactly 0
    target = draw(
        st.sampled_from([{"pruning_rate": 0.25}, {"pruning_rate": 0.5}, {"pruning_rate": 0.75}, {"k": 1}])
    )
    return DPPOFilter(
        **target,
        min_keep_prob=draw(st.sampled_from([0.05, 0.2, 0.5])),
        drop_zero_advantage=exact_zero and draw(st.booleans()),
        sampling=draw(st.sampled_from(["systematic", "bernoulli"])),
    )


def scored(case: Case, est: AdvantageConfig) -> tuple[torch.Tensor, ScoredBatch]:
    """Advantages over the full batch (``[N]``, or ``[N, T]`` with KL per token) and what the filter
    reads: one value per row, the row's largest ``|A_t|`` for per-token advantages."""
    adv = compute_advantages(
        case.rewards, case.rollout.group_index, case.mask, est, old_logps=case.old, ref_logps=case.ref
    )
    per_row = adv if adv.ndim == 1 else (adv.abs() * case.mask).amax(-1)
    return adv, ScoredBatch(case.rewards, per_row, case.rollout.group_index)


def outcome_path(case: Case, cfg: LossConfig, adv: torch.Tensor, denominators: str = "apply"):
    """One outcome the trainer's way: ``FilterResult`` -> ``apply_filter`` -> ``grpo_loss``.
    ``denominators="kept"`` (a control) normalises by the kept rows' own counts instead."""

    def run(kept: torch.Tensor, weights: torch.Tensor | None):
        zero = [torch.zeros_like(case.logps), torch.zeros_like(case.ent)]
        kb = apply_filter(FilterResult(kept, 0, {}, weights), case.rollout, adv, case.old, case.ref, loss=cfg)
        if kb.is_empty:  # the loop skips the step: nothing learnt
            return torch.zeros((), dtype=torch.float64), zero
        assert kb.rollout is not None
        tokens, seqs = kb.num_tokens, kb.num_seqs
        if denominators == "kept":
            tokens, seqs = loss_denominators(kb.rollout.completion_mask)
        k = kb.kept
        out = grpo_loss(
            case.logps[k], kb.old_logps, kb.advantages, kb.rollout.completion_mask, cfg, kb.ref_logps,
            entropy=case.ent[k], rollout_logps=case.roll[k], num_tokens=tokens, num_seqs=seqs,
            seq_weights=kb.weights,
        )  # fmt: skip
        grads = torch.autograd.grad(out.loss, [case.logps, case.ent], allow_unused=True)
        return out.loss.detach(), [z if g is None else g for z, g in zip(zero, grads)]

    return run


def full_batch(case: Case, cfg: LossConfig, adv: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unpruned loss with its own (default) denominators, and its gradients."""
    out = grpo_loss(
        case.logps, case.old, adv, case.mask, cfg, case.ref, entropy=case.ent, rollout_logps=case.roll
    )
    grads = torch.autograd.grad(out.loss, [case.logps, case.ent], allow_unused=True)
    zero = [torch.zeros_like(case.logps), torch.zeros_like(case.ent)]
    return out.loss.detach(), [z if g is None else g for z, g in zip(zero, grads)]


def deviation(
    outcomes, weights_of, case: Case, cfg: LossConfig, adv: torch.Tensor, denominators="apply"
) -> float:
    """Largest ``|E[loss_S] - loss|`` and ``|E[grad_S] - grad|`` over the outcomes."""
    e_loss, e_grads = expected(outcomes, weights_of, outcome_path(case, cfg, adv, denominators))
    f_loss, f_grads = full_batch(case, cfg, adv)
    return max(
        [float((e_loss - f_loss).abs())] + [float((a - b).abs().max()) for a, b in zip(e_grads, f_grads)]
    )


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("agg", AGGS)
@SETTINGS
@given(data=st.data())
def test_dppo_expected_gradient_is_the_full_gradient(agg: str, estimator: str, data: st.DataObject) -> None:
    case = data.draw(cases, "case")
    cfg = data.draw(loss_configs(agg), "loss")
    filt = data.draw(dppo_filters(cfg), "filter")
    assert filt.loss_not_supported_reasons(cfg) == []
    adv, batch = scored(case, ESTIMATORS[estimator])
    p = filt.inclusion_probs(batch)
    outcomes = outcomes_for(filt.sampling, p)
    torch.testing.assert_close(
        torch.tensor(marginals(outcomes, batch.size), dtype=torch.float64), p, rtol=0, atol=1e-12
    )
    assert deviation(outcomes, lambda kept: 1.0 / p[kept], case, cfg, adv) < EXACT


@pytest.mark.parametrize("agg", AGGS)
@SETTINGS
@given(data=st.data())
def test_cppo_fails_the_same_check(agg: str, data: st.DataObject) -> None:
    """The broken control: a deterministic top-k (one outcome, probability 1, kept-set normaliser,
    no weights) is biased whenever the full gradient is not zero."""
    case = data.draw(nonempty_cases, "case")  # (a pruned empty row changes nothing: no bias to show)
    cfg = data.draw(loss_configs(agg), "loss")
    adv, batch = scored(case, ESTIMATORS[data.draw(st.sampled_from(sorted(ESTIMATORS)), "estimator")])
    _, f_grads = full_batch(case, cfg, adv)
    assume(max(float(g.abs().max()) for g in f_grads) > 1e-3)
    res = TopKAbsAdvantage(pruning_rate=data.draw(st.sampled_from([0.25, 0.5, 0.75]), "rate")).select(batch)
    assert deviation({frozenset(res.kept.tolist()): 1.0}, lambda kept: None, case, cfg, adv) > 1e-6


# ---------------------------------------------------------------------- dppo with a piece left out


def fixed_case() -> tuple[Case, torch.Tensor, ScoredBatch]:
    """2 groups x 3: the second group is zero-variance (advantage 0)."""
    case = make_case([3, 3], 3, seed=7, discrete=False)
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.5, 0.5, 0.5], dtype=torch.float64)
    case = Case(case.rollout, rewards, case.old, case.ref, case.roll, case.logps, case.ent)
    adv, batch = scored(case, AdvantageConfig())
    return case, adv, batch


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("sampling", ["systematic", "bernoulli"])
def test_dppo_without_weights_or_with_kept_denominators_is_biased(agg: str, sampling: str) -> None:
    case, adv, batch = fixed_case()
    cfg = LossConfig(agg=agg, norm_constant=3.0 if agg == "seq-mean-token-sum-norm" else None)
    filt = DPPOFilter(k=2, min_keep_prob=0.2, sampling=sampling)
    p = filt.inclusion_probs(batch)
    assert bool(((p > 0) & (p < 1)).any())
    outcomes = outcomes_for(sampling, p)
    assert deviation(outcomes, lambda kept: 1.0 / p[kept], case, cfg, adv) < EXACT
    assert deviation(outcomes, lambda kept: None, case, cfg, adv) > 1e-6  # no weights
    assert deviation(outcomes, lambda kept: 1.0 / p[kept], case, cfg, adv, denominators="kept") > 1e-6


def test_dropping_zero_advantage_rows_is_biased_with_kl_and_refused() -> None:
    case, adv, batch = fixed_case()
    cfg = LossConfig(kl_coef=0.1)
    dropping = DPPOFilter(k=2, drop_zero_advantage=True)
    keeping = DPPOFilter(k=2, drop_zero_advantage=False)
    assert "drop_zero_advantage=True with kl_coef > 0" in dropping.loss_not_supported_reasons(cfg)[0]
    assert keeping.loss_not_supported_reasons(cfg) == []
    for filt, biased in ((dropping, True), (keeping, False)):
        p = filt.inclusion_probs(batch)
        dev = deviation(outcomes_for(filt.sampling, p), lambda kept, p=p: 1.0 / p[kept], case, cfg, adv)
        assert (dev > 1e-6) if biased else (dev < EXACT)
    # without KL or entropy, dropping A = 0 rows is exact
    p = dropping.inclusion_probs(batch)
    assert bool((p[3:] == 0).all())
    assert (
        deviation(outcomes_for("systematic", p), lambda kept: 1.0 / p[kept], case, LossConfig(), adv) < EXACT
    )


def test_sum_norm_without_constant_is_refused() -> None:
    """Its default constant is the padded width of the kept rows' tensor, which re-padding changes."""
    case, adv, batch = fixed_case()
    cfg = LossConfig(agg="seq-mean-token-sum-norm")
    reasons = DPPOFilter(pruning_rate=0.5).loss_not_supported_reasons(cfg)
    assert len(reasons) == 1 and "agg='seq-mean-token-sum-norm' without norm_constant" in reasons[0]
    w = torch.ones(2, dtype=torch.float64)
    with pytest.raises(
        GRPOPartsError, match=r"^seq_weights: agg='seq-mean-token-sum-norm' without norm_constant"
    ):
        grpo_loss(
            case.logps[:2],
            case.old[:2],
            adv[:2],
            case.mask[:2],
            cfg,
            num_tokens=9.0,
            num_seqs=6.0,
            seq_weights=w,
        )


def _with_empty_row(case: Case, row: int) -> Case:
    """``case`` with ``row``'s completion masked out entirely (TRL's ``mask_truncated_completions``)."""
    mask = case.rollout.completion_mask.clone()
    mask[row] = 0
    r = case.rollout
    rollout = Rollout(
        r.prompt_ids, r.prompt_mask, r.completion_ids, mask, r.logprobs, r.group_index, r.num_prompts
    )
    return Case(rollout, case.rewards, case.old, case.ref, case.roll, case.logps, case.ent)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seq_count", ["all", "nonempty"])
def test_the_documented_recipe_is_unbiased_with_an_empty_row(agg: str, seq_count: str) -> None:
    """``select`` -> ``apply_filter(..., loss=cfg)`` -> ``grpo_loss(seq_weights=)`` with a row that has
    no completion token: the full batch's sequence count is the loss's (every row under
    ``seq_count='all'``). Counting the non-empty rows there (what apply_filter did before) scales the
    expected loss by all / non-empty rows; without ``loss=`` such a batch is refused in one line."""
    base, _, _ = fixed_case()
    case = _with_empty_row(base, 2)
    adv, batch = scored(case, AdvantageConfig())
    cfg = LossConfig(
        agg=agg, seq_count=seq_count, norm_constant=3.0 if agg == "seq-mean-token-sum-norm" else None
    )
    filt = DPPOFilter(k=2, min_keep_prob=0.2)
    assert filt.loss_not_supported_reasons(cfg) == []
    p = filt.inclusion_probs(batch)
    outcomes = outcomes_for("systematic", p)
    assert deviation(outcomes, lambda kept: 1.0 / p[kept], case, cfg, adv) < EXACT
    if seq_count == "all":  # the old denominators (non-empty rows) are 6 / 5 times too small: biased
        old = LossConfig(agg=agg, seq_count="nonempty", norm_constant=cfg.norm_constant)
        e_loss, _ = expected(outcomes, lambda kept: 1.0 / p[kept], _with_loss(case, cfg, old, adv))
        f_loss, _ = full_batch(case, cfg, adv)
        assert float(e_loss) == pytest.approx(float(f_loss) * 6 / 5, rel=1e-9)
    with pytest.raises(
        GRPOPartsError, match=r"^apply_filter\(loss=\.\.\.\): a weighted result's batch has 1 row"
    ):
        apply_filter(
            FilterResult(torch.tensor([0, 1]), 0, {}, torch.ones(2, dtype=torch.float64)), case.rollout, adv
        )


def _with_loss(case: Case, cfg: LossConfig, counted: LossConfig, adv: torch.Tensor):
    """An outcome path whose denominators are counted under ``counted`` but whose loss runs ``cfg``."""

    def run(kept: torch.Tensor, weights: torch.Tensor | None):
        kb = apply_filter(
            FilterResult(kept, 0, {}, weights), case.rollout, adv, case.old, case.ref, loss=counted
        )
        zero = [torch.zeros_like(case.logps), torch.zeros_like(case.ent)]
        if kb.is_empty:
            return torch.zeros((), dtype=torch.float64), zero
        assert kb.rollout is not None
        out = grpo_loss(
            case.logps[kb.kept], kb.old_logps, kb.advantages, kb.rollout.completion_mask, cfg, kb.ref_logps,
            rollout_logps=case.roll[kb.kept], num_tokens=kb.num_tokens, num_seqs=kb.num_seqs, seq_weights=kb.weights,
        )  # fmt: skip
        return out.loss.detach(), zero

    return run
