"""Bad input raises a clear error naming the field, what it got and what it was expected to be.

One test per case (parametrized ids); each asserts on every fragment of the message.
Plain-tensor checks raise :class:`GRPOPartsError`; config models raise pydantic ``ValidationError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from grpo_parts.core import (
    AdvantageConfig,
    LossConfig,
    aggregate,
    group_advantages,
    grpo_loss,
    kl_estimate,
    token_logprobs,
)
from grpo_parts.errors import GRPOPartsError
from grpo_parts.registry import load
from grpo_parts.sampler import IMPLEMENTATIONS as SAMPLERS
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.types import Rollout, ScoredBatch

R = torch.tensor([1.0, 0.0, 1.0, 0.5])
G = torch.tensor([0, 0, 1, 1])
LP = torch.zeros(2, 3)
M = torch.ones(2, 3, dtype=torch.long)
A = torch.tensor([1.0, -1.0])


def _rollout(group_index: torch.Tensor, num_prompts: int = 2) -> Rollout:
    ids = torch.ones(2, 2, dtype=torch.long)
    return Rollout(ids, ids, ids, ids, torch.zeros(2, 2), group_index, num_prompts)


def _sample_with_big_token_id() -> Any:
    from grpo_parts.tiny import tiny_causal_lm

    sampler = load(SAMPLERS, "reference", "sampler")(
        tiny_causal_lm(vocab_size=16, hidden_size=8, num_heads=2)
    )
    return sampler.generate(PromptBatch.from_lists([[1, 99]], 0), SamplingParams(max_new_tokens=2))


# (id, call, fragments the message must contain: field, what it got, what it expected)
CORE_CASES: list[tuple[str, Callable[[], Any], list[str]]] = [
    # --- mismatched shapes
    (
        "group_index-length",
        lambda: group_advantages(R, G[:3]),
        ["group_index", "got [3]", "expected shape [4]"],
    ),
    ("rewards-2d", lambda: group_advantages(R.view(2, 2), G), ["rewards", "got shape [2, 2]", "1-D"]),
    (
        "old_logps-shape",
        lambda: grpo_loss(LP, torch.zeros(2, 4), A, M),
        ["old_logps", "got [2, 4]", "[2, 3]"],
    ),
    ("mask-shape", lambda: grpo_loss(LP, LP, A, M[:1]), ["mask", "got [1, 3]", "expected shape [2, 3]"]),
    (
        "advantages-shape",
        lambda: grpo_loss(LP, LP, torch.zeros(3), M),
        ["advantages", "got [3]", "shape [2]"],
    ),
    (
        "advantages-2d-shape",
        lambda: grpo_loss(LP, LP, torch.zeros(2, 2), M),
        ["advantages", "got [2, 2]", "[2, 3]"],
    ),
    (
        "ref_logps-shape",
        lambda: grpo_loss(LP, LP, A, M, LossConfig(kl_coef=0.1), torch.zeros(2, 2)),
        ["ref_logps", "got [2, 2]", "[2, 3]"],
    ),
    ("logps-1d", lambda: grpo_loss(torch.zeros(3), torch.zeros(3), A, M), ["logps", "got shape [3]", "2-D"]),
    ("kl-shape", lambda: kl_estimate(LP, torch.zeros(3, 2)), ["ref_logps", "got [3, 2]", "[2, 3]"]),
    ("aggregate-mask-shape", lambda: aggregate(LP, M[:, :2], "token-mean"), ["mask", "got [2, 2]", "[2, 3]"]),
    (
        "token_logprobs-shape",
        lambda: token_logprobs(torch.zeros(2, 3, 5), M[:, :2]),
        ["tokens", "got [2, 2]", "[2, 3]"],
    ),
    # --- wrong dtype / type
    ("rewards-int", lambda: group_advantages(G, G), ["rewards", "got torch.int64", "floating"]),
    (
        "group_index-float",
        lambda: group_advantages(R, G.float()),
        ["group_index", "got torch.float32", "integer"],
    ),
    ("rewards-list", lambda: group_advantages([1.0, 2.0], G[:2]), ["rewards", "got list", "torch.Tensor"]),
    ("logps-int", lambda: grpo_loss(M, M, A, M), ["logps", "got torch.int64", "floating"]),
    ("old_logps-int", lambda: grpo_loss(LP, M, A, M), ["old_logps", "got torch.int64", "floating"]),
    (
        "advantages-int",
        lambda: grpo_loss(LP, LP, torch.tensor([1, 0]), M),
        ["advantages", "torch.int64", "floating"],
    ),
    ("advantages-none", lambda: grpo_loss(LP, LP, None, M), ["advantages", "got NoneType", "torch.Tensor"]),
    (
        "tokens-float",
        lambda: token_logprobs(torch.zeros(2, 5), torch.zeros(2)),
        ["tokens", "float32", "integer"],
    ),
    # --- empty batch
    (
        "rewards-empty",
        lambda: group_advantages(torch.zeros(0), G[:0]),
        ["rewards", "got shape [0]", "non-empty"],
    ),
    (
        "logps-empty",
        lambda: grpo_loss(LP[:0], LP[:0], A[:0], M[:0]),
        ["logps", "got shape [0, 3]", "non-empty"],
    ),
    (
        "prompts-empty",
        lambda: PromptBatch.from_lists([], 0),
        ["prompts", "empty list", "at least one prompt"],
    ),
    (
        "prompt-empty-row",
        lambda: PromptBatch.from_lists([[1], []], 0),
        ["prompts[1]", "empty prompt", "at least one"],
    ),
    (
        "prompt-mask-all-zero",
        lambda: PromptBatch(torch.ones(2, 2, dtype=torch.long), torch.tensor([[1, 1], [0, 0]])),
        ["PromptBatch.attention_mask", "row 1 has 0", ">= 1 real token"],
    ),
    # --- group index out of range
    (
        "group_index-negative",
        lambda: group_advantages(R, torch.tensor([0, -1, 1, 1])),
        ["group_index", "got -1", ">= 0"],
    ),
    (
        "group_index-too-big",
        lambda: group_advantages(R, torch.tensor([0, 0, 1, 2]), num_groups=2),
        ["group_index", "got 2", "< num_groups=2"],
    ),
    (
        "rollout-group_index-range",
        lambda: _rollout(torch.tensor([0, 2])),
        ["Rollout.group_index", "got range [0, 2]", "[0, 2)"],
    ),
    (
        "scored-group_index-negative",
        lambda: ScoredBatch(R, R, torch.tensor([0, 0, -3, 1])),
        ["ScoredBatch.group_index", "got -3", ">= 0"],
    ),
    # --- bad values
    (
        "rewards-nan",
        lambda: group_advantages(torch.tensor([1.0, float("nan")]), G[:2]),
        ["rewards", "nan", "finite"],
    ),
    (
        "advantages-nan",
        lambda: grpo_loss(LP, LP, torch.tensor([0.0, float("nan")]), M),
        ["advantages", "NaN", "finite"],
    ),
    (
        "scored-advantages-nan",
        lambda: ScoredBatch(R, R * float("nan"), G),
        ["ScoredBatch.advantages", "NaN", "finite"],
    ),
    (
        "kl-missing-ref",
        lambda: grpo_loss(LP, LP, A, M, LossConfig(kl_coef=0.1)),
        ["ref_logps", "got None", "kl_coef"],
    ),
    ("kl-estimator", lambda: kl_estimate(LP, LP, "k4"), ["kl_estimator", "'k4'", "'k1', 'k2', 'k3'"]),  # type: ignore[arg-type]
    ("agg-mode", lambda: aggregate(LP, M, "mean"), ["agg", "'mean'", "token-mean"]),  # type: ignore[arg-type]
    (
        "logprob-temperature",
        lambda: token_logprobs(LP, M, temperature=0.0),
        ["temperature", "got 0.0", "> 0"],
    ),
    ("prompt-token-id", _sample_with_big_token_id, ["input_ids", "got 99", "< vocab_size=16"]),
    ("registry-name", lambda: load(SAMPLERS, "nope", "sampler"), ["sampler", "'nope'", "'reference'"]),
    (
        "prompt-right-padded",
        lambda: PromptBatch(torch.ones(1, 3, dtype=torch.long), torch.tensor([[1, 1, 0]])),
        ["PromptBatch.attention_mask", "left padding"],
    ),
]


@pytest.mark.parametrize("call,fragments", [c[1:] for c in CORE_CASES], ids=[c[0] for c in CORE_CASES])
def test_bad_input_raises_clear_error(call, fragments):
    with pytest.raises(GRPOPartsError) as info:
        call()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


# (id, model, kwargs, field, got, expected) -- pydantic messages name the field, the input and the rule
CONFIG_CASES: list[tuple[str, Any, dict[str, Any], str, str, str]] = [
    (
        "temperature-negative",
        SamplingParams,
        {"temperature": -0.5},
        "temperature",
        "input_value=-0.5",
        ">= 0",
    ),
    ("top_p-zero", SamplingParams, {"top_p": 0.0}, "top_p", "input_value=0.0", "greater than 0"),
    ("top_p-above-1", SamplingParams, {"top_p": 1.5}, "top_p", "input_value=1.5", "less than or equal to 1"),
    (
        "top_k-negative",
        SamplingParams,
        {"top_k": -1},
        "top_k",
        "input_value=-1",
        "greater than or equal to 0",
    ),
    (
        "group_size-zero",
        SamplingParams,
        {"group_size": 0},
        "group_size",
        "input_value=0",
        "greater than or equal to 1",
    ),
    ("max_new_tokens-zero", SamplingParams, {"max_new_tokens": 0}, "max_new_tokens", "input_value=0", ">= 1"),
    ("eos-negative", SamplingParams, {"eos_token_ids": (2, -1)}, "eos_token_ids", "(2, -1)", "non-negative"),
    ("sampling-typo", SamplingParams, {"temprature": 1.0}, "temprature", "input_value=1.0", "not permitted"),
    (
        "eps_low-above-1",
        LossConfig,
        {"eps_low": 1.5},
        "eps_low",
        "input_value=1.5",
        "less than or equal to 1",
    ),
    ("eps_low-negative", LossConfig, {"eps_low": -0.1}, "eps_low", "input_value=-0.1", ">= 0"),
    ("eps_high-negative", LossConfig, {"eps_high": -0.2}, "eps_high", "input_value=-0.2", ">= 0"),
    ("dual_clip-1", LossConfig, {"dual_clip": 1.0}, "dual_clip", "input_value=1.0", "greater than 1"),
    ("kl_coef-negative", LossConfig, {"kl_coef": -0.1}, "kl_coef", "input_value=-0.1", ">= 0"),
    (
        "kl_estimator",
        LossConfig,
        {"kl_estimator": "k4"},
        "kl_estimator",
        "input_value='k4'",
        "'k1', 'k2' or 'k3'",
    ),
    ("agg", LossConfig, {"agg": "mean"}, "agg", "input_value='mean'", "'token-mean'"),
    (
        "norm_constant-0",
        LossConfig,
        {"agg": "seq-mean-token-sum-norm", "norm_constant": 0.0},
        "norm_constant",
        "0.0",
        "> 0",
    ),
    (
        "norm_constant-wrong-agg",
        LossConfig,
        {"norm_constant": 4.0},
        "norm_constant",
        "agg='token-mean'",
        "only used with agg='seq-mean-token-sum-norm'",
    ),
    ("log_ratio_clamp-0", LossConfig, {"log_ratio_clamp": 0.0}, "log_ratio_clamp", "input_value=0.0", "> 0"),
    ("adv-eps-negative", AdvantageConfig, {"eps": -1e-6}, "eps", "input_value=-1e-06", ">= 0"),
    ("adv-norm", AdvantageConfig, {"norm": "std"}, "norm", "input_value='std'", "'group', 'batch' or 'none'"),
]
_SYNONYMS = {
    ">= 0": "greater than or equal to 0",
    ">= 1": "greater than or equal to 1",
    "> 0": "greater than 0",
}


@pytest.mark.parametrize(
    "model,kwargs,field,got,expected", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_bad_config_raises_validation_error(model, kwargs, field, got, expected):
    with pytest.raises(ValidationError) as info:
        model(**kwargs)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)  # callers can catch ValueError for both kinds
    for frag in (field, got, _SYNONYMS.get(expected, expected)):
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_configs_are_frozen():
    cfg = LossConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.eps_low = 0.5  # type: ignore[misc]
