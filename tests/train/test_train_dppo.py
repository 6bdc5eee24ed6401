"""``grpo-parts train`` with the weighted ``dppo`` filter (issue #39): the policy update multiplies
each kept row by its 1/p weight over the whole rolled-out batch's denominators; refill and losses
that cannot stay unbiased are refused before the run folder exists; the filter's generator is
checkpointed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_parts.attention.protocol import LogprobBatch
from grpo_parts.core import grpo_loss
from grpo_parts.errors import GRPOPartsError
from grpo_parts.filter.dppo import DPPOFilter
from grpo_parts.train.config import load_config
from grpo_parts.train.lifecycle.run import build_trainer
from grpo_parts.types import FilterResult, Rollout, ScoredBatch

REFERENCE = {"parts.sampler": "reference", "parts.draft": None, "parts.attention": "reference"}
DPPO = {**REFERENCE, "parts.filter": "dppo", "parts.filter_kwargs": {"pruning_rate": 0.5, "seed": 3}}


@pytest.fixture(autouse=True)
def dense_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward a random policy gets about half the time, so that advantages are not all zero."""
    from grpo_parts.task.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, text, problem: float(len(text) % 2 == 0))


def _trainer(model_dir: Path, tmp_path: Path, tiny_overrides: Any, double: bool = True, **extra: Any) -> Any:
    over = tiny_overrides(model_dir, tmp_path, **{**DPPO, "grad_clip": None, "prompts_per_step": 4, **extra})
    trainer, _ = build_trainer(load_config(overrides=over))
    if double:
        trainer.policy.double()  # float64: the hand computation below must agree to rounding
    return trainer


def _record(trainer: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Record the sampler's rollouts, the filter's inputs and results, and the gradient at every
    optimizer step (the step itself is a no-op, so the parameters stay those of the hand computation)."""
    seen: dict[str, list[Any]] = {"rollouts": [], "scored": [], "results": [], "grads": []}
    sampler, filt = trainer.parts.sampler, trainer.parts.filter
    generate, select = sampler.generate, filt.select

    def gen(*a: Any, **k: Any) -> Rollout:
        seen["rollouts"].append(generate(*a, **k))
        return seen["rollouts"][-1]

    def sel(batch: ScoredBatch, target_size: int | None = None) -> FilterResult:
        seen["scored"].append(batch)
        seen["results"].append(select(batch, target_size))
        return seen["results"][-1]

    def step(*a: Any, **k: Any) -> None:
        seen["grads"].append([p.grad.detach().clone() for p in trainer.policy.parameters()])

    monkeypatch.setattr(sampler, "generate", gen)
    object.__setattr__(filt, "select", sel)  # a frozen pydantic model: set the instance attribute anyway
    monkeypatch.setattr(trainer.optimizer, "step", step)
    return seen


def _hand_grads(
    trainer: Any, ro: Rollout, scored: ScoredBatch, res: FilterResult, groups: torch.Tensor, own: bool = False
) -> list[torch.Tensor]:
    """grpo_loss by hand on the kept rows of ``groups``: weights 1/p from the filter's result, the
    denominators of *every* rolled-out row of those groups (pruned ones included); ``own``: the
    kept rows' own denominators instead (the plain filters' rule, biased here)."""
    in_groups = torch.isin(ro.group_index.cpu(), groups)
    mine = in_groups[res.kept.cpu()]
    kept, w = res.kept.cpu()[mine], res.weights.cpu()[mine]
    sub = ro.select(kept.to(ro.group_index.device))
    batch = LogprobBatch.from_rollout(sub)
    trainer.policy.zero_grad(set_to_none=True)
    temp = trainer.params.logprob_temperature
    logps = trainer.parts.attention.completion_logprobs(trainer.policy, batch, temp).logprobs
    mask = sub.completion_mask
    full_mask = (
        sub.completion_mask if own else ro.completion_mask[in_groups.to(ro.group_index.device)]
    ).cpu()
    loss = grpo_loss(
        logps, logps.detach(), scored.advantages[kept.to(scored.advantages.device)].to(logps.dtype), mask,
        trainer.config.loss, num_tokens=float(full_mask.sum()), num_seqs=float((full_mask.sum(-1) > 0).sum()),
        seq_weights=w.to(logps.dtype),
    ).loss  # fmt: skip
    loss.backward()
    return [p.grad.detach().clone() for p in trainer.policy.parameters()]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_trainer_gradient_is_grpo_loss_with_the_filters_weights_and_full_counts(
    tiny_model_dir: Path,
    tmp_path: Path,
    tiny_overrides: Any,
    monkeypatch: pytest.MonkeyPatch,
    minibatches: int,
) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path, tiny_overrides, minibatches=minibatches)
    assert isinstance(trainer.parts.filter, DPPOFilter)
    seen = _record(trainer, monkeypatch)
    for _ in range(6):  # until a step draws a strict subset with weights above 1
        start = len(seen["grads"])
        m = trainer.step()
        res, ro = seen["results"][-1], seen["rollouts"][-1]
        if 0 < res.kept.numel() < ro.num_completions and bool((res.weights > 1).any()):
            break
    else:
        pytest.fail("no step drew a strict subset of the rows")
    assert len(seen["results"]) == len(seen["rollouts"])  # one round per step: no refill
    assert m["weighted_rows"] == res.kept.numel() == m["kept"]
    assert m["rollout_tokens"] == int(ro.completion_mask.sum())
    # the split is made on the rolled-out prompts, before the draw; the first optimizer step trains
    # the kept rows of the first part that kept any
    parts = torch.tensor_split(torch.arange(ro.num_prompts), minibatches)
    kept_groups = ro.group_index.cpu()[res.kept.cpu()]
    used = [g for g in parts if bool(torch.isin(kept_groups, g).any())]
    assert len(seen["grads"]) - start == len(used)
    want = _hand_grads(trainer, ro, seen["scored"][-1], res, used[0])
    for g, h in zip(seen["grads"][start], want):
        torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-12)
    # the control: the kept rows' own counts (the plain filters' rule) give another gradient
    own = _hand_grads(trainer, ro, seen["scored"][-1], res, used[0], own=True)
    assert not all(torch.allclose(g, h, rtol=1e-6, atol=1e-12) for g, h in zip(seen["grads"][start], own))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"parts.refill_rounds": 3}, "parts.refill_rounds=3: dppo keeps rows at random"),
        ({"loss.kl_coef": 0.01}, "drop_zero_advantage=True with kl_coef > 0"),
        ({"loss.agg": "seq-mean-token-sum-norm"}, "without norm_constant"),
    ],
)
def test_dppo_refuses_refill_and_biased_losses_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, extra: dict[str, Any], needle: str
) -> None:
    over = tiny_overrides(tiny_model_dir, tmp_path, **DPPO, **extra)
    with pytest.raises(GRPOPartsError) as e:
        build_trainer(load_config(overrides=over))
    msg = str(e.value)
    assert "filter 'dppo' cannot run here" in msg and needle in msg and "\n" not in msg


def test_dppo_run_logs_weighted_rows_and_rollout_tokens(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any
) -> None:
    """``--filter dppo`` end to end through the CLI: every step's row carries ``rollout_tokens``, and
    the weighted loss ran (``weighted_rows > 0``)."""
    from cli_helpers import QUIET

    from grpo_parts.cli import main

    rc = main(
        ["train", "--model", str(tiny_model_dir), "--out-dir", str(tmp_path), "--name", "d", "--filter", "dppo",
         "--sampler", "reference", "--attention", "reference", "--steps", "2", "--set", "prompts_per_step=3",
         "--set", "group_size=4", "--set", "max_new_tokens=6", "--set", "task.name=arithmetic",
         "--set", "task.num_eval=4", "--set", "threads=1", "--set", "stop_after_flat=0", *QUIET]
    )  # fmt: skip
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2 and all(r["rollout_tokens"] > 0 for r in steps)
    assert sum(r["weighted_rows"] for r in steps) > 0
    assert all(r["weighted_rows"] == r["kept"] for r in steps if "weighted_rows" in r)


def test_dppo_generator_is_checkpointed_so_a_resume_draws_the_same_rows(
    tiny_model_dir: Path, tmp_path: Path, tiny_overrides: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _trainer(tiny_model_dir, tmp_path, tiny_overrides, double=False)
    a.step()
    state = a.state_dict()
    assert "filter" in state and "generator" in state["filter"]
    b = _trainer(tiny_model_dir, tmp_path, tiny_overrides, double=False)
    b.load_state_dict(state)
    seen_a, seen_b = _record(a, monkeypatch), _record(b, monkeypatch)
    a.step()
    b.step()
    assert torch.equal(seen_a["results"][-1].kept, seen_b["results"][-1].kept)
    fresh = DPPOFilter(pruning_rate=0.5, seed=3)  # without the restored state the draw differs
    draws = {tuple(fresh.select(seen_a["scored"][-1]).kept.tolist()) for _ in range(8)}
    assert len(draws) > 1
