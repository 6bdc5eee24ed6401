"""The weighted ``dppo`` filter in OpenRLHF (issue #39): each kept row's per-token advantage times its
``1 / p`` weight times ``kept / rolled-out rows`` (rows the rounding re-adds: 0), so OpenRLHF's
per-step sequence mean gives the full batch's; one-line refusals of what cannot stay unbiased."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _openrlhf_helpers import fake_forwards, make_maker, openrlhf_args, rollout_samples, tiny_model

from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.errors import NotSupportedError
from grpo_parts.filter.dppo import DPPOFilter

G, P = 4, 3
REWARDS = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.2, 0.9, 0.4, 0.0]
SEQ_MEAN = {"actor.loss_agg_mode": "seq-mean-token-mean"}


def _recording(filt: DPPOFilter) -> list[Any]:
    results: list[Any] = []
    select = filt.select

    def sel(batch: Any, target_size: int | None = None) -> Any:
        results.append(select(batch, target_size))
        return results[-1]

    object.__setattr__(filt, "select", sel)  # a frozen pydantic model: set the instance attribute anyway
    return results


def test_openrlhf_weights_each_drawn_row_over_the_rolled_out_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.models import Actor, PolicyLoss
    from test_openrlhf_experience import actor_trainer

    actor = Actor(tiny_model("qwen2"))
    actor.packing_samples = False
    args = openrlhf_args(G, P, **SEQ_MEAN)  # train.batch_size 2: kept rows rounded up to even
    filt = DPPOFilter(pruning_rate=0.5, min_keep_prob=0.2, seed=4)
    results = _recording(filt)
    maker = make_maker(fake_forwards(GRPOPartsExperienceMaker, actor), args, filter=filt)
    samples = rollout_samples(torch.Generator().manual_seed(1), G, P, REWARDS)
    row_of = {tuple(s.sequences[0].tolist()): i for i, s in enumerate(samples)}
    experiences = maker.make_experience_batch(samples)
    (res,) = results
    full = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), torch.arange(P).repeat_interleave(G),
                            AdvantageConfig(eps=1e-9))  # fmt: skip
    drawn = dict(zip(res.kept.tolist(), res.weights.tolist()))
    kept_rows = [row_of[tuple(seq[m.bool()].tolist())] for e in experiences for seq, m in
                 zip(e.sequences, e.attention_mask)]  # fmt: skip
    k, n = len(kept_rows), G * P
    assert set(drawn) <= set(kept_rows) and k % 2 == 0 and 0 < len(drawn) < n
    rows = iter(kept_rows)
    for e in experiences:  # rows the rounding re-added: weight 0
        for adv, m in zip(e.advantages, e.action_mask):
            i = next(rows)
            want = float(full[i]) * drawn.get(i, 0.0) * k / n
            got = adv.double()[m.bool()]  # the cumulative return at every action token
            torch.testing.assert_close(got, torch.full_like(got, want), atol=1e-7, rtol=1e-6)
    assert maker.last_info["weighted_rows"] == len(drawn)

    # OpenRLHF's training step on all kept rows as one step (ratio 1): the sequence mean over the k
    # kept rows of -A x w x k / n is the Horvitz-Thompson estimate -sum_i w_i A_i / n
    trainer, buffer = actor_trainer(actor, args, monkeypatch)
    trainer.actor_loss_fn = PolicyLoss(token_level_loss=False)
    for e in experiences:
        buffer.append(e)
    batch = buffer.collate_fn([buffer[i] for i in range(len(buffer))])
    status = trainer.training_step(batch, kl_ctl=0.0, step=0)
    ht = -sum(float(full[i]) * w for i, w in drawn.items()) / n
    assert float(status["metrics"]["policy_loss"]) == pytest.approx(ht, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(
    ("overrides", "refill", "needle"),
    [
        ({}, 0, "--actor.loss_agg_mode token-mean"),  # OpenRLHF's default
        (SEQ_MEAN, 1, "--grpo_parts.refill_rounds > 0"),
        ({**SEQ_MEAN, "algo.kl.init_coef": 0.01}, 0, "--algo.kl.use_loss"),
        ({**SEQ_MEAN, "algo.kl.init_coef": 0.01, "algo.kl.use_loss": False}, 0, "drop_zero_advantage=True"),
    ],
)
def test_openrlhf_refuses_dppo_where_it_cannot_stay_unbiased(
    overrides: dict[str, Any], refill: int, needle: str
) -> None:
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker

    gen = object() if not refill else type("Gen", (), {"generate_prompts": None})()
    with pytest.raises(NotSupportedError) as e:
        make_maker(GRPOPartsExperienceMaker, openrlhf_args(G, P, **overrides), filter="dppo",
                   refill_rounds=refill, samples_generator=gen)  # fmt: skip
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_launcher_refuses_dppo_on_openrlhfs_defaults_in_one_line() -> None:
    """``launch.py --grpo_parts.filter dppo`` with OpenRLHF's default token-mean: refused while the
    flags are parsed (before Ray), naming the flag; with seq-mean-token-mean it parses."""
    from grpo_parts_adapters.openrlhf.launch import parse_args
    from test_openrlhf_launch import ARGV

    argv = [
        *ARGV,
        "--grpo_parts.filter",
        "dppo",
        "--grpo_parts.filter_kwargs",
        "{}",
        "--algo.kl.init_coef",
        "0",
    ]
    with pytest.raises(NotSupportedError) as e:
        parse_args(argv)
    assert "--actor.loss_agg_mode token-mean" in str(e.value) and "\n" not in str(e.value)
    args, parts = parse_args([*argv, "--actor.loss_agg_mode", "seq-mean-token-mean"])
    assert parts.filter == "dppo" and args.actor.loss_agg_mode == "seq-mean-token-mean"
