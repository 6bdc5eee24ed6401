"""GRPOPartsTrainer on a stock TRL 1.16 GRPOTrainer: a tiny float64 Qwen2, an offline tokenizer,
a few real training steps per test (CPU)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import trl_tiny as _tiny  # noqa: E402
from grpo_parts_adapters.trl import GRPOPartsTrainer, TRLPartsOptions, make_trainer  # noqa: E402
from grpo_parts_adapters.trl.rows import round_kept  # noqa: E402
from transformers import set_seed  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from grpo_parts.errors import NotSupportedError  # noqa: E402
from grpo_parts.parts_config import PartsConfig


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    return _tiny.model()


def _assert_grads_close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float
) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


class _RecordRollouts(GRPOPartsTrainer):
    """Records what the grpo_parts sampler returned to TRL, call by call."""

    rollouts: list[tuple[list[list[int]], Any]] = []

    def _generate_single_turn(self, prompt_ids, *a, **k):  # type: ignore[no-untyped-def]
        out = super()._generate_single_turn(prompt_ids, *a, **k)
        type(self).rollouts.append(([list(p) for p in prompt_ids], out[0]))
        return out


class _ReplayRollouts(GRPOTrainer):
    """Stock GRPOTrainer whose sampling step returns the recorded completions (same batch)."""

    rollouts: list[tuple[list[list[int]], Any]] = []

    def _generate_single_turn(self, prompt_ids, *a, **k):  # type: ignore[no-untyped-def]
        prompts, completions = type(self).rollouts.pop(0)
        assert [list(p) for p in prompt_ids] == prompts  # TRL tokenized the same prompts
        return completions, None


def test_reference_parts_equal_plain_trl(base: torch.nn.Module) -> None:
    """Same seed, same batch: the stock GRPOTrainer replays the completions the reference sampler
    drew (everything else -- tokenization, rewards, advantages, shuffling, loss -- is TRL's own), and
    the first steps' losses and gradients equal the reference parts'. TRL's fused LM head accumulates
    log-probs in float32 even for a float64 model, so agreement is to float32 rounding."""
    args = _tiny.config(gradient_accumulation_steps=2, max_steps=2)
    _RecordRollouts.rollouts = []
    set_seed(0)
    parts, cap_parts = _tiny.run(
        _RecordRollouts, base, args, sampler="reference", attention="reference", filter="keep_all"
    )
    assert len(_RecordRollouts.rollouts) == 2  # one rollout per optimizer step
    _ReplayRollouts.rollouts = list(_RecordRollouts.rollouts)
    set_seed(0)
    plain, cap_plain = _tiny.run(_ReplayRollouts, base, args)
    assert not _ReplayRollouts.rollouts
    lp, lq = plain.state.log_history[0], parts.state.log_history[0]
    assert lq["completions/mean_length"] == lp["completions/mean_length"] and lq["reward"] == lp["reward"]
    assert lq["loss"] == pytest.approx(lp["loss"], rel=1e-5, abs=1e-7)  # TRL sums its loss in float32
    _assert_grads_close(cap_plain.grads[0], cap_parts.grads[0], rtol=1e-5, atol=1e-8)
    assert lq["parts/filter/kept_fraction"] == 1.0 and len(cap_parts.grads) == 2


def _has(table: str, name: str) -> bool:
    import importlib

    return name in importlib.import_module(f"grpo_parts.{table}").IMPLEMENTATIONS


@pytest.mark.skipif(not _has("attention", "shared_prefix"), reason="shared_prefix backend not registered yet")
def test_shared_prefix_equals_reference_parts(base: torch.nn.Module) -> None:
    """Policy, old-policy (num_iterations=2 makes TRL compute it) and reference (beta > 0) log-probs
    through the shared-prefix backend, with TRL's default gradient checkpointing: loss and grads
    equal the reference backend's within 1e-6 (float64)."""
    args = _tiny.config(gradient_accumulation_steps=2, num_iterations=2, beta=0.1, max_steps=2)
    assert args.gradient_checkpointing
    runs = {}
    for name in ("reference", "shared_prefix"):
        set_seed(0)
        runs[name] = _tiny.run(GRPOPartsTrainer, base, args, attention=name)
    (ref, cap_ref), (sp, cap_sp) = runs["reference"], runs["shared_prefix"]
    for a, b in zip(ref.state.log_history[:2], sp.state.log_history[:2]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    for ga, gb in zip(cap_ref.grads, cap_sp.grads):
        _assert_grads_close(ga, gb, rtol=0, atol=1e-6)


def _rows(batch: dict[str, Any], idx: list[int] | None = None) -> list[tuple[Any, ...]]:
    """Rows as hashable (prompt tokens, completion tokens, advantage) tuples."""
    n = batch["completion_ids"].shape[0]
    out = []
    for i in range(n) if idx is None else idx:
        p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        c = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        out.append((tuple(p), tuple(c), round(float(batch["advantages"][i]), 12)))
    return sorted(out)


def test_filter_trains_exactly_the_kept_rows(base: torch.nn.Module) -> None:
    """CPPO keeps half the completions: the micro-batches TRL trains on hold exactly the kept rows,
    ``num_items_in_batch`` is the kept token count, the loss is normalised by it, and the old-policy /
    reference forwards ran on the kept rows only."""
    args = _tiny.config(gradient_accumulation_steps=2, num_iterations=2, beta=0.1, max_steps=1)
    set_seed(0)
    tr, _ = _tiny.run(_tiny.Recording, base, args, filter="cppo", filter_kwargs={"pruning_rate": 0.5})
    ((out, scored),) = tr.scored
    res = tr.gp_filter.select(scored, None)
    (kept,), _ = round_kept([scored], [res.kept], args.steps_per_generation, "up")
    assert 0 < kept.numel() < scored.size
    assert kept.numel() % args.steps_per_generation == 0
    trained = [r for b in tr.trained for r in _rows(b)]
    assert sorted(trained) == _rows(out, kept.tolist())
    kept_tokens = int(out["completion_mask"][kept].sum())
    for b in tr.trained:
        assert int(b["num_items_in_batch"]) == kept_tokens
    # dapo loss at step 1 (ratio 1, policy == reference): -sum_i A_i * len_i / kept tokens
    lens = out["completion_mask"][kept].sum(-1).double()
    want = float(-(out["advantages"][kept].double() * lens).sum() / kept_tokens)
    assert sum(tr.losses) == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert tr.nograd_rows == [kept.numel(), kept.numel()]  # old-policy and reference, kept rows only
    log = tr.state.log_history[0]
    assert log["parts/filter/num_kept"] == kept.numel()
    assert log["parts/filter/kept_fraction"] == pytest.approx(kept.numel() / scored.size)


def _reward_some_prompts(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    """Only prompts "a b c" and "d e" get a completion-dependent reward: the others are zero-variance."""
    return [_VOWELS([c])[0] if p in ("a b c", "d e") else 0.0 for p, c in zip(prompts, completions)]


_VOWELS = _tiny.reward


def test_zero_variance_filter_with_refill(base: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tiny, "reward", _reward_some_prompts)
    args = _tiny.config(gradient_accumulation_steps=2, max_steps=2)
    set_seed(0)
    tr, _ = _tiny.run(_tiny.Recording, base, args, filter="zero_variance", parts={"refill_rounds": 15})
    assert len(tr.trained) == 4  # 2 steps x 2 micro-batches
    for step in (tr.trained[:2], tr.trained[2:]):
        rows = [r for b in step for r in _rows(b)]
        assert len(rows) == 8  # refilled to the generation batch's size
        assert {r[0] for r in rows} <= {(3, 4, 5), (6, 7)}  # only the informative prompts ("a b c", "d e")
    assert max(h.get("parts/filter/rounds", 0) for h in tr.state.log_history) > 1


def test_all_parts_speculative_sampler_logs_acceptance(base: torch.nn.Module) -> None:
    try:
        from grpo_parts.draft.eagle import EagleDraft
        from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
    except ImportError as e:  # pragma: no cover - until the speculative sampler lands
        pytest.skip(f"speculative sampler not available: {e}")
    args = _tiny.config(max_steps=2)

    by_name = _has("sampler", "speculative") and _has("draft", "eagle")

    def parts(policy: torch.nn.Module) -> dict[str, Any]:
        cfg = SpeculativeConfig(draft_tokens=3)
        sampler: dict[str, Any] = (
            {"sampler": "speculative", "draft": "eagle", "sampler_kwargs": {"config": cfg}}
            if by_name  # registered: built on the trainer's policy by the adapter
            else {"sampler": SpeculativeSampler(policy, EagleDraft(policy), cfg)}
        )
        return {
            **sampler,
            "attention": "auto",  # shared_prefix where it supports the model
            "filter": "cppo",
            "filter_kwargs": {"pruning_rate": 0.5},
        }

    set_seed(0)
    tr, cap = _tiny.run(GRPOPartsTrainer, base, args, make_parts=parts)
    assert len(cap.grads) == 2  # all four parts on a stock GRPOTrainer: two optimizer steps
    assert tr.gp_attention is not None and tr.gp_filter is not None
    for log in tr.state.log_history[:2]:
        assert log["parts/filter/kept_fraction"] == 0.5
        assert 0.0 <= log["parts/sampler/draft_accept_rate"] <= 1.0
        assert log["parts/sampler/accepted_per_verify"] >= 1.0
        assert log["parts/sampler/draft_updates"] >= 1  # the online draft learned from this rollout


def test_part_that_cannot_apply_says_why(base: torch.nn.Module) -> None:
    args = _tiny.config(generation_kwargs={"do_sample": True})
    with pytest.raises(NotSupportedError, match="generation_kwargs"):
        _tiny.build(GRPOPartsTrainer, base, args, sampler="reference")
    tr = make_trainer(
        copy.deepcopy(base),
        _tiny.reward,
        _tiny.dataset(),
        _tiny.tokenizer(),
        args=args,
        sampler="reference",
        attention="auto",
        parts_options=TRLPartsOptions(strict=False),
    )
    assert tr.gp_sampler is None and "generation_kwargs" in " ".join(tr.parts_refused["sampler"])
    assert tr.gp_attention is not None and "chose" in tr.parts_choice["attention"]


def test_config_reasons_name_the_setting() -> None:
    from types import SimpleNamespace

    from grpo_parts_adapters.trl.options import attention_config_reasons, sampler_config_reasons

    t = SimpleNamespace(
        use_vllm=True, args=SimpleNamespace(vllm_mode="server", generation_kwargs=None), _is_vlm=True
    )
    assert any("vllm_mode='server'" in r for r in sampler_config_reasons(t))
    assert not any("multimodal" in r for r in attention_config_reasons(t))  # VLMs are served (#55)


def test_eval_batches_are_not_filtered_and_do_not_train_the_draft(base: torch.nn.Module) -> None:
    try:
        from grpo_parts.draft.eagle import EagleDraft
        from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
    except ImportError as e:  # pragma: no cover - until the speculative sampler lands
        pytest.skip(f"speculative sampler not available: {e}")
    args = _tiny.config(per_device_eval_batch_size=8)
    policy = copy.deepcopy(base)
    sampler = SpeculativeSampler(policy, EagleDraft(policy), SpeculativeConfig(draft_tokens=2))
    tr = GRPOPartsTrainer(
        model=policy,
        reward_funcs=_tiny.reward,
        args=args,
        train_dataset=_tiny.dataset(),
        eval_dataset=_tiny.dataset(4),
        processing_class=_tiny.tokenizer(),
        sampler=sampler,
        filter="cppo",
        filter_kwargs={"k": 2},
    )
    metrics = tr.evaluate()
    assert "eval_parts/sampler/accepted_per_verify" in metrics
    assert not any("draft_update" in k for k in metrics)  # eval rollouts leave the online draft alone
    filter_keys = {k for k in metrics if k.startswith("eval_parts/filter")}
    assert filter_keys == {"eval_parts/filter/calls", "eval_parts/filter/fallbacks"}  # not pruned:
    assert metrics["eval_parts/filter/calls"] == 0 == metrics["eval_parts/filter/fallbacks"]  # no call
    assert metrics["eval_parts/sampler/rollouts"] == 1 and metrics["eval_parts/sampler/fallbacks"] == 0
    assert sampler.config.train_draft  # restored after the eval rollout


def test_build_part_by_name() -> None:
    from grpo_parts_adapters.trl.build import build_part

    from grpo_parts.draft.reference import FrozenLMDraft
    from grpo_parts.errors import GRPOPartsError
    from grpo_parts.sampler.reference import ReferenceSampler

    policy, small = _tiny.model(), _tiny.model(seed=1)
    sampler = build_part("sampler", "reference", policy)
    assert isinstance(sampler, ReferenceSampler) and sampler.model is policy
    draft = build_part("draft", "frozen_lm", policy, {"model": small})
    assert isinstance(draft, FrozenLMDraft) and draft.model is small  # a frozen draft is its own LM
    filt = build_part("filter", "cppo", policy, {"k": 2})
    assert filt.k == 2
    with pytest.raises(GRPOPartsError, match="unknown implementation"):
        build_part("attention", "nope", policy)
    with pytest.raises(GRPOPartsError, match="only used when"):
        build_part("attention", None, policy, {"kernel": "sdpa"})


def test_micro_batches_hold_whole_groups_with_an_attention_backend(base: torch.nn.Module) -> None:
    """TRL shuffles rows one by one; with an attention backend the adapter re-cuts the batch so each
    micro-batch holds whole prompt groups (what a shared-prefix forward needs to share anything)."""
    args = _tiny.config(gradient_accumulation_steps=2, max_steps=2)  # 2 prompts x 4 = 2 micro-batches of 4
    set_seed(0)
    tr, _ = _tiny.run(_tiny.Recording, base, args, attention="reference")
    assert len(tr.trained) == 4
    for b in tr.trained:
        prompts = {r[0] for r in _rows(b)}
        assert len(prompts) == 1  # one whole group of G = 4 per micro-batch
    set_seed(0)
    off, _ = _tiny.run(
        _tiny.Recording, base, args, attention="reference", parts=PartsConfig(group_rows=False)
    )
    assert any(len({r[0] for r in _rows(b)}) > 1 for b in off.trained)  # TRL's own row shuffle
    # the same trainer given by the one parts configuration: the same parts, and they ran
    set_seed(0)
    via, _ = _tiny.run(_tiny.Recording, base, args, parts=PartsConfig(attention="reference", filter="cppo"))
    assert via.gp_attention is not None and via.gp_filter.name == "cppo"
    assert via.parts_config.filter == "cppo" and via._gp_counters.total("attention") > 0
