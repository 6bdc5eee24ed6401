"""Prompt skipping behind TRL (``GRPOPartsTrainer(prompt_skip="history")``, adapters/trl/skipping.py):
the generation batch keeps its size, its prompts are drawn through the skipper (TRL's, then the
seeded stream's), every trained row's advantage is TRL's times its prompt's ``1 / p`` times
``rolled out / drawn`` (a completion filter's own weight multiplied in), the skipper learns from the
rewards, the counters say what happened, and what cannot stay unbiased is refused in one line.
CPU, tiny float64 model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import trl  # noqa: E402
import trl_tiny as _tiny  # noqa: E402
from grpo_parts_adapters.trl import GRPOPartsTrainer, TRLPartsOptions  # noqa: E402
from grpo_parts_adapters.trl.skipping import row_prompt_key  # noqa: E402
from transformers import set_seed  # noqa: E402

from grpo_parts.core.inclusion import probabilities_for_target  # noqa: E402
from grpo_parts.errors import NotSupportedError  # noqa: E402
from grpo_parts.skip.history import HistorySkipper  # noqa: E402

PROMPTS = ["a b c", "d e", "f g h i", "j", "k l m", "n o", "p q r s t", "u v"]


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return _tiny.model()


def _skipper() -> HistorySkipper:
    """Every prompt of the dataset seen with equal rewards: the first half once (kept with p = 0.5),
    the second half twice (p = 0.25), so every batch is topped up and the weights differ."""
    sk = HistorySkipper(min_keep_prob=0.2, base_step=0.0, seed=3)
    for seen in (PROMPTS, PROMPTS[4:]):
        ids = [row_prompt_key({"prompt": p}) for p in seen]
        groups = torch.arange(len(ids)).repeat_interleave(2)
        sk.observe(
            ids, torch.zeros(2 * len(ids), dtype=torch.float64), groups, torch.full((2 * len(ids),), 3)
        )
    assert [sk.inclusion_probability(row_prompt_key({"prompt": p})) for p in PROMPTS] == [0.5] * 4 + [
        0.25
    ] * 4
    return sk


class _Recording(GRPOPartsTrainer):
    """Records each draw and every micro-batch TRL trains on."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.draws: list[Any] = []
        self.trained: list[dict[str, Any]] = []

    def _gp_skip_prompts(self, inputs):  # type: ignore[no-untyped-def]
        rows = super()._gp_skip_prompts(inputs)
        self.draws.append((inputs, rows, self._gp_stage.draw.rounds[0]))
        return rows

    def _compute_loss(self, model, inputs):  # type: ignore[no-untyped-def]
        self.trained.append(dict(inputs))
        return super()._compute_loss(model, inputs)


def _train(base: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, **parts: Any) -> tuple[Any, list[Any]]:
    """One step, 4 prompts x 4, ``loss_type='grpo'``; returns the trainer and TRL's own scored
    batches (advantages before any weight)."""
    scored: list[dict[str, Any]] = []
    original = trl.GRPOTrainer._generate_and_score_completions

    def spy(self, inputs):  # type: ignore[no-untyped-def]
        out = original(self, inputs)
        scored.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()})
        return out

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", spy)
    args = _tiny.config(per_device_train_batch_size=16, loss_type="grpo", max_steps=1)
    set_seed(0)
    tr, _ = _tiny.run(_Recording, base, args, prompt_skip=_skipper(), **parts)
    return tr, scored


def _key(batch: dict[str, Any], i: int) -> tuple[Any, ...]:
    p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
    return tuple(p), tuple(batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist())


def _expected(rnd: Any, out: dict[str, Any]) -> tuple[torch.Tensor, dict[tuple[Any, ...], float]]:
    """Independently of the adapter: the kept prompts' probabilities (the drawn prompts' raw ones
    raised to sum to 4, as the sampling design does) and each scored row's expected trained
    advantage, TRL's times ``1 / p`` of its prompt times ``rolled out / drawn``."""
    fresh = _skipper()
    drawn = rnd.kept_ids + rnd.skipped_ids
    raw = torch.tensor([fresh.inclusion_probability(i) for i in drawn], dtype=torch.float64)
    p = probabilities_for_target(raw, 4.0, 0.2)
    assert float(p.sum()) == pytest.approx(4.0)
    want = {_key(out, i): float(out["advantages"][i]) / float(p[i // 4]) * 4 / rnd.drawn for i in range(16)}
    return p[:4], want


def test_batch_keeps_its_size_and_each_row_carries_its_prompt_weight(
    base: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    tr, scored = _train(base, monkeypatch)
    ((inputs, rows, rnd),) = tr.draws
    assert len(rows) == len(inputs) == 16  # TRL's chunking and gathers see the size they expect
    assert len(rnd.kept_ids) == 4 and rnd.drawn == 4 + len(rnd.skipped_ids) > 4
    assert [row_prompt_key(r) for r in rows[::4]] == rnd.kept_ids  # the kept prompts', G each, in order
    # each trained row = TRL's advantage x 1 / p of its prompt x rolled out / drawn
    (out,) = scored
    p, want = _expected(rnd, out)
    factors = {round(1 / float(p[k]) * 4 / rnd.drawn, 9) for k in range(4)}
    assert factors != {1.0}  # the weights do change the advantages (p = 0.5 and 0.25 prompts drawn)
    trained = [(b, i) for b in tr.trained for i in range(b["completion_ids"].shape[0])]
    assert len(trained) == 16
    for b, i in trained:
        assert float(b["advantages"][i]) == pytest.approx(
            want[_key(b, i)], rel=1e-6, abs=1e-9
        )  # float32 advantages
    log = tr.state.log_history[0]
    assert log["parts/prompt_skip/prompts_drawn"] == rnd.drawn
    assert log["parts/prompt_skip/prompts_skipped"] == rnd.drawn - 4 > 0
    assert log["parts/prompt_skip/skip_rollout_tokens_saved"] > 0
    # the skipper learned from the rolled-out groups: each kept prompt's history grew
    fresh = _skipper()
    assert all(tr.gp_skipper.record(pid).seen > fresh.record(pid).seen for pid in rnd.kept_ids)


def test_a_completion_filter_multiplies_its_own_selection_in(
    base: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPPO after skipping: the kept rows keep the prompt weight (CPPO's own normaliser, no rescale)."""
    tr, scored = _train(base, monkeypatch, filter="cppo", filter_kwargs={"pruning_rate": 0.5})
    ((_, _, rnd),) = tr.draws
    (out,) = scored
    _, want = _expected(rnd, out)
    trained = [(b, i) for b in tr.trained for i in range(b["completion_ids"].shape[0])]
    assert 0 < len(trained) < 16
    for b, i in trained:
        assert float(b["advantages"][i]) == pytest.approx(
            want[_key(b, i)], rel=1e-6, abs=1e-9
        )  # float32 advantages
    assert tr.state.log_history[0]["parts/filter/calls"] == 1


@pytest.mark.parametrize(
    ("config", "parts", "needle"),
    [
        ({}, {}, "loss_type='dapo'"),  # TRL's default loss
        ({"loss_type": "grpo", "beta": 0.1}, {}, "beta=0.1"),
        ({"loss_type": "grpo", "scale_rewards": "batch"}, {}, "scale_rewards='batch'"),
        ({"loss_type": "grpo"}, {"refill_rounds": 3}, "refill_rounds=3"),
    ],
)
def test_refused_where_it_cannot_stay_unbiased(
    base: torch.nn.Module, config: dict[str, Any], parts: dict[str, Any], needle: str
) -> None:
    args = _tiny.config(**config)
    model = _tiny.policy_for(base, args)
    kw = dict(model=model, reward_funcs=_tiny.reward, args=args, train_dataset=_tiny.dataset(),
              processing_class=_tiny.tokenizer(), prompt_skip="history", parts=parts)  # fmt: skip
    with pytest.raises(NotSupportedError) as e:
        GRPOPartsTrainer(**kw, parts_options=TRLPartsOptions())
    assert needle in str(e.value) and "\n" not in str(e.value)
    lenient = GRPOPartsTrainer(**kw, parts_options=TRLPartsOptions(strict=False))
    assert lenient.gp_skipper is None and any(needle in r for r in lenient.parts_refused["prompt_skip"])


def test_a_step_that_rolls_out_fewer_prompts_is_refused(base: torch.nn.Module) -> None:
    """``step_size='fewer'`` would shrink TRL's fixed-size generation batch: refused in one line."""
    args = _tiny.config(loss_type="grpo")
    with pytest.raises(NotSupportedError, match="step_size='fewer'") as e:
        GRPOPartsTrainer(
            model=_tiny.policy_for(base, args), reward_funcs=_tiny.reward, args=args,
            train_dataset=_tiny.dataset(), processing_class=_tiny.tokenizer(), prompt_skip="history",
            prompt_skip_kwargs={"step_size": "fewer"},
        )  # fmt: skip
    assert "\n" not in str(e.value)


def test_none_and_a_skipper_that_never_skips_leave_trl_as_is(base: torch.nn.Module) -> None:
    for spec, kwargs in (("none", None), ("history", {"min_keep_prob": 1.0})):
        tr = _tiny.build(GRPOPartsTrainer, base, _tiny.config(), prompt_skip=spec, prompt_skip_kwargs=kwargs)
        assert tr.gp_skipper is None


@pytest.mark.parametrize(
    ("loss", "tail"),
    [
        ("dapo", "this run would refuse it: loss_type='dapo'"),
        ("grpo", "this run's loss would stay unbiased under it"),
    ],
)
def test_skipping_not_asked_for_says_in_one_line_it_is_opt_in_here(
    base: torch.nn.Module, caplog: pytest.LogCaptureFixture, loss: str, tail: str
) -> None:
    """Skipping is opt-in behind every door: behind TRL the loss is the user's, so the trainer says it
    is off, how to turn it on, and whether this run's loss could take it."""
    with caplog.at_level("INFO", logger="grpo_parts.skip.stage"):
        tr = _tiny.build(GRPOPartsTrainer, base, _tiny.config(loss_type=loss))
    assert tr.gp_skipper is None
    (line,) = [r.getMessage() for r in caplog.records if "prompt skipping" in r.getMessage()]
    assert line.startswith("grpo_parts: prompt skipping is opt-in (prompt_skip=history turns it on)")
    assert tail in line


def test_make_trainer_passes_the_skipper_through(base: torch.nn.Module) -> None:
    from grpo_parts_adapters.trl import make_trainer

    tr = make_trainer(
        copy.deepcopy(base), _tiny.reward, _tiny.dataset(), _tiny.tokenizer(), args=_tiny.config(loss_type="grpo"),
        prompt_skip="history", prompt_skip_kwargs={"min_keep_prob": 0.2},
    )  # fmt: skip
    assert isinstance(tr.gp_skipper, HistorySkipper) and tr.gp_skipper.min_keep_prob == 0.2


def test_the_skippers_history_and_dppos_generator_survive_trls_checkpoint(
    base: torch.nn.Module, tmp_path: Any
) -> None:
    """Two steps saved at each (TRL's ``save_steps``); a new trainer resumed from checkpoint-1 with
    ``train(resume_from_checkpoint=...)`` starts from the skipper's history and dppo's generator as
    they were at step 1 (adapters/trl/checkpoint.py), not empty."""
    from grpo_parts_adapters.trl.checkpoint import STATE_FILE

    args = _tiny.config(
        per_device_train_batch_size=16, loss_type="grpo", max_steps=2, output_dir=str(tmp_path),
        save_strategy="steps", save_steps=1, save_only_model=False,
    )  # fmt: skip
    parts: dict[str, Any] = dict(prompt_skip="history", filter="dppo", filter_kwargs={"pruning_rate": 0.5})
    set_seed(0)
    first, _ = _tiny.run(GRPOPartsTrainer, base, args, **parts)
    saved = torch.load(tmp_path / "checkpoint-1" / STATE_FILE, weights_only=True)
    assert saved["prompt_skip"]["ids"].numel() > 0 and "generator" in saved["filter"]
    assert (tmp_path / "checkpoint-2" / STATE_FILE).is_file()

    resumed = GRPOPartsTrainer(
        model=_tiny.policy_for(base, args), reward_funcs=_tiny.reward, args=args, train_dataset=_tiny.dataset(),
        processing_class=_tiny.tokenizer(), **parts,
    )  # fmt: skip
    seen: dict[str, Any] = {}
    original = resumed.gp_skipper.state_dict

    def at_first_generation(inputs):  # type: ignore[no-untyped-def]
        seen.setdefault("history", original())  # the history the resumed run starts step 2 with
        seen.setdefault("filter", resumed.gp_filter.state_dict())
        return skip_prompts(inputs)

    skip_prompts = resumed._gp_skip_prompts
    resumed._gp_skip_prompts = at_first_generation  # type: ignore[method-assign]
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert torch.equal(seen["history"]["ids"], saved["prompt_skip"]["ids"])
    assert torch.equal(seen["history"]["seen"], saved["prompt_skip"]["seen"])
    assert torch.equal(seen["filter"]["generator"], saved["filter"]["generator"])
