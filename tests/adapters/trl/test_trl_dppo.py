"""The weighted ``dppo`` filter in TRL (issue #39): each kept row's advantage times its ``1 / p``
weight (0 for rows the rounding re-adds), the full batch's normaliser (``num_items_in_batch``, or
``kept / scored rows`` folded into the weights for TRL's row-normalised losses), and one-line
refusals of what cannot stay unbiased (CPU, tiny float64 model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import trl_tiny as _tiny  # noqa: E402
from grpo_parts_adapters.trl import GRPOPartsTrainer  # noqa: E402
from transformers import set_seed  # noqa: E402

from grpo_parts.errors import NotSupportedError  # noqa: E402
from grpo_parts.filter.dppo import DPPOFilter  # noqa: E402

KW = {"pruning_rate": 0.5, "min_keep_prob": 0.2, "seed": 5}


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return _tiny.model()


def _key(batch: dict[str, Any], i: int) -> tuple[Any, ...]:
    p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
    return tuple(p), tuple(batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist())


def _train(base: torch.nn.Module, loss_type: str) -> tuple[Any, dict[tuple, float], dict[str, Any], Any]:
    """One step with dppo; returns the trainer, ``{row: weight the filter drew}``, the scored batch and
    the filter's result (redrawn from a fresh filter with the same seed)."""
    args = _tiny.config(gradient_accumulation_steps=2, max_steps=1, loss_type=loss_type)
    set_seed(0)
    tr, _ = _tiny.run(_tiny.Recording, base, args, filter="dppo", filter_kwargs=KW)
    ((out, scored),) = tr.scored
    res = DPPOFilter(**KW).select(scored, None)  # the draw the trainer's filter made
    assert 0 < res.kept.numel() < scored.size
    drawn = {_key(out, int(i)): float(w) for i, w in zip(res.kept, res.weights)}
    return tr, drawn, out, res


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_trl_trains_each_drawn_row_times_its_weight_over_the_full_batch(
    base: torch.nn.Module, loss_type: str
) -> None:
    tr, drawn, out, res = _train(base, loss_type)
    n = out["completion_ids"].shape[0]
    trained = [(b, i) for b in tr.trained for i in range(b["completion_ids"].shape[0])]
    k = len(trained)
    assert k % 2 == 0 and k >= res.kept.numel()  # a multiple of steps_per_generation, drawn rows all in
    factor = 1.0 if loss_type == "dapo" else k / n  # grpo: TRL divides by the micro-batch's rows
    adv = {_key(out, i): float(out["advantages"][i]) for i in range(n)}
    for b, i in trained:
        key = _key(b, i)
        want = adv[key] * drawn.get(key, 0.0) * factor  # rows the rounding re-added: weight 0
        assert float(b["advantages"][i]) == pytest.approx(want, rel=1e-6, abs=1e-9)  # float32
    full_tokens = int(out["completion_mask"].sum())
    assert all(int(b["num_items_in_batch"]) == full_tokens for b in tr.trained)
    # step 1: ratio 1, beta 0, so the loss is -sum_i w_i A_i (x len_i / tokens for dapo) over the
    # FULL batch's normaliser: the Horvitz-Thompson estimate of the unpruned loss
    w = res.weights.double()
    a = out["advantages"][res.kept].double()
    if loss_type == "dapo":
        want_loss = -(w * a * out["completion_mask"][res.kept].sum(-1).double()).sum() / full_tokens
    else:
        want_loss = -(w * a).sum() / n
    assert sum(tr.losses) == pytest.approx(float(want_loss), rel=1e-6, abs=1e-9)
    log = tr.state.log_history[0]
    assert log["parts/filter/weighted_rows"] == res.kept.numel() > 0
    assert log["parts/filter/calls"] == 1


@pytest.mark.parametrize(
    ("config", "parts", "needle"),
    [
        ({"beta": 0.1}, {}, "beta=0.1"),
        ({"loss_type": "bnpo"}, {}, "loss_type='bnpo'"),
        ({}, {"refill_rounds": 3}, "refill_rounds=3: dppo keeps rows at random"),
    ],
)
def test_trl_refuses_dppo_where_it_cannot_stay_unbiased(
    base: torch.nn.Module, config: dict[str, Any], parts: dict[str, Any], needle: str
) -> None:
    args = _tiny.config(**config)
    model = _tiny.policy_for(base, args)
    with pytest.raises(NotSupportedError) as e:
        GRPOPartsTrainer(
            model=model, reward_funcs=_tiny.reward, args=args, train_dataset=_tiny.dataset(),
            processing_class=_tiny.tokenizer(), filter="dppo",
            parts=parts,
        )  # fmt: skip
    assert needle in str(e.value) and "\n" not in str(e.value)
