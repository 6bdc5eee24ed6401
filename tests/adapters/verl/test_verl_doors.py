"""Door parity, verl (issue 38, docs/doors.md): verl's ``AgentLoopWorker.generate_sequences`` (its
registry, hydra instantiation, one agent loop per completion, post-processing) with the
``grpo_parts_agent`` loop on an in-process speculative sampler runs the decode optimizations of the
table on a tiny Llama policy, and counts each one (the samples' ``grpo_parts_stats``, the server's
``totals``). verl hands the loop one request per completion: the server batches a prompt's
``rollout.n`` requests into one group, or the shared-prompt decode attention has nothing to share.

The training-side rows run behind verl's own seams and are pinned where those seams are tested:
the padding-free layout in tests/adapters/verl/test_engine_hook.py
(``parts/attention/calls_varlen_cascade``), CPPO and refill in tests/adapters/verl/test_sampler_tq.py
(``parts/filter/rows_kept``, refill rounds)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

pytest.importorskip("verl.experimental.agent_loop")

from door_fixtures import (  # noqa: E402
    COMPLETION_TOKENS,
    REFUSAL_COUNTERS,
    SAMPLER_COUNTERS,
    missing,
    reasoning_problems,
    sampler_kwargs,
    tiny_reasoner,
)
from grpo_parts_adapters.verl import agent_loop as ours  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_agent_loop  # noqa: E402

N, PROMPT_LEN = 4, 128  # rollout.n; the reasoning prompts are ~110 tokens


def policy() -> Any:
    """The agent loop's ``model_factory``: the tiny Llama warm start of the reasoning task."""
    return tiny_reasoner()[0]


def _tokenizer() -> Any:
    tok = tiny_reasoner()[1]
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt as it is
    return tok


def _worker(tok: Any, name: str) -> Any:
    """verl's ``AgentLoopWorker`` with the state ``generate_sequences`` reads (no Ray, no servers)."""
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "model": {"path": "unused"},
                "rollout": {
                    "prompt_length": PROMPT_LEN, "response_length": COMPLETION_TOKENS, "temperature": 1.0,
                    "top_p": 1.0, "top_k": -1, "calculate_log_probs": True,
                    "agent": {"default_agent_loop": name},
                    "val_kwargs": {"top_p": 1.0, "top_k": -1, "temperature": 0},
                },
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )  # fmt: skip
    w = object.__new__(verl_agent_loop.AgentLoopWorker)
    w.tokenizer, w.processor = tok, None
    w.config, w.rollout_config = cfg, cfg.actor_rollout_ref.rollout
    w.reward_loop_worker_handles, w.distillation_enabled, w.mm_processor_kwargs = None, False, {}
    w.teacher_client, w.llm_client, w.dataset_cls, w.hf_model_type, w.tools = None, None, None, None, []
    return w


def _generate(name: str, draft: str, trees: bool) -> tuple[DataProto, ours.SamplerServer]:
    """One verl rollout of 4 prompts x ``N`` through the agent loop registered as ``name`` (an entry
    with the loop's arguments, as ``rollout.agent.agent_loop_config_path`` registers one)."""
    ours.register_agent_loop()
    entry = {
        "_target_": "grpo_parts_adapters.verl.agent_loop.GrpoPartsAgentLoop", "sampler": "speculative",
        "draft": draft, "model_factory": f"{__name__}:policy", "sampler_kwargs": sampler_kwargs(trees),
        "allow_frozen": True,  # a fixed policy on purpose: the door's decode counters, no trainer
    }  # fmt: skip
    verl_agent_loop._agent_loop_registry[name] = OmegaConf.create(entry)
    texts = [p for p in reasoning_problems(4)[0] for _ in range(N)]
    raw = np.empty(len(texts), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in texts]
    uid = np.array([f"u{i // N}" for i in range(len(texts))], dtype=object)
    batch = DataProto.from_dict(non_tensors={"raw_prompt": raw, "uid": uid, "index": np.arange(len(texts))})
    try:
        out = asyncio.run(_worker(_tokenizer(), name).generate_sequences(batch))
    finally:
        verl_agent_loop._agent_loop_registry.pop(name, None)
    (key,) = [k for k in ours._LOCAL_SERVERS if k[0] == f"{__name__}:policy" and draft in k[2]]
    return out, ours._LOCAL_SERVERS.pop(key)


@pytest.mark.parametrize(("draft", "trees"), [("ngram", False), ("eagle", True)])
def test_the_agent_loop_runs_the_decode_optimizations(draft: str, trees: bool) -> None:
    out, server = _generate(f"grpo_parts_door_{draft}", draft, trees)
    assert len(out) == 4 * N and out.batch["responses"].shape == (4 * N, COMPLETION_TOKENS)
    # a prompt's N requests were generated as one group: nothing refused
    assert max(server.batch_sizes) > N and all(server.totals[k] == 0 for k in REFUSAL_COUNTERS), server.totals
    wanted = {k: v for k, v in SAMPLER_COUNTERS.items() if k != "draft trees" or trees}
    if draft != "eagle":
        wanted.pop("online draft training")
    assert missing(dict(server.totals), wanted) == {}, server.totals
    # what verl carries per sample: the rollout's stats
    per_sample = out.non_tensor_batch["grpo_parts_stats"]
    assert all(s["lean_forward_calls"] > 0 and s["model_forward_calls"] == 0 for s in per_sample)
