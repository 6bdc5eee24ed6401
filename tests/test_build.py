"""grpo_parts.build: the one builder of every part, and every door (train, TRL, verl, OpenRLHF) using it."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest
import torch

from grpo_parts import build
from grpo_parts.build import (
    build_attention,
    build_draft,
    build_filter,
    build_part,
    build_sampler,
    choose_attention,
    policy_arg,
)
from grpo_parts.errors import GRPOPartsError
from grpo_parts.tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1, seed=0)


@pytest.fixture(scope="module")
def small() -> torch.nn.Module:
    return tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1, seed=1)


# ----------------------------------------------------------------------------------------- by name


def test_sampler_by_name_gets_the_policy(policy: torch.nn.Module) -> None:
    from grpo_parts.sampler.reference import ReferenceSampler

    s = build_sampler("reference", policy)
    assert isinstance(s, ReferenceSampler) and s.model is policy


def test_speculative_sampler_gets_policy_draft_and_a_pydantic_config(policy: torch.nn.Module) -> None:
    from grpo_parts.draft.ngram import NGramDraft

    draft = build_draft("ngram", policy, kwargs={"max_ngram": 3})
    assert isinstance(draft, NGramDraft) and draft.hi == 3  # no model argument: not given one
    s: Any = build_sampler("speculative", policy, draft=draft, kwargs={"max_draft_tokens": 3})
    assert s.model is policy and s.draft is draft and s.config.max_draft_tokens == 3


def test_draft_policy_argument_from_the_signature(policy: torch.nn.Module, small: torch.nn.Module) -> None:
    from grpo_parts.draft.eagle import EagleDraft
    from grpo_parts.draft.reference import FrozenLMDraft

    assert policy_arg(EagleDraft) == "policy" and policy_arg(FrozenLMDraft) == "model"
    eagle: Any = build_draft("eagle", policy)
    assert isinstance(eagle, EagleDraft)
    frozen: Any = build_draft("frozen_lm", policy)
    assert isinstance(frozen, FrozenLMDraft) and frozen.model is policy  # default: the policy
    own: Any = build_draft("frozen_lm", policy, kwargs={"model": small})
    assert own.model is small  # the kwargs name the model argument: a frozen draft's own LM
    assert build_draft(None, policy) is None


def test_attention_and_filter_by_name() -> None:
    from grpo_parts.attention.reference import RepeatedPrefixAttention
    from grpo_parts.attention.shared_prefix import SharedPrefixAttention
    from grpo_parts.filter.reference import KeepAll

    assert isinstance(build_attention("reference"), RepeatedPrefixAttention)
    sp: Any = build_attention("shared_prefix", kwargs={"kernel": "sdpa"})
    assert isinstance(sp, SharedPrefixAttention) and sp.kernel == "sdpa"
    assert isinstance(build_filter("keep_all"), KeepAll)
    assert build_filter("cppo", kwargs={"k": 2}).k == 2  # type: ignore[attr-defined]


def test_default_kwargs_when_none_are_given() -> None:
    assert build_filter("cppo").pruning_rate == 0.75  # type: ignore[attr-defined]
    assert build_filter("pods").pruning_rate == 0.5  # type: ignore[attr-defined]
    assert build_filter("cppo", kwargs={"pruning_rate": 0.25}).pruning_rate == 0.25  # type: ignore[attr-defined]


# -------------------------------------------------------------------------------- instances, errors


def test_instances_pass_through_unchanged(policy: torch.nn.Module) -> None:
    s, f, a = build_sampler("reference", policy), build_filter("keep_all"), build_attention("reference")
    d = build_draft("ngram", policy)
    assert build_sampler(s, policy) is s and build_filter(f) is f and build_attention(a) is a
    assert build_draft(d, policy) is d
    for part, inst in (("sampler", s), ("draft", d), ("attention", a), ("filter", f)):
        assert build_part(part, inst, policy) is inst
    assert build_part("attention", None, policy) is None  # None: the framework's own path


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: build_filter(build_filter("keep_all"), kwargs={"k": 1}), "filter_kwargs: only used when filter is given by name, got ['k']"),
        (lambda p: build_part("attention", None, p, kwargs={"kernel": "sdpa"}), "attention_kwargs: only used when attention is given by name, got ['kernel']"),
        (lambda p: build_draft("ngram", p, kwargs={"bogus": 1}), "draft_kwargs.bogus: draft 'ngram' has no argument 'bogus' (got 1); expected one of ['history_per_prompt', 'max_ngram', 'max_prompts', 'min_ngram']"),
        (lambda p: build_draft("ngram", p, kwargs={"max_ngram": "abc"}), "draft_kwargs.max_ngram: expected int, got 'abc' (draft 'ngram')"),
        (lambda p: build_draft("ngram", p, kwargs={"max_ngram": -1}), "draft_kwargs: draft 'ngram' rejected {'max_ngram': -1}: min_ngram/max_ngram: expected 1 <= min_ngram <= max_ngram"),
        (lambda p: build_filter("cppo", kwargs={"pruning_rate": 1.5}, where="parts.filter_kwargs"), "parts.filter_kwargs.pruning_rate: Input should be less than 1, got 1.5 (filter 'cppo')"),
        (lambda p: build_sampler("speculative", p, draft=build_draft("ngram", p), kwargs={"foo": 1}), "sampler_kwargs.foo: sampler 'speculative' has no argument 'foo' (got 1)"),
        (lambda p: build_sampler("speculative", p, draft=build_draft("ngram", p), kwargs={"max_draft_tokens": 0}), "sampler_kwargs.max_draft_tokens: Input should be greater than or equal to 1, got 0 (sampler 'speculative')"),
        (lambda p: build_draft("frozen_lm", p, kwargs={"model": "gpt2"}), "draft_kwargs.model: expected a torch.nn.Module (default: the policy), got 'gpt2'"),
        (lambda p: build_sampler("speculative", p), "draft: sampler 'speculative' needs a draft, got None"),
        (lambda p: build_sampler("reference", p, draft=build_draft("ngram", p)), "draft: sampler 'reference' takes no draft, got NGramDraft"),
        (lambda p: build_sampler("reference", None), "sampler: 'reference' is built on the policy model (model=), got None"),
        (lambda p: build_attention("nope"), "attention: unknown implementation 'nope'"),
        (lambda p: build_attention("auto"), "attention: 'auto' needs the model to choose a backend"),
    ],
)  # fmt: skip
def test_errors_are_one_line_naming_the_field(policy: torch.nn.Module, call: Any, message: str) -> None:
    with pytest.raises(GRPOPartsError) as e:
        call(policy)
    text = str(e.value)
    assert message in text and "\n" not in text


# ------------------------------------------------------------------------------------------- auto


def test_auto_is_resolved_once_with_its_explanation(
    policy: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    real = build.choose

    def counting(table: Any, priority: Any, part: str, reasons_for: Any) -> Any:
        calls.append(part)
        return real(table, priority, part, reasons_for)

    monkeypatch.setattr(build, "choose", counting)
    caplog.set_level(logging.INFO, logger="grpo_parts.build")
    backend = build_attention("auto", policy)
    assert calls == ["attention"]  # registry.choose, once
    assert type(backend).__name__ == "SharedPrefixAttention"
    logged = [r.message for r in caplog.records if "attention='auto'" in r.message]
    assert logged == ["grpo_parts: attention='auto' chose 'shared_prefix'"]  # Choice.explain(), once


def test_auto_falls_back_with_reasons_and_kwargs_only_where_taken(
    policy: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_parts.attention.shared_prefix import SharedPrefixAttention

    monkeypatch.setattr(SharedPrefixAttention, "not_supported_reasons", lambda self, m, b=None: ["no"])
    choice, kwargs = choose_attention(policy, {"kernel": "sdpa"})
    assert choice.name == "reference" and choice.refused == {"shared_prefix": ["no"]}
    assert kwargs == {}  # the reference takes no kernel
    assert "refused 'shared_prefix': no" in choice.explain()
    assert (
        type(build_attention("auto", policy, kwargs={"kernel": "sdpa"})).__name__ == "RepeatedPrefixAttention"
    )
    with pytest.raises(GRPOPartsError, match="attention_kwargs.kernal: attention 'shared_prefix'"):
        choose_attention(policy, {"kernal": "sdpa"})  # the kwargs must fit the first of the priority


def test_get_class_is_typed_and_finds_the_class() -> None:
    from grpo_parts.sampler import get_sampler_class
    from grpo_parts.sampler.reference import ReferenceSampler

    assert get_sampler_class("reference") is ReferenceSampler


# ------------------------------------------------------------------------- every door, one builder


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every construction by name through grpo_parts.build (``_named``) recorded as its part."""
    seen: list[str] = []
    real = build._named

    def spy(part: str, name: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(f"{part}:{name}")
        return real(part, name, *args, **kwargs)

    monkeypatch.setattr(build, "_named", spy)
    return seen


def test_train_builds_through_the_builder(policy: torch.nn.Module, counted: list[str]) -> None:
    from grpo_parts.train.config import PartsConfig
    from grpo_parts.train.step.parts import build_parts

    parts = build_parts(PartsConfig.for_door("train", {"filter": "cppo"}), policy)
    assert parts.filter.pruning_rate == 0.75 and parts.sampler.draft is parts.draft
    assert sorted(counted) == [
        "attention:shared_prefix", "draft:ngram", "filter:cppo", "prompt_skip:none", "sampler:speculative"
    ]  # fmt: skip


def test_trl_build_part_is_the_builder(policy: torch.nn.Module, counted: list[str]) -> None:
    pytest.importorskip("trl")
    trl_build = importlib.import_module("grpo_parts_adapters.trl.build")
    trainer = importlib.import_module("grpo_parts_adapters.trl.trainer")
    assert trainer.build_part is build.build_part and trainer.choose_attention is build.choose_attention
    trl_build.build_part("filter", "cppo", policy)
    trl_build.build_part("draft", "ngram", policy)
    trl_build.build_part("sampler", "reference", policy)
    assert counted == ["filter:cppo", "draft:ngram", "sampler:reference"]
    with pytest.raises(GRPOPartsError, match="filter_kwargs: only used when"):
        trl_build.build_part("filter", build_filter("keep_all"), policy, {"k": 1})


def test_verl_builds_through_the_builder(policy: torch.nn.Module, counted: list[str]) -> None:
    pytest.importorskip("verl")
    from grpo_parts_adapters.verl.filtering import FilterOptions
    from grpo_parts_adapters.verl.options import EngineOptions

    FilterOptions(name="zero_variance").build()
    FilterOptions(name="cppo", kwargs={"k": 2}).build()
    EngineOptions(attention="shared_prefix", kernel="sdpa").backend()
    assert counted == [
        "filter:zero_variance",
        "filter:cppo",
        "attention:shared_prefix",
    ]
    agent_loop = pytest.importorskip("grpo_parts_adapters.verl.agent_loop")
    counted.clear()
    s: Any = agent_loop.build_sampler("speculative", policy, draft="ngram")
    assert counted == ["draft:ngram", "sampler:speculative"] and s.model is policy


def test_openrlhf_builds_through_the_builder(policy: torch.nn.Module, counted: list[str]) -> None:
    pytest.importorskip("openrlhf")
    from grpo_parts_adapters.openrlhf.config import OpenRLHFPartsConfig as PartsConfig

    parts = PartsConfig(attention="auto", filter="cppo", filter_kwargs='{"k": 3}')
    assert parts.build_filter().k == 3
    assert type(parts.build_attention(policy)).__name__ == "SharedPrefixAttention"
    assert counted == ["filter:cppo", "attention:shared_prefix"]
