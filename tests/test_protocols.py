"""Protocol conformance for every registered implementation of every part.

For each ``IMPLEMENTATIONS`` entry (reference and optimized alike):

* the class defines every Protocol member; each method has the Protocol's parameter names, kinds,
  defaults and (resolved) type annotations, return type included; class attributes have the
  declared type -- checked on the class, so it runs even for classes this file cannot build;
* an instance (built by :data:`FACTORIES`) is an ``isinstance`` of the runtime-checkable Protocol
  and its methods return the declared data types with the documented shapes.

A new implementation only needs a factory here when its constructor needs arguments other than
``model``/``policy``/``draft``; otherwise it is built automatically.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch

import grpo_parts.attention as attention_part
import grpo_parts.draft as draft_part
import grpo_parts.filter as filter_part
import grpo_parts.sampler as sampler_part
from grpo_parts.attention.protocol import AttentionBackend, LogprobBatch, LogprobOutput
from grpo_parts.draft.protocol import DraftContext, DraftModel, DraftProposal, DraftTrainingBatch
from grpo_parts.errors import NotSupportedError
from grpo_parts.filter.protocol import CompletionFilter, FilterResult, ScoredBatch
from grpo_parts.registry import load
from grpo_parts.sampler.protocol import PromptBatch, Rollout, Sampler, SamplingParams
from grpo_parts.tiny import tiny_causal_lm

#: each part -> (its package, its Protocol)
PACKAGES: dict[str, tuple[Any, type]] = {
    "sampler": (sampler_part, Sampler),
    "draft": (draft_part, DraftModel),
    "attention": (attention_part, AttentionBackend),
    "filter": (filter_part, CompletionFilter),
}
REFERENCE = {"sampler": "reference", "draft": "frozen_lm", "attention": "reference", "filter": "keep_all"}
VOCAB = 32


def _policy() -> torch.nn.Module:
    return tiny_causal_lm("qwen2", vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, seed=0)


def _draft_lm() -> torch.nn.Module:
    return tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, seed=1)


#: (part, name) -> build(policy). Names not listed are built from their constructor's parameters.
FACTORIES: dict[tuple[str, str], Callable[[torch.nn.Module], Any]] = {
    ("sampler", "reference"): lambda policy: load(sampler_part.IMPLEMENTATIONS, "reference", "sampler")(
        policy
    ),
    ("draft", "frozen_lm"): lambda policy: load(draft_part.IMPLEMENTATIONS, "frozen_lm", "draft")(
        _draft_lm()
    ),
    ("draft", "small_lm"): lambda policy: load(draft_part.IMPLEMENTATIONS, "small_lm", "draft")(_draft_lm()),
    ("attention", "reference"): lambda policy: load(
        attention_part.IMPLEMENTATIONS, "reference", "attention"
    )(),
    ("filter", "keep_all"): lambda policy: load(filter_part.IMPLEMENTATIONS, "keep_all", "filter")(),
    ("filter", "cppo"): lambda policy: load(filter_part.IMPLEMENTATIONS, "cppo", "filter")(pruning_rate=0.5),
    ("filter", "pods"): lambda policy: load(filter_part.IMPLEMENTATIONS, "pods", "filter")(pruning_rate=0.5),
}


def _build(part: str, name: str, policy: torch.nn.Module) -> Any:
    if (part, name) in FACTORIES:
        return FACTORIES[(part, name)](policy)
    cls = load(PACKAGES[part][0].IMPLEMENTATIONS, name, part)
    known: dict[str, Callable[[], Any]] = {
        "model": lambda: policy,
        "policy": lambda: policy,
        "draft": lambda: FACTORIES[("draft", "frozen_lm")](policy),
    }
    kwargs = {}
    for p in list(inspect.signature(cls).parameters.values()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.name not in known:
            pytest.skip(
                f"no factory for {part} {name!r} (needs {p.name!r}): add one to FACTORIES in {__file__}"
            )
        kwargs[p.name] = known[p.name]()
    try:
        return cls(**kwargs)
    except (ImportError, NotSupportedError) as e:  # optional dependency (e.g. vllm) absent here
        if name == REFERENCE[part]:
            raise
        pytest.skip(f"{part} {name!r} cannot be built here: {e}")


ALL = [(part, name) for part, (mod, _) in PACKAGES.items() for name in mod.IMPLEMENTATIONS]


# ----------------------------------------------------------------------------- static conformance


def protocol_mismatches(cls: type, proto: type) -> list[str]:
    """Every way ``cls`` differs from ``proto`` (empty = conforms)."""
    problems: list[str] = []
    for attr, hint in typing.get_type_hints(proto).items():  # ClassVar[...] data members
        want = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.ClassVar else hint
        if not hasattr(cls, attr):
            problems.append(f"{attr}: missing (declared {hint})")
        elif isinstance(want, type) and not isinstance(getattr(cls, attr), want):
            problems.append(f"{attr}: expected {want.__name__}, got {type(getattr(cls, attr)).__name__}")
    methods = [n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")]
    for name in methods:
        impl = inspect.getattr_static(cls, name, None)
        if impl is None or not callable(impl):
            problems.append(f"{name}(): missing")
            continue
        sp, si = inspect.signature(getattr(proto, name)), inspect.signature(getattr(cls, name))
        want_params = [(p.name, p.kind, p.default) for p in sp.parameters.values()]
        got_params = [(p.name, p.kind, p.default) for p in si.parameters.values()]
        if want_params != got_params:
            problems.append(f"{name}(): parameters {got_params} != protocol's {want_params}")
        hp, hi = typing.get_type_hints(getattr(proto, name)), typing.get_type_hints(getattr(cls, name))
        for arg in sorted(set(hp) | set(hi)):
            if hp.get(arg) != hi.get(arg):
                problems.append(
                    f"{name}(): annotation of {arg!r} is {hi.get(arg)}, protocol says {hp.get(arg)}"
                )
    return problems


@pytest.mark.parametrize("part,name", ALL, ids=[f"{p}:{n}" for p, n in ALL])
def test_class_matches_protocol_signatures(part, name):
    mod, proto = PACKAGES[part]
    cls = load(mod.IMPLEMENTATIONS, name, part)
    assert protocol_mismatches(cls, proto) == []
    assert cls.name == name, f"{cls.__name__}.name is {cls.name!r} but it is registered as {name!r}"


def test_every_part_has_its_reference_and_auto_priority_is_registered():
    for part, (mod, _) in PACKAGES.items():
        assert REFERENCE[part] in mod.IMPLEMENTATIONS
        assert set(getattr(mod, "AUTO_PRIORITY", ())) <= set(mod.IMPLEMENTATIONS), part  # "auto" parts


# The checker itself must catch wrong methods and types (otherwise the test above proves nothing).


class _GoodFilter:
    name = "good"

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult: ...

    def not_supported_reasons(self, batch: ScoredBatch) -> list[str]: ...


class _RenamedParam(_GoodFilter):
    def select(self, scored: ScoredBatch, target_size: int | None = None) -> FilterResult: ...  # type: ignore[override]


class _WrongType(_GoodFilter):
    def select(self, batch: Rollout, target_size: int | None = None) -> FilterResult: ...  # type: ignore[override]


class _WrongReturn(_GoodFilter):
    def select(self, batch: ScoredBatch, target_size: int | None = None) -> torch.Tensor: ...  # type: ignore[override]


class _WrongDefault(_GoodFilter):
    def select(self, batch: ScoredBatch, target_size: int | None = 8) -> FilterResult: ...  # type: ignore[override]


class _MissingMethod:
    name = "missing"

    def select(self, batch: ScoredBatch, target_size: int | None = None) -> FilterResult: ...


class _WrongClassVar(_GoodFilter):
    name = 3  # type: ignore[assignment]


@pytest.mark.parametrize(
    "bad,fragment",
    [
        (_RenamedParam, "parameters"),
        (_WrongType, "annotation of 'batch'"),
        (_WrongReturn, "annotation of 'return'"),
        (_WrongDefault, "parameters"),
        (_MissingMethod, "not_supported_reasons(): missing"),
        (_WrongClassVar, "name: expected str"),
    ],
)
def test_checker_rejects_wrong_methods_and_types(bad, fragment):
    assert protocol_mismatches(_GoodFilter, CompletionFilter) == []
    problems = protocol_mismatches(bad, CompletionFilter)
    assert any(fragment in p for p in problems), problems
    if bad is _MissingMethod:  # the runtime isinstance check only sees missing members
        assert not isinstance(bad(), CompletionFilter)


# ----------------------------------------------------------------------------- instances and behaviour


@pytest.fixture(scope="module")
def policy():
    return _policy()


def _prompts() -> PromptBatch:
    return PromptBatch.from_lists([[3, 4, 5, 6], [7, 8]], pad_token_id=0)


@pytest.mark.parametrize("part,name", ALL, ids=[f"{p}:{n}" for p, n in ALL])
def test_instance_is_protocol_and_returns_declared_types(part, name, policy):
    impl = _build(part, name, policy)
    assert isinstance(impl, PACKAGES[part][1])
    {
        "sampler": _check_sampler,
        "draft": _check_draft,
        "attention": _check_attention,
        "filter": _check_filter,
    }[part](impl, policy)


def _check_sampler(s: Any, policy: torch.nn.Module) -> None:
    params = SamplingParams(group_size=3, max_new_tokens=5, eos_token_ids=(1,))
    reasons = s.not_supported_reasons(params)
    assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)
    if reasons:
        pytest.skip(f"{s.name} does not support the test setup here: {reasons}")
    ro = s.generate(_prompts(), params, torch.Generator().manual_seed(0))
    assert isinstance(ro, Rollout)
    assert ro.num_prompts == 2 and ro.completion_ids.shape[0] == 6 and ro.completion_ids.shape[1] <= 5
    assert ro.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert ro.logprobs.shape == ro.completion_ids.shape
    s.sync_weights(policy)


def _check_draft(d: Any, policy: torch.nn.Module) -> None:
    params = SamplingParams(temperature=1.0)
    assert d.not_supported_reasons(policy, params) == []
    d.bind_policy(policy)
    prompts = _prompts()
    d.reset(prompts.input_ids, prompts.attention_mask, torch.tensor([0, 1]))
    ctx = DraftContext(
        tokens=prompts.input_ids,
        lengths=prompts.attention_mask.sum(-1),
        rows=torch.arange(2),
        group_index=torch.arange(2),
    )
    if d.needs_hidden_states:
        pytest.skip(f"{d.name} needs policy hidden states; its sampler tests cover propose()")
    prop = d.propose(ctx, 3, params, torch.Generator().manual_seed(0))
    assert isinstance(prop, DraftProposal) and prop.tokens.shape == (2, 3)
    if prop.probs is not None:
        assert prop.probs.shape == (2, 3, VOCAB)
        torch.testing.assert_close(prop.probs.sum(-1), torch.ones(2, 3))
    d.observe(prop.tokens, torch.ones_like(prop.tokens), torch.arange(2))
    metrics = d.update(DraftTrainingBatch(prompts.input_ids, prompts.attention_mask, None, None))
    assert isinstance(metrics, dict)
    d.load_state_dict(d.state_dict())


def _check_attention(a: Any, policy: torch.nn.Module) -> None:
    batch = LogprobBatch(
        prompt_ids=torch.tensor([[0, 3, 4], [0, 3, 4], [5, 6, 7]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]]),
        completion_ids=torch.tensor([[9, 10, 0], [11, 12, 13], [14, 0, 0]]),
        completion_mask=torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]),
        group_index=torch.tensor([0, 0, 1]),
    )
    reasons = a.not_supported_reasons(policy, batch)
    assert isinstance(reasons, list)
    if reasons:
        pytest.skip(f"{a.name} does not support the test setup here: {reasons}")
    kernel = a.register_kernel()
    assert kernel is None or isinstance(kernel, str)
    out = a.completion_logprobs(policy, batch, 1.0, True)
    assert isinstance(out, LogprobOutput) and out.logprobs.shape == (3, 3)
    assert out.entropies is not None and out.entropies.shape == (3, 3)
    assert bool((out.logprobs[batch.completion_mask == 0] == 0).all())


def _check_filter(f: Any, policy: torch.nn.Module) -> None:
    batch = ScoredBatch(
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0, 0.0, 0.0, 0.7, -0.7]),
        group_index=torch.tensor([0, 0, 1, 1, 2, 2]),
        completion_lengths=torch.tensor([3, 4, 5, 6, 7, 8]),
    )
    assert isinstance(f.not_supported_reasons(batch), list)
    res = f.select(batch, 6)
    assert isinstance(res, FilterResult)
    assert res.kept.numel() <= 6 and (res.kept.numel() == 0 or int(res.kept.max()) < 6)
    assert res.extra_prompts_wanted >= 0


# ----------------------------------------------------------------------------- data types validate


def test_data_types_accept_well_formed_input():
    p = _prompts()
    assert p.num_prompts == 2 and p.input_ids.tolist()[1] == [0, 0, 7, 8]
    ro = Rollout(
        p.input_ids, p.attention_mask, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
        torch.zeros(2, 3), torch.tensor([0, 1]), 2,
    )  # fmt: skip
    assert ro.select(torch.tensor([1])).num_completions == 1
    assert ScoredBatch(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long)).size == 0
    assert FilterResult(torch.zeros(0, dtype=torch.long)).is_empty
    LogprobBatch.from_rollout(ro)
    DraftProposal(torch.zeros(2, 0, dtype=torch.long))


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: PromptBatch(torch.zeros(2, 3), torch.ones(2, 3)), "PromptBatch.input_ids"),
        (
            lambda: PromptBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 2, dtype=torch.long)),
            "PromptBatch.attention_mask",
        ),
        (lambda: PromptBatch(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[1, 1, 0]])), "left padding"),
        (
            lambda: Rollout(
                torch.ones(2, 2, dtype=torch.long),
                torch.ones(2, 2, dtype=torch.long),
                torch.ones(2, 3, dtype=torch.long),
                torch.ones(2, 3, dtype=torch.long),
                torch.zeros(2, 4),
                torch.tensor([0, 1]),
                2,
            ),  # fmt: skip
            "Rollout.logprobs",
        ),
        (
            lambda: ScoredBatch(torch.zeros(3), torch.zeros(2), torch.zeros(3, dtype=torch.long)),
            "ScoredBatch.advantages",
        ),
        (lambda: FilterResult(torch.tensor([2, 1])), "FilterResult.kept"),
        (
            lambda: FilterResult(torch.tensor([0]), extra_prompts_wanted=-1),
            "FilterResult.extra_prompts_wanted",
        ),
        (
            lambda: DraftContext(
                torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 4]), torch.arange(2), torch.arange(2)
            ),
            "DraftContext.lengths",
        ),
        (
            lambda: DraftProposal(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 2, 5)),
            "DraftProposal.probs",
        ),
        (
            lambda: LogprobBatch(
                torch.ones(2, 2, dtype=torch.long),
                torch.ones(2, 2, dtype=torch.long),
                torch.ones(3, 2, dtype=torch.long),
                torch.ones(3, 2, dtype=torch.long),
                torch.arange(2),
            ),  # fmt: skip
            "LogprobBatch.completion_ids",
        ),
    ],
)
def test_data_types_reject_malformed_input(build, field):
    from grpo_parts.errors import GRPOPartsError

    with pytest.raises(GRPOPartsError, match=field.replace(".", r"\.")):
        build()
