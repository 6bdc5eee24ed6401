"""Prompt skipping behind OpenRLHF (issue 44 item 6): the samples generator's prompts pass the
skipper before vLLM (a skipped prompt generates nothing), the step keeps its size by drawing more,
each kept row's advantage carries ``1 / p`` x rolled-out / drawn prompts, the counters reach the
trainer's logs (``parts/prompt_skip/prompts_skipped > 0``), the history survives OpenRLHF's
checkpoint ``client_states``, and what cannot stay unbiased is refused in one line."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _openrlhf_helpers import fake_forwards, make_maker, openrlhf_args, rollout_samples, tiny_model

from grpo_parts.core import AdvantageConfig, group_advantages
from grpo_parts.errors import GRPOPartsError, NotSupportedError
from grpo_parts.skip.history import HistorySkipper
from grpo_parts.skip.protocol import prompt_id

G, B, N_PROMPTS = 4, 4, 12
SEQ_MEAN = {"actor.loss_agg_mode": "seq-mean-token-mean"}
SOLVED = {f"problem {i}" for i in range(6)}  # every completion right: zero-variance groups


def _rewards(prompt: str, gen: torch.Generator) -> list[float]:
    if prompt in SOLVED:
        return [1.0] * G
    r = (torch.rand(G, generator=gen) > 0.5).double()
    r[0], r[1] = 1.0, 0.0  # never zero-variance
    return r.tolist()


def _generator(args: Any, skipper: HistorySkipper, generated: list[list[str]]) -> Any:
    """The trainer's samples generator over a 12-prompt dataloader, vLLM replaced by ``_generate_kept``."""
    from grpo_parts_adapters.openrlhf.samples import GRPOPartsSamplesGenerator
    from grpo_parts_adapters.openrlhf.skipping import SkipStage

    gen = torch.Generator().manual_seed(3)

    class Fake(GRPOPartsSamplesGenerator):
        def _generate_kept(self, batch: Any, num_prompts: int, **kw: Any) -> list[Any]:
            ((_, prompts, _labels, _images),) = list(batch)
            generated.append(list(prompts))
            rewards = [r for p in prompts for r in _rewards(p, gen)]
            samples = rollout_samples(gen, G, len(prompts), rewards)
            for i, s in enumerate(samples):
                s.prompts = [prompts[i // G]]
            return samples

    texts = [f"problem {i}" for i in range(N_PROMPTS)]
    loader = [(None, texts[i : i + B], [""] * B, [None] * B) for i in range(0, N_PROMPTS, B)]
    return Fake(SimpleNamespace(args=args), loader, None, None, [], skip_stage=SkipStage(skipper, G))


def _maker(args: Any, sg: Any) -> Any:
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker
    from openrlhf.models import Actor

    actor = Actor(tiny_model("qwen2", dtype=torch.float32))
    actor.packing_samples = False
    return make_maker(fake_forwards(GRPOPartsExperienceMaker, actor), args, samples_generator=sg)


def test_skipped_prompts_generate_nothing_and_kept_rows_carry_their_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = openrlhf_args(G, B, **SEQ_MEAN)
    generated: list[list[str]] = []
    skipper = HistorySkipper(keep_base=0.2, base_step=0.0, min_keep_prob=0.1, seed=1)
    sg = _generator(args, skipper, generated)
    maker = _maker(args, sg)
    skipped = 0.0
    for _ in range(9):  # 3 epochs of 3 steps
        samples, _, consumed, exhausted = sg.generate_samples()
        if not samples:
            continue
        rolled = [s.prompts[0] for s in samples[::G]]
        rewards = torch.tensor([float(s.rewards[0]) for s in samples], dtype=torch.float64)
        full = group_advantages(
            rewards, torch.arange(len(rolled)).repeat_interleave(G), AdvantageConfig(eps=1e-9)
        )
        weights = sg.skip_stage.prompt_weights()
        experiences = maker.make_experience_batch(samples)
        info = maker.last_skip_info
        assert info["prompts_drawn"] == consumed >= len(rolled)
        assert len(rolled) == B or exhausted  # the step keeps its size until the episode runs out
        skipped += info["prompts_skipped"]
        # every kept row's advantage: its full-group advantage x 1/p x rolled-out / drawn
        got_rows = [
            (adv.double()[m.bool()][0].item())
            for e in experiences
            for adv, m in zip(e.advantages, e.action_mask)
        ]
        w_rows = [weights[prompt_id(s.prompts[0])] for s in samples]
        assert len(got_rows) == len(samples)
        expected = sorted(round(float(full[i]) * w_rows[i], 5) for i in range(len(samples)))
        assert sorted(round(x, 5) for x in got_rows) == expected
    assert skipped > 0  # the zero-variance prompts were skipped in later epochs
    flat = [p for step in generated for p in step]
    assert sum(p in SOLVED for p in flat[-3 * B :]) < sum(p in SOLVED for p in flat[: 3 * B])
    # the trainer logs the maker's skip counters under parts/prompt_skip/ (OpenRLHF's train_step stubbed)
    from grpo_parts_adapters.openrlhf import ray_actors

    from grpo_parts.counters import PartCounters

    monkeypatch.setattr(ray_actors._Trainer, "train_step", lambda self, samples, step: ({}, step + 1))
    trainer = object.__new__(ray_actors.TrainerParts)
    trainer.experience_maker, trainer.model_groups_count = maker, False
    trainer.parts_counters = PartCounters({"filter": "calls"})
    maker.last_skip_info = {**maker.last_skip_info, "prompts_skipped": skipped}
    status, _ = trainer.train_step([], 0)
    assert status["parts/prompt_skip/prompts_skipped"] > 0 and "parts/prompt_skip/prompts_drawn" in status


def test_checkpoint_client_states_carry_the_history(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_parts_adapters.openrlhf import ray_actors
    from grpo_parts_adapters.openrlhf.skipping import SkipStage

    saved: list[dict[str, Any]] = []
    monkeypatch.setattr(
        ray_actors._Trainer, "save_logs_and_checkpoints", lambda self, g, logs=None, cs=None: saved.append(cs)
    )
    skipper = HistorySkipper(seed=1)
    skipper.observe([5, 6], torch.tensor([1.0] * G + [0.0, 1.0, 0.0, 1.0], dtype=torch.float64),
                    torch.arange(2).repeat_interleave(G), torch.full((2 * G,), 3))  # fmt: skip
    trainer = object.__new__(ray_actors.TrainerParts)
    trainer.skip_stage = SkipStage(skipper, G)
    states: dict[str, Any] = {"global_step": 3}
    trainer.save_logs_and_checkpoints(3, {}, states)
    assert saved[0] is states and ray_actors.SKIP_STATE in states
    resumed = object.__new__(ray_actors.TrainerParts)
    resumed.skip_stage = SkipStage(HistorySkipper(seed=1), G)
    monkeypatch.setattr(ray_actors._Trainer, "init_checkpoint_states", lambda self: states)
    resumed.init_checkpoint_states()
    assert resumed.skip_stage.skipper.state_dict().keys() == skipper.state_dict().keys()
    assert resumed.skip_stage.skipper.inclusion_probability(5) == skipper.inclusion_probability(5)


@pytest.mark.parametrize(
    ("overrides", "refill", "needle"),
    [
        ({}, 0, "--actor.loss_agg_mode token-mean"),  # OpenRLHF's default
        ({**SEQ_MEAN, "algo.dynamic_filtering_enable": True}, 0, "--algo.dynamic_filtering_enable"),
        ({**SEQ_MEAN, "rollout.vllm_generate_batch_size": 8}, 0, "--rollout.vllm_generate_batch_size 8"),
        (SEQ_MEAN, 2, "--grpo_parts.refill_rounds > 0"),
        ({**SEQ_MEAN, "actor.entropy_coef": 0.01}, 0, "--actor.entropy_coef 0.01"),
    ],
)
def test_refused_where_it_cannot_stay_unbiased(
    overrides: dict[str, Any], refill: int, needle: str, caplog: pytest.LogCaptureFixture
) -> None:
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig
    from grpo_parts_adapters.openrlhf.ray_actors import skip_stage

    args = openrlhf_args(G, B, **overrides)
    parts = OpenRLHFPartsConfig(prompt_skip="history", refill_rounds=refill)
    with pytest.raises(NotSupportedError) as e:
        skip_stage(parts, args)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with caplog.at_level("INFO", logger="grpo_parts.skip.stage"):
        assert skip_stage(OpenRLHFPartsConfig(refill_rounds=refill), args) is None  # off: plain OpenRLHF
    (line,) = [r.getMessage() for r in caplog.records]  # not asked for: opt-in, and what it would refuse
    assert line.startswith(
        "grpo_parts: prompt skipping is opt-in (grpo_parts.prompt_skip=history turns it on)"
    )
    assert f"this run would refuse it: {needle}" in line


def test_the_experience_maker_refuses_what_the_trainer_refuses() -> None:
    """A maker built by hand over a skipping samples generator applies the same rule (no refill)."""
    from grpo_parts_adapters.openrlhf.experience import GRPOPartsExperienceMaker

    args = openrlhf_args(G, B, **SEQ_MEAN)
    sg = _generator(args, HistorySkipper(), [])
    with pytest.raises(NotSupportedError, match="refill_rounds > 0"):
        make_maker(GRPOPartsExperienceMaker, args, samples_generator=sg, refill_rounds=1)


def test_a_step_that_rolls_out_fewer_prompts_is_refused() -> None:
    from grpo_parts_adapters.openrlhf.skipping import SkipStage

    with pytest.raises(GRPOPartsError, match="step_size"):
        SkipStage(HistorySkipper(step_size="fewer"), G)
