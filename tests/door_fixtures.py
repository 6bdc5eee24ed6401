"""The door tests' common ground (issue 38, docs/doors.md): what every door must run for a policy it
can serve, the counters that prove it ran, and a tiny Llama-family policy on a task where those
paths have work to do.

A *door* is a way into the parts: ``grpo-parts train`` (the embedded trainer), the TRL, verl and
OpenRLHF adapters, or a user's own loop. Each door logs the speculative sampler's
``Rollout.stats`` under its own prefix (``metrics.jsonl``: none; TRL and OpenRLHF:
``parts/sampler/``; verl: the samples' ``grpo_parts_stats`` and ``SamplerServer.totals``), so a door
test asserts, for each optimization the door's row of the table says it runs, that its counter is
above zero -- a door that silently loses one fails.

The policy is the committed ``tiny_reasoner`` (a 4-layer Llama, 0.87M parameters) on the built-in
reasoning task: its completions repeat the prompt's terms, so the n-gram draft is accepted and the
cost model speculates, and its prompts (~110 tokens) dominate the decode cache, as in reasoning RL.
"""

from __future__ import annotations

from typing import Any

import torch

#: optimization (docs/doors.md row) -> ``Rollout.stats`` key counting the decode loop's use of it
SAMPLER_COUNTERS = {
    "lean decode forward": "lean_forward_calls",
    "shared-prompt decode attention": "decode_attention_shared_prefix_calls",
    "speculation chosen by the cost model": "verify_steps",
    "draft trees": "tree_steps",
    "online draft training": "draft_updates",
}
#: ``Rollout.stats`` keys that count a path the decode loop could not take (each must stay 0 where
#: the door runs the path)
REFUSAL_COUNTERS = ("lean_forward_refused", "decode_attention_refused")
#: completion tokens of a door test: a 7-term problem's worked solution is ~61 tokens (rewards vary)
COMPLETION_TOKENS = 64


def sampler_kwargs(trees: bool = False) -> dict[str, Any]:
    """The speculative sampler's kwargs of a door test: the shared-prompt decode attention in every
    decode forward (its cost rule takes it from 64 rows; a test's batch is smaller) and, with
    ``trees``, a 4-node draft tree per row in every speculative step."""
    kw: dict[str, Any] = {"decode_shared_prompt": "always"}
    if trees:
        kw["tree_nodes"] = 4
    return kw


def tiny_reasoner(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """``(policy, tokenizer)``: the built-in reasoning task's warm start (a Llama), SDPA attention,
    left padding, in eval mode (what ``grpo-parts train`` loads)."""
    from grpo_parts.train.lifecycle.setup import builtin_model_path, load_model

    return load_model(builtin_model_path("reasoning"), dtype, torch.device("cpu"), progress=False)


def reasoning_problems(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``(prompts, answers)`` of the first ``n`` training problems of the reasoning task."""
    from grpo_parts.task.reasoning import ReasoningTask

    task = ReasoningTask(seed=seed)
    problems = [task.train_problem(i) for i in range(n)]
    return [p.prompt for p in problems], [p.answer for p in problems]


def reasoning_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 for the right number after the last ``;`` (TRL's reward-function signature)."""
    from grpo_parts.task.graders import after_delimiter

    return [1.0 if after_delimiter(c, ";") == a else 0.0 for c, a in zip(completions, answer)]


def missing(metrics: dict[str, Any], keys: dict[str, str], prefix: str = "") -> dict[str, Any]:
    """The ``{optimization: value}`` of ``keys`` (optimization -> key) whose ``metrics[prefix + key]``
    is missing or not above zero (empty: every one ran)."""
    out = {}
    for what, key in keys.items():
        v = metrics.get(prefix + key)
        if v is None or not float(v) > 0:
            out[what] = v
    return out
